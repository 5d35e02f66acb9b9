"""Helpers that break a tpshard output on purpose and keep its manifest checksums consistent, so
that only a check against the source (check --source, verify) can tell."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import tpshard
from tpshard.digest import file_digest
from tpshard.manifest import MANIFEST_NAME, encode_manifest, rank_dir, read_manifest
from tpshard.plan import spec_layout


def rewrite_checksums(out: Path) -> None:
    """Recompute the manifest's checksums from the files as they are: a breakage only
    reassembly against the source can see."""
    m = read_manifest(out)
    import msgspec

    from tpshard.digest import hash_range

    files = []
    for f in m.files:
        if not f.checksum:  # not written (split --ranks)
            files.append(f)
            continue
        path = out / rank_dir(min(set(f.ranks) & set(m.written_ranks))) / f.name
        header, offsets = m.plan.header(f.name), m.plan.offsets(f.name)
        fd = os.open(path, os.O_RDONLY)
        digests = [hash_range(fd, o, e - o, m.plan.options.checksum) for o, e in zip(offsets, [*offsets[1:], f.size])]
        os.close(fd)
        files.append(msgspec.structs.replace(f, checksum=file_digest(header, digests), digests=b"".join(digests).hex()))
    (out / MANIFEST_NAME).write_bytes(encode_manifest(msgspec.structs.replace(m, files=tuple(files))))


def file_specs(plan, name: str) -> list:
    """The ShardSpec views of the tensors of output file `name`, in data order."""
    return [plan.view(t, c) for t, c in plan.members(plan.file_index(name))]


def overwrite_tensor(out: Path, rank: int, name: str, tensor: torch.Tensor) -> None:
    """Replace one tensor's bytes in place (in the shared file, so every holder sees it)."""
    m = read_manifest(out)
    spec = next(s for s in m.plan.shards if s.name == name and rank in s.ranks)
    specs = [s for s in m.plan.shards if s.file == spec.file]
    _, offsets = spec_layout(specs)
    offset = offsets[specs.index(spec)]
    with open(out / rank_dir(rank) / spec.file, "r+b") as f:
        f.seek(offset)
        f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def take_from_rank(out: Path, rank: int, name: str, donor: int) -> None:
    """World rank `rank`'s `name` overwritten with world rank `donor`'s copy of it: another rank's slice."""
    overwrite_tensor(out, rank, name, tpshard.open_rank(out, donor)[name].clone())


def swap_ranks(out: Path, name: str, a: int, b: int) -> None:
    """World ranks `a` and `b` each hold the other's `name`."""
    ta, tb = (tpshard.open_rank(out, r)[name].clone() for r in (a, b))
    overwrite_tensor(out, a, name, tb)
    overwrite_tensor(out, b, name, ta)


def reorder_experts(out: Path, rank: int, names, order: list[int]) -> None:
    """World rank `rank`'s fused [E, ...] tensors `names` with their experts in `order` on the experts axis."""
    held = tpshard.open_rank(out, rank)
    for name in names:
        overwrite_tensor(out, rank, name, held[name][order].clone())


def problems(out: Path, source: Path | None) -> list[str]:
    """check's findings on `out`, each "[check] message": against `source`, or of the output alone (None)."""
    return [f"[{p.check}] {p.message}" for p in tpshard.check(out, source).problems]


def only_the_source_tells(out: Path, source: Path) -> list[str]:
    """After a breakage of `out`: its checksums rewritten to match (rewrite_checksums), check of the
    output alone finds nothing; returns what check against `source` finds (`problems`)."""
    rewrite_checksums(out)
    assert not problems(out, None), "with consistent checksums only the source can tell"
    return problems(out, source)
