"""export: turn a tpshard output into the per-rank files of an engine's `sharded_state` format.

No re-slicing: every engine tensor is the rank's shards, already cut by `split`, concatenated
along dim 0 (or a constant buffer). Each shard is copied once from the tpshard output to its offset
in the engine file, whose header is laid out before any data exists: a large one inside the kernel,
small ones gathered into a buffer of at most RUN_BYTES per run of adjacent tensors and written at
once. The export's digests follow from the tpshard manifest's (crc32 combines), so no byte is
hashed, and memory does not grow with the model's bytes. Ranks are laid out and written one at a
time (layout.rank_layouts), so it grows with one rank's tensor count, not the world's.

Staged like `split` (tpshard.publish): a hidden sibling folder, data fsynced, the export manifest
written last, then put in place of `dest` in one step.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from collections.abc import Callable, Iterator

import msgspec
import numpy as np

from tpshard.version import __version__
from tpshard.collector import paused
from tpshard.digest import crc32_combine, file_digest, new_hash, sha256_file, tensor_digest
from tpshard.errors import CheckpointError, OutputError, TpshardError
from tpshard.export.layout import (
    DEFAULT_MAX_PART_BYTES,
    EngineTensor,
    Part,
    PartFile,
    config_tied,
    constant_bytes,
    stage_first_part,
    partition_env,
    rank_layouts,
)
from tpshard.export.manifest import (
    EXPORT_FORMAT,
    EXPORT_MANIFEST_NAME,
    EXPORT_VERSION,
    ConfigEdit,
    ExportFile,
    ExportManifest,
    ExportTensor,
    From,
    encode_export_manifest,
)
from tpshard.export.quant import config_additions, config_bytes
from tpshard.manifest import MANIFEST_NAME, Manifest, Plan, rank_dir, read_manifest
from tpshard.pieces import read_into, scratch
from tpshard.plan import file_header
from tpshard.publish import staged_output, write_durably
from tpshard.workers import default_workers
from tpshard.writer import SMALL_BYTES, adjacent_runs, pwrite_all, start_writeback

CHUNK = 4 << 20
RUN_BYTES, RUN_TENSORS = 8 << 20, 4096  # one run of small tensors (_tasks)


@paused()
def export(
    out_dir: str | Path,
    dest: str | Path,
    engine: str,
    *,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    workers: int | None = None,
    force: bool = False,
    on_bytes: Callable[[int], None] | None = None,
) -> ExportManifest:
    """Write the `engine` ("vllm" or "sglang") sharded_state files of the tpshard output at
    `out_dir` into `dest`, with the source's config and tokenizer files and an export manifest;
    `on_bytes(n)` as each run of n tensor bytes is written (the command's progress)."""
    out = Path(out_dir)
    manifest = read_manifest(out)
    plan = manifest.plan
    missing = sorted(set(range(plan.topology.world_size)) - set(manifest.written_ranks))
    if missing:
        raise OutputError(f"{out}: holds ranks {list(manifest.written_ranks)}; an export needs every rank (missing {missing}); merge the parts first")
    folder = out / rank_dir(manifest.written_ranks[0])
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise OutputError(f"{folder}/config.json: unreadable ({e}); the engines build the model from it") from None
    layouts = rank_layouts(plan, engine, config_tied(config), max_part_bytes, config)  # the engine's refusals first

    with staged_output(dest, force=force, inputs=[out]) as staging:
        result = _write(out, manifest, layouts, engine, max_part_bytes, staging, workers or default_workers(), on_bytes)
    return result


def export_total(out_dir: str | Path) -> int:
    """The bytes `export`'s on_bytes counts (export_bytes), for a progress bar; 0 where export will
    refuse the output."""
    try:
        plan = read_manifest(Path(out_dir)).plan
    except (TpshardError, OSError):
        return 0
    return export_bytes(plan)


def export_bytes(plan: Plan) -> int:
    """The tensor bytes an export of an output of `plan` writes: every rank's files' data (a file
    shared by ranks is written once for each)."""
    return sum(f.size - plan.header_size(f.name) for r in range(plan.topology.world_size) for f in plan.rank_files(r))


class _Source:
    """The tpshard output's files, each opened once (by the first written rank holding it): where
    each shard's bytes sit, and the digest its manifest holds."""

    def __init__(self, out: Path, manifest: Manifest):
        written = set(manifest.written_ranks)
        self.plan, self.lock = manifest.plan, threading.Lock()
        self.paths = [out / rank_dir(min(written & set(f.ranks))) / f.name for f in self.plan.files]
        self.offsets = [self.plan.offsets(f.name) for f in self.plan.files]
        self.fds: dict[int, int] = {}

    def at(self, part: Part) -> tuple[int, int]:
        """(open file, data offset) of a shard."""
        i = part.cut.file
        fd = self.fds.get(i)
        if fd is None:
            with self.lock:
                fd = self.fds.get(i)
                if fd is None:
                    fd = self.fds[i] = os.open(self.paths[i], os.O_RDONLY)
        return fd, self.offsets[i][part.index]

    def digest(self, part: Part) -> bytes:
        """The shard's digest in the tpshard manifest."""
        return self.plan.files[part.cut.file].digest(part.index, self.plan.options.checksum)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def _write(
    out: Path, manifest: Manifest, layouts: Iterator[list[PartFile]], engine: str, max_part_bytes: int, staging: Path,
    workers: int, on_bytes: Callable[[int], None] | None = None,
) -> ExportManifest:  # fmt: skip
    """Write the export rank by rank (rank_layouts): only one rank's engine tensors and copy jobs
    are held, and each file's record keeps its digests as one string and shares its tensor list
    with the same part of the stage's other ranks (the same names, dtypes and shapes)."""
    plan = manifest.plan
    files: list[ExportFile] = []
    shared: dict[str, tuple[ExportTensor, ...]] = {}  # a file of a stage's first rank -> its tensors
    source = _Source(out, manifest)
    try:
        with ThreadPoolExecutor(max(1, workers)) as pool:
            for layout in layouts:
                files += _write_rank(source, layout, staging, pool, shared, on_bytes)
                del layout  # or it would live on (every engine tensor of the rank) while the next is laid out
    finally:
        source.close()

    folder = out / rank_dir(manifest.written_ranks[0])
    for extra in manifest.extra_files:  # byte-identical copies of config.json, tokenizer, ...
        shutil.copyfile(folder / extra.name, staging / extra.name)
        if sha256_file(staging / extra.name) != extra.checksum:
            raise OutputError(f"{folder / extra.name}: differs from its sha256 in the tpshard manifest; run tpshard check {out}")
    edit = _edit_config(staging, plan)

    result = ExportManifest(
        format=EXPORT_FORMAT,
        version=EXPORT_VERSION,
        tool_version=__version__,
        engine=engine,
        from_=From(path=str(out.resolve()), manifest_sha256=sha256_file(out / MANIFEST_NAME), topology=plan.topology, options=plan.options),
        source=manifest.source,
        max_part_bytes=max_part_bytes,
        files=tuple(files),
        env=partition_env(plan.topology) or msgspec.UNSET,
        config=edit,
    )
    write_durably(staging / EXPORT_MANIFEST_NAME, encode_export_manifest(result))
    return result


def _edit_config(staging: Path, plan) -> ConfigEdit | msgspec.UnsetType:
    """config.json with what vLLM needs to load the export quantized (tpshard.export.quant.config_additions),
    or UNSET where the source's copy is loaded as it is."""
    path = staging / "config.json"
    config = json.loads(path.read_bytes())
    added = config_additions(plan, config)
    if not added:
        return msgspec.UNSET
    return ConfigEdit(added=added, **_write_config(path, config, added))


def _write_config(path: Path, config: dict, added: dict) -> dict:
    """Write the source's config with `added` in its quantization_config; its size and sha256."""
    edited = dict(config, quantization_config={**config["quantization_config"], **added})
    path.write_bytes(config_bytes(edited))
    return {"size": path.stat().st_size, "checksum": sha256_file(path)}


def _write_rank(
    source: _Source, layout: list[PartFile], staging: Path, pool: ThreadPoolExecutor, shared: dict, on_bytes=None
) -> list[ExportFile]:  # fmt: skip
    """The files of one rank written (_copy_all), and their manifest records. A record's tensors
    are the tuple of the same part of the stage's first rank (`shared`) where they are equal."""
    topo = source.plan.topology
    digests, headers = _copy_all(source, layout, staging, pool, on_bytes)
    files = []
    for p, (f, found) in enumerate(zip(layout, digests)):
        tensors = tuple(ExportTensor(name=t.name, dtype=t.dtype, shape=t.shape, value=t.value) for t in f.tensors)
        first = stage_first_part(f.rank, p, topo)
        if shared.get(first) == tensors:
            tensors = shared[first]
        else:
            shared.setdefault(first, tensors)
        files.append(ExportFile(
            name=f.name, rank=f.rank, size=(staging / f.name).stat().st_size,
            checksum=file_digest(headers[f.name], found), digests=b"".join(found).hex(), tensors=tensors,
        ))  # fmt: skip
    return files


def _copy_all(
    source: _Source, layout: list[PartFile], staging: Path, pool: ThreadPoolExecutor, on_bytes: Callable[[int], None] | None = None
) -> tuple[list[list[bytes]], dict[str, bytes]]:  # fmt: skip
    """The files of one rank (`layout`) written into `staging` and fsynced: each file's tensor
    digests, in data order, and its header; `on_bytes` hears each task's bytes once written."""
    algorithm = source.plan.options.checksum
    fds: dict[str, int] = {}
    headers: dict[str, bytes] = {}
    jobs: list[tuple[EngineTensor, int, int]] = []  # (tensor, fd, data offset)
    try:
        for f in layout:
            header, offsets = file_header([(t.name, t.dtype, t.shape) for t in f.tensors])
            fd = os.open(staging / f.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            fds[f.name], headers[f.name] = fd, header
            os.pwrite(fd, header, 0)
            os.ftruncate(fd, offsets[-1] + f.tensors[-1].nbytes if f.tensors else len(header))
            jobs += [(t, fd, o) for t, o in zip(f.tensors, offsets)]
        sizes = [t.nbytes for t, _, _ in jobs]
        tasks = _tasks(jobs, sizes)
        digests: list[bytes] = [b""] * len(jobs)
        for task, got in zip(tasks, pool.map(lambda task: _copy_task(task, jobs, sizes, source, algorithm), tasks)):
            for i, digest in zip(task, got):
                digests[i] = digest
            if on_bytes is not None:
                on_bytes(sum(sizes[i] for i in task))
        list(pool.map(os.fsync, fds.values()))
    finally:
        for fd in fds.values():
            os.close(fd)
    by_file, at = [], 0
    for f in layout:
        by_file.append(digests[at : at + len(f.tensors)])
        at += len(f.tensors)
    return by_file, headers


def _tasks(jobs: list[tuple[EngineTensor, int, int]], sizes: list[int]) -> list[list[int]]:
    """The copy's pool tasks, as job indices: each large tensor alone, largest first (one left for
    the end would keep a worker busy while the others idle), then runs of small tensors that lie
    back to back in one file (jobs are in file order), each gathered in memory and written at once:
    most of a model of many tensors is shards of a few hundred bytes, and a system call or a pool
    task per shard costs more than its bytes."""
    large = sorted((i for i, n in enumerate(sizes) if n >= SMALL_BYTES), key=lambda i: -sizes[i])
    small = (i for i, n in enumerate(sizes) if n < SMALL_BYTES)
    follows = lambda a, b: jobs[a][1] == jobs[b][1] and jobs[a][2] + sizes[a] == jobs[b][2]  # noqa: E731
    return [[i] for i in large] + adjacent_runs(small, sizes.__getitem__, follows, RUN_BYTES, RUN_TENSORS)


def _copy_task(task: list[int], jobs: list[tuple[EngineTensor, int, int]], sizes: list[int], source: _Source, algorithm: str) -> list[bytes]:
    """Write the tensors of one task (_tasks); returns their digests."""
    first, fd, begin = jobs[task[0]]
    if sizes[task[0]] >= SMALL_BYTES and first.value is None and not first.transformed:  # a constant or a cast is made in memory
        return [_copy(jobs[task[0]], source, algorithm)]
    end = jobs[task[-1]][2] + sizes[task[-1]]
    buf = scratch("export-run", end - begin)
    digests = [_gather(jobs[i][0], buf[jobs[i][2] - begin : jobs[i][2] - begin + sizes[i]], source, algorithm) for i in task]
    pwrite_all(fd, memoryview(buf), begin)
    start_writeback(fd, begin, len(buf))
    return digests


def _copy(job: tuple[EngineTensor, int, int], source: _Source, algorithm: str) -> bytes:
    """Write one large engine tensor: its shards back to back, copied inside the kernel
    (copy_file_range, as `cp` does). Returns the tensor's digest (_digest); only a fused tensor
    under sha256 is read, to hash the concatenation."""
    tensor, fd, offset = job
    whole = new_hash(algorithm) if algorithm != "crc32" and len(tensor.parts) > 1 else None
    at = offset
    for part in tensor.parts:
        src, src_offset = source.at(part)
        n = part.nbytes
        if whole is not None:
            _read_write(src, src_offset, fd, at, n, whole)
        else:
            _kernel_copy(src, src_offset, fd, at, n)
        at += n
    start_writeback(fd, offset, at - offset)
    return whole.digest() if whole is not None else _digest(tensor, source, algorithm)


def _gather(tensor: EngineTensor, into: np.ndarray, source: _Source, algorithm: str) -> bytes:
    """Put one small engine tensor's bytes into `into`; returns its digest (_digest)."""
    if tensor.value is not None:
        data = constant_bytes(tensor.dtype, tensor.value, tensor.shape)
        into[:] = np.frombuffer(data, np.uint8)
        return tensor_digest(algorithm, data)
    if tensor.transformed:
        return _transform(tensor, into, source, algorithm)
    at = 0
    for part in tensor.parts:
        src, src_offset = source.at(part)
        n = part.nbytes
        _read(src, into[at : at + n], src_offset, n)
        at += n
    if algorithm != "crc32" and len(tensor.parts) > 1:
        return tensor_digest(algorithm, into)
    return _digest(tensor, source, algorithm)


def _transform(tensor: EngineTensor, into: np.ndarray, source: _Source, algorithm: str) -> bytes:
    """A quantized parameter whose bytes are not its shards' back to back (fused along dim 1, or
    cast: tpshard.export.quant.assemble). Each shard is read whole and proven against its digest
    in the tpshard manifest first, so that a shard damaged on disk is refused here instead of
    exported under a digest of its damaged bytes; the result is hashed as written."""
    from tpshard.export.quant import assemble

    pieces = []
    for part in tensor.parts:
        src, src_offset = source.at(part)
        data = _read(src, np.empty(part.nbytes, np.uint8), src_offset, part.nbytes)
        if tensor_digest(algorithm, data) != source.digest(part):
            raise OutputError(f"{part.name}: a shard in the tpshard output differs from its {algorithm} in the manifest; run tpshard check on it")
        pieces.append((data, part.shape))
    into[:] = assemble(pieces, tensor.parts[0].dtype, tensor.dtype, tensor.axis, tensor.shape[0] if tensor.axis == 2 else 1, tensor.rotary)
    return tensor_digest(algorithm, into)


def _digest(tensor: EngineTensor, source: _Source, algorithm: str) -> bytes:
    """An engine tensor's digest from those the tpshard manifest holds for its shards (crc32s
    combine; a one-shard tensor keeps its shard's), never from the bytes as read: a shard damaged on
    disk since the split is exported with the digest it should have, so `tpshard check` on the
    export names it. A fused tensor under sha256 has none: its caller hashes it."""
    if algorithm != "crc32":
        return source.digest(tensor.parts[0])
    crc = 0
    for part in tensor.parts:
        crc = crc32_combine(crc, int.from_bytes(source.digest(part), "big"), part.nbytes)
    return crc.to_bytes(4, "big")


_ENDS_EARLY = "a shard file of the tpshard output ends early (truncated?); run tpshard check on it"


def _read(src: int, buf: np.ndarray, offset: int, n: int) -> np.ndarray:
    try:
        return read_into(src, buf, offset, n)
    except CheckpointError:  # the tpshard output is what is short, not a checkpoint
        raise OutputError(_ENDS_EARLY) from None


def _kernel_copy(src: int, src_offset: int, dst: int, dst_offset: int, n: int) -> None:
    done = 0
    try:
        while done < n:
            k = os.copy_file_range(src, dst, n - done, src_offset + done, dst_offset + done)
            if k == 0:
                raise OutputError(_ENDS_EARLY)
            done += k
    except OSError:  # no copy_file_range here (or across these filesystems): copy through memory
        _read_write(src, src_offset + done, dst, dst_offset + done, n - done, None)


def _read_write(src: int, src_offset: int, dst: int, dst_offset: int, n: int, h) -> None:
    buf = scratch("export", min(max(n, 1), CHUNK))
    done = 0
    while done < n:
        k = min(n - done, len(buf))
        chunk = _read(src, buf, src_offset + done, k)
        if h is not None:
            h.update(chunk)
        pwrite_all(dst, memoryview(chunk), dst_offset + done)
        done += k
