"""A tpshard output read as the checkpoint it was split from (for `reshard` and `check --from`).

`open_output_source(out)` checks the output against its own manifest (tpshard.check without a
source, tpshard.check.files.check_output: the plan's alignment checks, the folder's layout, every
rank's index and copied files, every file's size, header and file checksum; the tensor digests of
the copy of each file the reader reads are compared as it reads them, those of any other copy
here), then gives:

* `checkpoint`: a Checkpoint that `make_plan` reads as it read the original. Its config.json and
  other copied files are those of a written rank folder (split copies them unchanged); its tensors
  are the source tensors with their names, dtypes and shapes, in the source's (file, offset) order,
  which is the manifest's tensor order (make_plan lists tensors in that order). The tensors split
  dropped (rotary inv_freq) are named only by its warnings; they come back as empty tensors, in
  their order, so that the plan's warnings are the same. What make_plan does not read (file names,
  offsets) is made up. `make_plan` on it must give the old output's manifest, or it is refused.
* `reader` (OutputReader): each source tensor's bytes, reassembled from the shards: one copy per
  cut (kv-head and attention-DP replicas share a cut), padding stripped and required to be zero,
  each shard's digest compared with the manifest's as it is read; `verify_rest` hashes what no
  tensor needed (duplicates, padding-only cuts, planned values, a tied lm_head copy). A tensor
  lives in memory while it is cut; the buffers, in use or kept for reuse, stay under one largest
  tensor (or 64 MiB) together.

What it cannot rebuild exactly it refuses in one line (an output written for some ranks only, a
manifest the rules do not give). The source section of the manifest (path, source file checksums)
is the old output's: the shards are proven to be what that output's manifest says, and that
manifest was written by the split that read those source files (docs/reshard.md).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import defaultdict
from pathlib import Path

import numpy as np

from tpshard.check.files import check_output, distinct_copies
from tpshard.check.report import CheckReport, some_of
from tpshard.checkpoint import Checkpoint
from tpshard.collector import paused
from tpshard.cuts import lead_block, runs
from tpshard.digest import new_hash, range_digests
from tpshard.errors import OutputError, TpshardError
from tpshard.inputs import read_config
from tpshard.manifest import Cut, Manifest, Source, SourceFile, TensorPlan, plan_differences, rank_dir, read_manifest, shard_shape
from tpshard.pieces import CHUNK_BYTES, OpenFiles, cut_geometry, read_into, scratch
from tpshard.safetensors_format import TensorInfo, nbytes_of

VIRTUAL_FILE = "(tensors reassembled from a tpshard output)"
_DROPPED = re.compile(r"(.+): dropped \(engines recompute it\)")
MIN_BUDGET = 64 << 20


class _Cut:
    """One cut of a source tensor as the reader uses it: where one copy of its shard lies."""

    __slots__ = ("tensor", "cut", "copy", "offset", "digest", "file", "index")

    def __init__(self, tensor: TensorPlan, cut: Cut, copy: tuple[Path, list[int]], offset: int, digest: bytes, file: str, index: int):
        self.tensor, self.cut, self.offset, self.digest = tensor, cut, offset, digest
        self.copy, self.file = copy, file  # (path, ranks) of the copy read; the file's name
        self.index = index  # in its file

    @property
    def path(self) -> Path:
        return self.copy[0]

    @property
    def where(self) -> str:  # for messages only: not one string per cut kept (460k at 90k tensors)
        return f"{self.file} of ranks {self.copy[1]}"


class OutputSource:
    """What `open_output_source` gives: the old output's manifest, its checkpoint view, its reader."""

    def __init__(self, out: Path, manifest: Manifest, checkpoint: Checkpoint, reader: OutputReader):
        self.out, self.manifest, self.checkpoint, self.reader = out, manifest, checkpoint, reader


