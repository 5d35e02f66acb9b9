"""merge: join outputs written for different ranks (`split --ranks`) into one output.

Each node of a cluster can split its own ranks in parallel; `merge` checks that the parts come from
the same source with the same plan, hard-links the files each part's manifest names for its ranks
into one staged output (parts are left as they are; nothing else in a part is taken) and writes the
merged manifest last. A part with a missing rank folder or file, a file of the wrong size or a
link in place of a file is refused by name before anything is written.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from tpshard.errors import OutputError
from tpshard.manifest import Manifest, rank_dir, read_manifest, write_manifest
from tpshard.publish import staged_output
from tpshard.writer import link_or_copy

INDEX_NAME = "model.safetensors.index.json"


def merge_manifests(parts: list[Manifest]) -> Manifest:
    first = parts[0]
    files = list(first.files)
    for m in parts[1:]:
        same_plan = (m.topology, m.options, m.model, m.tensors) == (first.topology, first.options, first.model, first.tensors)
        if not same_plan or [(f.name, f.ranks, f.size) for f in m.files] != [(f.name, f.ranks, f.size) for f in files]:
            raise OutputError("the parts were split with different plans (source, topology or options differ)")
        if m.source.files != first.source.files:
            raise OutputError("the parts were split from different source checkpoints (source checksums differ)")
        if m.extra_files != first.extra_files:
            raise OutputError("the parts copied different config or tokenizer files; split them again from one source")
        for i, f in enumerate(m.files):
            if not f.checksum:
                continue
            if files[i].checksum and files[i] != f:
                raise OutputError(f"{f.name} differs between parts; split the parts again with the same tpshard")
            files[i] = f
    ranks = sorted({r for m in parts for r in m.written_ranks})
    return msgspec.structs.replace(first, written_ranks=tuple(ranks), files=tuple(files))


def _rank_files(part: Path, m: Manifest, rank: int) -> list[tuple[Path, str]]:
    """(path in the part, name) of every file the manifest says rank `rank`'s folder holds, each
    checked to be a plain file of the recorded size; a one-line refusal otherwise."""
    folder = part / rank_dir(rank)
    if not folder.is_dir() or folder.is_symlink():
        raise OutputError(f"{part}: the manifest lists rank {rank}, but {folder.name} is missing or not a folder")
    expected = [(f.name, f.size) for f in m.plan.rank_files(rank)]
    expected += [(e.name, e.size) for e in m.extra_files] + [(INDEX_NAME, None)]
    found = []
    for name, size in expected:
        path = folder / name
        if path.is_symlink() or not path.is_file():
            raise OutputError(f"{part}: {folder.name}/{name} is missing or not a plain file")
        if size is not None and path.stat().st_size != size:
            raise OutputError(f"{part}: {folder.name}/{name} is {path.stat().st_size} bytes, the manifest says {size}")
        found.append((path, name))
    return found


def refuse_repeated(parts: list[Path]) -> None:
    """A part given twice (under any name) would merge as if it were two nodes' work."""
    seen: dict[tuple[int, int], Path] = {}
    for part in parts:
        try:
            st = part.stat()
        except OSError:
            continue  # read_manifest names what is wrong with it
        first = seen.setdefault((st.st_dev, st.st_ino), part)
        if first is not part:
            raise OutputError(f"{part}: the same part as {first}, given twice; give each part once")


def missing_ranks(manifest: Manifest) -> list[int]:
    """The ranks of the split that no merged part holds."""
    return sorted(set(range(manifest.topology.world_size)) - set(manifest.written_ranks))


def merge(
    parts: list[str | Path], out: str | Path, *, force: bool = False, on_rank: Callable[[int, int], None] | None = None
) -> Manifest:  # fmt: skip
    """Merge tpshard outputs holding different ranks of one split into `out`; `on_rank(done, total)`
    after each rank's folder is linked (the command's progress)."""
    if not parts:
        raise OutputError("merge needs at least one part")
    parts = [Path(p) for p in parts]
    refuse_repeated(parts)
    manifests = [read_manifest(p) for p in parts]
    merged = merge_manifests(manifests)
    taken: dict[int, list[tuple[Path, str]]] = {}
    for part, m in zip(parts, manifests):
        for r in m.written_ranks:
            if r not in taken:
                taken[r] = _rank_files(part, m, r)
    with staged_output(out, force=force, inputs=parts) as staging:
        shared: dict[str, Path] = {}  # a file of several ranks: staged once, linked as split links it
        for done, (r, files) in enumerate(sorted(taken.items()), 1):
            dst = staging / rank_dir(r)
            dst.mkdir()
            for path, name in files:
                link_or_copy(shared.get(name, path), dst / name)
                if name != INDEX_NAME:  # each rank's index is its own
                    shared.setdefault(name, dst / name)
            if on_rank is not None:
                on_rank(done, len(taken))
        write_manifest(staging, merged)
    return merged
