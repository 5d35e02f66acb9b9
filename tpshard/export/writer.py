"""export: turn a tpshard output into the per-rank files of an engine's `sharded_state` format.

No re-slicing: every engine tensor is the rank's shards, already cut by `split`, concatenated
along dim 0 (or a constant buffer). Each shard is copied once, inside the kernel, from the tpshard
output to its offset in the engine file, whose header is laid out before any data exists; the
export's digests follow from the tpshard manifest's (crc32 combines), so no byte passes through
Python and memory does not grow with the model.

Staged like `split` (tpshard.publish): a hidden sibling folder, data fsynced, the export manifest
written last, then put in place of `dest` in one step.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from tpshard import __version__
from tpshard.digest import crc32_combine, file_digest, new_hash, sha256_file
from tpshard.errors import OutputError
from tpshard.export.layout import DEFAULT_MAX_PART_BYTES, EngineTensor, PartFile, config_tied, export_layout, partition_env
from tpshard.export.manifest import (
    EXPORT_MANIFEST_NAME,
    ExportFile,
    ExportManifest,
    ExportTensor,
    From,
    encode_export_manifest,
)
from tpshard.manifest import MANIFEST_NAME, Manifest, rank_dir, read_manifest
from tpshard.pieces import read_into, scratch
from tpshard.plan import file_header
from tpshard.publish import staged_output
from tpshard.safetensors_format import nbytes_of
from tpshard.writer import WRITE_BYTES, default_workers, start_writeback, write_durably

CHUNK = 4 << 20


def export(
    out_dir: str | Path,
    dest: str | Path,
    engine: str,
    *,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    workers: int | None = None,
    force: bool = False,
) -> ExportManifest:
    """Write the `engine` ("vllm" or "sglang") sharded_state files of the tpshard output at
    `out_dir` into `dest`, with the source's config and tokenizer files and an export manifest."""
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
    layout = export_layout(plan, engine, config_tied(config), max_part_bytes, config)

    with staged_output(dest, force=force, inputs=[out]) as staging:
        result = _write(out, manifest, layout, engine, max_part_bytes, staging, workers or default_workers())
    return result


def constant_bytes(dtype: str, value: float) -> bytes:
    return struct.pack({"F32": "<f", "F64": "<d"}[dtype], value)


class _Source:
    """Where each shard's bytes sit in the tpshard output, and the digest its manifest holds."""

    def __init__(self, out: Path, manifest: Manifest):
        written = set(manifest.written_ranks)
        checksums = {w.name: w.tensor_checksums for w in manifest.files}
        self.at: dict[int, tuple[Path, int, str]] = {}
        for name, specs in manifest.plan.specs_by_file().items():
            _, offsets = manifest.plan.layout(name)
            for spec, offset, digest in zip(specs, offsets, checksums[name]):
                path = out / rank_dir(min(written & set(spec.ranks))) / name
                self.at[id(spec)] = (path, offset, digest)


