"""gpt-oss (SGLang models/gpt_oss.py; transformers models/gpt_oss/modeling_gpt_oss.py).

What a rank holds is what SGLang 0.5.23's GptOssForCausalLM builds for it:
- GptOssAttention: q/k/v one QKVParallelLinear over attn_tp (q heads even; kv heads even, or each
  replicated attn_tp / kv ways when attn_tp > kv), with their biases; o_proj a RowParallelLinear
  over attn_tp whose bias is kept whole (added once after the reduction); `sinks` [heads], a bare
  Parameter of num_heads / attn_tp that the loader fills with `[attn_tp_rank * h, +h)`: cut with
  the q heads (layer class AttentionSinks), never with the kv heads, never whole.
- The embedding is a VocabParallelEmbedding with enable_tp=not is_dp_attention_enabled(): over tp
  without attention DP, whole (padded) under it (embed_group "replicated"); lm_head, a
  ParallelLMHead built on every pipeline stage, over tp (attn_tp with --enable-dp-lm-head).
- Every layer is a GptOssSparseMoeBlock (a dense MLP raises NotImplementedError): the router
  `mlp.router` a ReplicatedLinear with a bias, whole; the experts one FusedMoE loaded by
  `weight_loader_fused` from the checkpoint's fused tensors (tpshard.arch.fused):
  `gate_up_proj` [E, H, 2I] with gate and up interleaved on the last dim (gate = [..., ::2]),
  transposed by the loader and narrowed to the rank's contiguous 2I / moe_tp slice of the
  interleaved dim: the (gate_j, up_j) pairs of j in the rank's I / moe_tp (a [gate | up] reading is
  wrong from moe_tp 2 on); `gate_up_proj_bias` [E, 2I] the same on dim 1; `down_proj` [E, I, H]
  dim 1; `down_proj_bias` [E, H] kept whole, as tpshard keeps every row-parallel bias (the
  runtime adds it once; SGLang zeroes it on moe_tp ranks != 0 after loading, a choice of its
  kernel, not of the checkpoint). FusedMoE asserts I % moe_tp == 0.
- MXFP4 (quant_method mxfp4, _load_mxfp4_experts_weights): `*_blocks` [E, out, in/32, 16] and
  `*_scales` [E, out, in/32], stored transposed (gate/up rows interleaved on dim 1, down's blocks on
  dim 2), replace gate_up_proj / down_proj; the intermediate axis is cut in whole 32-blocks,
  ceil(I/32 / moe_tp) a rank and the last rank short (`end = min(.., I)`), the gate/up bias alike,
  the down bias whole. A rank left empty is refused; SGLang asserts I % 32 == 0.
- Expert parallelism: bf16 refused for SGLang (for vLLM see below). Its experts load through FusedMoE.weight_loader_fused
  (models/gpt_oss.py L237 `use_weight_loader_fused` for every quant method but mxfp4;
  layers/moe/fused_moe_triton/layer.py L1559), which narrows the moe_tp slice only and copies the
  whole [E, ...] tensor into the rank's [E / ep, ...] parameter (_load_w13 L879, _load_w2 L969): no
  expert is chosen by EP rank, so SGLang cannot load it at ep > 1. The MXFP4 loader
  (_load_mxfp4_experts_weights, models/gpt_oss.py L954-1140) slices experts by EP rank
  (`[moe_ep_rank * E/ep, +E/ep)`, the down bias too) and moe_tp at once, moe_ep_rank = tp_rank //
  moe_tp and moe_tp_rank = tp_rank % moe_tp (distributed/parallel_state.py's moe_ep / moe_tp
  groups): at --ep == --tp (moe_tp 1) every fused tensor is cut on dim 0, one EP slot's experts a
  rank, the whole intermediate size; at ep < tp each rank's piece is its moe_tp slice (as at ep 1,
  blocks and padding alike) of its EP slot's experts, a cut of dim 1 or 2 with a leading-dim range
  of dim 0 (ShardSpec.lead_start), and the down bias its slot's experts, whole on the slot's ranks.
- No tp > experts check in this class (unlike GLM); no MTP layer (the NextN path only logs).
- Router (transformers GptOssTopKRouter): logits = x W^T + b, top-k of the logits, softmax over
  the k: the same as a softmax over all experts renormalised over the k picked.
- Experts (GptOssExperts): gu = x @ gate_up_proj[e] + bias; g = gu[..., ::2].clamp(max=limit),
  u = gu[..., 1::2].clamp(-limit, limit); (u + 1) * g * sigmoid(alpha * g) @ down_proj[e] + bias.
- Pipeline stages: GptOssModel builds the embedding on the first stage, the norm on the last,
  layers by make_layers; lm_head on every stage (pp_head "every").
- `verify --model` runs tpshard.verify.moe_model's decoder with the gpt-oss layers
  (tpshard.verify.sinks_model: attention sinks, sliding windows by config.json layer_types, yarn
  RoPE from transformers' own tables, the fused experts' clamped SwiGLU). Export: vLLM bf16 (EXPORTS
  below, docs/deploy.md); SGLang's sharded_state refuses every family with routed experts.
- vLLM bf16 with expert parallelism: vLLM's _load_weights_other (models/gpt_oss.py L1186-1235) slices
  every fused tensor by EP rank under --enable-expert-parallel (`weight[ep_rank_start:ep_rank_end]`,
  whole experts, the down bias too and not zeroed), so a split placed for vLLM (`--format vllm`,
  `--engine vllm`) takes --ep = --tp (FUSED.vllm_ep; tpshard.plan.fused.engine_placed records the
  engine in its topology), where one placed for SGLang is refused.
"""