def open_checked_source(old: Path, report: CheckReport, workers: int, what: str = "resharded from") -> OutputSource | None:
    """check --from: the output `old` proven against its own manifest (its findings added to
    `report`, as "from"), then opened as the source; None where it fails (nothing to compare with)."""
    old_manifest = read_manifest(old)
    old_report = verify_output(old, workers, manifest=old_manifest)
    for p in old_report.problems:
        report.add("from", f"{old} ({what}): [{p.check}] {p.message}")
    report.omitted += old_report.omitted
    if not old_report.ok:
        return None
    try:
        return open_output_source(old, workers=workers, verified=True, manifest=old_manifest)
    except TpshardError as e:
        report.add("from", str(e))
        return None


def verify_output(out: Path, workers: int, deferred: set[Path] = frozenset(), manifest: Manifest | None = None):
    """The old output's own check (no source): a CheckReport. `deferred`: files whose tensor
    digests an OutputReader compares as it reads them (OutputReader.verify_rest for the rest).
    `manifest`: its manifest, when the caller has read it (its plan's file headers are then laid
    out once, not again for the reader)."""
    report = CheckReport(out_dir=str(out), source=None)
    check_output(out, manifest or read_manifest(out), report, workers, deferred)
    return report


@paused()
def open_output_source(out: str | Path, *, workers: int = 2, verified: bool = False, manifest: Manifest | None = None) -> OutputSource:
    """The output at `out` as a source; OutputError (one line) when it cannot be one exactly.
    `verified`: the caller has already run tpshard.check on it and found nothing; `manifest`: its
    manifest, when the caller has read it."""
    out = Path(out)
    manifest = manifest or read_manifest(out)
    reader = OutputReader(out, manifest)
    if not verified:
        # The files the reader reads are hashed as they are read (once, not twice): here only
        # their sizes, headers and file checksums, and every other copy in full.
        report = verify_output(out, workers, reader.first_copies(), manifest)
        if not report.ok:
            first = f"[{report.problems[0].check}] {report.problems[0].message}" if report.problems else "see tpshard check"
            more = report.found - 1
            raise OutputError(
                f"{out}: fails its own check, so it cannot be resharded: {first}"
                + (f" (and {more} more; run tpshard check {out})" if more else "")
            )
    reader.check_held()
    ckpt = _checkpoint_of(out, manifest)
    _same_plan(out, ckpt, manifest)
    return OutputSource(out, manifest, ckpt, reader)


def _same_plan(out: Path, ckpt: Checkpoint, manifest: Manifest) -> None:
    """The rules give, for this view of the source and the old topology, the plan the old output
    records: then the view holds what make_plan read from the real source (every tensor it kept or
    dropped, in order; the config), and a new plan made from it is the one split would make."""
    from tpshard.plan import make_plan

    try:
        again = make_plan(ckpt, manifest.topology, manifest.options)
    except TpshardError as e:
        raise OutputError(f"{out}: the rules of this tpshard refuse its own topology ({e}); it cannot be resharded exactly") from None
    differs = plan_differences(again, manifest)
    if differs:
        raise OutputError(
            f"{out}: its manifest's {differs[0]} are not what this tpshard's rules give for the source it records"
            f" (written by tpshard {manifest.tool_version}?); the source cannot be rebuilt exactly from it"
        )


def _checkpoint_of(out: Path, manifest: Manifest) -> Checkpoint:
    folder = out / rank_dir(manifest.written_ranks[0])
    if not any(e.name == "config.json" for e in manifest.extra_files) or not (folder / "config.json").is_file():
        raise OutputError(f"{out}: the output holds no config.json of its source; it cannot be resharded")
    config = read_config(folder)

    tensors: dict[str, TensorInfo] = {}
    at = 0
    for w in manifest.warnings:  # in the order split met them, before every kept tensor: only their order counts
        m = _DROPPED.fullmatch(w)
        if m:
            tensors[m.group(1)] = TensorInfo(file=VIRTUAL_FILE, dtype="F32", shape=(0,), begin=at, end=at)
    for t in manifest.tensors:
        if t.source:  # a copy of another source tensor (a tied lm_head at pp > 1)
            continue
        n = nbytes_of(t.dtype, t.shape)
        tensors[t.name] = TensorInfo(file=VIRTUAL_FILE, dtype=t.dtype, shape=t.shape, begin=at, end=at + n)
        at += n
    missing = sorted(t.source for t in manifest.tensors if t.source and t.source not in tensors)
    if missing:
        raise OutputError(f"{out}: {missing[0]} is recorded as the source of another tensor but is not in the output")
    # weight_files stays empty: extra_files() then lists the copied files (the rank's own
    # safetensors files and index are weight files to it) and check_source_sizes has no file to size.
    return Checkpoint(path=folder, config=config, weight_files=(), tensors=tensors, index_file=None)


