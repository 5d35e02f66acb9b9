"""The checks of a manifest read, past its schema: what every reader refuses (docs/format.md).

What this file holds: _frame_problem (topology, written ranks, files, extra files), _tensors_problem
and _TensorChecks (each tensor's fields and cuts, checked once per kind of cut, _CutKind; then the
files' digests), digests_problem (the export manifest's checks use it too; plain_name is
tpshard.inputs', shared with the checkpoint's index), and
_located, which names a field as decoding the whole document would.

What it is not: decoding (tpshard.manifest.decode, tpshard.manifest.rank_records: both run these
checks) or the records' own bounds (tpshard.manifest.records, checked by msgspec as it decodes).
"""

from __future__ import annotations

import re

import msgspec

from tpshard.digest import DIGEST_SIZE
from tpshard.inputs import plain_name
from tpshard.manifest.envelope import TOO_DEEP
from tpshard.manifest.records import MANIFEST_NAME, MAX_BYTES, MAX_WORLD, Cut, OutputFile

_cuts_decoder = msgspec.json.Decoder(tuple[Cut, ...])


def _located(e: msgspec.DecodeError | RecursionError, path: str) -> str:
    """msgspec's message for a part decoded on its own, at `path` as decoding the whole manifest says it."""
    text = str(e) if isinstance(e, msgspec.DecodeError) else TOO_DEEP
    return text.replace("`$", f"`{path}") if "`$" in text else f"{text} - at `{path}`"


def _check_cuts(
    shape: tuple[int, ...], dim: int | None, group_size: int, cuts: tuple[Cut, ...], size: int, nfiles: int, segments: tuple[int, ...] = (),
    version: int = 3,
) -> str | None:  # fmt: skip
    """What is wrong with a tensor's shape, dim, segments or cuts (the text after its name), or None.
    A cut's leading-dim range (Cut.lead_start / lead_length) needs version 4 and a cut dim past 0."""
    for d in shape:  # zero dims count as one: no dim may hide a huge product
        size *= max(d, 1)
        if size > MAX_BYTES:
            return f".shape: {list(shape)} is more than {MAX_BYTES} bytes"
    if dim is not None and dim >= len(shape):
        return f".dim: {dim} but the shape {list(shape)} has {len(shape)} dims"
    full = shape[dim] if dim is not None else 0
    row = size // max(full, 1)  # bytes per index along the cut dim
    if segments:  # cuts index the unit of the segments (ShardSpec.segments), unpadded
        if dim is None or len(segments) > 64 or full % sum(segments) or any(c.pad for c in cuts):
            return f".segments: {list(segments)[:8]} do not cut dim {dim} of {list(shape)} into whole units, unpadded"
        full, row = full // sum(segments), row * sum(segments)
    for j, c in enumerate(cuts):
        if c.file >= nfiles:
            return f".cuts[{j}]: file index {c.file} but there are {nfiles} files"
        if c.group_rank >= group_size:
            return f".cuts[{j}]: group rank {c.group_rank} of a group of {group_size}"
        if dim is not None and (c.start + c.length > full or (c.length + c.pad) * row > MAX_BYTES):
            return f".cuts[{j}]: [{c.start}, +{c.length}) + {c.pad} padding does not fit dim {dim} of size {full}"
        if c.value is not None and len(c.value) > 64:
            return f".cuts[{j}]: a value of {len(c.value)} numbers"
        if c.lead_length or c.lead_start:
            if version < 4:
                return f".cuts[{j}]: a leading-dim range, which a version {version} manifest cannot hold"
            if not dim or not c.lead_length or c.lead_start + c.lead_length > shape[0]:
                return f".cuts[{j}]: leading-dim range [{c.lead_start}, +{c.lead_length}) does not fit dim 0 of {list(shape)} beside a cut of dim {dim}"
    return None


def _frame_problem(m) -> str | None:
    """The topology, written ranks, files and extra files of a manifest (or of its rank records)."""
    world = m.topology.world_size
    if world > MAX_WORLD:
        return f"topology: world size {world} exceeds {MAX_WORLD}"
    if m.topology.pp > 1 and sum(m.topology.pp_layers) != m.model.num_layers:
        return f"topology.pp_layers: {list(m.topology.pp_layers)} adds up to {sum(m.topology.pp_layers)} layers; the model has {m.model.num_layers}"
    for i, r in enumerate(m.written_ranks):
        if r >= world:
            return f"written_ranks[{i}]: rank {r} outside the world of {world}"
    if len(set(m.written_ranks)) != len(m.written_ranks):
        return "written_ranks: a rank is listed twice"
    names: set[str] = set()
    for i, f in enumerate(m.files):
        if not plain_name(f.name) or not f.name.endswith(".safetensors"):
            return f"files[{i}].name: {f.name!r} is not a plain *.safetensors file name"
        if f.name in names:
            return f"files[{i}].name: {f.name!r} listed twice"
        names.add(f.name)
        for r in f.ranks:
            if r >= world:
                return f"files[{i}].ranks: rank {r} outside the world of {world}"
    for i, e in enumerate(m.source.extra_files):
        if not plain_name(e.name) or e.name == MANIFEST_NAME:
            return f"source.extra_files[{i}].name: {e.name!r} is not a plain file name"
    return None


