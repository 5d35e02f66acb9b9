"""One rank's records: what open_rank and load_rank read of a manifest (read_rank_records).

open_rank / load_rank read one rank of an output whose manifest may describe hundreds of thousands
of shards. They decode the fields that place bytes (names, dtypes, shapes, cuts, files, digests)
and what validate() checks across fields, never build a ShardSpec, and lay out only the rank's own
files. The fields for engines and checks (layer, kind, quantized layout, ...) are check's and
verify's: those read the whole manifest. Field for field these are Manifest's (a test holds them so).

What this file holds: read_rank_records, RankRecords and RankFile, and the lean schema they decode
(_TensorRecord, _FileRecord, _RankManifest). What it is not: the whole manifest's reader
(tpshard.manifest.decode) or the rank's tensors themselves (tpshard.rank).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import msgspec

from tpshard.manifest.decode import _decode, _manifest_bytes
from tpshard.manifest.records import Count, ModelInfo, Options, OutputFile, Positive, Rank, Source, shard_shape
from tpshard.manifest.validation import _CutKind, _frame_problem, _tensors_problem
from tpshard.topology import GroupName, Topology


class _TensorRecord(msgspec.Struct, kw_only=True, gc=False):
    name: str
    source: str = ""
    dtype: str
    shape: tuple[Count, ...]
    group: GroupName
    group_size: Positive = 1
    dim: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ep_slot: Annotated[int, msgspec.Meta(ge=0)] | None = None
    expert: Annotated[int, msgspec.Meta(ge=0)] | None = None
    segments: tuple[Positive, ...] = ()  # a segmented cut: shard_shape needs it
    cuts: msgspec.Raw  # decoded once per kind (_tensors_problem): tensors of a kind share it


class _FileRecord(msgspec.Struct, kw_only=True, gc=False):
    name: str
    ranks: tuple[Rank, ...]
    size: Count
    checksum: str = ""
    digests: str = ""  # checked for the rank's own files only


class _RankManifest(msgspec.Struct, kw_only=True):
    format: Any = None
    version: Any = None
    source: Source
    topology: Topology
    options: Options
    model: ModelInfo
    written_ranks: tuple[Rank, ...]
    tensors: tuple[_TensorRecord, ...]
    files: tuple[_FileRecord, ...]


_rank_decoder = msgspec.json.Decoder(_RankManifest)


class RankFile(msgspec.Struct, frozen=True, gc=False):
    """One file of a rank: its record (digests included) and its tensors in data order."""

    record: OutputFile
    members: list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape), as the file's header lists them


class RankRecords(msgspec.Struct, frozen=True):
    written_ranks: tuple[int, ...]
    checksum: str  # the digests' algorithm (Options.checksum)
    files: list[RankFile]  # the files holding the rank, in manifest order


def read_rank_records(out_dir: str | Path, rank: int) -> RankRecords:
    """Rank `rank`'s files and their tensors, from the manifest of `out_dir`, validated as
    read_manifest does except for what no byte of the rank depends on (see above); OutputError otherwise."""
    from tpshard.errors import OutputError

    data, where = _manifest_bytes(out_dir)
    m = _decode(_rank_decoder, data, where)
    kinds: list[_CutKind] = []
    problem = _frame_problem(m) or _tensors_problem(m, kinds)
    if problem:
        raise OutputError(f"{where}: not a valid tpshard manifest ({problem})")
    held = {i for i, f in enumerate(m.files) if rank in f.ranks}
    members: dict[int, list] = {i: [] for i in held}
    for t, kind in zip(m.tensors, kinds):
        placed = kind.placed
        if placed is None:  # the kind's shards in the rank's files, worked out once
            placed = kind.placed = [(members[c.file], shard_shape(t, c)) for c in kind.cuts if c.file in held]
        for into, shape in placed:
            into.append((t.name, t.dtype, shape))
    files = []
    for i in sorted(held):
        f = m.files[i]
        record = OutputFile(name=f.name, ranks=f.ranks, size=f.size, checksum=f.checksum, digests=f.digests)
        files.append(RankFile(record, members[i]))
    return RankRecords(m.written_ranks, m.options.checksum, files)
