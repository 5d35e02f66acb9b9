"""split: execute a plan. The only code that writes tensor bytes.

Each source tensor is read once, front to back in chunks, and every rank's piece of it is cut from
the chunk in memory: a contiguous slice (dim 0) is written straight from the read buffer, a strided
one (dim > 0) is gathered into a buffer of its own. Output files get their header from the plan
before any data exists, so every piece is written with pwrite at its final offset; memory is bounded
by the chunk size times the worker count, whatever the model size, and the bytes do not depend on
the order workers finish in.

Checksums are computed while writing: sha256 of each tensor's bytes, and a file's checksum is sha256
over its header followed by its tensors' digests (tpshard.digest). `check` recomputes both.

Output is staged in a hidden sibling folder (tpshard.publish); the data is fsynced, the manifest
written last, and the folder put in place of the output atomically: an output folder with a
manifest is complete, and an old output stays whole until the new one replaces it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from array import array
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from tpshard.version import __version__
from tpshard.checkpoint import Checkpoint, open_checkpoint
from tpshard.collector import libc, paused, release_freed_memory
from tpshard.digest import (
    DIGEST_SIZE,
    Crc32,
    crc32_combine,
    digest_of,
    digest_slots,
    file_digest,
    file_hash,
    hash_digest,
    new_hash,
    packed_digests,
    sha256_file,
    tensor_digest,
)
from tpshard.errors import TopologyError
from tpshard.manifest import (
    Cut,
    Manifest,
    Options,
    OutputFile,
    Plan,
    ShardSpec,
    Source,
    SourceFile,
    TensorPlan,
    SourceCuts,
    rank_dir,
    rank_index_pieces,
    write_manifest,
)
from tpshard.pieces import cut_pieces, read_into, scratch, slot_pieces, value_bytes
from tpshard.plan import make_plan
from tpshard.processes import can_fork, run_forked, shared_bytes, shared_slots
from tpshard.publish import staged_output
from tpshard.safetensors_format import TensorInfo, nbytes_of, read_header_bytes
from tpshard.topology import Topology
from tpshard.workers import check_workers


def split(
    source: str | Path | Checkpoint,
    out: str | Path,
    topology: Topology,
    options: Options | None = None,
    *,
    workers: int | None = None,
    force: bool = False,
    ranks: Iterable[int] | None = None,
    on_tensor: Callable[[int], None] | None = None,
) -> Manifest:
    """Split the checkpoint at `source` into per-rank folders under `out`; return the manifest.

    `source` is a checkpoint folder or an already opened Checkpoint. `ranks` limits the output to those world ranks (each node of a cluster can write its own);
    `on_tensor(nbytes)` is called after each source tensor, for progress.
    """
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    plan = make_plan(ckpt, topology, options)
    selected = select_ranks(topology, ranks)
    workers = check_workers(workers)
    with staged_output(out, force=force, inputs=[ckpt.path]) as staging:
        manifest = write_plan(ckpt, plan, staging, selected, workers, on_tensor)
    return manifest


def select_ranks(topology: Topology, ranks: Iterable[int] | None) -> list[int]:
    """The world ranks to write, sorted: all of them, or `ranks` (each inside the world)."""
    selected = sorted(set(range(topology.world_size) if ranks is None else ranks))
    bad = [r for r in selected if not 0 <= r < topology.world_size]
    if bad or not selected:
        raise TopologyError(f"--ranks {bad or '(none)'}: ranks must lie in 0..{topology.world_size - 1}")
    return selected


class CheckpointReader:
    """Where split reads each source tensor's bytes: the checkpoint's own files.

    The interface the writer reads through (tpshard.check.output_source.OutputReader is the other one):
    `job(tensors, run)`, a context giving, for each (name, info, needed) of one pool task, the
    (fd, TensorInfo, bytes or None) to cut it from, in order; `source(digests)`, the manifest's
    source path and files, given each source tensor's crc32 (4 bytes each, in the checkpoint's
    tensor order); `reads_every_tensor`, whether tensors no target needs are read too;
    `forkable`, whether jobs may run in forked processes (no state of the reader is read back)."""

    reads_every_tensor = True  # the source checksums cover every byte of the checkpoint
    forkable = True  # nothing of it is read back after the copy: jobs may run on forked processes

    def __init__(self, ckpt: Checkpoint):
        self.ckpt = ckpt
        self.fds: dict[str, int] = {}

    def __enter__(self) -> CheckpointReader:
        for name in self.ckpt.weight_files:
            self.fds[name] = os.open(self.ckpt.path / name, os.O_RDONLY)
        return self

    def __exit__(self, *exc) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}

    @contextlib.contextmanager
    def job(self, tensors: list[tuple[str, TensorInfo, bool]], run: bool):
        if not run:
            yield ((self.fds[info.file], info, None) for _, info, _ in tensors)
            return
        # adjacent in one file: one read, into the buffer cut_pieces reads a large tensor's chunks
        # into (a thread does one or the other at a time: two were 4 MiB more per worker)
        begin, fd = tensors[0][1].begin, self.fds[tensors[0][1].file]
        n = tensors[-1][1].end - begin
        data = read_into(fd, scratch("read", n), begin, n)
        yield ((fd, info, data[info.begin - begin : info.end - begin]) for _, info, _ in tensors)

    def source(self, digests: bytearray) -> tuple[str, tuple[SourceFile, ...]]:
        return str(self.ckpt.path.resolve()), _source_files(self.ckpt, digests)


_NOTHING = TensorInfo(file="", dtype="U8", shape=(0,), begin=0, end=0)
WRITE_BYTES = 128 << 10
# A pool task's bytes: a run of small tensors is read whole and its shards kept until written, so
# each worker holds about twice this (8 MiB: DeepSeek-V3's count peaked ~25 MiB higher, no faster).
BATCH_BYTES, BATCH_TENSORS = 4 << 20, 256
# Small tensors copied together: one read, and one write per output file. Not more: at 90k tiny
# tensors and tp 8, runs of 1024 held ~6 MiB more of pieces and slots than 256 (the split's peak),
# runs of 4096 ~40 MB more, for no time saved.
RUN_TENSORS = 256
SMALL_BYTES = 1 << 20  # tensors under this are copied in runs; also the least shard sync_file_range is worth


def copy_jobs(infos: Sequence[TensorInfo]) -> list[tuple[bool, array]]:
    """The copy's pool tasks, as (run, positions in `infos`): positions, not (name, info) pairs,
    which were 6 MB at 90k tensors for the whole copy.

    Large tensors go first, largest first (one left for the end would keep a worker busy while the
    others idle), in tasks of about BATCH_BYTES. Small ones follow as runs: tensors adjacent in one
    source file, in source order, read in one pread; as output files keep source order, their
    shards land next to each other too, and each output file gets one write per run instead of one
    per shard (DeepSeek-V3: 92k tensors, most of them small; a system call costs tens of
    microseconds on some VMs)."""
    large = sorted((p for p, i in enumerate(infos) if i.nbytes >= SMALL_BYTES), key=lambda p: (-infos[p].nbytes, infos[p].file, infos[p].begin))
    jobs: list[tuple[bool, array]] = []
    batch, size = array("I"), 0
    for p in large:
        batch.append(p)
        size += infos[p].nbytes
        if size >= BATCH_BYTES or len(batch) >= BATCH_TENSORS:
            jobs.append((False, batch))
            batch, size = array("I"), 0
    if batch:
        jobs.append((False, batch))
    small = sorted((p for p, i in enumerate(infos) if i.nbytes < SMALL_BYTES), key=lambda p: (infos[p].file, infos[p].begin))
    follows = lambda a, b: infos[a].file == infos[b].file and infos[a].end == infos[b].begin  # noqa: E731
    runs = adjacent_runs(small, lambda p: infos[p].nbytes, follows, BATCH_BYTES, RUN_TENSORS)
    return jobs + [(True, array("I", run)) for run in runs]


def adjacent_runs(items: Iterable, nbytes: Callable, follows: Callable, max_bytes: int, max_items: int) -> list[list]:
    """`items` in order, cut into runs in which each item follows the one before it
    (`follows(before, item)`: back to back in one file), of at most max_bytes and max_items each:
    small tensors are copied a run at a time, one read and one write for the run."""
    runs: list[list] = []
    run: list = []
    size = 0
    for item in items:
        n = nbytes(item)
        if run and (not follows(run[-1], item) or size + n > max_bytes or len(run) >= max_items):
            runs.append(run)
            run, size = [], 0
        run.append(item)
        size += n
    if run:
        runs.append(run)
    return runs


class _Pending:
    """Pieces for the output files, kept (not copied) until the run is done, so that adjacent
    pieces go out in one gathering write."""

    def __init__(self) -> None:
        self.runs: dict[int, list[list]] = {}  # fd -> [start, end, pieces] of each run of adjacent pieces

    def add(self, fd: int, offset: int, view) -> None:  # bytes or a uint8 array: no memoryview of each (2.7 MB a run)
        runs = self.runs.setdefault(fd, [])
        if runs and runs[-1][1] == offset:
            runs[-1][1] += len(view)
            runs[-1][2].append(view)
        else:
            runs.append([offset, offset + len(view), [view]])

    def flush(self) -> None:
        for fd, runs in self.runs.items():
            for offset, _, views in runs:
                group, size = [], 0
                for view in views:
                    group.append(view)
                    size += len(view)
                    if size >= WRITE_BYTES or len(group) >= IOV_MAX:
                        _pwritev_all(fd, group, offset)
                        offset += size
                        group, size = [], 0
                if group:
                    _pwritev_all(fd, group, offset)
            # Written back while the copy goes on, not all at the fsync (runs of small shards hold
            # most bytes of a model of many small tensors; the fsync was a third of such a split).
            lo, hi = min(run[0] for run in runs), max(run[1] for run in runs)
            if hi > lo:  # 0 bytes would mean "to the end of the file"
                start_writeback(fd, lo, hi - lo)
        self.runs.clear()


IOV_MAX = 1024  # pieces per gathering write (Linux's limit)


def _pwritev_all(fd: int, views: list[memoryview], offset: int) -> None:
    done = os.pwritev(fd, views, offset)
    total = sum(len(v) for v in views)
    if done < total:  # a short write: the rest piece by piece
        pwrite_all(fd, memoryview(b"".join(views))[done:], offset + done)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """All of `view` at `offset`, in writes of WRITE_BYTES: on this project's VMs a write of 512 KiB
    costs 3x the kernel time of four of 128 KiB (docs/performance.md)."""
    for a in range(0, len(view), WRITE_BYTES):
        piece = view[a : a + WRITE_BYTES]
        done = 0
        while done < len(piece):
            done += os.pwrite(fd, piece[done:], offset + a + done)


class _Target:
    """Where one large shard's bytes go, hashed as its pieces are written."""

    def __init__(self, spec: ShardSpec, fd: int, offset: int, checksum: str):
        self.spec, self.fd, self.offset = spec, fd, offset
        self.hash = new_hash(checksum)

    def write(self, data, at: int) -> None:
        view = memoryview(data).cast("B")
        # Hashed piece by piece while each is in the CPU cache.
        for a in range(0, len(view), WRITE_BYTES):
            piece = view[a : a + WRITE_BYTES]
            pwrite_all(self.fd, piece, self.offset + at + a)
            self.hash.update(piece)


