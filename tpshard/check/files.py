"""check's checks of an output's files, which need no source: the folder holds what the manifest
accounts for (check_layout), each rank's index is the plan's (check_index), and every file of every
rank folder has its size, header and per-tensor and file checksums (a copy that replaced a hard
link is checked on its own). check_output runs those and the plan's (tpshard.check.alignment).

Hashed carries the tensor digests the reassembly (tpshard.check.reassembly) took as it read the
files, so that check --source reads them once; distinct_copies lists the copies it reads.
"""

from __future__ import annotations

import bisect
import json
import os
import stat
from array import array
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from tpshard.check.alignment import check_plan
from tpshard.check.report import CheckReport
from tpshard.digest import DIGEST_SIZE, digest_of, file_hash, packed_digests, range_digests, sha256_file
from tpshard.manifest import MANIFEST_NAME, Manifest, Plan, differing, rank_dir, rank_index_pieces, shard_shape
from tpshard.processes import shared_bytes, shared_slots
from tpshard.safetensors_format import nbytes_of


def check_output(
    out: Path, manifest: Manifest, report: CheckReport, workers: int, deferred: set[Path] = frozenset(), hashed: Hashed | None = None,
    on_bytes: Callable[[int], None] | None = None, unread: Unread | None = None,
) -> None:  # fmt: skip
    """The checks without a source: the plan's, the folder's layout, every file of every rank.
    `deferred`: files whose tensor digests the caller compares as it reads them
    (tpshard.check.output_source); their size, header and file checksum are checked here.
    `hashed`: tensor digests the reassembly took as it read the files, used instead of reading
    them again. `on_bytes(n)`: called with the size of each file once checked, for progress.
    `unread`: what unread_findings found for this output, when the caller made them already."""
    if unread is None:  # the indexes are checked while the files are hashed (_check_files)
        check_plan(manifest.plan, report)
        check_layout(out, manifest, report)
    else:
        report.extend(unread.first)
    _check_files(out, manifest, report, workers, deferred=deferred, hashed=hashed, on_bytes=on_bytes, indexes=None if unread is None else unread.indexes)


class Unread(NamedTuple):
    """check_output's findings that read no tensor byte: the plan's and the layout's (`first`), each
    written rank's index (`indexes`, by rank)."""

    first: CheckReport
    indexes: dict[int, CheckReport]


def unread_findings(out: Path, manifest: Manifest) -> Unread:
    """Unread for the output at `out`: check --source makes them while its reassembly reads (Python
    work, a tenth of the check at 9k tensors), check_output reports them in their place."""
    first = CheckReport(out_dir=str(out), source=None)
    check_plan(manifest.plan, first)
    check_layout(out, manifest, first)
    indexes = {}
    for r in manifest.written_ranks:
        indexes[r] = CheckReport(out_dir=str(out), source=None)
        check_index(out / rank_dir(r), manifest.plan, r, indexes[r])
    return Unread(first, indexes)


class Hashed:
    """Each tensor's digest in each copy of an output file, set as the reassembly reads it (from
    the pool's threads) for check_output to compare with the manifest. A copy of which some tensor
    was not read whole (a value set by the plan, a read that failed) is hashed by check_output."""

    def __init__(self, plan: Plan) -> None:
        self.plan, self.algorithm = plan, plan.options.checksum
        self.copies: dict[Path, tuple[int, Sequence[int], array | list, bytearray]] = {}  # path -> (file index, offsets, digests, set)

    def expect(self, path: Path, index: int) -> None:
        offsets = self.plan.offsets(self.plan.files[index].name)  # one per tensor
        # shared with the reassembly's worker processes (tpshard.processes), which set them
        self.copies[path] = (index, offsets, shared_slots(DIGEST_SIZE[self.algorithm], len(offsets)), shared_bytes(len(offsets)))

    def put(self, path: Path, offset: int, nbytes: int, digest: int | bytes) -> None:
        """The digest (as digest_slots holds it) of the `nbytes` at `offset` of the copy at `path`."""
        index, offsets, digests, done = self.copies[path]
        k = bisect.bisect_left(offsets, offset)
        if k < len(offsets) and offsets[k] == offset and self._end(index, offsets, k) - offset == nbytes:  # the tensor, whole
            digests[k], done[k] = digest, 1

    def put_read(self, path: Path, begin: int, data) -> None:
        """The digests of the tensors that lie whole in `data`, the bytes read at `begin` of the copy at `path`."""
        index, offsets, digests, done = self.copies[path]
        k, end = bisect.bisect_left(offsets, begin), begin + len(data)
        while k < len(offsets) and (stop := self._end(index, offsets, k)) <= end:
            digests[k], done[k] = digest_of(self.algorithm, data[offsets[k] - begin : stop - begin]), 1
            k += 1

    def _end(self, index: int, offsets: Sequence[int], k: int) -> int:
        """Where tensor k of file `index` ends: its data lie back to back."""
        return offsets[k + 1] if k + 1 < len(offsets) else self.plan.files[index].size

    def of(self, path: Path, index: int) -> bytes | None:
        """The digests of every tensor of the copy at `path` of file `index`, back to back in file
        order, or None when some tensor was not read."""
        copy = self.copies.get(path)
        if copy is None or copy[0] != index or 0 in bytes(copy[3]):
            return None
        return packed_digests(copy[2])


