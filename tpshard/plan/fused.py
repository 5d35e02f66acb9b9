"""The cut of routed experts stored fused [E, ...] (tpshard.arch.fused): one tensor per projection
of a layer's experts, its intermediate axis cut over moe_tp; under expert parallelism, where the
engine's loader slices the experts axis by EP slot, the rank's contiguous block of experts too: at
ep = tp (moe_tp 1) a cut of dim 0 alone, at ep < tp a cut of two dims of one tensor, its moe_tp
slice taken from its EP block (a leading-dim range, ShardSpec.lead_start / lead_length).

What this file is: `fused_cut`, the Cutting of one parameter of a FusedExperts module from the
family's FusedParam, and `sinks_cut`, attention sinks [heads] cut with the q heads.

What it is not: no rule table (the family modules), no bytes (tpshard.pieces: a cut on an inner dim
is gathered from whole rows of the outer dims, so a strided per-expert slice costs one pass).
"""

from __future__ import annotations

from msgspec import UNSET
from msgspec.structs import replace

from tpshard.arch import Arch
from tpshard.arch.fused import FUSED_SHAPES
from tpshard.cuts import Cutting, even_cuts
from tpshard.errors import PlanError
from tpshard.manifest import Cut, ModelInfo
from tpshard.topology import Topology


