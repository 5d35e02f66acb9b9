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
of `count` concatenated along dim 0. Architectures that are not here are refused by the exporter.
"""

from __future__ import annotations

import re
from typing import NamedTuple


class Piece(NamedTuple):
    engine: str  # engine key, a template over the HF name's regex groups
    position: int  # place along dim 0 of the engine tensor
    count: int  # pieces in the engine tensor (1 = the HF tensor itself)


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

TABLES: dict[str, dict[str, EngineTable]] = {
    "vllm": {
        "LlamaForCausalLM": _VLLM_DENSE,
        "MistralForCausalLM": _VLLM_DENSE,
        "Qwen2ForCausalLM": _VLLM_DENSE,
        "Qwen3ForCausalLM": _VLLM_DENSE,
    },
    "sglang": {
        "LlamaForCausalLM": _SGLANG_DENSE,
        "MistralForCausalLM": _SGLANG_DENSE,
        "Qwen2ForCausalLM": _SGLANG_DENSE,
        "Qwen3ForCausalLM": _SGLANG_DP,
    },
}

ENGINES = tuple(TABLES)


class NameMap:
    """Compiled table: HF tensor name -> its Piece with the engine name filled in."""

    def __init__(self, table: EngineTable):
        self.table = table
        self._rules = [(re.compile(pattern), piece) for pattern, piece in table.pieces]

    def piece(self, hf_name: str) -> Piece | None:
        for pattern, piece in self._rules:
            m = pattern.fullmatch(hf_name)
            if m:
                return piece._replace(engine=m.expand(piece.engine))
        return None

    def buffers(self, layer: str) -> list[Buffer]:
        return [b._replace(engine=b.engine.format(layer=layer)) for b in self.table.buffers]