def check_rank_files(out_dir: str | Path, manifest: Manifest, ranks: list[int], *, workers: int = 2) -> CheckReport:
    """Checksums of the files of `ranks` only (verify: each rank checks its own files, on its own node)."""
    report = CheckReport(out_dir=str(out_dir), source=None)
    _check_files(Path(out_dir), manifest, report, workers, ranks=ranks)
    return report


def _check_files(
    out: Path, manifest: Manifest, report: CheckReport, workers: int, ranks: list[int] | None = None, deferred: set[Path] = frozenset(),
    hashed: Hashed | None = None, on_bytes: Callable[[int], None] | None = None, indexes: dict[int, CheckReport] | None = None,
) -> None:  # fmt: skip
    plan = manifest.plan
    algorithm = plan.options.checksum

    units: dict[tuple[int, int, str], tuple[Path, int, list[int]]] = {}  # (inode, name) -> (path, index in plan.files, ranks)
    extras: dict[tuple[int, int, str], tuple[Path, object, list[int]]] = {}  # the same for copied files
    missing: list[tuple[int, CheckReport]] = []  # each rank's findings on its files, reported after its index's
    for r in manifest.written_ranks if ranks is None else ranks:
        folder = out / rank_dir(r)
        missing.append((r, CheckReport(out_dir=report.out_dir, source=report.source)))
        for f in plan.rank_files(r):
            st = _plain_file(folder / f.name, r, missing[-1][1])
            if st is not None:  # every name is checked, also one hard-linked to another name
                units.setdefault((st.st_dev, st.st_ino, f.name), (folder / f.name, plan.file_index(f.name), []))[2].append(r)
        for extra in manifest.extra_files:
            st = _plain_file(folder / extra.name, r, missing[-1][1])
            if st is not None:
                extras.setdefault((st.st_dev, st.st_ino, extra.name), (folder / extra.name, extra, []))[2].append(r)

    for _, i, _ in units.values():  # laid out here, once: the threads and the index check need them
        plan.offsets(plan.files[i].name)

    def verify(unit: tuple[Path, int, list[int]]) -> list[tuple[str, str]]:
        # What a file holds is looked at a piece of its header and a run of its tensors at a time,
        # its digests as one string: each thread held ~15 MB per file at 90k tensors and tp 8.
        path, i, ranks = unit
        rec = plan.files[i]
        name = rec.name
        where = f"{name} of ranks {ranks}"
        if not rec.checksum:
            return [("checksum", f"{where}: the manifest has no checksum for it")]
        size = os.lstat(path).st_size
        offsets = plan.offsets(name)
        planned = plan.header_size(name)  # the data ends with the last tensor
        if offsets:
            t, c = plan.member(i, len(offsets) - 1)
            planned = offsets[-1] + nbytes_of(t.dtype, shard_shape(t, c))
        if size != rec.size or planned != rec.size:
            return [("files", f"{where}: {size} bytes, the manifest says {rec.size} and its tensors need {planned} (truncated or extended)")]
        found: list[tuple[str, str]] = []
        checksum = file_hash(b"")  # over the header, then the tensor digests (tpshard.digest.file_digest)
        with open(path, "rb") as fh:
            for piece in plan.header_pieces(name):
                if fh.read(len(piece)) != piece:
                    return [("files", f"{where}: safetensors header differs from the planned one")]
                checksum.update(piece)
            if path in deferred:  # compared by the caller as it reads: the manifest's own here
                digests = bytes.fromhex(rec.digests)
            else:
                digests = hashed.of(path, i) if hashed is not None else None
                if digests is None:
                    sizes = [b - a for a, b in zip(offsets, [*offsets[1:], rec.size])]  # tensors lie back to back
                    digests = b"".join(range_digests(fh.fileno(), offsets, sizes, algorithm))
                for k in differing(digests, rec.digests, algorithm):
                    found.append(("checksum", f"{where}: tensor {plan.member(i, k)[0].name} does not match its {algorithm} in the manifest"))
        checksum.update(digests)
        if checksum.hexdigest() != rec.checksum:
            found.append(("checksum", f"{where}: file checksum differs from the manifest"))
        return found

    # The pool hashes the files, largest first (the last to finish is a small one), while this
    # thread checks each rank's index and the copied files (Python work: a tenth of a check at 9k
    # tensors); the findings are reported in the order they are made without the pool: by rank,
    # its index, then its files' presence; then each file's checksums; then the copied files'.
    with ThreadPoolExecutor(workers) as pool:
        by_size = sorted(units, key=lambda key: -plan.files[units[key][1]].size)
        verified = {key: pool.submit(verify, units[key]) for key in by_size}
        for r, held in missing:
            if indexes is None:
                check_index(out / rank_dir(r), plan, r, report)
            else:
                report.extend(indexes[r])
            report.extend(held)
        copied = [os.lstat(path).st_size == extra.size and sha256_file(path) == extra.checksum for path, extra, _ in extras.values()]
        for key, unit in units.items():
            report.files_checked += 1
            for c, m in verified[key].result():
                report.add(c, m)
            report.bytes_checked += plan.files[unit[1]].size
            if on_bytes is not None:
                on_bytes(plan.files[unit[1]].size)
    for (_, extra, ranks), same in zip(extras.values(), copied):
        if not same:
            report.add("checksum", f"{extra.name} of ranks {ranks}: sha256 differs from the manifest")


