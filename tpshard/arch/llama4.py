"""Llama-4 text (SGLang models/mllama4.py Llama4ForConditionalGeneration and its load_weights, the
layers in models/llama4.py; transformers models/llama4/modeling_llama4.py).

Checkpoints are Llama4ForConditionalGeneration's: the text weights under `language_model.`
(`language_model.model.layers.N...`, `language_model.lm_head`), as the release and transformers 5's
save_pretrained write them, the experts fused per layer. What rank r holds (attn_tp = tp / attn_dp,
moe_tp = tp) is what SGLang 0.5.23 builds for it:

- Llama4Attention: q/k/v one QKVParallelLinear over attn_tp (built with the attention-TP rank and
  size; kv heads even, or replicated when attn_tp > kv heads; its asserts refuse heads that do not
  divide), o_proj a RowParallelLinear over attn_tp, no biases. Its q/k norm is an L2 norm without
  weight (nothing on disk). The loader permutes each head's q/k rows for its rotary kernel
  (permute_qk_weight_for_rotary, by the total head counts) before the cut: that is the engine's
  in-memory order; a per-rank checkpoint in HF names keeps the checkpoint's order (the permutation
  stays inside each head, so the rank holds the same heads either way).
- Layers: layer i is a Llama4MoE iff (i + 1) % interleave_moe_layer_step == 0 (every layer when the
  step is 0), else a LlamaMLP of intermediate_size_mlp over the full tp. Transformers decides by
  config.json's moe_layers: a config whose moe_layers differ from the step's is refused.
- Llama4MoE: the router `feed_forward.router` a ReplicatedLinear, whole; the shared expert
  `feed_forward.shared_expert` a LlamaMLP of intermediate_size over the full tp (also under
  attention DP); the routed experts one FusedMoE of intermediate_size, loaded by mllama4.py's
  _handle_expert_weight_params from the fused tensors: `experts.gate_up_proj` [E, H, 2I] is
  `chunk(2, -1)` into gate [E, H, I] and up [E, H, I], each expert's `.T` fed to FusedMoE's
  weight_loader as w1 / w3, which narrows it to the rank's I / moe_tp rows: per rank a segmented
  cut of the last dim, its slice of the gate half then its slice of the up half (ShardSpec.segments
  (1, 1) on dim 2; one contiguous slice, gpt-oss's interleaved reading, is wrong from tp 2 on);
  `experts.down_proj` [E, I, H] on dim 1. FusedMoE asserts I % moe_tp == 0. Llama4MoE does not
  compare tp with the expert count.
- Expert parallelism: _handle_expert_weight_params (models/mllama4.py L895-957) feeds each expert by
  its global id to FusedMoE.weight_loader, which keeps only those of the rank's EP block
  (_map_global_expert_id_to_local_expert_id, layers/moe/fused_moe_triton/layer.py L1153:
  `[moe_ep_rank * E/ep, +E/ep)`, moe_ep_rank = tp_rank // moe_tp) and narrows each to its
  moe_tp_rank's I / moe_tp rows of gate and of up (_load_w13 L856). So at ep > 1 a rank holds its EP
  block of experts (a leading-dim range of dim 0, ShardSpec.lead_start) cut on dim 2 (gate_up_proj,
  segmented) or dim 1 (down_proj) as at ep 1; the shared expert stays over the full tp.
- Embedding: a VocabParallelEmbedding with enable_tp=not is_dp_attention_enabled(): over tp, whole
  (padded) under attention DP. lm_head: LlamaForCausalLM's ParallelLMHead, over tp (attn_tp with
  --enable-dp-lm-head).
- Router (SGLang Llama4MoE.custom_routing_function, transformers Llama4Router): top-k of the
  logits, each weight the sigmoid of its logit, not renormalised.
- The vision tower (`vision_model.*`, `multi_modal_projector.*`): refused. SGLang builds it only
  when the checkpoint's index names vision weights and multimodal is enabled, with its own
  column/row cuts that tpshard has not measured; text-only checkpoints (ModelOpt's exports) load
  through the same class without it.
- Refused, where SGLang would build another model than transformers: RoPE layers other than all
  but each 4th (Llama4Attention hard-codes `(layer_id + 1) % 4 != 0`; transformers reads
  no_rope_layers), layer_types other than chunked attention on those layers, top-k other than 1
  (Llama4MoE's apply_router_weight_on_input, which SGLang's FusedMoE asserts top-1 for), tied
  embeddings, an activation other than silu.
- Refused: Llama4ForCausalLM checkpoints (transformers' text-only class, names without
  `language_model.`): SGLang's Llama4ForCausalLM loads through LlamaForCausalLM.load_weights, which
  has no mapping for the fused experts (models/llama.py); pipeline stages (no per-stage layout on
  record); export for SGLang (routed experts: SGLang's sharded_state loads post-processed layouts).
- vLLM export (VLLM_TABLE below, docs/deploy.md): the language model only (`--language-model-only`),
  each q/k head's rows in vLLM's rotary order, the fused experts as vLLM's FusedMoE holds them.
- `verify --model` runs tpshard.verify.llama4_model's decoder (rotary on adjacent pairs, the L2 q/k
  norm, NoPE layers' temperature tuning, chunked attention, the sigmoid router weight on the
  experts' input, the shared expert) against transformers' Llama4ForCausalLM on the same weights;
  layer-level verify runs every layer, the fused experts included (tpshard.verify.fused_layers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tpshard.arch.base import Arch, EngineNames, EngineTable, Piece, Rule, first_and_more
from tpshard.arch.engine_names import VLLM_ATTENTION_BUFFERS, bf16_only
from tpshard.arch.fused import FusedExperts, FusedParam
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import config_value
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

LM = "language_model."
LL = r"(language_model\.model\.layers\.\d+)"
FF = LL + r"\.feed_forward"


def _mlp(at: str, name: str, role, up: str, down: str, moe: bool) -> tuple[Rule, ...]:
    """gate/up/down of a LlamaMLP at `at`: one MergedColumnParallelLinear and one RowParallelLinear."""
    return (
        Rule(at + r"\.gate_proj", "MergedColumnParallelLinear", role, name + ".gate_up_proj", "gate", up, moe=moe),
        Rule(at + r"\.up_proj", "MergedColumnParallelLinear", role, name + ".gate_up_proj", "up", up, moe=moe),
        Rule(at + r"\.down_proj", "RowParallelLinear", role, name + ".down_proj", shape=down, moe=moe),
    )


RULES = (
    Rule(r"language_model\.model\.embed_tokens", "VocabParallelEmbedding", "embed", LM + "model.embed_tokens", shape="vocab"),
    Rule(r"language_model\.lm_head", "ParallelLMHead", "lm_head", LM + "lm_head", shape="vocab"),
    Rule(r"language_model\.model\.norm", "Replicated", "replicated", LM + "model.norm"),
    Rule(LL + r"\.(input_layernorm|post_attention_layernorm)", "Replicated", "replicated", r"\1.\2"),
    Rule(LL + r"\.self_attn\.q_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "q", "q"),
    Rule(LL + r"\.self_attn\.k_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "k", "kv"),
    Rule(LL + r"\.self_attn\.v_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "v", "kv"),
    Rule(LL + r"\.self_attn\.o_proj", "RowParallelLinear", "attn", r"\1.self_attn.o_proj", shape="o"),
    # the dense layers' MLP is intermediate_size_mlp wide, which ModelInfo does not record: shape unchecked
    *_mlp(FF, r"\1.feed_forward", "mlp", "", "", moe=False),
    *_mlp(FF + r"\.shared_expert", r"\1.feed_forward.shared_expert", "shared_expert", "expert_up", "expert_down", moe=True),
    Rule(FF + r"\.router", "ReplicatedLinear", "replicated", r"\1.feed_forward.router", shape="router", moe=True),
    Rule(FF + r"\.experts", "FusedExperts", "expert", r"\1.feed_forward.experts", moe=True),
)  # fmt: skip

FUSED = FusedExperts(
    params={
        "gate_up_proj": FusedParam("w13", "segmented", 2, per_i=2, shape="e_h_2i"),
        "down_proj": FusedParam("w2", "single", 1, shape="e_i_h"),
    },
    # mllama4.py _handle_expert_weight_params feeds each expert by its global id to FusedMoE.weight_loader,
    # which keeps those of the rank's EP block (_map_global_expert_id_to_local_expert_id) and narrows
    # each to its moe_tp rows: at ep < tp a cut of dims 0 and 2 (tpshard.plan.fused).
    ep_loads="always",
)


def sparse(model: ModelInfo, layer: int) -> bool:
    """Llama4DecoderLayer._is_moe_layer: (layer + 1) % interleave_moe_layer_step == 0 (ModelInfo's
    moe_layer_freq holds the step; a step of 0 reads as 1, every layer, as SGLang makes it)."""
    return (layer + 1) % model.moe_layer_freq == 0


def expected(model: ModelInfo, config: dict) -> Iterable[str]:
    """Embedding, final norm, lm_head (Llama4ForConditionalGeneration loads its own); per layer two
    norms, q/k/v/o, and a dense MLP or the router, the shared expert and the two fused expert tensors."""
    p = LM + "model"
    yield from (f"{p}.embed_tokens.weight", f"{p}.norm.weight")
    if not config_value(config, "tie_word_embeddings", False):  # tied is refused (refuse_config)
        yield LM + "lm_head.weight"
    for i in range(model.num_layers):
        layer = f"{p}.layers.{i}"
        yield from (f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight")
        yield from (f"{layer}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        mlp = f"{layer}.feed_forward" + (".shared_expert" if sparse(model, i) else "")
        yield from (f"{mlp}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))
        if sparse(model, i):
            yield f"{layer}.feed_forward.router.weight"
            yield from (f"{layer}.feed_forward.experts.{n}" for n in FUSED.params)


def refuse_config(config: dict, model: ModelInfo) -> None:
    """What SGLang's Llama4ForConditionalGeneration would build differently from transformers' model."""
    name = model.architecture
    step = config_value(config, "interleave_moe_layer_step", 1)
    listed = config_value(config, "moe_layers")
    ours = [i for i in range(model.num_layers) if sparse(model, i)]
    if listed is not None and list(listed) != ours:
        raise PlanError(
            f"{name}: config.json moe_layers {list(listed)[:16]} are not the layers interleave_moe_layer_step {step}"
            f" gives ({ours[:16]}); SGLang's Llama4DecoderLayer decides by the step, transformers by moe_layers"
        )
    # Llama4Attention: use_rope = (layer_id + 1) % 4 != 0, whatever config.json says; transformers
    # reads no_rope_layers (by default from no_rope_layer_interval) and chunks the RoPE layers' attention
    every = config_value(config, "no_rope_layer_interval", 4)
    theirs = list(config_value(config, "no_rope_layers") or [int((i + 1) % every != 0) for i in range(model.num_layers)])
    sglang = [int((i + 1) % 4 != 0) for i in range(model.num_layers)]
    if theirs != sglang:
        raise PlanError(
            f"{name}: config.json's RoPE layers (no_rope_layers {theirs[:16]}) are not SGLang's: Llama4Attention rotates"
            f" every layer but each 4th ({sglang[:16]}) whatever the config says"
        )
    types = config_value(config, "layer_types")
    if types is not None and list(types) != ["chunked_attention" if r else "full_attention" for r in sglang]:
        raise PlanError(f"{name}: config.json layer_types {list(types)[:8]} are not chunked attention on the RoPE layers, full on the others, as SGLang's Llama4Attention builds them")
    k = config_value(config, "num_experts_per_tok", 1)
    if k != 1:
        raise PlanError(
            f"{name}: num_experts_per_tok {k}; SGLang's Llama4MoE applies the router weight to the experts' input"
            " (apply_router_weight_on_input), which its FusedMoE runs for top-1 only (it asserts topk == 1)"
        )
    if config_value(config, "tie_word_embeddings", False):
        raise PlanError(f"{name}: tied embeddings; SGLang's Llama4ForConditionalGeneration loads language_model.lm_head.weight")
    act = config_value(config, "hidden_act", "silu")
    if act != "silu":
        raise PlanError(f"{name}: hidden_act {act!r}; SGLang's Llama4MoE and LlamaMLP run silu")


_VISION = re.compile(r"(vision_model|multi_modal_projector)\.")


def refuse_tensors(names: Iterable[str]) -> None:
    """The vision tower, by its tensors (SGLang decides by the same names in the checkpoint's index)."""
    found = sorted(n for n in names if _VISION.match(n))
    if found:
        raise PlanError(
            f"Llama4ForConditionalGeneration: the checkpoint holds the vision tower ({first_and_more(found)});"
            " tpshard has no rule for SGLang's Llama4VisionModel cut (models/mllama4.py), so it converts text-only"
            " checkpoints (language_model.* alone) only"
        )


# Architectures this family knows and refuses (tpshard.arch.refuse_architecture): why, in one line.
REFUSED = {
    "Llama4ForCausalLM": (
        "SGLang's Llama4ForCausalLM loads through LlamaForCausalLM.load_weights, which has no mapping for the fused"
        " experts (models/llama.py); save the text weights as Llama4ForConditionalGeneration (language_model.*), as the"
        " release and ModelOpt's text-only exports do"
    ),
}


def llama4_router(config: dict, e: int, k: int) -> RouterConfig:
    return RouterConfig(num_experts=e, top_k=k, scoring="sigmoid", renormalize=False)


# vLLM 0.33.0 (models/mllama4.py Llama4ForConditionalGeneration, models/llama4.py), keys read from
# the model built on CPU (docs/deploy.md). The text model is `language_model` (Llama4ForCausalLM,
# mllama4.py L779-786) under the checkpoint's names; q/k/v one QKVParallelLinear `qkv_proj` whose q
# and k heads' rows vLLM reorders for its rotary kernel (permute_qk_weight_for_rotary L805-844:
# "rotary", tpshard.export.rotary); the L2 q/k norm has no weight; the dense MLP and the shared expert
# LlamaMLPs (the shared expert kept under FusedMoE's `_shared_experts._layer`, the name the state
# dict's storage dedup keeps); the router a GateLinear in the checkpoint's dtype; the fused experts
# FusedMoE's routed_experts, each expert's shard transposed (load_moe_expert_weights L432-442).
# The vision tower and projector are built under _mark_tower_model (mllama4.py L765-777), which
# leaves them out (StageMissingLayer, no state-dict keys) when every image limit is 0, i.e. under
# `--language-model-only` (config/multimodal.py MultiModalConfig.get_limit_per_prompt): the export
# holds the language model only, served so (tpshard.export.launch).
_T = r"(language_model\.model\.layers\.\d+)"
_TA, _TF = _T + r"\.self_attn\.", _T + r"\.feed_forward\."
VLLM_PIECES = (
    (r"language_model\.(model\.embed_tokens|model\.norm|lm_head)\.weight", Piece(r"language_model.\1.weight", 0, 1)),
    (_T + r"\.(input_layernorm|post_attention_layernorm)\.weight", Piece(r"\1.\2.weight", 0, 1)),
    (_TA + r"q_proj\.weight", Piece(r"\1.self_attn.qkv_proj.weight", 0, 3)),
    (_TA + r"k_proj\.weight", Piece(r"\1.self_attn.qkv_proj.weight", 1, 3)),
    (_TA + r"v_proj\.weight", Piece(r"\1.self_attn.qkv_proj.weight", 2, 3)),
    (_TA + r"o_proj\.weight", Piece(r"\1.self_attn.o_proj.weight", 0, 1)),
    (_TF + r"gate_proj\.weight", Piece(r"\1.feed_forward.gate_up_proj.weight", 0, 2)),
    (_TF + r"up_proj\.weight", Piece(r"\1.feed_forward.gate_up_proj.weight", 1, 2)),
    (_TF + r"down_proj\.weight", Piece(r"\1.feed_forward.down_proj.weight", 0, 1)),
    (_TF + r"shared_expert\.gate_proj\.weight", Piece(r"\1.feed_forward.experts._shared_experts._layer.gate_up_proj.weight", 0, 2)),
    (_TF + r"shared_expert\.up_proj\.weight", Piece(r"\1.feed_forward.experts._shared_experts._layer.gate_up_proj.weight", 1, 2)),
    (_TF + r"shared_expert\.down_proj\.weight", Piece(r"\1.feed_forward.experts._shared_experts._layer.down_proj.weight", 0, 1)),
    (_TF + r"router\.weight", Piece(r"\1.feed_forward.router.weight", 0, 1)),
    (_TF + r"experts\.gate_up_proj", Piece(r"\1.feed_forward.experts.routed_experts.w13_weight", 0, 1)),
    (_TF + r"experts\.down_proj", Piece(r"\1.feed_forward.experts.routed_experts.w2_weight", 0, 1)),
)  # fmt: skip
VLLM_FUSED = ((r".*\.routed_experts\.w(13|2)_weight", "transpose"), (r".*\.self_attn\.qkv_proj\.weight", "rotary"))
VLLM_TABLE = EngineTable(
    VLLM_PIECES, tied="language_model.lm_head.weight", ep="vllm", fused=VLLM_FUSED, refuse=bf16_only("models/llama4.py"),
    buffers=VLLM_ATTENTION_BUFFERS,
    buffers_at=_T + r"\.self_attn\.o_proj\.weight",
)  # fmt: skip

ARCHS = (
    Arch(
        "Llama4ForConditionalGeneration", RULES, "mllama4.py", attn_group="attn_tp", embed_group="replicated",
        model_type="llama4", expected=expected, exports=EngineNames(vllm=VLLM_TABLE, sglang=None), verify="llama4",
        router=llama4_router, sparse=sparse, check=refuse_config, fused_experts=FUSED, refuse_tensors=refuse_tensors,
    ),
)  # fmt: skip
