"""The load contract of quantized tensors: a layer's logical cut converted into each tensor's physical cut.

What this file is: pure functions that `tpshard.quant.layers` calls for a quantized linear. The
layer is cut in its logical [N, K] coordinates by the dense rules (same groups, heads, replicas,
padding); here that cut becomes, for every on-disk tensor of the format, one narrow along one
physical dim (or a whole copy, or a rewritten value), by the format's row in
`tpshard.quant.formats.LAYOUTS`. Every conversion is recorded on the ShardSpec (quant, step, ratio,
atom, logical_*) so `check` can redo it. Also the alignment pre-flight: cuts that would split a
pack word, a group, a Marlin tile or an FP8 block are errors (with the tensor, the rank and the
numbers); what only engine kernels need is a warning.

What it is not: no file I/O, no config parsing (tpshard.quant.config), no bytes.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from fractions import Fraction

from tpshard.manifest import Cut, shard_shape
from tpshard.quant.formats import QuantSpec, TensorRole, replicated_on, step_ratio

# What each step is, for messages: the unit a rank boundary must not split.
_UNIT = {
    "packed": "pack unit ({atom} values share {words} word(s))",
    "group": "quantization group of {atom} (the group size must divide each rank's K)",
    "block_n": "FP8 {atom}-block grid (one scale per {atom}x{atom} block)",
    "block_k": "FP8 {atom}-block grid (one scale per {atom}x{atom} block)",
    "tile": "Marlin {atom}-row tile",
    "marlin_n": "Marlin {atom}-column permutation unit (shards need multiples of 64 output columns)",
    "perm64": "Marlin {atom}-column scale permutation",
    "fp4_moe": "{atom}-multiple of the expert intermediate size per rank that SGLang's Fp8MoEMethod asks of FP4 experts (weight_block_size)",
}
PAD_BLOCK_FORMATS = ("fp8_block", "ct_fp8_block")

# What engine kernels need beyond what tpshard can cut exactly: (kernel, N per rank multiple,
# K per rank multiple). A miss is a warning: the split is exact, the engine may pick a slower kernel.
ENGINE_MULTIPLES: dict[str, tuple[str, int, int]] = {
    "gptq": ("vLLM gptq_marlin", 64, 128),
    "gptq_v2": ("vLLM gptq_marlin", 64, 128),
    "awq": ("vLLM awq_marlin", 64, 128),
    "ct_int": ("vLLM Marlin WNA16", 64, 128),
    "marlin": ("Marlin kernels (engines)", 64, 128),
}


def moe_engine_note(spec: QuantSpec) -> str | None:
    """What SGLang's FusedMoE quant methods refuse to load for routed experts in this format, though
    the cut is exact (a warning: vLLM or another build may serve it)."""
    if spec.format == "ct_int" and not spec.sym:
        return ("asymmetric compressed-tensors experts (weight_zero_point): SGLang's CompressedTensorsWNA16MoE"
                " asserts symmetric quantization (compressed_tensors_wNa16_moe.py)")
    if spec.format.startswith("ct_int8_"):
        return ("int-quantized (W8A8 int8) experts: SGLang's compressed-tensors MoE scheme for them is Ascend NPU"
                " only, with channel weights and dynamic per-token activations (compressed_tensors_w8a8_int8_moe.py)")
    return None


def fp4_expert_blocks(spec: QuantSpec, dim: int, cuts: list[Cut]) -> list[tuple[TensorRole, Cut, str, int]]:
    """DeepSeek-V4's FP4 experts, exact at any 32-multiple, are allocated by SGLang's Fp8MoEMethod
    (fp8.py create_fp8_moe_weight_) under the block check of quantization_config's weight_block_size:
    each moe_tp rank's intermediate size a multiple of block_n (gate / up) and of block_k (down), or
    it raises ValueError (down's only when moe_tp > 1). The same refusal, as (role, cut, step, atom)."""
    if dim == 1 and len(cuts) < 2:
        return []
    atom = spec.block[0 if dim == 0 else 1]
    return [(spec.roles()[0], c, "fp4_moe", atom) for c in cuts if c.start % atom or c.length % atom]


def side_of(dim: int) -> str:
    return "output" if dim == 0 else "input"


def pad_blocks_per(spec: QuantSpec, full: int, parts: int, atom: int) -> int:
    """--pad-blocks: per-rank logical size rounded up to whole blocks, so every rank starts on one."""
    return math.ceil(full / (parts * atom)) * atom


def misalignments(spec: QuantSpec, roles: tuple[TensorRole, ...], dim: int, full: int, cuts: list[Cut]) -> list[tuple[TensorRole, Cut, str, int]]:
    """(role, cut, step, atom) for every tensor and rank whose logical range is off its step's atom."""
    side = side_of(dim)
    found = []
    for role in roles:
        axis = role.output if side == "output" else role.input
        if role.rewrite_shape or axis is None or replicated_on(spec, role, side, full):  # type: ignore[arg-type]
            continue
        _, atom = step_ratio(spec, role, axis.step, full)
        for c in cuts:
            end = c.start + c.length
            if c.length and (c.start % atom or (end % atom and end != full)):
                found.append((role, c, axis.step, atom))
    return found


def misalignment_message(
    prefix: str, spec: QuantSpec, role: TensorRole, bad: list[tuple[Cut, tuple[int, ...]]], step: str,
    atom: int, dim: int, full: int, group: str, group_size: int, pad_hint: str,
) -> str:  # fmt: skip
    """One line per tensor: the unit it breaks, the first offending rank's numbers, every offending rank."""
    cut, _ = bad[0]
    end = cut.start + cut.length
    at = cut.start if cut.start % atom else end
    words = spec.bits * atom // 32 if step == "packed" else 1
    unit = _UNIT.get(step, step + " unit {atom}").format(atom=atom, words=max(1, words))
    nk = "N" if dim == 0 else "K"
    ranks = sorted({r for _, rs in bad for r in rs})
    return (
        f"{prefix}.{role.suffix}: {nk} {full} over {group} of {group_size} gives {cut.length + cut.pad} per rank,"
        f" which breaks the {spec.format} {unit}; rank {bad[0][1][0]} ({group} rank {cut.group_rank})"
        f" holds {nk} [{cut.start}, {end}) and {at} % {atom} = {at % atom}; misaligned ranks {ranks}."
        f"{pad_hint} Or choose a tp whose per-rank {nk} is a multiple of {atom}."
    )


def expected_physical_shape(spec: QuantSpec, role: TensorRole, shape: tuple[int, ...], n: int, k: int) -> tuple[int, ...]:
    """The on-disk shape a layer [N, K] implies for this tensor (dims without an axis as found)."""
    out = list(shape)
    for axis, full in ((role.output, n), (role.input, k)):
        if axis is not None and axis.dim < len(out):
            ratio, _ = step_ratio(spec, role, axis.step, full)
            out[axis.dim] = math.ceil(full * ratio)
    return tuple(out)


def physical_cut(spec: QuantSpec, role: TensorRole, dim: int, full: int, cut: Cut) -> tuple[int, int, int, int, Fraction, int, str] | None:
    """(physical dim, start, length, pad, ratio, atom, step) of one rank's cut, or None if whole.

    The logical range must be aligned (see `misalignments`); a range ending at `full` takes the
    partial last word / group / block (ceil). Padding fills the rank up to ceil(per * ratio).
    """
    side = side_of(dim)
    axis = role.output if side == "output" else role.input
    if axis is None or replicated_on(spec, role, side, full):  # type: ignore[arg-type]
        return None
    ratio, atom = step_ratio(spec, role, axis.step, full)
    per = cut.length + cut.pad
    phys_per = math.ceil(per * ratio)
    start = cut.start * ratio
    if cut.length == 0:  # an all-padding rank: starts where the tensor ends
        p_start = math.ceil(full * ratio)
        p_len = 0
    else:
        assert start.denominator == 1, (role.suffix, cut)
        p_start = int(start)
        p_len = math.ceil((cut.start + cut.length) * ratio) - p_start
    return axis.dim, p_start, p_len, phys_per - p_len, ratio, atom, axis.step


def engine_warnings(findings: dict[tuple, list[str]]) -> list[str]:
    """Aggregate (format, kernel, side, size, multiple) -> layers into one warning line each."""
    lines = []
    for (fmt, kernel, nk, size, multiple, cls, group, g), layers in sorted(findings.items()):
        generic = sorted({re.sub(r"\.layers\.\d+\.", ".layers.*.", layer) for layer in layers})
        lines.append(
            f"{fmt}: {kernel} needs {nk} per rank % {multiple} == 0, but {', '.join(generic)} ({cls} over"
            f" {group} of {g}) has {size} ({size} % {multiple} = {size % multiple}); the split is exact,"
            " but engines will refuse this layer or fall back to a slower kernel"
        )
    return lines


def alignment_rows(plan) -> list[dict]:
    """Pre-flight table: per quantized tensor (layers and experts folded) the cut, atom and per-rank sizes."""
    from tpshard.report import generic_name

    rows: dict[str, dict] = {}
    for t in plan.tensors:
        if not t.quant:
            continue
        generic = generic_name(t.name)
        padded = any(c.logical_pad or c.pad for c in t.cuts)
        if generic in rows:
            if padded:
                rows[generic]["padded"] = "yes"
            continue
        c = t.cuts[0]
        if c.value is not None:
            cut = f"value {list(c.value)} (rank's shape)"
        elif t.dim is None:
            cut = "whole (replicated)"
        else:
            cut = f"{'N' if t.logical_dim == 0 else 'K'} {c.logical_length + c.logical_pad}/rank -> dim {t.dim} x{t.ratio[0]}/{t.ratio[1]}"
        rows[generic] = dict(
            tensor=generic,
            format=t.quant,
            step=t.step or "-",
            atom=t.atom,
            cut=cut,
            rank_shape=list(shard_shape(t, c)),
            padded="yes" if padded else "",
        )
    return list(rows.values())


def group_findings() -> dict[tuple, list[str]]:
    return defaultdict(list)
