"""The Plan: what `tpshard plan` prints and `tpshard split` executes, and its files' layout.

What this file holds: `Plan` (the topology, options and model, one TensorPlan per source tensor
kept, the output files), its ShardSpec views (`view`, `shards`, `rank_shards`), and what it works
out of its files on first use and keeps: each file's shards in data order (FileShards), its header
size and data offsets (a header itself is built when asked for, kept nowhere); `take_layout`
receives the layout make_plan worked out while planning, `share_layout` another plan's.
SourceCuts finds each source tensor's cuts by position (the writer, check --source).

What it is not: the records it is made of (tpshard.manifest.records), the rules that make one
(tpshard.plan), the Manifest written from it (tpshard.manifest.document).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from functools import cached_property
from operator import attrgetter
from typing import NamedTuple

import msgspec

from tpshard.manifest.records import FILE_METADATA, Cut, ModelInfo, Options, OutputFile, ShardSpec, TensorPlan, pack_tensors, shard_shape
from tpshard.safetensors_format import Numbering, Shapes, kinds_header_layout, kinds_header_pieces
from tpshard.public_struct import PublicStruct
from tpshard.topology import Topology


class FileShards(NamedTuple):
    """An output file's shards in data order, as a plan keeps them: 12 bytes a shard (a pair of
    objects a shard for every file was ~30 MB at 90k tensors and tp 8)."""

    tensors: array  # each shard's tensor, by its index in Plan.tensors
    cuts: array  # each shard's cut, by its index in the tensor's cuts
    kinds: array  # each shard's (dtype, shape), by its index in `shapes`
    shapes: Shapes  # each kind's (dtype, shape): a few dozen in a file


class SourceCuts:
    """Where each source tensor's cuts lie, by the tensor's position in a list of source names: its
    TensorPlans (a tied lm_head copy at pp > 1 is a second one), each cut with its index in its
    file (Plan.cut_places). In arrays: the places of every shard listed at once were 75 MB in the
    writer and 56 MB in check at 90k tensors and tp 8, a dict by name 6 MB."""

    def __init__(self, plan: Plan, names: Sequence[str]):
        self.tensors = plan.tensors
        self.first = array("I")  # per TensorPlan: the number of its first cut, cuts numbered in plan order
        self.place = plan.cut_places()  # per cut: its index in its file
        plan_of: dict[str, int] = {}  # source name -> its first TensorPlan: only while the arrays are made
        others: dict[str, list[int]] = {}  # source name -> its other TensorPlans (rare)
        n = 0
        for k, t in enumerate(plan.tensors):
            name = t.source or t.name
            if plan_of.setdefault(name, k) != k:
                others.setdefault(name, []).append(k)
            self.first.append(n)
            n += len(t.cuts)
        self.plan_at = array("i", [plan_of.get(name, -1) for name in names])  # -1: no TensorPlan
        self.more = {p: others[name] for p, name in enumerate(names) if name in others}

    def of(self, position: int) -> list[tuple[TensorPlan, Cut, int]]:
        """(tensor, cut, the cut's index in its file) of each cut of the source tensor at `position`."""
        found = []
        first = self.plan_at[position]
        for k in () if first < 0 else (first, *self.more.get(position, ())):
            t = self.tensors[k]
            found += [(t, c, self.place[n]) for n, c in enumerate(t.cuts, self.first[k])]
        return found



class Plan(PublicStruct, frozen=True, kw_only=True, dict=True):
    """What every rank of an output holds, as data: the topology and options it was made for, the
    model's dims, each tensor's cut per rank and the files they go to (make_plan makes one;
    read_manifest gives an output's). docs/format.md describes the fields as the manifest stores them."""

    topology: Topology
    options: Options
    model: ModelInfo
    tensors: tuple[TensorPlan, ...]
    files: tuple[OutputFile, ...]
    warnings: tuple[str, ...] = ()
    # HF module prefix -> its tpshard.quant.formats.QuantSpec as plain data (format, bits,
    # group_size, desc_act, sym, block, static_input), for readers that dequantize (verify).
    quant_layers: dict[str, dict] = {}

    def view(self, t: TensorPlan, c: Cut) -> ShardSpec:
        """The ShardSpec of one cut of a tensor."""
        f = self.files[c.file]
        return ShardSpec(
            name=t.name, source=t.source or t.name, layer=t.layer, layer_class=t.layer_class, piece=t.piece, kind=t.kind,
            dtype=t.dtype, source_shape=t.shape, shape=shard_shape(t, c), dim=t.dim, start=c.start,
            length=c.length, pad=c.pad, group=t.group, factor=t.factor, group_rank=c.group_rank,
            group_size=t.group_size, ranks=f.ranks, file=f.name, quant=t.quant, step=t.step,
            ratio=t.ratio, atom=t.atom, logical_dim=t.logical_dim, logical_size=t.logical_size,
            logical_start=c.logical_start, logical_length=c.logical_length, logical_pad=c.logical_pad, value=c.value,
            ep_slot=t.ep_slot, expert=t.expert, segments=t.segments, lead_start=c.lead_start, lead_length=c.lead_length,
        )  # fmt: skip

    @cached_property
    def shards(self) -> tuple[ShardSpec, ...]:
        """Every distinct per-rank tensor, in plan order (built on first use)."""
        return tuple(self.view(t, c) for t in self.tensors for c in t.cuts)

    def rank_shards(self, rank: int) -> list[ShardSpec]:
        """Rank `rank`'s tensors, in plan order; builds only this rank's views."""
        if "shards" in self.__dict__:  # every view is built already
            return [s for s in self.shards if rank in s.ranks]
        held = {i for i, f in enumerate(self.files) if rank in f.ranks}
        return [self.view(t, c) for t in self.tensors for c in t.cuts if c.file in held]

    def rank_files(self, rank: int) -> list[OutputFile]:
        return [f for f in self.files if rank in f.ranks]

    def file_index(self, name: str) -> int:
        """The index in `files` of the file of this name."""
        if "_file_index" not in self.__dict__:
            self.__dict__["_file_index"] = {f.name: i for i, f in enumerate(self.files)}
        return self.__dict__["_file_index"][name]

    def members(self, index: int) -> list[tuple[TensorPlan, Cut]]:
        """The tensors of file `index` as (TensorPlan, Cut), in data order: what check and an
        output's reader walk instead of ShardSpec views. Made on each call from the file's shards:
        every file's kept were 29 MB at 90k tensors and tp 8."""
        shards = self._file_shards()[index]
        return [(t, t.cuts[j]) for t, j in zip(map(self.tensors.__getitem__, shards.tensors), shards.cuts)]

    def member(self, index: int, k: int) -> tuple[TensorPlan, Cut]:
        """Tensor k of file `index` as (TensorPlan, Cut): members(index)[k] without the list."""
        shards = self._file_shards()[index]
        t = self.tensors[shards.tensors[k]]
        return t, t.cuts[shards.cuts[k]]

    def cut_places(self) -> array:
        """Each cut's index in its file, cuts numbered in plan order: a file holds its tensors in
        plan order, so a cut's place counts the cuts of its file before it."""
        places, count = array("I"), [0] * len(self.files)
        for t in self.tensors:
            for c in t.cuts:
                places.append(count[c.file])
                count[c.file] += 1
        return places

    def index_names(self, index: int) -> list[str]:
        """The names of the tensors of file `index`, sorted (each rank's model.safetensors.index.json
        merges its files' lists), made on each call from the file's shards: kept, every file's were
        4 MB at 90k tensors and tp 8."""
        return sorted(map(attrgetter("name"), map(self.tensors.__getitem__, self._file_shards()[index].tensors)))

    def header(self, file: str) -> bytes:
        """The header bytes of an output file (header_pieces joined)."""
        return b"".join(self.header_pieces(file))

    def header_pieces(self, file: str) -> Iterator[bytes]:
        """The header bytes of an output file, in pieces built as they are asked for and kept
        nowhere: the writer and check need each file's once (at 90k tensors and tp 8 the headers are
        48 MB in all). Its length is the one the file's offsets were laid out with: anything else is
        a bug, never a file written with its data in the wrong place."""
        size, relative, pieces = kinds_header_pieces(*self._file_kinds(file), FILE_METADATA)
        layouts = self.__dict__.setdefault("_layouts", {})
        if file not in layouts:  # not laid out yet: this header is the layout
            layouts[file] = (size, array("Q", map(size.__add__, relative)))
        elif size != layouts[file][0]:
            raise AssertionError(f"{file}: the header built is {size} bytes, the plan laid it out as {layouts[file][0]}")
        return pieces

    def offsets(self, file: str) -> Sequence[int]:
        """Each tensor's absolute data offset in an output file, in data order; no header is built."""
        return self._layout(file)[1]

    def header_size(self, file: str) -> int:
        """The length of a file's header: its data follows."""
        return self._layout(file)[0]

    def _layout(self, file: str) -> tuple[int, Sequence[int]]:
        """(header size, data offsets) of a file: make_plan's, or counted on first use (a plan read
        from a manifest)."""
        layouts = self.__dict__.setdefault("_layouts", {})
        if file not in layouts:
            size, offsets = kinds_header_layout(*self._file_kinds(file), FILE_METADATA)
            layouts[file] = (size, array("Q", offsets))
        return layouts[file]

    def _file_kinds(self, file: str) -> tuple[list[str], Sequence[int], Shapes]:
        """A file's tensors, in data order, as build_kinds_header takes them."""
        shards = self._file_shards()[self.file_index(file)]
        return list(map(attrgetter("name"), map(self.tensors.__getitem__, shards.tensors))), shards.kinds, shards.shapes

    def _file_shards(self) -> list[FileShards]:
        """Per file (indexing `files`): its FileShards, make_plan's or made here in one pass."""
        if "_shards" not in self.__dict__:
            held = [(array("I"), array("I"), array("I"), Numbering()) for _ in self.files]
            for i, t in enumerate(self.tensors):
                for j, c in enumerate(t.cuts):
                    tensors, cuts, kinds, numbers = held[c.file]
                    tensors.append(i)
                    cuts.append(j)
                    kinds.append(numbers[(t.dtype, shard_shape(t, c))])
            self.__dict__["_shards"] = [FileShards(tensors, cuts, kinds, list(numbers)) for tensors, cuts, kinds, numbers in held]
        return self.__dict__["_shards"]

    def take_layout(self, layouts: dict[str, tuple[int, array]], shards: list[FileShards] | None = None) -> None:
        """Receive the files' layout that make_plan worked out while it made this plan: per file
        name its (header size, data offsets), and, unless None, per file (indexing `files`) its
        FileShards, naming tensors by their index in `tensors`. Only on a plan nothing has read
        yet: offsets, header_size, header_pieces and members then use these instead of laying the
        files out again (header_pieces still refuses a header whose length is not the one given)."""
        self.__dict__["_layouts"] = layouts
        if shards is not None:
            self.__dict__["_shards"] = shards

    def share_layout(self, other: Plan) -> None:
        """Take the files' layout (shards, header sizes, offsets) that `other` has made, when it
        plans the same tensors into files of the same names: a manifest's plan that is the
        rules' (check --source) need not lay its files out again beside theirs."""
        if self.tensors is other.tensors and [f.name for f in self.files] == [f.name for f in other.files]:
            for cache in ("_shards", "_layouts"):
                if cache in other.__dict__:
                    self.__dict__.setdefault(cache, other.__dict__[cache])

    def with_shards(self, specs: Iterable[ShardSpec]) -> Plan:
        """This plan with its tensors rebuilt from `specs` (files kept): for tests that break a plan."""
        return msgspec.structs.replace(self, tensors=pack_tensors(specs, self.files))
