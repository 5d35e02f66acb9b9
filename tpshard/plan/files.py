"""The file layout of a plan: which file holds each shard, and each file's header and offsets.

What this file is: `layout_files` (shards grouped by the set of ranks holding them, one file set
each, cut into parts of at most --max-file-bytes, headers sized without being built),
`tensor_plans` (the TensorPlans of a plan's entries, their cuts naming their files), and the
header of an output file (`file_header`, `spec_layout`), which rank loaders rebuild.

What it is not: no cut of a tensor (tpshard.plan.dense, tpshard.quant), no bytes of tensor data.
"""

from __future__ import annotations

import itertools
from array import array
from operator import add, attrgetter

import msgspec

from tpshard.errors import PlanError
from tpshard.manifest import FILE_METADATA, FileShards, Options, OutputFile, ShardSpec, TensorPlan
from tpshard.plan.kinds import Entry, KindCut
from tpshard.safetensors_format import Numbering, build_header, kinds_header_layout, plain_layout, plain_names


def file_header(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    """The header of an output file and its tensors' data offsets."""
    return build_header(tensors, FILE_METADATA)


def spec_layout(specs: list[ShardSpec]) -> tuple[bytes, list[int]]:
    """Header bytes and each tensor's absolute data offset in a file holding `specs` in order."""
    return file_header([(s.name, s.dtype, s.shape) for s in specs])


def layout_files(
    entries: list[Entry], options: Options, layouts: dict[str, tuple[int, array]], shards: list[FileShards]
) -> tuple[list[OutputFile], array, array]:
    """Group shards by the set of ranks holding them (one file set each), split into parts by size.

    Returns the files and the file index of each entry's cuts, back to back (entry e's at
    first[e] : first[e + 1]) as (first, file_of): a list per entry was 9 MB at 90k tensors. Sets each file's
    (header size, offsets) in `layouts` and appends its FileShards (tensors by their entry's
    index) to `shards`. Tensors keep source order inside a file."""
    # Each rank set's shards as (entry, cut, kind cut) indexes in three arrays: a tuple per shard
    # was 33 MB at 90k tensors and tp 8, and all of them were alive at once.
    by_ranks: dict[tuple[int, ...], tuple[array, array, array]] = {}
    kind_cuts: list[KindCut] = []  # every kind's cuts, numbered
    # Each kind's cuts go to the same rank sets: found once per kind (the sets keep the order in
    # which the tensors first reach them).
    buckets_of: dict[int, list[tuple[int, int, tuple[array, array, array]]]] = {}
    for e, entry in enumerate(entries):
        buckets = buckets_of.get(id(entry.kind))
        if buckets is None:
            buckets = buckets_of[id(entry.kind)] = []
            for j, cut in enumerate(entry.kind.cuts):
                buckets.append((j, len(kind_cuts), by_ranks.setdefault(cut.ranks, (array("I"), array("I"), array("I")))))
                kind_cuts.append(cut)
        for j, k, (bucket_entries, bucket_cuts, bucket_kinds) in buckets:
            bucket_entries.append(e)
            bucket_cuts.append(j)
            bucket_kinds.append(k)
    files: list[OutputFile] = []
    first = array("I", itertools.accumulate((len(entry.kind.cuts) for entry in entries), initial=0))
    file_of = array("I", bytes(4 * first[-1]))
    # Names that JSON writes as they are, none twice (a repeated one is refused by tensor_plans):
    # a file's header is sized from the lengths of its names and of its kinds' entry texts.
    names = [entry.name for entry in entries]
    plain = plain_names(names, FILE_METADATA)
    name_sizes = array("I", map(len, names))
    del names
    sizes_of, texts_of = [cut.nbytes for cut in kind_cuts], [cut.text for cut in kind_cuts]
    # The shards of a rank set are walked in C loops (map) over these arrays: a tuple per shard
    # cost 0.2 s at 90k tensors.
    for ranks, (held, cut_index, kind_index) in by_ranks.items():
        sizes = list(map(sizes_of.__getitem__, kind_index))
        bounds = _part_bounds(sizes, options.max_file_bytes)
        for p, (a, b) in enumerate(zip(bounds, bounds[1:])):
            suffix = f"-part-{p + 1:05d}-of-{len(bounds) - 1:05d}" if len(bounds) > 2 else ""
            name = f"model-{kind_cuts[kind_index[a]].label}{suffix}.safetensors"
            numbers = Numbering()  # kind cut -> its index in this file's shapes
            kinds = array("I", map(numbers.__getitem__, kind_index[a:b]))
            shard = FileShards(held[a:b], cut_index[a:b], kinds, [(kind_cuts[k].dtype, kind_cuts[k].shape) for k in numbers])
            if plain:  # what an entry adds up to is its name's length and its kind's
                text = sum(map(name_sizes.__getitem__, held[a:b])) + sum(map(texts_of.__getitem__, kind_index[a:b]))
                size, offsets = plain_layout(text, sizes[a:b], FILE_METADATA)
            else:
                tensors = list(map(attrgetter("name"), map(entries.__getitem__, held[a:b])))
                size, offsets = kinds_header_layout(tensors, shard.kinds, shard.shapes, FILE_METADATA)
            layouts[name] = size, array("Q", offsets)
            shards.append(shard)
            number = len(files)
            for at in map(add, map(first.__getitem__, held[a:b]), cut_index[a:b]):
                file_of[at] = number
            # the data ends with the last tensor
            files.append(OutputFile(name=name, ranks=ranks, size=offsets[-1] + sizes[b - 1]))
    return files, first, file_of


def _part_bounds(sizes: list[int], max_bytes: int) -> list[int]:
    """Where a rank set's shards are cut into files of at most `max_bytes` each (a larger shard
    alone): the index each file starts at, then len(sizes)."""
    if sum(sizes) <= max_bytes:
        return [0, len(sizes)]  # what the loop below gives when no part fills up
    bounds, size = [0], 0
    for k, nbytes in enumerate(sizes):
        if k > bounds[-1] and size + nbytes > max_bytes:
            bounds.append(k)
            size = 0
        size += nbytes
    return [*bounds, len(sizes)]


def tensor_plans(entries: list[Entry], first: array, file_of: array) -> tuple[TensorPlan, ...]:
    _refuse_repeated_names(entries)  # first: its set of every name is gone before the TensorPlans are made
    out = []
    # A TensorPlan per kind, copied with each tensor's own fields: six times faster than building
    # each from the kind's fifteen shared ones.
    templates: dict[int, TensorPlan] = {}
    replace = msgspec.structs.replace
    for entry, a, b in zip(entries, first, itertools.islice(first, 1, None)):
        kind = entry.kind
        if not kind.cuts:
            continue  # a misaligned quantized cut: refused by tpshard.quant.layers.QuantLayers.finish
        template = templates.get(id(kind))
        if template is None:
            template = templates[id(kind)] = TensorPlan(name="", layer="", cuts=(), **kind.shared)
        source = "" if entry.source == entry.name else entry.source  # recorded only where it differs
        out.append(replace(template, name=entry.name, source=source, layer=entry.layer, expert=entry.expert, cuts=kind.plan_cuts(tuple(file_of[a:b]))))
    return tuple(out)


def _refuse_repeated_names(entries: list[Entry]) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry.kind.cuts:
            if entry.name in seen:
                raise PlanError(f"{entry.name}: two tensors of the checkpoint would be written under this name")
            seen.add(entry.name)
