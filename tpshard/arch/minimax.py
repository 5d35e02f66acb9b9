"""MiniMax-M2 (SGLang models/minimax_m2.py; transformers models/minimax_m2/modeling_minimax_m2.py).

What a rank holds is what SGLang 0.5.23's MiniMaxM2ForCausalLM builds for it:
- MiniMaxM2Attention: q/k/v one QKVParallelLinear over attn_tp (q heads even; kv heads even, or each
  replicated attn_tp / kv ways), no biases; o_proj a RowParallelLinear over attn_tp without bias.
  The heads must divide attn_tp (its asserts).
- q_norm [heads * head_dim] and k_norm [kv_heads * head_dim] normalise the *whole* projection, not
  each head (transformers' MiniMaxM2Attention: MiniMaxM2RMSNorm(num_heads * head_dim)). SGLang's
  MiniMaxM2RMSNormTP cuts each over attn_tp at head granularity: its weight_loader takes shard
  attn_tp_rank // num_head_replicas of num_heads // attn_tp heads (or one head, replicated
  attn_tp / heads ways), which is exactly QKVParallelLinear's q cut for q_norm and its kv cut for
  k_norm: k_norm is replicated with the kv heads. Its forward all-reduces the mean of squares over
  attn_tp and divides by attn_tp (MiniMaxM2QKRMSNorm: the sum of squares / D / tp_world), so the RMS
  is over all heads; tpshard.runtime.norms.RMSNormTP does the same in verify.
- Every layer is a MiniMaxM2MoE (no dense layer, no shared expert): the router `block_sparse_moe.gate`
  (a ReplicatedLinear, fp32 parameters in SGLang) and `block_sparse_moe.e_score_correction_bias`
  (fp32, built when config.json's use_routing_bias) whole on every rank, as saved; FusedMoE experts
  `block_sparse_moe.experts.<e>.w1/w3/w2` (make_expert_params_mapping with ckpt names w1, w2, w3) in
  contiguous blocks of E / ep per EP slot, each cut over moe_tp, of config.json's intermediate_size.
  MiniMaxM2MoE refuses tp greater than num_local_experts.
- The embedding is a VocabParallelEmbedding with use_attn_tp_group=is_dp_attention_enabled() (over
  attn_tp under attention DP); lm_head a ParallelLMHead that ignores --enable-dp-lm-head (no
  use_attn_tp_group), so over tp; load_weights has no tie (lm_head is always its own weight).
- transformers 5 saves the release's names (its conversion_mapping "minimax_m2": Mixtral's w1/w3/w2
  experts under block_sparse_moe, and block_sparse_moe.e_score_correction_bias), so one table serves both.
- Router: sigmoid scores, e_score_correction_bias for the choice only, top-k renormalised, no groups,
  no scaling (MiniMaxM2TopKRouter; SGLang's TopK(renormalize=True, routed_scaling_factor=1.0)).
- Refused in one line, what SGLang would load differently from transformers' class (which always has
  q/k norms, the correction bias, sigmoid scores and rotates rotary_dim dims): use_qk_norm not true
  or a qk_norm_type other than per_layer (SGLang then builds no q/k norms and drops them, or raises);
  use_routing_bias not true (it drops the bias); scoring_func not sigmoid; no rotary_dim while
  transformers rotates a part of each head (SGLang rotates rotary_dim, default head_dim); tied
  embeddings; an activation other than silu. MTP modules (num_mtp_modules, layers num_hidden_layers
  on) are skipped by SGLang's main-model loader and served by a draft class tpshard does not model:
  a checkpoint holding them is refused (their experts' layer is past the config's layers).
- Pipeline stages: refused. MiniMaxM2Model builds its VocabParallelEmbedding on every stage (only
  the norm and lm_head are PPMissingLayer off the last), a placement tpshard's stages do not express.
- Export: vLLM only (SGLang's sharded_state refuses routed experts). vLLM 0.33.0's MiniMaxM2ForCausalLM
  (models/minimax_m2.py) cuts q/k/v, o_proj and the vocabulary over tp, and its q_norm / k_norm are
  MiniMaxText01RMSNormTP (layers/minimax_rms_norm): q_norm's [heads * head_dim / tp] rows of tp rank r,
  k_norm's of kv head r // (tp / kv) when tp > kv (weight_shard_world_size = kv), i.e. SGLang's
  head cut, which is the tpshard output at attn_tp = tp. Its router is a GateLinear built in float32
  and e_score_correction_bias a float32 parameter of the MoE block: both written in float32; the
  experts as every FusedMoE (--ep 1, or --ep tp with --enable-expert-parallel).
"""

from tpshard.arch.base import NORMS, QKV_ATTENTION, VOCAB, Arch, EngineNames, EngineTable, L, Piece, Rule, routed_experts, router
from tpshard.arch.engine_names import NO_MLP, VLLM_MOE, bf16_only, vllm_experts
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import attention_tensors, config_value, decoder_tensors, expert_tensors
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