class _Buffers:
    """The reassembled tensors' memory: buffers in use stay under `limit` bytes (one buffer larger
    than that waits until it is alone), and are kept for the next tensors, free and in use together
    also under the limit: a fresh buffer costs a page fault per 4 KiB (3 s per GiB on this project's
    VMs, more than reading it)."""

    def __init__(self, limit: int):
        self.limit, self.used = limit, 0
        self.free: list[np.ndarray] = []
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def get(self, n: int):
        buf = None
        with self.cond:
            while True:
                fits = [i for i, b in enumerate(self.free) if len(b) >= n]
                if fits:
                    buf = self.free.pop(min(fits, key=lambda i: len(self.free[i])))
                    break
                if self.used + n <= self.limit or not self.used:
                    # None of the free ones is large enough: let go of them until the new one fits.
                    self.free.sort(key=len)
                    while self.free and self.used + sum(map(len, self.free)) + n > self.limit:
                        self.free.pop(0)
                    break
                self.cond.wait()
            size = n if buf is None else len(buf)
            self.used += size
        try:
            if buf is None:
                buf = np.empty(n, np.uint8)
            yield buf[:n]
        finally:
            with self.cond:
                self.used -= size
                if buf is not None:
                    self.free.append(buf)
                self.cond.notify_all()

    def clear(self) -> None:
        with self.cond:
            self.free = []


