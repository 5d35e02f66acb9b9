"""check's checks of a plan, which read no byte: 1 group, 2 global vs per-rank size, 3 logical vs
physical (quantized cuts), 4 replicas (one piece per rank), 5 reduction (a row-parallel bias once
per group), and the pipeline stages' (tpshard.check.pipeline) at pp > 1.

They run on the manifest alone, with or without the source; the files are tpshard.check.files'.
"""

from __future__ import annotations

from collections import defaultdict

import msgspec

from tpshard.check.pipeline import check_stages
from tpshard.check.report import CheckReport, shard_text
from tpshard.errors import TpshardError
from tpshard.manifest import Plan, ShardSpec


def check_plan(plan: Plan, report: CheckReport) -> None:
    """The seed's alignment checks that need no bytes: 1 group, 2 global vs per-rank, 3 logical vs
    physical, 4 replicas, 5 reduction.

    A tensor's findings depend on its record without its names (shape, dim, group, cuts, files...)
    and its pipeline stages, which most tensors share with many others (every layer, every expert):
    a combination found clean once is not checked again; one with findings is checked, and
    reported, tensor by tensor."""
    stages_of = check_stages(plan, report)  # tensor name -> its pipeline stages; empty at pp 1
    memo: dict[tuple, tuple[int, ...]] = {}  # topology lookups shared by every tensor
    layer_groups: dict[str, set[str]] = defaultdict(set)
    seen: set[str] = set()
    clean: set[tuple] = set()
    for t in plan.tensors:
        if t.kind != "replicated":
            layer_groups[t.layer].add(t.group)
        if t.name in seen:
            report.add("replicas", f"{t.name}: listed more than once in the manifest")
            continue
        seen.add(t.name)
        key = (msgspec.structs.replace(t, name="", source="", layer=""), stages_of.get(t.name))
        if key in clean:
            continue
        found = _tensor_findings(plan, t, stages_of.get(t.name), memo)
        for c, m in found:
            report.add(c, m)
        if not found:
            clean.add(key)
    for layer, groups in layer_groups.items():
        if len(groups) > 1:
            report.add("group", f"{layer}: its tensors are sharded over different groups {sorted(groups)}; one layer reduces over one group")

    # 5. reduction: a row-parallel bias is whole on every rank and added once, by group rank 0.
    for t in plan.tensors:
        if t.layer_class == "RowParallelLinear" and t.name.endswith(".bias"):
            weight_groups = layer_groups.get(t.layer, set())
            for c in t.cuts:
                s = plan.view(t, c)
                if s.kind != "row_bias" or s.dim is not None:
                    report.add("reduction", f"{shard_text(s)}: bias of a row-parallel layer recorded as '{s.kind}' cut at dim {s.dim}; it must be kept whole and added once per reduction group")
                elif weight_groups and s.group not in weight_groups:
                    report.add("reduction", f"{shard_text(s)}: bias recorded for group {s.group}, but {s.layer} reduces over {sorted(weight_groups)}")