QK_NORM_TP = (
    Rule(L + r"\.self_attn\.q_norm", "RMSNormTP", "attn", r"\1.self_attn.q_norm", "q", "q_norm"),
    Rule(L + r"\.self_attn\.k_norm", "RMSNormTP", "attn", r"\1.self_attn.k_norm", "k", "k_norm"),
)
# e_score_correction_bias is a parameter of the MoE block, not of its gate; it is kept with the
# router (one engine layer: TopK reads both), whole.
CORRECTION_BIAS = (
    Rule(L + r"\.block_sparse_moe", "ReplicatedLinear", "replicated", r"\1.block_sparse_moe.gate", moe=True),
)
RULES = (
    VOCAB + NORMS + QKV_ATTENTION + QK_NORM_TP + router("block_sparse_moe") + CORRECTION_BIAS
    + routed_experts("block_sparse_moe", "w1", "w3", "w2")
)  # fmt: skip


def expected(model: ModelInfo, config: dict):
    """Every layer: q/k/v/o, q_norm and k_norm, the router, its correction bias, every expert's w1, w2, w3."""

    def mlp(p: str, i: int):
        yield from expert_tensors(f"{p}.block_sparse_moe", model, ("w1", "w2", "w3"))
        yield f"{p}.block_sparse_moe.e_score_correction_bias"

    return decoder_tensors(model, config, lambda p: attention_tensors(p, {}, qk_norm=True), mlp)


def minimax_router(config: dict, e: int, k: int) -> RouterConfig:
    return RouterConfig(num_experts=e, top_k=k, scoring="sigmoid", renormalize=True, correction_bias=True)


def refuse_config(config: dict, model: ModelInfo) -> None:
    """What SGLang's MiniMaxM2ForCausalLM reads from config.json that would make it another model
    than transformers' MiniMaxM2ForCausalLM (module docstring)."""
    name = model.architecture
    wants = (
        ("use_qk_norm", True, "MiniMaxM2Attention then builds no q_norm / k_norm and drops the checkpoint's"),
        ("qk_norm_type", "per_layer", "MiniMaxM2Attention raises Unsupported qk_norm_type"),
        ("use_routing_bias", True, "MiniMaxM2MoE then builds no e_score_correction_bias and drops the checkpoint's"),
        ("scoring_func", "sigmoid", "MiniMaxM2MoE's TopK reads config.scoring_func; transformers' router is sigmoid"),
    )
    for key, want, why in wants:
        got = config_value(config, key)
        if got != want:
            raise PlanError(f"{name}: config.json {key} is {got!r}, not {want!r}: SGLang's {why} (set it as the release's config.json does)")
    # transformers derives partial_rotary_factor from rotary_dim when config.json has only the latter
    factor = (config_value(config, "rope_parameters") or {}).get("partial_rotary_factor", config_value(config, "partial_rotary_factor"))
    rotary = config_value(config, "rotary_dim", model.head_dim)
    if factor is not None and rotary != int(model.head_dim * factor):
        raise PlanError(
            f"{name}: config.json rotary_dim {rotary}, but transformers rotates head_dim {model.head_dim} x"
            f" partial_rotary_factor {factor} dims; SGLang's MiniMaxM2Attention rotates rotary_dim (default head_dim)"
        )
    if config_value(config, "tie_word_embeddings", False) or model.tie_word_embeddings:
        raise PlanError(f"{name}: tied embeddings; SGLang's MiniMaxM2ForCausalLM always loads its own lm_head.weight")
    act = config_value(config, "hidden_act", "silu")
    if act != "silu":
        raise PlanError(f"{name}: hidden_act {act!r}; SGLang's FusedMoE for MiniMaxM2MoE runs silu")


# vLLM 0.33.0 (models/minimax_m2.py), keys read from the model built on CPU at tp 2 and 4 (docs/deploy.md):
# MiniMaxM2MoE's `gate` is a GateLinear(params_dtype=torch.float32), its e_score_correction_bias a
# float32 Parameter (given to FusedMoE too; the filter keeps the block's name); FusedMoE with
# ckpt_names w1, w2, w3: w13 = [w1; w3] per expert. q_norm / k_norm keep their names (NO_MLP).
_B = L + r"\.block_sparse_moe\."
VLLM_PIECES = (
    NO_MLP
    + (
        (_B + r"gate\.weight", Piece(r"\1.block_sparse_moe.gate.weight", 0, 1, dtype="F32")),
        (_B + r"e_score_correction_bias", Piece(r"\1.block_sparse_moe.e_score_correction_bias", 0, 1, dtype="F32")),
    )
    + vllm_experts("block_sparse_moe", "w1", "w3", "w2", "block_sparse_moe.experts.routed_experts")
)

ARCHS = (
    Arch(
        "MiniMaxM2ForCausalLM", RULES, "minimax_m2.py", attn_group="attn_tp", embed_group="attn_tp",
        model_type="minimax_m2", expected=expected, exports=EngineNames(vllm=EngineTable(VLLM_PIECES, refuse=bf16_only("models/minimax_m2.py"), **VLLM_MOE), sglang=None), verify="moe",
        router=minimax_router, dp_lm_head=False, sparse=lambda model, layer: True, experts_limit="tp",
        check=refuse_config,
    ),
)  # fmt: skip