from tpshard.arch.base import NORMS, QKV_ATTENTION, VOCAB, Arch, EngineNames, EngineTable, L, Piece, Rule
from tpshard.arch.engine_names import VLLM_ATTENTION_BUFFERS, bf16_only
from tpshard.arch.fused import FusedExperts, FusedParam
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import attention_tensors, config_value, decoder_tensors
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

RULES = VOCAB + NORMS + QKV_ATTENTION + (
    Rule(L + r"\.self_attn", "AttentionSinks", "attn", r"\1.self_attn.sinks", heads=True),
    Rule(L + r"\.mlp\.router", "ReplicatedLinear", "replicated", r"\1.mlp.router", shape="router", moe=True),
    Rule(L + r"\.mlp\.experts", "FusedExperts", "expert", r"\1.mlp.experts", moe=True),
)  # fmt: skip

EXPERT_PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
MXFP4_PARAMS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales", "down_proj_bias")

FUSED = FusedExperts(
    params={
        "gate_up_proj": FusedParam("w13", "interleaved", 2, per_i=2, shape="e_h_2i", blocks=False),
        "gate_up_proj_bias": FusedParam("w13_bias", "interleaved", 1, per_i=2, shape="e_2i"),
        "down_proj": FusedParam("w2", "single", 1, shape="e_i_h", blocks=False),
        "down_proj_bias": FusedParam("w2_bias", "whole", None, shape="e_h"),
        # MXFP4: stored transposed ([E, out, in]), so gate/up rows on dim 1 and down's blocks on dim 2
        "gate_up_proj_blocks": FusedParam("w13", "interleaved", 1, per_i=2, shape="e_2i_hb_16", blocks=True),
        "gate_up_proj_scales": FusedParam("w13", "interleaved", 1, per_i=2, shape="e_2i_hb", blocks=True),
        "down_proj_blocks": FusedParam("w2", "single", 2, shape="e_h_ib_16", block=32, blocks=True),
        "down_proj_scales": FusedParam("w2", "single", 2, shape="e_h_ib", block=32, blocks=True),
    },
    ep_loads="blocks",
    ep_refusal=(
        "SGLang loads a bf16 gpt-oss checkpoint's experts with FusedMoE.weight_loader_fused (models/gpt_oss.py L237;"
        " layers/moe/fused_moe_triton/layer.py L1559), which copies all of them into each rank's [E / ep, ...] parameter"
        " (_load_w13 L879): it cannot load --ep > 1; split with --ep 1 (the MXFP4 release loads with --ep)"
    ),
    vllm_ep=True,  # vLLM 0.33.0 models/gpt_oss.py L1186-1235: weight[ep_rank_start:ep_rank_end] of every fused tensor

)


def sparse(model: ModelInfo, layer: int) -> bool:
    """GptOssDecoderLayer: every layer is sparse."""
    return True


def expected(model: ModelInfo, config: dict):
    """Per layer q/k/v/o with their biases (attention_bias), the sinks, the router with its bias,
    and the four fused expert tensors."""

    def attention(p: str):
        yield from attention_tensors(p, config)
        yield f"{p}.self_attn.sinks"

    def mlp(p: str, i: int):
        yield from (f"{p}.mlp.router.weight", f"{p}.mlp.router.bias")
        yield from (f"{p}.mlp.experts.{n}" for n in (MXFP4_PARAMS if model.expert_block else EXPERT_PARAMS))

    return decoder_tensors(model, config, attention, mlp)