# One shard to write: its tensor and cut, the open output file, the data offset in it, and where
# its digest goes (file index, position in the file).
_Slot = tuple[TensorPlan, Cut, int, int, int, int]


class _Slots:
    """Each source tensor's slots, listed when its job runs (tpshard.manifest.SourceCuts)."""

    def __init__(self, plan: Plan, names: Sequence[str], fds: dict[int, int], offsets: dict[int, Sequence[int]]):
        self.cuts, self.fds, self.offsets = SourceCuts(plan, names), fds, offsets

    def of(self, position: int) -> list[_Slot]:
        """The slots of the source tensor at `position` (the checkpoint's order) in the files being written."""
        return [(t, c, fd, self.offsets[c.file][p], c.file, p) for t, c, p in self.cuts.of(position) if (fd := self.fds.get(c.file)) is not None]


@paused()
def write_plan(
    ckpt: Checkpoint,
    plan: Plan,
    staging: Path,
    selected: list[int],
    workers: int,
    on_tensor: Callable[[int], None] | None,
    reader=None,
) -> Manifest:
    """Write `plan` for `selected` ranks into `staging`, reading each of `ckpt`'s tensors through
    `reader` (default: CheckpointReader, the checkpoint's files); the manifest last."""
    reader = reader or CheckpointReader(ckpt)
    chosen = set(selected)
    written_files = [i for i, f in enumerate(plan.files) if chosen & set(f.ranks)]
    for r in selected:
        (staging / rank_dir(r)).mkdir()

    # Every output file laid out from the plan at its full size; header and data by pwrite.
    fds: dict[int, int] = {}
    checksums = {}  # file index -> its file_hash, the header hashed
    offsets: dict[int, Sequence[int]] = {}  # file index -> each tensor's data offset, in data order
    digests: dict[int, array | list] = {}  # file index -> each tensor's digest (digest_slots), in data order
    algorithm = plan.options.checksum
    names, infos = list(ckpt.tensors), list(ckpt.tensors.values())  # the copy names tensors by position
    tasks = copy_jobs(infos)
    # Processes where a copy has work for more than one (tpshard.processes); threads for a reader
    # whose state the parent reads afterwards (a reshard's OutputReader notes what it hashed).
    forked = workers > 1 and len(tasks) > 1 and reader.forkable and can_fork()
    slots_for = (lambda n: shared_slots(DIGEST_SIZE[algorithm], n)) if forked else (lambda n: digest_slots(algorithm, n))
    try:
        for i in written_files:
            f = plan.files[i]
            fds[i] = os.open(staging / rank_dir(min(chosen & set(f.ranks))) / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            os.ftruncate(fds[i], f.size)
            offsets[i] = plan.offsets(f.name)
            digests[i] = slots_for(len(offsets[i]))

        def headers_and_indexes() -> None:
            # Nothing the copy reads: with forked workers the parent writes these while they copy.
            for i in written_files:
                checksums[i] = _write_header(plan, i, fds[i])
            release_freed_memory()  # the headers
            for r in selected:
                with open(staging / rank_dir(r) / "model.safetensors.index.json", "wb") as f:
                    f.writelines(rank_index_pieces(plan, r))

        slots = _Slots(plan, names, fds, offsets)
        release_freed_memory()  # the name lookup _Slots made its arrays from (~12 MB at 90k tensors)
        # each source tensor's crc32 by position, set by the jobs as they go
        source_digests = shared_bytes(4 * len(names)) if forked else bytearray(4 * len(names))

        with reader:
            # Every source tensor is read (also those no selected rank needs) so that the source
            # checksums cover the whole checkpoint; a reshard (reads_every_tensor false) reads only
            # tensors some shard needs bytes of.
            def job(task: tuple[bool, array], progress: Callable[[int], None] | None) -> None:
                run, positions = task
                digest = reader.reads_every_tensor
                slots_each = [slots.of(p) for p in positions]
                wanted = [
                    (names[p], infos[p], digest or any(slot[1].value is None for slot in tensor_slots))
                    for p, tensor_slots in zip(positions, slots_each)
                ]  # fmt: skip
                pending = _Pending() if run else None
                with reader.job(wanted, run) as sources:
                    for p, (_, info, needed), tensor_slots, (src, src_info, data) in zip(positions, wanted, slots_each, sources):
                        if not needed:  # only planned values to write: nothing to read
                            src, src_info, data = -1, _NOTHING, None
                        if pending is not None:
                            crc = _copy_small(src_info, data, tensor_slots, pending, digests, algorithm, digest)
                        else:
                            crc = _copy_large(plan, src, src_info, data, tensor_slots, digests, digest)
                        if digest:  # b"" otherwise
                            source_digests[4 * p : 4 * p + 4] = crc
                        if progress:
                            progress(info.nbytes)
                    if pending is not None:  # its pieces are views of the reader's bytes: written while they live
                        pending.flush()

            if forked:
                run_forked(tasks, job, workers, on_tensor, meanwhile=headers_and_indexes)
            else:
                headers_and_indexes()
            with ThreadPoolExecutor(max(1, workers)) as pool:
                if not forked:
                    list(pool.map(lambda task: job(task, on_tensor), tasks))
                # On disk before the manifest says the output is complete.
                list(pool.map(os.fsync, fds.values()))
    finally:
        for fd in fds.values():
            os.close(fd)
    del slots
    release_freed_memory()  # the copy's buffers
    source_path, source_files = reader.source(source_digests)
    del source_digests  # before the files' digests are spelled out in hex

    written: dict[str, OutputFile] = {}
    for i in written_files:
        f = plan.files[i]
        packed = packed_digests(digests.pop(i))
        checksums[i].update(packed)
        written[f.name] = msgspec.structs.replace(f, checksum=checksums[i].hexdigest(), digests=packed.hex())
        canonical = staging / rank_dir(min(chosen & set(f.ranks))) / f.name
        for r in sorted(chosen & set(f.ranks)):
            if (staging / rank_dir(r) / f.name) != canonical:
                link_or_copy(canonical, staging / rank_dir(r) / f.name)

    extra = []
    for name in ckpt.extra_files():
        canonical = staging / rank_dir(selected[0]) / name
        shutil.copyfile(ckpt.path / name, canonical)
        extra.append(SourceFile(name=name, size=canonical.stat().st_size, checksum=sha256_file(canonical)))
        for r in selected[1:]:
            link_or_copy(canonical, staging / rank_dir(r) / name)

    manifest = Manifest.of(
        plan,
        tool_version=__version__,
        source=Source(path=source_path, files=source_files, extra_files=tuple(extra)),
        written_ranks=tuple(selected),
        files=tuple(written.get(f.name, f) for f in plan.files),
    )
    write_manifest(staging, manifest)
    return manifest


def _write_header(plan: Plan, i: int, fd: int):
    """Write file `i`'s header into `fd`; return its file_hash. The header is built here a piece at
    a time, each dropped once written and hashed (Plan.header_pieces refuses one whose length is not
    the size the file was laid out with)."""
    f = plan.files[i]
    h, at = file_hash(b""), 0
    for piece in plan.header_pieces(f.name):
        pwrite_all(fd, memoryview(piece), at)
        h.update(piece)
        at += len(piece)
    return h


def _copy_small(
    info: TensorInfo, data, slots: list[_Slot], pending: _Pending, digests: dict[int, array | list], algorithm: str, digest: bool
) -> bytes:  # fmt: skip
    """Cut every shard of one small tensor from its bytes in memory (`data`, None when only planned
    values are wanted), hash it and queue it in `pending`. Returns the tensor's crc32 (b"" without
    `digest`: a reshard records the old output's source checksums). Straight-line code: DeepSeek-V3
    at tp 8 has about 460k shards, nearly all of them small."""
    for (_, _, fd, offset, i, position), piece in zip(slots, slot_pieces(data, info.shape, slots)):
        digests[i][position] = digest_of(algorithm, piece)
        if len(piece):
            pending.add(fd, offset, piece)
    if not digest:
        return b""
    # Combining costs about a microsecond a shard, crc32 about as much a KB.
    tiles = _tiles(info, slots, algorithm) if info.nbytes >= len(slots) * COMBINE_BYTES else None
    return _combined_crc(info, tiles, digests) if tiles else tensor_digest("crc32", data)


def _copy_large(plan: Plan, src_fd: int, info: TensorInfo, data, slots: list[_Slot], digests: dict[int, array | list], digest: bool) -> bytes:
    """Read one large source tensor once, in chunks (or take its bytes, `data`), and write every
    shard's pieces of it as they come. Returns its crc32, as _copy_small."""
    algorithm = plan.options.checksum
    targets = []
    for t, c, fd, offset, i, position in slots:
        if c.value is not None:  # content given by the plan (e.g. a rank's weight_shape)
            value = value_bytes(t.dtype, c.value)
            pwrite_all(fd, memoryview(value), offset)
            digests[i][position] = digest_of(algorithm, value)
        else:
            targets.append((_Target(plan.view(t, c), fd, offset, algorithm), i, position))
    tiles = _tiles(info, slots, algorithm) if digest else None
    source_hash = Crc32() if digest and not tiles else None
    for k, at, piece in cut_pieces(src_fd, info, [target.spec for target, _, _ in targets], source_hash, data):
        targets[k][0].write(piece, at)
    for target, i, position in targets:
        digests[i][position] = hash_digest(target.hash)
        nbytes = nbytes_of(target.spec.dtype, target.spec.shape)
        if nbytes >= SMALL_BYTES:  # a call per small shard costs more than it saves
            start_writeback(target.fd, target.offset, nbytes)
    if not digest:
        return b""
    return _combined_crc(info, tiles, digests) if tiles else source_hash.digest()


COMBINE_BYTES = 1 << 10  # per shard: below this a second crc32 pass costs less than combining


def _tiles(info: TensorInfo, slots: list[_Slot], algorithm: str) -> list[_Slot] | None:
    """Shards whose crc32s give the source's without a pass of its own: a whole copy, or unpadded
    dim-0 runs covering the whole tensor back to back (in source order); None otherwise."""
    if algorithm != "crc32":
        return None
    for slot in slots:
        if slot[0].dim is None and slot[1].value is None:
            return [slot]
    tiles = sorted(slots, key=lambda slot: slot[1].start)
    end = 0
    for t, c, *_ in tiles:
        if t.dim not in (0, None) or c.pad or c.start != end or c.value is not None or t.segments or c.lead_length:
            return None
        end += c.length
    return tiles if tiles and end == (info.shape or (1,))[0] else None


def _combined_crc(info: TensorInfo, tiles: list[_Slot], digests: dict[int, array | list]) -> bytes:
    if len(tiles) == 1:  # the whole tensor
        _, _, _, _, i, position = tiles[0]
        return digests[i][position].to_bytes(4, "big")
    row = info.nbytes // (info.shape or (1,))[0]
    crc = 0
    for _, c, _, _, i, position in tiles:
        crc = crc32_combine(crc, digests[i][position], c.length * row)
    return crc.to_bytes(4, "big")


_sync_file_range = libc("sync_file_range", "c_int", "c_int64", "c_int64", "c_uint")


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing these bytes to disk now (Linux sync_file_range, no wait):
    the fsync before the manifest then finds most of the data written, instead of all of it
    waiting at the end (about 6 % of a split here)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE


def link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links: a copy holds the same bytes
        shutil.copyfile(src, dst)


def _source_files(ckpt: Checkpoint, digests: bytearray) -> tuple[SourceFile, ...]:
    """The checkpoint's files as the manifest records them; `digests`: each tensor's crc32, by position."""
    files = []
    names, infos = list(ckpt.tensors), list(ckpt.tensors.values())
    by_file: dict[str, array] = {name: array("I") for name in ckpt.weight_files}
    for p, info in enumerate(infos):  # one pass: DeepSeek-V3 has 163 files and 91k tensors
        by_file[info.file].append(p)
    for name in ckpt.weight_files:
        path = ckpt.path / name
        order = sorted(by_file.pop(name), key=lambda p: (infos[p].begin, names[p]))  # data order, empty tensors by name
        crcs = [digests[4 * p : 4 * p + 4] for p in order]
        files.append(SourceFile(name=name, size=path.stat().st_size, checksum=file_digest(read_header_bytes(path), crcs)))
    if ckpt.index_file:
        path = ckpt.path / ckpt.index_file
        files.append(SourceFile(name=ckpt.index_file, size=path.stat().st_size, checksum=sha256_file(path)))
    return tuple(files)
