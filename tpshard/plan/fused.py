"""The cut of routed experts stored fused [E, ...] (tpshard.arch.fused): one tensor per projection
of a layer's experts, its intermediate axis cut over moe_tp, the experts axis whole (or, where the
engine's loader slices it, by EP slot: not built yet, refused).

What this file is: `fused_cut`, the Cutting of one parameter of a FusedExperts module from the
family's FusedParam, and `sinks_cut`, attention sinks [heads] cut with the q heads.

What it is not: no rule table (the family modules), no bytes (tpshard.pieces: a cut on an inner dim
is gathered from whole rows of the outer dims, so a strided per-expert slice costs one pass).
"""

from __future__ import annotations

from tpshard.arch import Arch
from tpshard.arch.fused import FUSED_SHAPES
from tpshard.cuts import Cutting, even_cuts
from tpshard.errors import PlanError
from tpshard.manifest import Cut, ModelInfo
from tpshard.topology import Topology


def fused_cut(name: str, shape: tuple[int, ...], param: str, arch: Arch, model: ModelInfo, topology: Topology) -> Cutting:
    """How one fused expert tensor is cut over moe_tp (the whole group of the rank's EP slot)."""
    fused = arch.fused_experts
    spec = fused.params.get(param) if fused is not None else None
    if spec is None:
        known = ", ".join(sorted(fused.params)) if fused is not None else "none"
        raise PlanError(f"{name}: no rule for parameter '{param}' of the fused experts (known: {known})")
    if topology.ep > 1 and not fused.ep_loads:
        raise PlanError(f"--ep {topology.ep}: {name} holds every expert in one tensor; {fused.ep_refusal}")
    e, h, i = model.num_experts, model.hidden_size, model.moe_intermediate_size
    want = FUSED_SHAPES[spec.shape](e, h, i)
    if tuple(shape) != want:
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies {list(want)} ([E, ...] of {e} experts)")
    g = topology.moe_tp
    if spec.layout == "whole":  # a row-parallel bias: whole, added once after the reduction
        return Cutting("row_bias", None, g, 1, [Cut(0, 0, shape[0], 0, 0)])
    if spec.layout == "segmented":
        raise PlanError(f"{name}: a [gate | up] segmented fused expert tensor has no segment cut in tpshard yet")
    if i % g:
        raise PlanError(
            f"{name}: expert intermediate size {i} does not divide over moe_tp {g} (tp {topology.tp} / ep"
            f" {topology.ep}); SGLang's FusedMoE asserts it"
        )
    # interleaved gate/up: ONE contiguous slice of the 2I axis (the rank's (gate_j, up_j) pairs);
    # single (down): the rank's I / moe_tp columns.
    per = spec.per_i * (i // g)
    kind = "row" if spec.role == "w2" else "column"
    return Cutting(kind, spec.dim, 1, g, even_cuts(shape[spec.dim], g, per))


def sinks_cut(name: str, shape: tuple[int, ...], param: str, model: ModelInfo, g: int) -> Cutting:
    """Attention sinks [heads]: the rank's q heads, num_heads / g of them (GptOssAttention's loader
    copies `[attn_tp_rank * h, +h)`); never the kv heads' cut, never whole."""
    if param != "sinks":
        raise PlanError(f"{name}: no rule for parameter '{param}' of the attention (known: sinks)")
    if tuple(shape) != (model.num_heads,):
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies [{model.num_heads}] (one sink per head)")
    per = model.num_heads // g
    return Cutting("column", 0, 1, g, even_cuts(shape[0], g, per))
