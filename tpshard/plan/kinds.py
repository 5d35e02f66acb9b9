"""The kind memo of a plan: what every tensor of one kind shares, worked out once per kind.

What this file is: `TensorKind` (TensorPlan's fields but the names, and each per-rank cut with
what the file layout needs of it: ranks, shard shape, size, header entry length, file label),
`Entry` (one tensor: its names and its kind) and `file_label`, the file-name part of a set of ranks.

What it is not: no decision of a cut (tpshard.plan.dense, tpshard.quant), no grouping of shards
into files (tpshard.plan.files).
"""

from __future__ import annotations

from typing import NamedTuple

from msgspec.structs import replace

from tpshard.manifest import SPEC_DEFAULTS, TENSOR_FIELDS, Cut
from tpshard.safetensors_format import entry_text, nbytes_of
from tpshard.topology import Topology


class KindCut(NamedTuple):
    """One cut of a kind of tensor, with what the file layout needs of it."""

    cut: Cut  # with file 0: each tensor of the kind has its own files (plan_cuts)
    ranks: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]  # the shard's shape
    nbytes: int
    text: int  # the length of its header entry but the name and offsets (entry_text)
    label: str  # the file-name part of its rank set (file_label)


class TensorKind:
    """What every tensor of one kind shares: TensorPlan's fields but the names, and its cuts.

    The cut depends on the rule, the parameter, the shape, the EP slot and the stages, not on the
    name: DeepSeek-V3 has ~92k tensors but a few dozen kinds, so each kind is worked out once and
    each tensor is a (names, kind) entry."""

    def __init__(self, records: list[dict], topology: Topology):
        first = {**SPEC_DEFAULTS, **records[0]} if records else {}
        self.shared = {f: first[f] for f in _KIND_FIELDS} | {"shape": tuple(first["source_shape"])} if records else {}
        self.cuts: list[KindCut] = []
        self.padded = False  # zero-padded by --pad / --pad-blocks (vocab padding is expected)
        for r in records:
            r = {**SPEC_DEFAULTS, **r}
            if any(r[f] != first[f] for f in _KIND_FIELDS) or r["source_shape"] != first["source_shape"]:
                raise AssertionError(f"the cuts of one kind of tensor disagree: {first} / {r}")
            cut = Cut(
                r["group_rank"], r["start"], r["length"], r["pad"], 0, r["logical_start"], r["logical_length"], r["logical_pad"], r["value"],
                r["lead_start"], r["lead_length"],
            )  # fmt: skip
            self.cuts.append(KindCut(
                cut, r["ranks"], r["dtype"], tuple(r["shape"]),
                nbytes_of(r["dtype"], r["shape"]), len(entry_text(r["dtype"], tuple(r["shape"]))), file_label(r, topology),
            ))  # fmt: skip
            self.padded |= bool(r["pad"]) and r["kind"] != "vocab"
        self._cuts: dict[tuple[int, ...], tuple[Cut, ...]] = {}

    def plan_cuts(self, files: tuple[int, ...]) -> tuple[Cut, ...]:
        """The manifest cuts of a tensor of this kind whose shards lie in `files`: shared by every
        tensor whose shards land in the same files (most of them)."""
        if files not in self._cuts:
            self._cuts[files] = tuple(replace(c.cut, file=f) for c, f in zip(self.cuts, files))
        return self._cuts[files]


# TensorPlan's fields that a kind fixes (the names, layer and expert id are each tensor's own).
_KIND_FIELDS = tuple(f for f in TENSOR_FIELDS if f not in ("layer", "expert"))


class Entry(NamedTuple):
    name: str
    source: str
    layer: str
    expert: int | None
    kind: TensorKind


def file_label(spec: dict, topology: Topology) -> str:
    """The file name part of a set of ranks: its group and group rank, after its pipeline stages
    when they are not all of them (pp-000-of-003-..., pp-000+002-of-003-...)."""
    stages = sorted({r // topology.tp for r in spec["ranks"]})
    if len(stages) == topology.pp:
        return _stage_label(spec, topology, len(stages))
    return f"pp-{'+'.join(f'{s:03d}' for s in stages)}-of-{topology.pp:03d}-" + _stage_label(spec, topology, len(stages))


def _stage_label(spec: dict, topology: Topology, stages: int) -> str:
    if len(spec["ranks"]) == topology.tp * stages:
        return "common"
    if spec.get("ep_slot") is not None:
        label = f"ep-{spec['ep_slot']:03d}-of-{topology.ep:03d}"
        return label + (f"-moe_tp-{spec['group_rank']:03d}-of-{spec['group_size']:03d}" if spec["group_size"] > 1 else "")
    # Without attention DP attn_tp is the tp group itself: name it so.
    group = "tp" if topology.span(spec["group"]) == topology.tp else spec["group"]
    label = group if spec["factor"] == 1 else f"{group}-x{spec['factor']}"
    return f"{label}-{spec['group_rank']:03d}-of-{spec['group_size']:03d}"
