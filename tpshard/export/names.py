"""Per-engine name tables: what each engine's model `state_dict()` calls a rank's tensors.

An export writes, per rank, exactly the keys the engine's `sharded_state` loader compares against
(the model's state dict after its storage dedup, vLLM and SGLang `_filter_subtensors`), so these
tables are facts about engine code, read from vLLM 0.33.0 and SGLang 0.5.23:

- `qkv_proj` is [q; k; v] of the rank along dim 0 and `gate_up_proj` is [gate; up]: the stacking
  of `stacked_params_mapping` in `models/llama.py`, `qwen2.py`, `qwen3.py` of both engines
  (MistralForCausalLM is vLLM's and SGLang's Llama class);
- a tied table is one storage under two names; the filter keeps the smaller key, `lm_head.weight`;
- vLLM's `Attention` registers four persistent 0-d float32 buffers set to 1.0 per layer
  (`layers/attention/attention.py`, `set_default_quant_scales(register_buffer=True)`): a file
  without them ends in "Missing keys"; SGLang's `RadixAttention` has none, and a file carrying them
  fails with KeyError there.

A table maps an HF tensor name to (engine name, position, count): the tensor is piece `position`
of `count` concatenated along dim 0; routed experts are stacked into [E_local, rows, cols]
(`Piece.stacked`). The MoE and MLA tables (vLLM only) are below DENSE_PIECES, with the vLLM lines
they come from. Architectures that are not here are refused by the exporter.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Piece(NamedTuple):
    engine: str  # engine key, a template over the HF name's regex groups; "" = not in the engine's state
    position: int  # place along dim 0 of the engine tensor (of each expert's slice when `stacked`)
    count: int  # pieces in the engine tensor (1 = the HF tensor itself)
    # Routed experts: the engine tensor is [E_local, rows, cols], the rank's experts in ascending id,
    # each expert's `count` pieces along its rows; its bytes are the dim-0 concatenation of those 2-D
    # pieces, expert by expert.
    stacked: bool = False


class Buffer(NamedTuple):
    """A tensor the engine model registers that no checkpoint holds: its constant content."""

    engine: str  # template over `{layer}`, the decoder layer prefix model.layers.N
    dtype: str
    value: float


class EngineTable(NamedTuple):
    pieces: tuple[tuple[str, Piece], ...]  # (HF name regex, piece)
    tied: str  # the key a tied embedding / lm_head table is kept under
    buffers: tuple[Buffer, ...] = ()  # per decoder layer
    attn_dp: bool = False  # the engine model shards attention and the embedding over attn_tp
    buffers_at: str = r"(model\.layers\.\d+)\.self_attn\.o_proj\.weight"  # a kept tensor of each attention layer
    ep: str = ""  # "" = no routed experts; "vllm": vLLM's expert placement (layout.refuse_unexportable)
    q_lora: tuple = ()  # (pieces with q_lora_rank, pieces without): MLA's kv_a_proj_with_mqa
    drop_mtp: bool = False  # decoder layers >= num_hidden_layers (DeepSeek's MTP) are not in the engine's state


L = r"(model\.layers\.\d+)"
P = r"\.(weight|bias)"

DENSE_PIECES: tuple[tuple[str, Piece], ...] = (
    (r"model\.embed_tokens\.weight", Piece("model.embed_tokens.weight", 0, 1)),
    (r"lm_head\.weight", Piece("lm_head.weight", 0, 1)),
    (r"model\.norm\.weight", Piece("model.norm.weight", 0, 1)),
    (L + r"\.(input_layernorm|post_attention_layernorm)\.weight", Piece(r"\1.\2.weight", 0, 1)),
    (L + r"\.self_attn\.q_proj" + P, Piece(r"\1.self_attn.qkv_proj.\2", 0, 3)),
    (L + r"\.self_attn\.k_proj" + P, Piece(r"\1.self_attn.qkv_proj.\2", 1, 3)),
    (L + r"\.self_attn\.v_proj" + P, Piece(r"\1.self_attn.qkv_proj.\2", 2, 3)),
    (L + r"\.self_attn\.o_proj\.weight", Piece(r"\1.self_attn.o_proj.weight", 0, 1)),
    (L + r"\.mlp\.gate_proj\.weight", Piece(r"\1.mlp.gate_up_proj.weight", 0, 2)),
    (L + r"\.mlp\.up_proj\.weight", Piece(r"\1.mlp.gate_up_proj.weight", 1, 2)),
    (L + r"\.mlp\.down_proj\.weight", Piece(r"\1.mlp.down_proj.weight", 0, 1)),
    # Qwen3: per-head RMSNorm of q and k, the same [head_dim] on every rank
    (L + r"\.self_attn\.(q_norm|k_norm)\.weight", Piece(r"\1.self_attn.\2.weight", 0, 1)),
)

VLLM_ATTENTION_BUFFERS = tuple(
    Buffer("{layer}.self_attn.attn." + b, "F32", 1.0) for b in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
)

_VLLM_DENSE = EngineTable(DENSE_PIECES, tied="lm_head.weight", buffers=VLLM_ATTENTION_BUFFERS)
_SGLANG_DENSE = EngineTable(DENSE_PIECES, tied="lm_head.weight")
# SGLang 0.5.23 splits attention heads over attn_tp only in the classes written for DP attention
# (Qwen3Attention); Llama/Mistral/Qwen2 split over the full tp even under --enable-dp-attention,
# which tpshard's attn-dp plan does not match (ENGINE_FORMATS.md §2, measured).
_SGLANG_DP = _SGLANG_DENSE._replace(attn_dp=True)

# ---- MoE and MLA, vLLM 0.33.0 only (SGLang loads post-processed, backend-specific expert layouts) ----
#
# The keys are those of vLLM's `_filter_subtensors(model.state_dict())` (sharded_state_loader.py
# L137-172), which keeps the lexicographically smallest of the names one storage has. vLLM's FusedMoE
# (layers/fused_moe/layer.py L415-457) registers its parameters in a `routed_experts` child
# (layers/fused_moe/routed_experts.py) and also holds the router `gate` and, where given, the shared
# experts (`_shared_experts._layer`, layers/fused_moe/runner/shared_experts.py L56) and the shared
# expert's gate, so those tensors have two names and the kept one is often `mlp.experts.…`. Every
# key below was read from vLLM's own models built on CPU (tp 2, docs/deploy.md), not guessed from
# the attribute names: Qwen3-MoE's router is kept as `mlp.experts.gate.weight` (passed to the
# FusedMoE, models/qwen3_moe.py L170-205), Qwen2-MoE's as `mlp.gate.weight`.
#
# w13_weight [E_local, 2*I/moe_tp, H] is each local expert's gate rows then up rows, w2_weight
# [E_local, H, I/moe_tp] its down columns (layers/fused_moe/unquantized_fused_moe_method.py L87-117).
E = r"\.experts\.\d+\."


def _experts(block: str, gate: str, up: str, down: str, at: str) -> tuple[tuple[str, Piece], ...]:
    """Routed experts of `L.<block>` into the FusedMoE parameters at `L.<at>`."""
    src = L + r"\." + re.escape(block) + E
    return (
        (src + re.escape(gate) + r"\.weight", Piece(r"\1." + at + ".w13_weight", 0, 2, stacked=True)),
        (src + re.escape(up) + r"\.weight", Piece(r"\1." + at + ".w13_weight", 1, 2, stacked=True)),
        (src + re.escape(down) + r"\.weight", Piece(r"\1." + at + ".w2_weight", 0, 1, stacked=True)),
    )


def _mlp(block: str, at: str) -> tuple[tuple[str, Piece], ...]:
    """A gate/up/down MLP at `L.<block>` as vLLM's gate_up_proj / down_proj at `L.<at>`."""
    src = L + r"\." + re.escape(block) + r"\."
    return (
        (src + r"gate_proj\.weight", Piece(r"\1." + at + ".gate_up_proj.weight", 0, 2)),
        (src + r"up_proj\.weight", Piece(r"\1." + at + ".gate_up_proj.weight", 1, 2)),
        (src + r"down_proj\.weight", Piece(r"\1." + at + ".down_proj.weight", 0, 1)),
    )


