"""Is this the checkpoint an output was split from? The manifest's `source.files` (docs/format.md)
records each of its files as the split read it: the size, and for a weight file the sha256 over its
header and its tensors' crc32s in data order (tpshard.digest), for the index a plain sha256.

`check --source` and `verify --source` compare the source with that record: another checkpoint
(same names and shapes, other values), another model, or the right checkpoint with a byte changed
since the split is one line naming the first file that differs, exit 2 (docs/reliability.md), not
a list of findings that blames the output. Names and sizes come first, before anything else (no
byte read); the checksums read every weight byte once, crc32 at several GB/s, the files in
parallel. `check --source` takes the crc32s of the tensors its reassembly read (one read of the
source, not two) and reads only the rest; whatever the reassembly found, a wrong source is then
this one line.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tpshard.digest import file_digest, range_digests, sha256_file
from tpshard.errors import TpshardError
from tpshard.safetensors_format import read_header_bytes

if TYPE_CHECKING:
    from tpshard.checkpoint import Checkpoint


class WrongSource(TpshardError):
    """The source given is not the checkpoint the output was split from (or changed since). Exit 2."""


def check_source_identity(ckpt: Checkpoint, recorded, out, *, workers: int = 4, crcs: dict[str, bytes] | None = None, listing_only: bool = False) -> None:
    """Raise WrongSource unless `ckpt` holds exactly the files `recorded` (a manifest's source.files).
    `crcs`, `listing_only`: as source_difference."""
    problem = wrong_source(ckpt, recorded, out, workers=workers, crcs=crcs, listing_only=listing_only)
    if problem:
        raise WrongSource(problem)


def wrong_source(ckpt: Checkpoint, recorded, out, *, workers: int = 4, crcs: dict[str, bytes] | None = None, listing_only: bool = False) -> str | None:
    """The one line saying that `ckpt` is not the checkpoint `out` was split from, or None when it is."""
    problem = source_difference(ckpt, recorded, workers=workers, crcs=crcs, listing_only=listing_only)
    if problem is None:
        return None
    return (
        f"{ckpt.path} is not the checkpoint {out} was split from: {problem}"
        " (the manifest records the source's files, their sizes and checksums)"
    )


def source_difference(ckpt: Checkpoint, recorded, *, workers: int = 4, crcs: dict[str, bytes] | None = None, listing_only: bool = False) -> str | None:
    """The first difference between `ckpt`'s files and `recorded`, in words; None when there is none.

    `listing_only`: compare the files' names and sizes only (no byte read); `crcs`: the crc32 of
    tensors already read whole (check --source's reassembly), by name: only the others are read."""
    want = {f.name: f for f in recorded}
    have = list(ckpt.weight_files) + ([ckpt.index_file] if ckpt.index_file else [])
    extra = [n for n in have if n not in want]
    if extra:
        return f"it has {extra[0]}, which the split did not read (it read {_names(want)})"
    missing = [n for n in want if n not in have]
    if missing:
        return f"it has no {missing[0]} (the split read {_names(want)})"
    for name in have:
        size = (ckpt.path / name).stat().st_size
        if size != want[name].size:
            return f"{name} has {size} bytes, the split read {want[name].size}"
    if listing_only:
        return None
    by_file: dict[str, list] = {name: [] for name in ckpt.weight_files}
    for n, t in ckpt.tensors.items():  # one pass: DeepSeek-V3 has 163 files and 91k tensors
        by_file[t.file].append((t.begin, n, t))
    with ThreadPoolExecutor(max(1, min(workers, len(have)))) as pool:
        for name, checksum in zip(have, pool.map(lambda n: _checksum(ckpt, n, by_file.get(n), crcs or {}), have)):
            if checksum != want[name].checksum:
                return f"{name} differs from the file the split read (its checksum over the header and tensors)"
    return None


def _names(files: dict) -> str:
    names = list(files)
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _checksum(ckpt: Checkpoint, name: str, tensors: list | None, known: dict[str, bytes]) -> str:
    """The checksum the split recorded for file `name` (tpshard.writer's _source_files), recomputed;
    `tensors`: (begin, name, TensorInfo) of each of its tensors, None for the index; `known`: the
    crc32s already computed, by tensor name (the rest are read)."""
    path = ckpt.path / name
    if tensors is None:
        return sha256_file(path)
    infos = sorted(tensors, key=lambda x: x[:2])  # data order, empty tensors by name
    unread = [t for _, n, t in infos if n not in known]
    fd = os.open(path, os.O_RDONLY)
    try:
        read = iter(range_digests(fd, [t.begin for t in unread], [t.nbytes for t in unread], "crc32"))
        crcs = [known[n] if n in known else next(read) for _, n, _ in infos]
    finally:
        os.close(fd)
    return file_digest(read_header_bytes(path), crcs)
