"""GLM-4.5 / 4.6 / 4.5-Air (SGLang models/glm4_moe.py, models/glm4_moe_nextn.py; transformers
models/glm4_moe/modeling_glm4_moe.py).

What a rank holds is what SGLang 0.5.23's Glm4MoeForCausalLM builds for it:
- Glm4MoeAttention: q/k/v one QKVParallelLinear over attn_tp (q heads even; kv heads even, or
  each replicated attn_tp / kv ways when attn_tp > kv), their biases (config.json attention_bias)
  cut with their weights; o_proj a RowParallelLinear over attn_tp that never has a bias (a checkpoint
  carrying one is refused: SGLang's loader would skip it silently); q_norm /
  k_norm ([head_dim], config.json use_qk_norm) whole. The heads must divide attn_tp.
- The embedding is a VocabParallelEmbedding with use_attn_tp_group=is_dp_attention_enabled(), so
  over attn_tp under attention DP; lm_head over tp (attn_tp with --enable-dp-lm-head).
- Layers below first_k_dense_replace have a Glm4MoeMLP over tp, whole with --moe-dense-tp-size 1
  (enable_moe_dense_fully_dp). Every other layer (Glm4MoeDecoderLayer._is_layer_sparse; GLM has
  no moe_layer_freq) is a Glm4MoeSparseMoeBlock: the router Glm4MoeGate (`gate.weight` and
  `e_score_correction_bias`, fp32 in the checkpoint, whole on every rank), FusedMoE experts in
  contiguous blocks of E / ep per EP slot, each cut over moe_tp = tp / ep, and the shared experts,
  a Glm4MoeMLP over the full tp even under EP. Glm4MoeSparseMoeBlock refuses tp greater than the
  routed experts and any activation but silu.
- The MTP layer (num_nextn_predict_layers, draft class Glm4MoeForCausalLMNextN) is decoder layer
  num_hidden_layers: a sparse layer cut like the main ones, its enorm / hnorm / shared_head.norm
  and eh_proj whole, its own embed_tokens and shared_head.head (which the NextN loader skips: the
  draft shares the target's) cut like the model's, as for DeepSeek (tpshard/arch/deepseek.py). The
  NextN loader asserts one MTP layer. It is optional in a complete checkpoint.
- The same rules as DeepSeek's MoE, dense MLP and MTP layers, so they are taken from
  tpshard/arch/deepseek.py; the router too (sigmoid scores, e_score_correction_bias for the choice
  only, n_group / topk_group by each group's top-2 sum, renormalised, times routed_scaling_factor:
  transformers' Glm4MoeTopkRouter and Glm4MoeMoE.route_tokens_to_experts).
- Pipeline stages: refused. Glm4MoeModel builds the embedding on the first stage and the norm on
  the last, but where the MTP draft's embedding and head live at pp > 1 is not established for
  this class (its NextN loader skips them), so tpshard states no per-stage layout.
- `verify --model` runs tpshard.verify.moe_model's decoder against transformers' Glm4MoeForCausalLM:
  RoPE on the first head_dim * partial_rotary_factor dims of each head (Glm4MoeRotaryEmbedding,
  apply_rotary_pos_emb), q/k norms before it, q/k/v biases; the MTP layer at layer level only
  (transformers does not run it).
- Export: vLLM only (SGLang's sharded_state refuses every family with routed experts). vLLM 0.33.0's
  Glm4MoeForCausalLM (models/glm4_moe.py) cuts attention, the dense MLP, the shared experts and the
  vocabulary over tp and places the experts as its FusedMoE does for every family (tpshard --ep 1
  or --ep tp with --enable-expert-parallel), so the tpshard output at attn_tp = tp is its layout;
  its router is a GateLinear built in float32 and the correction bias a float32 parameter it hands
  to FusedMoE (kept under mlp.experts.routed_experts), both written in float32; the MTP layer is
  left out (make_layers builds num_hidden_layers, skip_spec_layers drops the rest). Refused: tied
  embeddings (the class never ties lm_head). The ROCm AITER fused shared expert
  (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS) appends the shared experts to w13/w2 instead: not this layout.
- Under an all-to-all MoE backend (--moe-a2a-backend) Glm4MoeSparseMoeBlock.__init__ builds the
  shared experts "replicated" for deepep, mooncake, nixl, mori, ascend_fuseep, flashinfer and
  flashinfer_megamoe (glm4_moe.py L471-491): whole on every rank; under megamoe, deepep_v2 and pplx
  (not in that list) they stay over tp. Shared-expert fusion is off there whenever ep > 1 on NVIDIA
  (Glm4MoeForCausalLM.shared_experts_fusion_disable_reason L1022-1027).
"""

from tpshard.arch.base import NORMS, QK_NORM, QKV_ATTENTION, VOCAB, Arch, EngineNames, EngineTable, L, Piece
from tpshard.arch.deepseek import DENSE, MOE, MTP, v3_router
from tpshard.arch.engine_names import DENSE_PIECES, ROUTED, VLLM_MOE, bf16_only, vllm_mlp
from tpshard.arch.tensors import attention_tensors, config_value, decoder_tensors, expert_tensors, mlp_tensors
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

