"""Routed experts stored fused in the checkpoint: one tensor [E, ...] per projection of a layer's
experts (gpt-oss `mlp.experts.gate_up_proj` [E, H, 2I], Llama-4 `feed_forward.experts.gate_up_proj`,
Qwen3.5's `mlp.experts.gate_up_proj` [E, 2I, H] with [gate | up] rows, which its loader reads as well
as the per-expert form: `per_expert`), instead of one tensor per expert and projection.

A family declares how each parameter of its fused-experts module is cut (`Arch.fused_experts`,
param -> `FusedParam`); tpshard.plan.fused turns that into cuts and verify reads the same table
to know which rows are gate and which are up. The vocabulary:

- the **experts axis** is dim 0: under expert parallelism an EP slot holds the contiguous block
  `[slot * E/ep, (slot + 1) * E/ep)` where the engine's loader slices it (`ep_loads`; refused with
  `ep_refusal` saying why where it does not); at ep = tp (moe_tp 1) that is a cut of dim 0 alone,
  at ep < tp the moe_tp cut below taken from the slot's block (a leading-dim range of the cut,
  ShardSpec.lead_start / lead_length), one piece per tp rank (tpshard.plan.fused);
- the **intermediate axis** (`dim`) is cut over moe_tp; `per_i` indices of it per intermediate
  element (2 for a gate/up tensor, 1 for down);
- `layout` says how gate and up share a gate/up axis: `interleaved` (gpt-oss: gate_j, up_j
  alternate, so a rank keeps ONE contiguous slice of the axis, its (gate_j, up_j) pairs for
  j in its intermediate range), `segmented` (Llama-4: [gate | up] halves, a rank keeps its slice of
  each half, concatenated: a segmented cut, ShardSpec.segments (1, 1) along `dim`), `single` (down: one projection), `whole` (down's bias: not cut, kept
  whole on every rank of the EP slot, as every row-parallel bias);
- `role`: which projection a parameter is (w13 / w2), for verify;
- `block`: intermediate elements per index of `dim` (MXFP4's down_proj_blocks: 32 per block);
  `blocks` True: a parameter of block-quantized checkpoints only (ModelInfo.expert_block, gpt-oss
  MXFP4: `*_blocks` / `*_scales`), False: of unquantized ones only, None: of both (the biases).
  A block-quantized checkpoint's intermediate axis is cut in whole blocks, ceil(blocks / moe_tp)
  per rank, the last rank short (zero-padded to the others' size).

Not here: the cut arithmetic (tpshard.plan.fused), the runtime layer (tpshard.runtime.fused_moe).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Layout = Literal["interleaved", "segmented", "single", "whole"]


class FusedParam(NamedTuple):
    role: Literal["w13", "w13_bias", "w2", "w2_bias"]
    layout: Layout
    dim: int | None  # the intermediate axis cut over moe_tp; None for `whole`
    per_i: int = 1  # indices of `dim` per intermediate element (2: gate and up)
    shape: str = ""  # the source shape by config.json: a key of FUSED_SHAPES
    block: int = 1  # intermediate elements per index of `dim`
    blocks: bool | None = None  # only in block-quantized (True) / unquantized (False) checkpoints


# [E, ...] of each parameter by config.json, as (E, H, I) -> shape.
FUSED_SHAPES = {
    "e_h_2i": lambda e, h, i: (e, h, 2 * i),
    "e_2i": lambda e, h, i: (e, 2 * i),
    "e_i_h": lambda e, h, i: (e, i, h),
    "e_h": lambda e, h, i: (e, h),
    # Qwen3.5's [out, in] per expert: gate_up_proj [E, 2I, H] ([gate | up] rows), down_proj [E, H, I]
    "e_2i_h": lambda e, h, i: (e, 2 * i, h),
    "e_h_i": lambda e, h, i: (e, h, i),
    # MXFP4 (32 values a block, two per byte): blocks [..., blocks, 16] and one E8M0 scale a block
    "e_2i_hb_16": lambda e, h, i: (e, 2 * i, h // 32, 16),
    "e_2i_hb": lambda e, h, i: (e, 2 * i, h // 32),
    "e_h_ib_16": lambda e, h, i: (e, h, i // 32, 16),
    "e_h_ib": lambda e, h, i: (e, h, i // 32),
}


class FusedExperts(NamedTuple):
    params: dict[str, FusedParam]
    # Which checkpoints the engine's loader slices by EP slot on the experts axis: "never" (--ep > 1
    # refused with `ep_refusal`), "blocks" (block-quantized ones only: gpt-oss MXFP4), "always".
    ep_loads: Literal["never", "blocks", "always"] = "never"
    ep_refusal: str = ""  # why not, for the refusal
    # Where the engine's loader reads the experts either fused or one by one (Qwen3.5): each fused
    # parameter and the per-expert projections it stands for, so that a checkpoint holding either form
    # is complete (tpshard.completeness); () = the fused form only (gpt-oss, Llama-4).
    per_expert: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # vLLM's loader slices every checkpoint's experts by EP rank (gpt-oss bf16: models/gpt_oss.py
    # _load_weights_other's use_ep branch), so an output placed for vLLM (--engine / --format vllm) may
    # use --ep where `ep_loads` refuses it for SGLang (tpshard.plan.fused.engine_placed)
    vllm_ep: bool = False