def check_index(folder: Path, plan: Plan, rank: int, report: CheckReport) -> None:
    """A rank's model.safetensors.index.json is, byte for byte, the one the plan gives."""
    path = folder / "model.safetensors.index.json"
    if _plain_file(path, rank, report) is None:
        return
    try:
        # piece by piece (a rank's index is 7 MB at 90k tensors and tp 8); whole only to say what differs
        with open(path, "rb") as fh:
            if all(fh.read(len(piece)) == piece for piece in rank_index_pieces(plan, rank)) and not fh.read(1):
                return
        held = path.read_bytes()
    except OSError as e:
        report.add("files", f"rank {rank}: unreadable model.safetensors.index.json ({e.strerror})")
        return
    expected = b"".join(rank_index_pieces(plan, rank))
    try:
        weight_map = json.loads(held)["weight_map"]
        want = json.loads(expected)["weight_map"]
        diff = sorted(set(weight_map.items()) ^ set(want.items()))[:3]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        diff = []
    report.add("files", f"rank {rank}: model.safetensors.index.json differs from the one the plan gives" + (f", e.g. {diff}" if diff else ""))


def _plain_file(path: Path, rank: int, report: CheckReport) -> os.stat_result | None:
    """The file's stat when it is a plain file (hard links are plain files); a finding otherwise:
    tpshard never writes a symbolic link, so a link is something the plan did not make."""
    try:
        st = os.lstat(path)
    except OSError:
        report.add("files", f"rank {rank}: {path.name} is missing")
        return None
    if stat.S_ISLNK(st.st_mode):
        report.add("files", f"rank {rank}: {path.name} is a symbolic link to {os.readlink(path)}; tpshard writes plain files (hard links or copies), so the plan did not make it")
        return None
    if not stat.S_ISREG(st.st_mode):
        report.add("files", f"rank {rank}: {path.name} is not a plain file")
        return None
    return st


def check_layout(out: Path, manifest: Manifest, report: CheckReport) -> None:
    """Nothing in the output that the manifest does not account for: stray files or folders at the
    top or in a rank folder, folders of ranks not written, a missing rank folder."""
    written = {rank_dir(r) for r in manifest.written_ranks}
    for entry in sorted(os.listdir(out)):
        if entry != MANIFEST_NAME and entry not in written:
            report.add("stray", f"{entry}: not part of the output (the manifest lists {MANIFEST_NAME} and {len(written)} rank folders)")
    extra_names = [e.name for e in manifest.extra_files] + ["model.safetensors.index.json"]
    for r in manifest.written_ranks:
        folder = out / rank_dir(r)
        if folder.is_symlink() or not folder.is_dir():
            report.add("files", f"{folder.name}: missing or not a folder")
            continue
        expected = {f.name for f in manifest.plan.rank_files(r)} | set(extra_names)
        for entry in sorted(set(os.listdir(folder)) - expected):
            report.add("stray", f"{folder.name}/{entry}: not part of the output; an engine reading this folder may load it")


def distinct_copies(out: Path, manifest: Manifest) -> dict[str, list[tuple[Path, list[int]]]]:
    """File name -> each distinct copy of it in the written rank folders (one per inode, hard links
    counted once), with the ranks that hold that copy. Symbolic links are left out (a finding)."""
    copies: dict[str, dict[tuple[int, int], tuple[Path, list[int]]]] = defaultdict(dict)
    for r in manifest.written_ranks:
        for f in manifest.plan.rank_files(r):
            path = out / rank_dir(r) / f.name
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                copies[f.name].setdefault((st.st_dev, st.st_ino), (path, []))[1].append(r)
    return {name: list(by_inode.values()) for name, by_inode in copies.items()}
