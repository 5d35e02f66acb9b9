"""A tensor's cut over its group's ranks, as the rules decide it, and even pieces of one dim.

What this file is: `Cutting` (the kind of cut, the dim, the replica factor, how many pieces, and
each group rank's piece as a `tpshard.manifest.Cut`), `even_cuts` and `ceil_div`, `runs`, the
source runs of a segmented cut (ShardSpec.segments, in rank order), and `lead_block` / `lead_rows`,
the sub-tensor a cut with a leading-dim range is taken from (ShardSpec.lead_start): the arithmetic
that the dense rules (tpshard.plan.dense) and the quantized cut (tpshard.quant.layers, which
re-cuts a layer to whole blocks under --pad-blocks) both write their cuts with.

What it is not: no rule (which dim, which group: tpshard.plan.dense), no file: a cut decided here
names file 0 until the plan lays its tensor out (tpshard.plan.kinds.TensorKind.plan_cuts).
"""

from __future__ import annotations

from typing import NamedTuple

from tpshard.manifest import Cut, Kind


class Cutting(NamedTuple):
    """How one tensor (or a quantized layer, in its logical [N, K]) is cut over its group."""

    kind: Kind
    dim: int | None  # None: whole, one replica held by every rank of the group
    factor: int  # consecutive group ranks holding one piece (GQA kv replicas); the group size when whole
    group_size: int  # how many pieces
    cuts: list[Cut]  # a piece per group rank of `group_size`, file 0 until laid out
    segments: tuple[int, ...] = ()  # a segmented cut (ShardSpec.segments); `cuts` index the unit


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def even_cuts(n: int, parts: int, per: int) -> list[Cut]:
    """`parts` pieces of `per` along a dim of size n; trailing pieces are zero-padded past n."""
    return [
        Cut(r, r * per, max(0, min(per, n - r * per)), per - max(0, min(per, n - r * per)), 0)
        for r in range(parts)
    ]


def runs(segments: tuple[int, ...], rows: int, cut) -> list[tuple[int, int, int]]:
    """The (source start, length, pad) runs along the cut dim of size `rows` that one cut (a Cut or
    ShardSpec: start, length, pad) holds, in the order its shard holds them: one run, or with
    `segments` (ShardSpec.segments) segment i's [off_i + m_i * start, + m_i * length) for each
    segment of m_i units (unit = rows / sum(segments)), off_i the units before it."""
    if not segments:
        return [(cut.start, cut.length, cut.pad)]
    unit, off, out = rows // sum(segments), 0, []
    for m in segments:
        out.append((off + m * cut.start, m * cut.length, m * cut.pad))
        off += m * unit
    return out


def lead_block(shape: tuple[int, ...], nbytes: int, cut) -> tuple[tuple[int, ...], int, int]:
    """(shape, first byte, bytes) of the sub-tensor of a source tensor [shape] of `nbytes` that a
    cut (a Cut or ShardSpec) is taken from: source[lead_start : lead_start + lead_length] along dim 0
    where it has a leading-dim range (a contiguous run of bytes), else the whole tensor. Its `dim`,
    runs and padding then apply to that sub-tensor as to any other."""
    if not cut.lead_length:
        return shape, 0, nbytes
    row = nbytes // shape[0]
    return (cut.lead_length, *shape[1:]), cut.lead_start * row, cut.lead_length * row


def lead_rows(shape: tuple[int, ...], outer: int, cut) -> tuple[int, int]:
    """The [first, end) of the `outer` rows (the product of the dims before the cut dim) that a
    cut's leading-dim range covers: all of them without one."""
    if not cut.lead_length:
        return 0, outer
    per = outer // shape[0]
    return cut.lead_start * per, (cut.lead_start + cut.lead_length) * per