# Glm4MoeAttention builds o_proj with bias=False (glm4_moe.py L268-276) and load_weights skips a
# ".bias" it has no parameter for (L1234-1236), as transformers' Glm4MoeAttention has none either:
# a checkpoint's o_proj.bias would be carried by the split and silently dropped by the engine.
ATTENTION = tuple(r._replace(bias=False) if r.module.endswith(r"o_proj") else r for r in QKV_ATTENTION)
RULES = VOCAB + NORMS + ATTENTION + QK_NORM + MOE + DENSE + MTP


def sparse(model: ModelInfo, layer: int) -> bool:
    """Glm4MoeDecoderLayer._is_layer_sparse: the MTP decoder, or every layer from first_k_dense_replace on."""
    return layer >= model.num_layers or (model.num_experts > 0 and layer >= model.first_k_dense_replace)


def expected(model: ModelInfo, config: dict):
    """Per layer the attention (q/k/v biases with attention_bias, never an o_proj bias; q/k norms with
    use_qk_norm), then a dense MLP or the router with its correction bias, every routed expert and the
    shared experts. The MTP layer is optional: an engine serving without speculative decoding never reads it."""
    qkv_bias = bool(config_value(config, "attention_bias", False))
    qk_norm = bool(config_value(config, "use_qk_norm", False))

    def attention(p: str):
        # {} : attention_tensors would add o_proj.bias for attention_bias, which Glm4MoeAttention never builds
        return attention_tensors(p, {}, qkv_bias=qkv_bias, qk_norm=qk_norm)

    def mlp(p: str, i: int):
        if not sparse(model, i):
            yield from mlp_tensors(f"{p}.mlp")
            return
        yield from expert_tensors(f"{p}.mlp", model, ("gate_proj", "up_proj", "down_proj"))
        yield f"{p}.mlp.gate.e_score_correction_bias"
        if model.num_shared_experts:
            yield from mlp_tensors(f"{p}.mlp.shared_experts")

    return decoder_tensors(model, config, attention, mlp)


def refuse_config(config: dict, model: ModelInfo) -> None:
    """What SGLang's classes assert of config.json beyond the rules."""
    act = config_value(config, "hidden_act", "silu")
    if act != "silu":
        raise PlanError(f"{model.architecture}: hidden_act {act!r}; SGLang's Glm4MoeSparseMoeBlock supports only silu")
    if model.num_nextn_predict_layers > 1:
        raise PlanError(
            f"{model.architecture}: num_nextn_predict_layers {model.num_nextn_predict_layers}; SGLang's"
            " Glm4MoeForCausalLMNextN (glm4_moe_nextn.py) asserts \"Only 1 nextn layer is supported\""
        )


# vLLM 0.33.0 (models/glm4_moe.py), keys read from the model built on CPU (docs/deploy.md): Glm4MoE's
# `gate` is a GateLinear(params_dtype=torch.float32) and its e_score_correction_bias a float32
# Parameter also given to FusedMoE, whose `routed_experts.e_score_correction_bias` is the name the
# loader's filter keeps; the shared experts (a Glm4MoeMLP over tp) sit under FusedMoE's
# `_shared_experts._layer`; layers below first_k_dense_replace have Glm4MoeMLP gate_up/down.
VLLM_PIECES = (
    DENSE_PIECES
    + (
        (L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.gate.weight", 0, 1, dtype="F32")),
        (L + r"\.mlp\.gate\.e_score_correction_bias", Piece(r"\1.mlp.experts.routed_experts.e_score_correction_bias", 0, 1, dtype="F32")),
    )
    + ROUTED
    + vllm_mlp("mlp.shared_experts", "mlp.experts._shared_experts._layer")
)


def refuse_vllm(plan, config: dict) -> str | None:
    """What vLLM's Glm4MoeForCausalLM would build otherwise than the table says."""
    if plan.model.tie_word_embeddings:
        return "the checkpoint ties lm_head to the embedding; vLLM's Glm4MoeForCausalLM (models/glm4_moe.py) never ties them"
    return None


EXPORTS = EngineNames(vllm=EngineTable(VLLM_PIECES, drop_mtp=True, refuse=bf16_only("models/glm4_moe.py", refuse_vllm), **VLLM_MOE), sglang=None)

ARCHS = (
    Arch(
        "Glm4MoeForCausalLM", RULES, "glm4_moe.py", attn_group="attn_tp", embed_group="attn_tp", model_type="glm4_moe",
        expected=expected, exports=EXPORTS, verify="moe", router=v3_router,
        sparse=sparse, experts_limit="tp", check=refuse_config,
        a2a_shared=frozenset(("deepep", "mooncake", "nixl", "mori", "ascend_fuseep", "flashinfer", "flashinfer_megamoe")),
    ),
)  # fmt: skip