def _write(out: Path, manifest: Manifest, layout: list[PartFile], engine: str, max_part_bytes: int, staging: Path, workers: int) -> ExportManifest:
    plan = manifest.plan
    algorithm = plan.options.checksum
    source = _Source(out, manifest)
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
        # Largest first, so that no big tensor runs alone at the end.
        order = sorted(range(len(jobs)), key=lambda i: -jobs[i][0].nbytes)
        with ThreadPoolExecutor(max(1, workers)) as pool:
            digests = dict(zip(order, pool.map(lambda i: _copy(jobs[i], source, algorithm), order)))
            list(pool.map(os.fsync, fds.values()))
    finally:
        for fd in fds.values():
            os.close(fd)

    files, i = [], 0
    for f in layout:
        tensors = []
        for t in f.tensors:
            tensors.append(ExportTensor(
                name=t.name, dtype=t.dtype, shape=t.shape, digest=digests[i].hex(),
                parts=tuple((s.name, s.group_rank) for s in t.parts), value=t.value,
            ))  # fmt: skip
            i += 1
        size = (staging / f.name).stat().st_size
        checksum = file_digest(headers[f.name], [bytes.fromhex(t.digest) for t in tensors])
        files.append(ExportFile(name=f.name, rank=f.rank, size=size, checksum=checksum, tensors=tuple(tensors)))

    folder = out / rank_dir(manifest.written_ranks[0])
    for extra in manifest.extra_files:  # byte-identical copies of config.json, tokenizer, ...
        shutil.copyfile(folder / extra.name, staging / extra.name)
        if sha256_file(staging / extra.name) != extra.checksum:
            raise OutputError(f"{folder / extra.name}: differs from its sha256 in the tpshard manifest; run tpshard check {out}")

    result = ExportManifest(
        tool_version=__version__,
        engine=engine,
        from_=From(path=str(out.resolve()), manifest_sha256=sha256_file(out / MANIFEST_NAME), topology=plan.topology, options=plan.options),
        source=manifest.source,
        max_part_bytes=max_part_bytes,
        files=tuple(files),
        env=partition_env(plan.topology) or msgspec.UNSET,
    )
    write_durably(staging / EXPORT_MANIFEST_NAME, encode_export_manifest(result))
    return result


def _copy(job: tuple[EngineTensor, int, int], source: _Source, algorithm: str) -> bytes:
    """Write one engine tensor: its shards back to back. Returns the tensor's digest.

    The digest follows from the digests the tpshard manifest holds for the shards (crc32 combines;
    a one-shard tensor keeps its shard's digest), never from the bytes as read: the shards are
    copied inside the kernel (copy_file_range, as `cp` does), and a shard damaged on disk since the
    split is exported with the digest it should have, so `tpshard check` on the export names it.
    Only a fused tensor under sha256 is read, to hash the concatenation."""
    tensor, fd, offset = job
    if tensor.value is not None:
        data = constant_bytes(tensor.dtype, tensor.value)
        os.pwrite(fd, data, offset)
        h = new_hash(algorithm)
        h.update(data)
        return h.digest()
    hashed = algorithm != "crc32" and len(tensor.parts) > 1
    whole = new_hash(algorithm) if hashed else None
    crc = 0
    at = offset
    for spec in tensor.parts:
        path, src_offset, want = source.at[id(spec)]
        n = nbytes_of(spec.dtype, spec.shape)
        src = os.open(path, os.O_RDONLY)
        try:
            if hashed:
                _read_write(src, src_offset, fd, at, n, whole)
            else:
                _kernel_copy(src, src_offset, fd, at, n)
        finally:
            os.close(src)
        if algorithm == "crc32":
            crc = crc32_combine(crc, int(want, 16), n)
        at += n
    start_writeback(fd, offset, at - offset)
    if whole is not None:
        return whole.digest()
    return crc.to_bytes(4, "big") if algorithm == "crc32" else bytes.fromhex(source.at[id(tensor.parts[0])][2])


def _kernel_copy(src: int, src_offset: int, dst: int, dst_offset: int, n: int) -> None:
    done = 0
    try:
        while done < n:
            k = os.copy_file_range(src, dst, n - done, src_offset + done, dst_offset + done)
            if k == 0:
                raise OutputError("a shard file of the tpshard output ends early (truncated?); run tpshard check on it")
            done += k
    except OSError:  # no copy_file_range here (or across these filesystems): copy through memory
        _read_write(src, src_offset + done, dst, dst_offset + done, n - done, None)


def _read_write(src: int, src_offset: int, dst: int, dst_offset: int, n: int, h) -> None:
    buf = scratch("export", min(max(n, 1), CHUNK))
    done = 0
    while done < n:
        k = min(n - done, len(buf))
        chunk = read_into(src, buf, src_offset + done, k)
        if h is not None:
            h.update(chunk)
        view = memoryview(chunk)
        for a in range(0, k, WRITE_BYTES):  # small writes: docs/performance.md
            piece = view[a : a + WRITE_BYTES]
            w = 0
            while w < len(piece):
                w += os.pwrite(dst, piece[w:], dst_offset + done + a + w)
        done += k