_NO_MLP = tuple(p for p in DENSE_PIECES if ".mlp." not in p[1].engine)  # embedding, norms, attention, q/k norms
_ROUTED = _experts("mlp", "gate_proj", "up_proj", "down_proj", "mlp.experts.routed_experts")
QWEN3_MOE_PIECES = _NO_MLP + ((L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.experts.gate.weight", 0, 1)),) + _ROUTED
QWEN2_MOE_PIECES = (
    _NO_MLP
    + (
        (L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.gate.weight", 0, 1)),
        (L + r"\.mlp\.shared_expert_gate\.weight", Piece(r"\1.mlp.experts._shared_experts._layer.expert_gate.weight", 0, 1)),
    )
    + _ROUTED
    + _mlp("mlp.shared_expert", "mlp.experts._shared_experts._layer")
)
# Mixtral keeps its checkpoint's block name (models/mixtral.py): router `block_sparse_moe.gate`.
MIXTRAL_PIECES = _NO_MLP + (
    (L + r"\.block_sparse_moe\.gate\.weight", Piece(r"\1.block_sparse_moe.gate.weight", 0, 1)),
) + _experts("block_sparse_moe", "w1", "w3", "w2", "block_sparse_moe.experts.routed_experts")
# DeepSeek V2/V3 (models/deepseek_v2.py). MLA: DeepseekV2MLAAttention (L1052-1106) hands q_b_proj /
# q_proj, o_proj and q_a_layernorm to its `mla_attn` wrapper (L1196-1198), whose names sort first;
# with q_lora_rank, fused_qkv_a_proj = [q_a_proj; kv_a_proj_with_mqa] (L1052), else
# kv_a_proj_with_mqa stands alone. The MLA attention's four scale buffers sit at
# self_attn.mla_attn.mla_attn. The router's e_score_correction_bias is a float32 parameter of the
# gate, built only when config.json says topk_method "noaux_tc" (L327-332). The MTP layer
# (num_hidden_layers) is not built (make_layers L1468) and its weights are skipped (L1653-1654).
_MLA = L + r"\.self_attn\."
DEEPSEEK_PIECES = (
    tuple(p for p in DENSE_PIECES if ".self_attn." not in p[1].engine)  # embedding, norms, dense MLP of layers < first_k_dense_replace
    + (
        (_MLA + r"q_a_proj\.weight", Piece(r"\1.self_attn.fused_qkv_a_proj.weight", 0, 2)),
        (_MLA + r"q_a_layernorm\.weight", Piece(r"\1.self_attn.mla_attn.q_a_layernorm.weight", 0, 1)),
        (_MLA + r"q_b_proj\.weight", Piece(r"\1.self_attn.mla_attn.q_b_proj.weight", 0, 1)),
        (_MLA + r"q_proj\.weight", Piece(r"\1.self_attn.mla_attn.q_proj.weight", 0, 1)),
        (_MLA + r"kv_a_layernorm\.weight", Piece(r"\1.self_attn.kv_a_layernorm.weight", 0, 1)),
        (_MLA + r"kv_b_proj\.weight", Piece(r"\1.self_attn.kv_b_proj.weight", 0, 1)),
        (_MLA + r"o_proj\.weight", Piece(r"\1.self_attn.mla_attn.o_proj.weight", 0, 1)),
        (L + r"\.mlp\.gate\.(weight|e_score_correction_bias)", Piece(r"\1.mlp.experts.gate.\2", 0, 1)),
    )
    + _ROUTED
    + _mlp("mlp.shared_experts", "mlp.experts._shared_experts._layer")
)
KV_A_FUSED = ((_MLA + r"kv_a_proj_with_mqa\.weight", Piece(r"\1.self_attn.fused_qkv_a_proj.weight", 1, 2)),)
KV_A_ALONE = ((_MLA + r"kv_a_proj_with_mqa\.weight", Piece(r"\1.self_attn.kv_a_proj_with_mqa.weight", 0, 1)),)
MLA_BUFFERS = tuple(b._replace(engine=b.engine.replace("self_attn.attn.", "self_attn.mla_attn.mla_attn.")) for b in VLLM_ATTENTION_BUFFERS)
_VLLM_MOE = dict(tied="lm_head.weight", buffers=VLLM_ATTENTION_BUFFERS, ep="vllm")

TABLES: dict[str, dict[str, EngineTable]] = {
    "vllm": {
        "LlamaForCausalLM": _VLLM_DENSE,
        "MistralForCausalLM": _VLLM_DENSE,
        "Qwen2ForCausalLM": _VLLM_DENSE,
        "Qwen3ForCausalLM": _VLLM_DENSE,
        "Qwen3MoeForCausalLM": EngineTable(QWEN3_MOE_PIECES, **_VLLM_MOE),
        "Qwen2MoeForCausalLM": EngineTable(QWEN2_MOE_PIECES, **_VLLM_MOE),
        "MixtralForCausalLM": EngineTable(MIXTRAL_PIECES, **_VLLM_MOE),
        **{
            arch: EngineTable(DEEPSEEK_PIECES, tied="lm_head.weight", buffers=MLA_BUFFERS, ep="vllm", drop_mtp=True, q_lora=(KV_A_FUSED, KV_A_ALONE))
            for arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
        },
    },
    "sglang": {
        "LlamaForCausalLM": _SGLANG_DENSE,
        "MistralForCausalLM": _SGLANG_DENSE,
        "Qwen2ForCausalLM": _SGLANG_DENSE,
        "Qwen3ForCausalLM": _SGLANG_DP,
    },
}

ENGINES = tuple(TABLES)


def _format(template: str) -> str:
    """A table's engine template (group references \\1, \\2 and plain text) as a str.format
    string: Match.expand parses its template again on every call, and a model of 90k tensors
    has 90k names."""
    if "\\" in re.sub(r"\\\d", "", template):
        raise ValueError(f"{template!r}: an engine template holds plain text and \\N group references only")
    return re.sub(r"\\(\d)", lambda m: "{%d}" % (int(m.group(1)) - 1), template.replace("{", "{{").replace("}", "}}"))


class NameMap:
    """Compiled table: HF tensor name -> its Piece with the engine name filled in."""

    def __init__(self, table: EngineTable, q_lora_rank: int | None = None):
        self.table = table
        pieces = table.pieces + (table.q_lora[0 if q_lora_rank else 1] if table.q_lora else ())
        self._rules = [(re.compile(pattern), piece, _format(piece.engine)) for pattern, piece in pieces]

    def piece(self, hf_name: str) -> Piece | None:
        for pattern, piece, engine in self._rules:
            m = pattern.fullmatch(hf_name)
            if m:
                return piece._replace(engine=engine.format(*m.groups()))
        return None

    def buffers(self, layer: str) -> list[Buffer]:
        return [b._replace(engine=b.engine.format(layer=layer)) for b in self.table.buffers]
