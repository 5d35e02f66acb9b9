"""merge: join outputs written for different ranks (`split --ranks`) into one output.

Each node of a cluster can split its own ranks in parallel; `merge` checks that the parts come from
the same source with the same plan, hard-links their rank folders into one staged output (parts are
left as they are) and writes the merged manifest last.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec

from tpshard.errors import OutputError
from tpshard.manifest import MANIFEST_NAME, Manifest, encode_manifest, rank_dir, read_manifest
from tpshard.writer import link_or_copy, write_durably


def merge_manifests(parts: list[Manifest]) -> Manifest:
    first = parts[0]
    files = list(first.files)
    for m in parts[1:]:
        same_plan = (m.topology, m.options, m.model, m.tensors) == (first.topology, first.options, first.model, first.tensors)
        if not same_plan or [(f.name, f.ranks, f.size) for f in m.files] != [(f.name, f.ranks, f.size) for f in files]:
            raise OutputError("the parts were split with different plans (source, topology or options differ)")
        if m.source.files != first.source.files:
            raise OutputError("the parts were split from different source checkpoints (source checksums differ)")
        for i, f in enumerate(m.files):
            if not f.checksum:
                continue
            if files[i].checksum and files[i] != f:
                raise OutputError(f"{f.name} differs between parts; split the parts again with the same tpshard")
            files[i] = f
    ranks = sorted({r for m in parts for r in m.written_ranks})
    return msgspec.structs.replace(first, written_ranks=tuple(ranks), files=tuple(files))


def merge(parts: list[str | Path], out: str | Path, *, force: bool = False) -> Manifest:
    """Merge tpshard outputs holding different ranks of one split into `out`."""
    if not parts:
        raise OutputError("merge needs at least one part")
    out = Path(out)
    if out.exists() and not force:
        raise OutputError(f"{out} already exists; pass --force to replace it")
    manifests = [read_manifest(p) for p in parts]
    merged = merge_manifests(manifests)
    staging = out.parent / f".{out.name}.tpshard-partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        done: set[int] = set()
        for part, m in zip(parts, manifests):
            for r in m.written_ranks:
                if r in done:
                    continue
                done.add(r)
                src, dst = Path(part) / rank_dir(r), staging / rank_dir(r)
                dst.mkdir()
                for entry in sorted(os.listdir(src)):
                    link_or_copy(src / entry, dst / entry)
        write_durably(staging / MANIFEST_NAME, encode_manifest(merged))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return merged
