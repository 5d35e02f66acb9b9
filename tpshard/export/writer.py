"""export: turn a tpshard output into the per-rank files of an engine's `sharded_state` format.

No re-slicing: every engine tensor is the rank's shards, already cut by `split`, concatenated
along dim 0 (or a constant buffer). Each shard is read once from the tpshard output in chunks,
checked against the digest the tpshard manifest holds for it (a damaged output is refused, not
exported), and written with pwrite at its offset in the engine file, whose header is laid out
before any data exists. Memory is a chunk per worker, whatever the model size.

Staged like `split`: a hidden sibling folder, data fsynced, the export manifest written last, then
renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tpshard import __version__
from tpshard.digest import Crc32, crc32_combine, file_digest, new_hash, sha256_file
from tpshard.errors import OutputError
from tpshard.export.layout import DEFAULT_MAX_PART_BYTES, EngineTensor, PartFile, config_tied, export_layout
from tpshard.export.manifest import (
    EXPORT_MANIFEST_NAME,
    ExportFile,
    ExportManifest,
    ExportTensor,
    From,
    Source,
    encode_export_manifest,
)
from tpshard.manifest import MANIFEST_NAME, Manifest, rank_dir, read_manifest
from tpshard.pieces import read_into, scratch
from tpshard.plan import file_header, spec_layout
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
    layout = export_layout(plan, engine, config_tied(config), max_part_bytes)

    dest = Path(dest)
    if dest.exists() and not force:
        raise OutputError(f"{dest} already exists; pass --force to replace it")
    if dest.resolve() == out.resolve():
        raise OutputError(f"{dest}: the export goes into its own folder, not into the tpshard output")
    staging = dest.parent / f".{dest.name}.tpshard-partial"
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        result = _write(out, manifest, layout, engine, max_part_bytes, staging, workers or default_workers())
        if dest.exists():
            trash = dest.parent / f".{dest.name}.tpshard-old"
            shutil.rmtree(trash, ignore_errors=True)
            dest.rename(trash)
            staging.rename(dest)
            shutil.rmtree(trash)
        else:
            staging.rename(dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
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
            _, offsets = spec_layout(specs)
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
        source=Source(path=manifest.source_path, files=manifest.source_files, extra_files=manifest.extra_files),
        max_part_bytes=max_part_bytes,
        files=tuple(files),
    )
    write_durably(staging / EXPORT_MANIFEST_NAME, encode_export_manifest(result))
    return result


def _copy(job: tuple[EngineTensor, int, int], source: _Source, algorithm: str) -> bytes:
    """Write one engine tensor: its shards back to back, each checked against the tpshard
    manifest while it is read. Returns the tensor's digest."""
    tensor, fd, offset = job
    if tensor.value is not None:
        data = constant_bytes(tensor.dtype, tensor.value)
        os.pwrite(fd, data, offset)
        h = new_hash(algorithm)
        h.update(data)
        return h.digest()
    whole = None if algorithm == "crc32" else new_hash(algorithm)
    crc = 0
    at = offset
    for spec in tensor.parts:
        path, src_offset, want = source.at[id(spec)]
        n = nbytes_of(spec.dtype, spec.shape)
        h = new_hash(algorithm)
        src = os.open(path, os.O_RDONLY)
        try:
            buf = scratch("export", min(max(n, 1), CHUNK))
            done = 0
            while done < n:
                k = min(n - done, len(buf))
                chunk = read_into(src, buf, src_offset + done, k)
                h.update(chunk)
                if whole is not None:
                    whole.update(chunk)
                view = memoryview(chunk)
                for a in range(0, k, WRITE_BYTES):  # small writes: docs/performance.md
                    piece = view[a : a + WRITE_BYTES]
                    w = 0
                    while w < len(piece):
                        w += os.pwrite(fd, piece[w:], at + done + a + w)
                done += k
        finally:
            os.close(src)
        if h.digest().hex() != want:
            raise OutputError(f"{path}: {spec.name} does not match its {algorithm} in the tpshard manifest; run tpshard check on the output")
        if isinstance(h, Crc32):  # the tensor's crc32 follows from its parts' (no second pass)
            crc = crc32_combine(crc, h.value, n)
        at += n
    start_writeback(fd, offset, at - offset)
    return whole.digest() if whole is not None else crc.to_bytes(4, "big")
