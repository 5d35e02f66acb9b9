"""The vocabulary of the engines' name tables, and the pieces several families' tables share.

An export (tpshard.export) writes, per rank, exactly the keys the engine's `sharded_state` loader
compares against (the model's state dict after its storage dedup, vLLM and SGLang
`_filter_subtensors`), so these tables are facts about engine code, read from vLLM 0.33.0 and
SGLang 0.5.23; each family's module (tpshard.arch.llama, ...) declares its tables from the pieces
here, with the engine lines they come from:

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
(`Piece.stacked`; the vocabulary is tpshard.arch.base's). Not here: compiling a table and laying
out the files (tpshard.export.names, tpshard.export.layout).
"""

from __future__ import annotations

import re

from tpshard.arch.base import Buffer, EngineTable, L, Piece

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

VLLM_DENSE = EngineTable(DENSE_PIECES, tied="lm_head.weight", buffers=VLLM_ATTENTION_BUFFERS)
SGLANG_DENSE = EngineTable(DENSE_PIECES, tied="lm_head.weight")

# ---- MoE, vLLM 0.33.0 only (SGLang loads post-processed, backend-specific expert layouts) ------
#
# The keys are those of vLLM's `_filter_subtensors(model.state_dict())` (sharded_state_loader.py
# L137-172), which keeps the lexicographically smallest of the names one storage has. vLLM's FusedMoE
# (layers/fused_moe/layer.py L415-457) registers its parameters in a `routed_experts` child
# (layers/fused_moe/routed_experts.py) and also holds the router `gate` and, where given, the shared
# experts (`_shared_experts._layer`, layers/fused_moe/runner/shared_experts.py L56) and the shared
# expert's gate, so those tensors have two names and the kept one is often `mlp.experts.…`. Every
# key in the families' tables was read from vLLM's own models built on CPU (tp 2, docs/deploy.md),
# not guessed from the attribute names.
#
# w13_weight [E_local, 2*I/moe_tp, H] is each local expert's gate rows then up rows, w2_weight
# [E_local, H, I/moe_tp] its down columns (layers/fused_moe/unquantized_fused_moe_method.py L87-117).
E = r"\.experts\.\d+\."


def vllm_experts(block: str, gate: str, up: str, down: str, at: str) -> tuple[tuple[str, Piece], ...]:
    """Routed experts of `L.<block>` into the FusedMoE parameters at `L.<at>`."""
    src = L + r"\." + re.escape(block) + E
    return (
        (src + re.escape(gate) + r"\.weight", Piece(r"\1." + at + ".w13_weight", 0, 2, stacked=True)),
        (src + re.escape(up) + r"\.weight", Piece(r"\1." + at + ".w13_weight", 1, 2, stacked=True)),
        (src + re.escape(down) + r"\.weight", Piece(r"\1." + at + ".w2_weight", 0, 1, stacked=True)),
    )


def vllm_mlp(block: str, at: str) -> tuple[tuple[str, Piece], ...]:
    """A gate/up/down MLP at `L.<block>` as vLLM's gate_up_proj / down_proj at `L.<at>`."""
    src = L + r"\." + re.escape(block) + r"\."
    return (
        (src + r"gate_proj\.weight", Piece(r"\1." + at + ".gate_up_proj.weight", 0, 2)),
        (src + r"up_proj\.weight", Piece(r"\1." + at + ".gate_up_proj.weight", 1, 2)),
        (src + r"down_proj\.weight", Piece(r"\1." + at + ".down_proj.weight", 0, 1)),
    )


NO_MLP = tuple(p for p in DENSE_PIECES if ".mlp." not in p[1].engine)  # embedding, norms, attention, q/k norms
ROUTED = vllm_experts("mlp", "gate_proj", "up_proj", "down_proj", "mlp.experts.routed_experts")
VLLM_MOE = dict(tied="lm_head.weight", buffers=VLLM_ATTENTION_BUFFERS, ep="vllm")


def bf16_only(vllm_file: str, then=None):
    """An EngineTable.refuse for a table proven with unquantized checkpoints only (the 2026 families):
    a quantized checkpoint (FP8 block passes tpshard.export.layout's own check) is refused; `then`:
    the family's further refusals."""

    def refuse(plan, config: dict) -> str | None:
        quant = sorted({t.quant for t in plan.tensors if t.quant} | {q.get("format", "?") for q in plan.quant_layers.values()})
        if quant:
            return (
                f"the checkpoint is quantized ({', '.join(quant)}); tpshard's vLLM table for {plan.model.architecture}"
                f" ({vllm_file}) is proven for unquantized checkpoints only; serve it with vLLM's own loader"
            )
        return then(plan, config) if then else None

    return refuse