def fused_cut(name: str, shape: tuple[int, ...], param: str, arch: Arch, model: ModelInfo, topology: Topology) -> Cutting:
    """How one fused expert tensor is cut: over moe_tp, and under EP in each slot's block of experts."""
    fused = arch.fused_experts
    spec = fused.params.get(param) if fused is not None else None
    if spec is None:
        known = ", ".join(sorted(fused.params)) if fused is not None else "none"
        raise PlanError(f"{name}: no rule for parameter '{param}' of the fused experts (known: {known})")
    b = model.expert_block
    if spec.blocks is not None and spec.blocks != bool(b):
        kind = "a block-quantized (MXFP4)" if spec.blocks else "an unquantized"
        raise PlanError(f"{name}: {kind} expert tensor, but config.json's quantization_config says the experts are {'MXFP4' if b else 'unquantized'}")
    ep = topology.ep
    if ep > 1 and _sglang_refuses_ep(fused, model) and not (fused.vllm_ep and topology.placed_for == "vllm"):
        why = fused.ep_refusal + (", or split for vLLM (--format vllm or --engine vllm), whose loader slices them by EP rank" if fused.vllm_ep else "")
        raise PlanError(f"--ep {ep}: {name} holds every expert in one tensor; {why}")
    e, h, i = model.num_experts, model.hidden_size, model.moe_intermediate_size
    want = FUSED_SHAPES[spec.shape](e, h, i)
    if tuple(shape) != want:
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies {list(want)} ([E, ...] of {e} experts)")
    if ep > 1 and topology.moe_tp == 1:  # each rank its EP slot's block of experts, every parameter whole inside it
        return Cutting("column", 0, 1, ep, even_cuts(e, ep, e // ep))
    inner = _moe_tp_cut(name, shape, spec, model, topology)
    return inner if ep == 1 else _in_ep_blocks(inner, e, ep)


def _sglang_refuses_ep(fused, model: ModelInfo) -> bool:
    return fused.ep_loads == "never" or (fused.ep_loads == "blocks" and not model.expert_block)


def engine_placed(topology: Topology, arch: Arch, model: ModelInfo) -> Topology:
    """The topology the plan records: a vLLM engine at one stage (kept there at --ep > 1,
    tpshard.topology) only where the family's fused experts are placed by EP rank for vLLM alone
    (FusedExperts.vllm_ep), else dropped as at ep 1, so that every other output stays as it was."""
    if topology.pp > 1 or topology.engine is UNSET:
        return topology
    fused = arch.fused_experts
    if fused is not None and fused.vllm_ep and topology.ep > 1 and _sglang_refuses_ep(fused, model):
        return topology
    return replace(topology, engine=UNSET)


def _in_ep_blocks(inner: Cutting, e: int, ep: int) -> Cutting:
    """`inner` (the moe_tp cut of one EP slot) taken in every slot from its block of experts, over
    the tp group (tp rank = slot * moe_tp + moe_tp rank, SGLang's moe_ep / moe_tp groups): slot k's
    pieces hold experts [k * E/ep, +E/ep) (a leading-dim range) cut as `inner` cuts all of them; a
    parameter whole within the slot (the down bias) is a cut of dim 0 held by the slot's moe_tp ranks."""
    per = e // ep
    if inner.dim is None:
        return Cutting("column", 0, inner.factor, ep, even_cuts(e, ep, per))
    cuts = [replace(c, group_rank=k * inner.group_size + c.group_rank, lead_start=k * per, lead_length=per) for k in range(ep) for c in inner.cuts]
    return Cutting(inner.kind, inner.dim, 1, ep * inner.group_size, cuts, inner.segments)


def _moe_tp_cut(name: str, shape: tuple[int, ...], spec, model: ModelInfo, topology: Topology) -> Cutting:
    """One parameter cut over the moe_tp ranks of an EP slot, every expert alike."""
    g, b, i = topology.moe_tp, model.expert_block, model.moe_intermediate_size
    if spec.layout == "whole":  # a row-parallel bias: whole, added once after the reduction
        return Cutting("row_bias", None, g, 1, [Cut(0, 0, shape[0], 0, 0)])
    per = intermediate_per_rank(name, i, g, b, topology)
    if spec.layout == "segmented":  # [gate | up] halves of I each: the rank's slice of each, concatenated
        if b:
            raise PlanError(f"{name}: a [gate | up] segmented fused expert tensor in {b}-value blocks has no cut in tpshard")
        return Cutting("segmented", spec.dim, 1, g, even_cuts(i, g, per), (1,) * spec.per_i)
    # interleaved gate/up: ONE contiguous slice of the 2I axis (the rank's (gate_j, up_j) pairs);
    # single (down): the rank's intermediate columns (or blocks of them).
    kind = "row" if spec.role == "w2" else "column"
    return Cutting(kind, spec.dim, 1, g, even_cuts(shape[spec.dim], g, per * spec.per_i // spec.block))


def intermediate_per_rank(name: str, i: int, g: int, block: int, topology: Topology) -> int:
    """Intermediate elements per moe_tp rank: I / moe_tp (FusedMoE asserts it divides), or for
    block-quantized experts whole blocks, ceil(I / block / moe_tp) of them, the last rank short
    (SGLang's _load_mxfp4_experts_weights: per-rank block count math.ceil, end min(.., I))."""
    if not block:
        if i % g:
            raise PlanError(
                f"{name}: expert intermediate size {i} does not divide over moe_tp {g} (tp {topology.tp} / ep"
                f" {topology.ep}); SGLang's FusedMoE asserts it"
            )
        return i // g
    if i % block:
        raise PlanError(f"{name}: expert intermediate size {i} is not a multiple of the {block}-value MXFP4 block; SGLang asserts it")
    per = -(-(i // block) // g) * block
    if (g - 1) * per >= i:
        raise PlanError(
            f"{name}: {i // block} MXFP4 blocks of the expert intermediate size over moe_tp {g}: {per // block} per rank"
            f" leaves moe_tp rank {g - 1} none (SGLang's loader would give it an empty slice); choose a smaller tp"
        )
    return per


def sinks_cut(name: str, shape: tuple[int, ...], param: str, model: ModelInfo, g: int) -> Cutting:
    """Attention sinks [heads]: the rank's q heads, num_heads / g of them (GptOssAttention's loader
    copies `[attn_tp_rank * h, +h)`); never the kv heads' cut, never whole."""
    if param != "sinks":
        raise PlanError(f"{name}: no rule for parameter '{param}' of the attention (known: sinks)")
    if tuple(shape) != (model.num_heads,):
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies [{model.num_heads}] (one sink per head)")
    per = model.num_heads // g
    return Cutting("column", 0, 1, g, even_cuts(shape[0], g, per))