def refuse_config(config: dict, model: ModelInfo) -> None:
    """What SGLang's GptOss classes need of config.json beyond the rules."""
    types = config_value(config, "layer_types")
    if types is not None and (len(types) != model.num_layers or set(types) - {"sliding_attention", "full_attention"}):
        raise PlanError(
            f"{model.architecture}: layer_types {types} is not one of sliding_attention / full_attention per layer;"
            " GptOssAttention asserts it"
        )


def router(config: dict, e: int, k: int) -> RouterConfig:
    """GptOssTopKRouter: softmax over the top-k logits (the router's bias included in them)."""
    return RouterConfig(num_experts=e, top_k=k, scoring="softmax", renormalize=True)


# vLLM 0.33.0 (models/gpt_oss.py), keys read from the model built on CPU (docs/deploy.md): the
# attention module is `attn` (OAIAttention: qkv_proj, o_proj with its bias whole on every rank,
# sinks of the rank's q heads; vLLM's four scale buffers at attn.attn), the embedding
# `model.embedding`; the fused experts load through _load_weights_other into FusedMoE's
# routed_experts: w13 / w2 each expert's shard transposed, w13_bias as cut, w2_bias whole on moe-tp
# rank 0 and zeroed on the others (without expert parallelism; tpshard.export.fused).
_A, _X, _P = L + r"\.self_attn\.", L + r"\.mlp\.experts\.", r"\.(weight|bias)"
VLLM_PIECES = (
    (r"model\.embed_tokens\.weight", Piece("model.embedding.weight", 0, 1)),
    (r"lm_head\.weight", Piece("lm_head.weight", 0, 1)),
    (r"model\.norm\.weight", Piece("model.norm.weight", 0, 1)),
    (L + r"\.(input_layernorm|post_attention_layernorm)\.weight", Piece(r"\1.\2.weight", 0, 1)),
    (_A + r"q_proj" + _P, Piece(r"\1.attn.qkv_proj.\2", 0, 3)),
    (_A + r"k_proj" + _P, Piece(r"\1.attn.qkv_proj.\2", 1, 3)),
    (_A + r"v_proj" + _P, Piece(r"\1.attn.qkv_proj.\2", 2, 3)),
    (_A + r"o_proj" + _P, Piece(r"\1.attn.o_proj.\2", 0, 1)),
    (_A + r"sinks", Piece(r"\1.attn.sinks", 0, 1)),
    (L + r"\.mlp\.router" + _P, Piece(r"\1.mlp.router.\2", 0, 1)),
    (_X + r"gate_up_proj", Piece(r"\1.mlp.experts.routed_experts.w13_weight", 0, 1)),
    (_X + r"gate_up_proj_bias", Piece(r"\1.mlp.experts.routed_experts.w13_bias", 0, 1)),
    (_X + r"down_proj", Piece(r"\1.mlp.experts.routed_experts.w2_weight", 0, 1)),
    (_X + r"down_proj_bias", Piece(r"\1.mlp.experts.routed_experts.w2_bias", 0, 1)),
)
VLLM_FUSED = ((r".*\.routed_experts\.w(13|2)_weight", "transpose"), (r".*\.routed_experts\.w2_bias", "rank0"))


def refuse_vllm(plan, config: dict) -> str | None:
    """What vLLM's GptOssForCausalLM builds otherwise than the tpshard output (or cannot build)."""
    kv, tp = plan.model.num_kv_heads, plan.topology.tp
    if tp > kv:
        return (
            f"gpt-oss at tp {tp} over {kv} kv heads; vLLM's OAIAttention (models/gpt_oss.py) gives each rank"
            f" num_key_value_heads // tp = 0 kv heads and cannot build the model; split with a tp of at most {kv}"
        )
    if plan.topology.pp > 1:
        return "gpt-oss with pipeline stages: tpshard places its lm_head on every stage as SGLang builds it, not as vLLM's GptOssForCausalLM (models/gpt_oss.py) does"
    return None


EXPORTS = EngineNames(
    vllm=EngineTable(
        VLLM_PIECES, tied="lm_head.weight", ep="vllm", fused=VLLM_FUSED, refuse=bf16_only("models/gpt_oss.py", refuse_vllm),
        buffers=tuple(b._replace(engine=b.engine.replace(".self_attn.attn.", ".attn.attn.")) for b in VLLM_ATTENTION_BUFFERS),
    ),
    sglang=None,
)  # fmt: skip

ARCHS = (
    Arch(
        "GptOssForCausalLM", RULES, "gpt_oss.py", attn_group="attn_tp", embed_group="replicated", model_type="gpt_oss",
        expected=expected, exports=EXPORTS, verify="moe", router=router,
        sparse=sparse, check=refuse_config, pp_head="every", fused_experts=FUSED,
    ),
)  # fmt: skip