class _CutKind:
    """The tensors sharing one (dtype, shape, dim, group size, cuts): checked once, counted for the
    per-file tensor counts, and (rank records) placed in the rank's files once."""

    __slots__ = ("count", "cuts", "placed")

    def __init__(self, cuts: tuple[Cut, ...]):
        self.count, self.cuts, self.placed = 1, cuts, None


def _tensors_problem(m, kind_of: list) -> str | None:
    """The tensors' fields and cuts (JSON text, decoded here once per kind), and each written
    file's digests; `kind_of` receives each tensor's _CutKind."""
    checks = _TensorChecks(m)
    for i, t in enumerate(m.tensors):
        problem, kind = checks.tensor(i, t)
        if problem:
            return problem
        kind_of.append(kind)
    return checks.files(m)


class _TensorChecks:
    """_tensors_problem's checks, a tensor at a time, then the files' digests."""

    def __init__(self, m) -> None:
        from tpshard.safetensors_format import DTYPE_SIZE

        self.size_of = DTYPE_SIZE.get
        self.nfiles, self.ep, self.experts, self.version = len(m.files), m.topology.ep, m.model.num_experts, m.version
        # The cuts' checks depend on a tensor's dtype, shape, dim, group size and cuts, which most
        # tensors share with many others (every layer, every expert): each distinct one is checked once.
        self.kinds: dict[tuple, _CutKind] = {}

    def tensor(self, i: int, t) -> tuple[str | None, _CutKind | None]:
        """(the problem of tensors[i], None) or (None, its _CutKind)."""
        size = self.size_of(t.dtype)
        if size is None:
            return f"tensors[{i}] ({t.name}).dtype: {t.dtype!r} is not a safetensors dtype tpshard writes", None
        if t.source == t.name:
            return f"tensors[{i}] ({t.name}).source: equal to the name (recorded only where they differ)", None
        if t.ep_slot is not None and t.ep_slot >= self.ep:
            return f"tensors[{i}] ({t.name}).ep_slot: {t.ep_slot} but --ep is {self.ep}", None
        if t.expert is not None and t.expert >= self.experts:
            return f"tensors[{i}] ({t.name}).expert: {t.expert} but the model has {self.experts} routed experts", None
        cuts = t.cuts  # text (a record being decoded) or Cuts (a TensorPlan: manifest_with_tensors)
        key = (t.dtype, t.shape, t.dim, t.group_size, t.segments, cuts if isinstance(cuts, tuple) else bytes(cuts))
        kind = self.kinds.get(key)
        if kind is not None:
            kind.count += 1
            return None, kind
        if not isinstance(cuts, tuple):
            try:
                cuts = _cuts_decoder.decode(key[-1])
            except (msgspec.DecodeError, RecursionError) as e:
                return _located(e, f"$.tensors[{i}].cuts"), None
        problem = _check_cuts(t.shape, t.dim, t.group_size, cuts, size, self.nfiles, t.segments, self.version)
        if problem:
            return f"tensors[{i}] ({t.name}){problem}", None
        kind = self.kinds[key] = _CutKind(cuts)
        return None, kind

    def files(self, m) -> str | None:
        """The first written file whose digests are not one per tensor it holds."""
        per_file = [0] * self.nfiles
        for kind in self.kinds.values():
            for c in kind.cuts:
                per_file[c.file] += kind.count
        for i, f in enumerate(m.files):
            problem = digests_problem(i, f, per_file[i], m.options.checksum)
            if problem:
                return problem
        return None


def digests_problem(i: int, f: OutputFile, count: int, algorithm: str) -> str | None:
    """What is wrong with files[i].digests for a file of `count` tensors, or None; `f` may be a rank
    record's file too (tpshard.manifest.rank_records, the same fields)."""
    width = 2 * DIGEST_SIZE[algorithm]
    if f.digests and len(f.digests) != count * width:
        return f"files[{i}].digests: {len(f.digests)} hex digits for the {count} tensors of {f.name} ({width} each)"
    if not _LOWER_HEX.fullmatch(f.digests):
        return f"files[{i}].digests: not lower-case hex"
    return None


_LOWER_HEX = re.compile("[0-9a-f]*")