def _tensor_findings(plan: Plan, t, stages: tuple[int, ...] | None, memo: dict) -> list[tuple[str, str]]:
    """Checks 1-4 of one tensor, as (check, message)."""
    topo = plan.topology
    specs = [plan.view(t, c) for c in t.cuts]
    found: list[tuple[str, str]] = []
    for s in specs:
        # 1. group: the ranks holding the shard's file are the ones the topology gives its group rank
        # (in the pipeline stages that hold the tensor).
        try:
            size = topo.group_size(s.group, s.factor)
            key = (s.group, s.group_rank, s.factor, s.ep_slot, stages)
            ranks = memo.get(key)
            if ranks is None:
                ranks = memo[key] = topo.ranks_of(*key)
        except TpshardError as e:
            found.append(("group", f"{shard_text(s)}: {e}"))
            continue
        if size != s.group_size or tuple(s.ranks) != ranks or not 0 <= s.group_rank < size:
            slot = f" in EP slot {s.ep_slot}" if s.ep_slot is not None else ""
            found.append(("group", f"{shard_text(s)}: the topology ({topo.describe()}) puts group rank {s.group_rank} with factor {s.factor}{slot} on ranks {list(ranks)} of a group of {size}"))
        # 1b. EP slot: a routed expert lives in the contiguous block of experts of its slot.
        if (s.expert is None) != (s.ep_slot is None) or (
            s.expert is not None and (not plan.model.num_experts or s.ep_slot != s.expert // (plan.model.num_experts // topo.ep))
        ):
            want = s.expert // (plan.model.num_experts // topo.ep) if s.expert is not None and plan.model.num_experts else None
            found.append(("experts", f"{shard_text(s)}: expert {s.expert} recorded in EP slot {s.ep_slot}; with {plan.model.num_experts} experts over ep {topo.ep} it belongs to slot {want}"))
        # 2. per-rank shape = the cut plus its padding; every other dim as in the source.
        expected = list(s.source_shape)
        if s.dim is None:
            ok = s.pad == 0 and s.start == 0
        else:  # a segmented cut: start / length in the unit of its segments (ShardSpec.segments)
            unit = s.source_shape[s.dim] // (sum(s.segments) or 1)
            expected[s.dim] = (s.length + s.pad) * (sum(s.segments) or 1)
            ok = 0 <= s.start and s.start + s.length <= unit and unit * (sum(s.segments) or 1) == s.source_shape[s.dim]
            if s.lead_length:  # taken from a leading-dim range of dim 0 (ShardSpec.lead_start)
                expected[0] = s.lead_length
                ok = ok and s.dim > 0 and s.lead_start + s.lead_length <= s.source_shape[0]
        if not ok or tuple(expected) != tuple(s.shape):
            lead = f" of dim 0 [{s.lead_start}, +{s.lead_length})" if s.lead_length else ""
            found.append(("sizes", f"{shard_text(s)}: shape {list(s.shape)} is not source {list(s.source_shape)}{lead} cut at dim {s.dim} [{s.start}, +{s.length}) plus {s.pad} padding"))

    first = specs[0] if specs else None
    # 2. global vs per-rank: the pieces tile the source dim exactly, in group-rank order; with
    # leading-dim ranges, those tile dim 0 and the pieces of each range tile the cut dim.
    if first is not None and first.dim is not None:
        blocks: dict[tuple[int, int], list[ShardSpec]] = defaultdict(list)
        for s in sorted(specs, key=lambda s: s.group_rank):
            blocks[(s.lead_start, s.lead_length)].append(s)
        if first.lead_length or len(blocks) > 1:
            found += _lead_findings(t.name, list(blocks), first.source_shape[0])
        for block in blocks.values():
            covered = 0
            for s in block:
                if s.length and s.start != covered:
                    found.append(("sizes", f"{shard_text(s)}: starts at {s.start}, but group ranks before it end at {covered}"))
                covered = max(covered, s.start + s.length)
            if covered != first.source_shape[first.dim] // (sum(first.segments) or 1) or len({s.shape for s in specs}) != 1:
                found.append(("sizes", f"{t.name}: per-rank pieces cover {covered} of {first.source_shape[first.dim]} along dim {first.dim} with shapes {sorted({s.shape for s in specs})}"))
    # 4. replicas: every rank holds exactly one piece of every tensor (of a routed expert: every
    # rank of its EP slot, and no other; at pp > 1, of the stages holding the tensor).
    holders: dict[int, int] = defaultdict(int)
    for c in t.cuts:
        for r in plan.files[c.file].ranks:
            holders[r] += 1
    key = ("owners", t.ep_slot, stages)
    if key not in memo:
        memo[key] = frozenset(topo.ranks_of("moe_tp", 0, topo.moe_tp, t.ep_slot, stages))
    owners = memo[key]
    wrong = [r for r in range(topo.world_size) if holders[r] != (r in owners)]
    if wrong:
        found.append(("replicas", f"{t.name}: ranks {wrong} hold {[holders[r] for r in wrong]} pieces instead of {[int(r in owners) for r in wrong]}"))
    found += _logical_findings(t.name, specs)
    return found


def _lead_findings(name: str, ranges: list[tuple[int, int]], rows: int) -> list[tuple[str, str]]:
    """A tensor's leading-dim ranges (start, length), in group-rank order of their first piece,
    must tile dim 0 of `rows` back to back (ShardSpec.lead_start)."""
    at = 0
    for start, length in ranges:
        if not length or start != at:
            break
        at += length
    else:
        if at == rows:
            return []
    return [("sizes", f"{name}: leading-dim ranges {[[a, a + n] for a, n in ranges]} do not tile dim 0 of {rows} in group-rank order")]


def _logical_findings(name: str, specs: list[ShardSpec]) -> list[tuple[str, str]]:
    """3. logical vs physical: each quantized cut of a tensor converts back to its layer's logical
    range exactly.

    physical start = logical start * ratio (an integer), the end is ceil(logical end * ratio), the
    logical range sits on the format's atom (or ends the dim), padding fills ceil(per * ratio), and
    the logical ranges of the group ranks tile [0, logical_size).
    """
    tiles = [s for s in specs if s.quant and s.logical_dim is not None]
    found: list[tuple[str, str]] = []
    for s in tiles:
        lo, n, per = s.logical_start, s.logical_length, s.logical_length + s.logical_pad
        if s.value is not None:
            if len(s.value) <= s.logical_dim or s.value[s.logical_dim] != per:
                found.append(("logical", f"{shard_text(s)}: holds the value {list(s.value)}, but its rank's logical size along dim {s.logical_dim} is {per}"))
            continue
        if s.dim is None:
            continue
        num, den = s.ratio
        end = lo + n
        why = []
        if n and (lo % s.atom or (end % s.atom and end != s.logical_size // (sum(s.segments) or 1))):
            why.append(f"logical range [{lo}, {end}) is off the {s.step} atom {s.atom}")
        if n and s.start * den != lo * num:
            why.append(f"physical start {s.start} != logical start {lo} x {num}/{den}")
        if n and s.start + s.length != -(-end * num // den):
            why.append(f"physical end {s.start + s.length} != ceil(logical end {end} x {num}/{den})")
        if s.length + s.pad != -(-per * num // den):
            why.append(f"per-rank physical size {s.length + s.pad} != ceil({per} x {num}/{den})")
        if why:
            found.append(("logical", f"{shard_text(s)} ({s.quant} {s.step}): {'; '.join(why)}"))
    if tiles:
        covered = 0
        for s in sorted(tiles, key=lambda s: s.group_rank):
            if s.logical_length and s.logical_start != covered:
                found.append(("logical", f"{shard_text(s)}: logical start {s.logical_start}, but group ranks before it end at {covered}"))
            if s.logical_length:
                covered = max(covered, s.logical_start + s.logical_length)
        if covered * (sum(tiles[0].segments) or 1) != tiles[0].logical_size:  # a segmented cut covers each segment's unit
            found.append(("logical", f"{name}: logical ranges cover {covered} of {tiles[0].logical_size}"))
    return found