class OutputReader:
    """Source tensors reassembled from an output's shards; the writer's and check's reader
    (tpshard.writer.CheckpointReader has the interface)."""

    reads_every_tensor = False  # no source digests to compute: a tensor only planned values hold is not read
    forkable = False  # `read` (what the copy hashed) is read back by verify_rest

    def __init__(self, out: Path, manifest: Manifest):
        self.out, self.manifest = out, manifest
        plan = manifest.plan
        self.algorithm = plan.options.checksum
        copies = distinct_copies(out, manifest)
        self.cuts: dict[str, list[_Cut]] = defaultdict(list)
        self.unheld: dict[str, str] = {}  # source tensor -> a file of it no written rank holds
        for index, f in enumerate(plan.files):
            held = copies.get(f.name)
            for i, ((t, c), offset) in enumerate(zip(plan.members(index), plan.offsets(f.name))):
                if (t.source or t.name) != t.name or c.value is not None:
                    continue  # a copy of another tensor, or content the plan gives (never read)
                if not held or not f.digests:
                    self.unheld.setdefault(t.name, f.name)
                    continue
                self.cuts[t.name].append(_Cut(t, c, held[0], offset, f.digest(i, self.algorithm), f.name, i))
        self.copies = copies
        self.read: set[tuple[Path, int]] = set()  # (file, tensor index) hashed while read
        self.largest = max((nbytes_of(t.dtype, t.shape) for t in manifest.tensors), default=0)
        self.buffers = _Buffers(max(self.largest, MIN_BUDGET))
        self.files = OpenFiles()
        self.lock = threading.Lock()  # guards `read`

    def first_copies(self) -> set[Path]:
        """The copy of each file the reader reads (the others are checked in full beforehand)."""
        return {held[0][0] for held in self.copies.values() if held}

    def check_held(self) -> None:
        """Refuse, in one line, an output in which some source tensor has no copy (split --ranks)."""
        out, manifest, plan = self.out, self.manifest, self.manifest.plan
        if self.unheld:
            name, fname = next(iter(self.unheld.items()))
            raise OutputError(
                f"{out}: written for ranks {some_of(manifest.written_ranks)} of {plan.topology.world_size} only:"
                f" no rank folder holds {fname} ({name}); reshard needs every source tensor (tpshard merge the parts first)"
            )

    def verify_rest(self, workers: int = 2) -> None:
        """Hash every tensor of the first copies that no tensor() call read (duplicates, padding-only
        cuts, planned values, tied copies, tensors no new rank needed): then every byte of the old
        output has been compared with its manifest."""
        plan = self.manifest.plan

        def one(item: tuple[str, list]) -> None:
            fname, held = item
            path = held[0][0]
            index = plan.file_index(fname)
            record, members = plan.files[index], plan.members(index)
            offsets = plan.offsets(fname)
            todo = [k for k in range(len(members)) if (path, k) not in self.read]
            sizes = [nbytes_of(members[k][0].dtype, shard_shape(*members[k])) for k in todo]
            for k, got in zip(todo, range_digests(self.files.fd(path), [offsets[k] for k in todo], sizes, self.algorithm)):
                if got != record.digest(k, self.algorithm):
                    raise OutputError(f"{self.out}: {fname} of ranks {held[0][1]}: tensor {members[k][0].name} does not match its {self.algorithm} in the manifest")

        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, self.copies.items()))

    def __enter__(self) -> OutputReader:
        return self

    def __exit__(self, *exc) -> None:
        self.files.close()
        self.buffers.clear()

    @contextlib.contextmanager
    def tensor(self, name: str, info: TensorInfo):
        """(-1, info, the tensor's bytes as a uint8 array) while the block runs (check's reader)."""
        with self.buffers.get(info.nbytes) as data:
            if info.nbytes:
                self._fill(name, info, data)
            yield -1, info, data

    @contextlib.contextmanager
    def job(self, tensors: list[tuple[str, TensorInfo, bool]], run: bool):
        """The writer's reader (tpshard.writer.CheckpointReader.job): a run of small tensors,
        adjacent in the view, reassembled into one buffer that lives until the block ends (the
        writer's gathered writes point into it); other tensors one at a time."""
        if run:
            begin = tensors[0][1].begin
            with self.buffers.get(tensors[-1][1].end - begin) as data:
                for name, info, needed in tensors:
                    if needed and info.nbytes:
                        self._fill(name, info, data[info.begin - begin : info.end - begin])
                yield ((-1, info, data[info.begin - begin : info.end - begin]) for _, info, _ in tensors)
            return
        each = self._each(tensors)
        try:
            yield each
        finally:
            each.close()

    def _each(self, tensors: list[tuple[str, TensorInfo, bool]]):
        for name, info, needed in tensors:
            if not needed:
                yield -1, info, None
                continue
            with self.tensor(name, info) as got:  # its buffer goes back when the next is asked for
                yield got

    def source(self, digests: dict[str, bytes]) -> tuple[str, tuple[SourceFile, ...]]:
        """The old output's record of its source: the split that made it read those files."""
        s: Source = self.manifest.source
        return s.path, s.files

    def _fill(self, name: str, info: TensorInfo, data: np.ndarray) -> None:
        cuts = self.cuts.get(name)
        if not cuts:
            raise OutputError(f"{self.out}: {name} is held only as values the plan gives; its bytes cannot be rebuilt")
        dim = cuts[0].tensor.dim
        if dim is None:
            self._read(cuts[0], data, 1, 0)
            for c in cuts[1:]:  # several whole copies must agree; the manifest's digests say so
                if c.digest != cuts[0].digest:
                    raise OutputError(f"{self.out}: {name}: the whole copies in {cuts[0].where} and {c.where} differ")
            return
        blocks: dict[tuple[int, int], list[_Cut]] = defaultdict(list)
        for c in cuts:
            blocks[(c.cut.lead_start, c.cut.lead_length)].append(c)
        if len(blocks) == 1 and not cuts[0].cut.lead_length:
            self._tile(name, cuts, data, info.shape, dim)
            return
        covered = 0  # leading-dim ranges (ShardSpec.lead_start): each a sub-tensor its cuts tile
        for (start, length), block in sorted(blocks.items()):
            if not length or start != covered:
                raise OutputError(f"{self.out}: {name}: its cuts' leading-dim ranges do not tile dim 0 (a gap or overlap at {covered})")
            covered = start + length
            shape, first, size = lead_block(info.shape, info.nbytes, block[0].cut)
            self._tile(name, block, data[first : first + size], shape, dim)
        if covered != info.shape[0]:
            raise OutputError(f"{self.out}: {name}: its cuts' leading-dim ranges cover {covered} of {info.shape[0]} along dim 0")

    def _tile(self, name: str, cuts: list[_Cut], data: np.ndarray, shape: tuple[int, ...], dim: int) -> None:
        """Put `cuts`, which must tile dim `dim` of the (sub-)tensor `data` [shape], into place."""
        outer, rows, inner = cut_geometry(shape, len(data), dim)
        covered = 0
        seen: dict[tuple[int, int], _Cut] = {}
        for c in sorted(cuts, key=lambda c: (c.cut.start, -c.cut.length)):
            s = c.cut
            if not s.length:
                continue
            first = seen.setdefault((s.start, s.length), c)
            if first is not c:
                if first.digest != c.digest or first.cut.pad != s.pad:
                    raise OutputError(f"{self.out}: {name}: two copies of rows [{s.start}, {s.start + s.length}) differ ({first.where}, {c.where})")
                continue
            if s.start != covered:
                raise OutputError(f"{self.out}: {name}: its cuts do not tile dim {dim} (a gap or overlap at {covered})")
            covered = s.start + s.length
            self._read(c, data, outer, inner * rows)
        if covered != rows // (sum(cuts[0].tensor.segments) or 1):  # a segmented cut's units (ShardSpec.segments)
            raise OutputError(f"{self.out}: {name}: its cuts cover {covered} of {rows} along dim {dim}")

    def _read(self, c: _Cut, data: np.ndarray, outer: int, row_bytes: int) -> None:
        """Put cut `c`'s real rows into `data` (the whole source tensor); its digest and zero padding checked."""
        t, s = c.tensor, c.cut
        fd = self.files.fd(c.path)
        size = nbytes_of(t.dtype, shard_shape(t, s))
        h = new_hash(self.algorithm)
        if t.dim is None:
            h.update(read_into(fd, data, c.offset, size))
        elif outer == 1:  # contiguous runs (one, or one per segment): straight into place, then the padding
            inner, at = row_bytes // t.shape[t.dim], c.offset
            for start, length, pad in runs(t.segments, t.shape[t.dim], s):
                region = data[start * inner : (start + length) * inner]
                h.update(read_into(fd, region, at, len(region)))
                at += len(region)
                if pad:
                    tail = read_into(fd, scratch("pad", pad * inner), at, pad * inner)
                    h.update(tail)
                    self._zero(tail, c)
                    at += len(tail)
        else:  # cut along an inner dim: whole rows of the outer dims at a time, a few MiB each
            pieces = runs(t.segments, t.shape[t.dim], s)  # one run, or one per segment (fused [gate | up])
            per = sum(n + p for _, n, p in pieces)
            inner = row_bytes // t.shape[t.dim]
            shard_row = per * inner
            step = max(1, CHUNK_BYTES // max(shard_row, 1))
            into = data.reshape(outer, t.shape[t.dim], inner)
            for a in range(0, outer, step):
                b = min(outer, a + step)
                chunk = read_into(fd, scratch("shard", (b - a) * shard_row), c.offset + a * shard_row, (b - a) * shard_row)
                h.update(chunk)
                view = chunk.reshape(b - a, per, inner)
                at = 0
                for start, length, pad in pieces:
                    if pad:
                        self._zero(view[:, at + length : at + length + pad], c)
                    into[a:b, start : start + length] = view[:, at : at + length]
                    at += length + pad
        if h.digest() != c.digest:
            raise OutputError(f"{self.out}: {c.where}: tensor {t.name} does not match its {self.algorithm} in the manifest")
        with self.lock:
            self.read.add((c.path, c.index))

    def _zero(self, pad: np.ndarray, c: _Cut) -> None:
        if pad.any():
            raise OutputError(f"{self.out}: {c.where}: the padding of {c.tensor.name} is not zero; a split writes zeros there")
