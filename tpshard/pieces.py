"""The byte-level execution of ShardSpecs: one source tensor in, every spec's bytes out.

`cut_pieces` reads a source tensor once, front to back in chunks, and yields for each spec the
pieces of its per-rank tensor, in order, padding included. The writer writes the pieces; `check`
compares them with what the output holds. Neither knows how a tensor is cut.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterator

import numpy as np

from tpshard.cuts import lead_block, lead_rows, runs
from tpshard.manifest import ShardSpec
from tpshard.safetensors_format import TensorInfo, read_exact

CHUNK_BYTES = 4 << 20  # read granularity; bounds memory per worker (4 MiB measured best of 1-32)

_local = threading.local()


def scratch(name: str, n: int) -> np.ndarray:
    """A per-thread buffer of at least n bytes, reused across tensors: fresh allocations of tens
    of MB per tensor would cost a page fault per 4 KiB each time."""
    buf = getattr(_local, name, None)
    if buf is None or len(buf) < n:
        buf = np.empty(n, np.uint8)
        setattr(_local, name, buf)
    return buf[:n]


def cut_geometry(shape: tuple[int, ...], nbytes: int, dim: int) -> tuple[int, int, int]:
    """A tensor seen as [outer, rows, inner bytes] around its cut dim: the product of the dims
    before it, its size, and the bytes per index of it."""
    shape = shape or (1,)
    outer, rows = math.prod(shape[:dim]), shape[dim]
    return outer, rows, nbytes // (outer * rows) if outer * rows else 0


def cut_pieces(
    src_fd: int, info: TensorInfo, specs: list[ShardSpec], source_hash=None, data: np.ndarray | None = None
) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield (spec index, byte offset in that spec's tensor, bytes) until every spec is complete.

    Each spec's pieces come in increasing offset order; `source_hash.update` sees the whole
    source tensor in order. `data`: the tensor's bytes, already read (then src_fd is not used, and
    every piece stays valid after the next one: views of `data` or memory of its own).
    """
    if info.nbytes == 0:
        return
    shape = info.shape or (1,)
    dims = {s.dim for s in specs} - {None}
    if len(dims) > 1:
        raise ValueError(f"{info}: specs cut along several dims {sorted(dims)}")
    dim = dims.pop() if dims else 0
    outer, rows, inner = cut_geometry(shape, info.nbytes, dim)
    row_bytes = rows * inner
    if data is None:
        buf = scratch("read", min(info.nbytes, CHUNK_BYTES))

        def read(offset: int, n: int) -> np.ndarray:
            return read_into(src_fd, buf, info.begin + offset, n)
    else:
        buf = data

        def read(offset: int, n: int) -> np.ndarray:
            return data[offset : offset + n]

    if outer == 1 or row_bytes > len(buf):
        # Each run is a byte range of its outer row (all of the tensor for a dim-0 cut): read in
        # chunks of the buffer whatever an index of the cut dim weighs (an expert whole under EP:
        # 160 MiB for Llama-4 Maverick's gate_up_proj), and the pieces are views of the chunk.
        # per spec: its leading-dim range of outer rows, its bytes per outer row, its runs in bytes
        each = [(*lead_rows(shape, outer, s), shard_row(s) * inner, [(start * inner, length * inner, pad * inner) for start, length, pad in runs(s.segments, rows, s)]) for s in specs]  # fmt: skip
        step = len(buf)
        for o in range(outer):
            for a in range(0, row_bytes, step):
                b = min(row_bytes, a + step)
                chunk = read(o * row_bytes + a, b - a)
                if source_hash is not None:
                    source_hash.update(chunk)
                for i, (first, end, width, byte_runs) in enumerate(each):
                    if first <= o < end:
                        at = (o - first) * width  # where this row's runs start in the shard
                        for start, length, pad in byte_runs:
                            x, y = max(a, start), min(b, start + length)
                            if x < y:
                                yield i, at + x - start, chunk[x - a : y - a]
                            at += length + pad
            for i, (first, end, width, byte_runs) in enumerate(each):  # the row's padding, after its data
                if first <= o < end and specs[i].pad:  # only unsegmented cuts pad: one run
                    (_, length, pad), = byte_runs
                    yield from ((i, at, z) for at, z in _zeros((o - first) * width + length, pad))
        return

    # Cut along an inner dim: gather each piece's slab from whole rows of the outer dims.
    step = max(1, len(buf) // row_bytes)
    for a in range(0, outer, step):
        b = min(outer, a + step)
        chunk = read(a * row_bytes, (b - a) * row_bytes)
        if source_hash is not None:
            source_hash.update(chunk)
        view = chunk.reshape(b - a, rows, inner)  # [outer rows, cut dim, bytes per index]
        for i, s in enumerate(specs):
            lo, hi = lead_rows(shape, outer, s)  # a leading-dim range: only its rows (ShardSpec.lead_start)
            x, y = max(a, lo), min(b, hi)
            if x >= y:
                continue
            # Given `data`, the caller may keep the pieces until the whole run is written: new memory.
            width = shard_row(s)
            n = (y - x) * width * inner
            piece = (scratch("piece", n) if data is None else np.empty(n, np.uint8)).reshape(y - x, width, inner)
            _gather(piece, view[x - a : y - a], runs(s.segments, rows, s))
            yield i, (x - lo) * width * inner, piece.reshape(-1)


def shard_row(spec) -> int:
    """Indices of the cut dim a shard holds per outer row, padding included (every segment's)."""
    return (spec.length + spec.pad) * (sum(spec.segments) or 1)


VALUE_DTYPES = {"I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "U16": "<u2", "U32": "<u4", "U64": "<u8"}


def value_bytes(dtype: str, value: tuple[int, ...]) -> np.ndarray:
    """The bytes of a shard whose content is given (`Cut.value`, e.g. CT weight_shape), not read."""
    return np.asarray(value, dtype=VALUE_DTYPES[dtype]).reshape(-1).view(np.uint8)


def shard_bytes(data: np.ndarray, shape: tuple[int, ...], dim: int | None, cut, segments: tuple[int, ...] = ()) -> np.ndarray:
    """One shard's bytes, padding included, from its source tensor's bytes in memory: what
    cut_pieces yields for it, in one array (a view of `data` when the cut is a contiguous run).
    `cut` has start, length and pad (a Cut or a ShardSpec) and its leading-dim range; `segments`:
    its tensor's (ShardSpec.segments)."""
    if dim is None or not len(data):
        return data
    shape, first, n = lead_block(shape, len(data), cut)
    data = data[first : first + n]
    outer, rows, inner = cut_geometry(shape, len(data), dim)
    pieces = runs(segments, rows, cut)
    if outer == 1 and len(pieces) == 1:  # one run (of a segment's units, for a one-segment cut)
        start, length, pad = pieces[0]
        piece = data[start * inner : (start + length) * inner]
        return np.concatenate((piece, np.zeros(pad * inner, np.uint8))) if pad else piece
    piece = np.empty((outer, sum(n + p for _, n, p in pieces), inner), np.uint8)
    _gather(piece, data.reshape(outer, rows, inner), pieces)
    return piece.reshape(-1)


def shards_bytes(data: np.ndarray, shape: tuple[int, ...], dim: int | None, cuts: list, segments: tuple[int, ...] = ()) -> list[np.ndarray]:
    """shard_bytes of each of several cuts of one tensor, in order. Where the cuts are equal,
    unpadded, whole pieces of an inner dim (a row-parallel cut), every piece of the tensor is
    gathered in one copy, a transpose, instead of one gather per cut: at tp 8, a tenth of the
    time for the small tensors of a model of many layers."""
    n = cuts[0].length if cuts else 0
    if dim and n and not segments and len(cuts) > 1 and all(c.length == n and not c.pad and not c.lead_length and c.start % n == 0 for c in cuts):
        outer, rows, inner = cut_geometry(shape, len(data), dim)
        if rows % n == 0:
            parts, wide = rows // n, np.dtype((np.void, n * inner))
            every = np.empty(len(data), np.uint8)  # [parts, outer, n * inner]
            every.view(wide).reshape(parts, outer)[:] = data.view(wide).reshape(outer, parts).T
            size = outer * n * inner
            return [every[c.start // n * size : (c.start // n + 1) * size] for c in cuts]
    return [shard_bytes(data, shape, dim, c, segments) for c in cuts]


def slot_pieces(data: np.ndarray | None, shape: tuple[int, ...], slots: list) -> list[np.ndarray]:
    """Each slot's bytes, in order, for slots (TensorPlan, Cut, ...) of one source tensor: its cut's
    (the cuts of one TensorPlan through shards_bytes) or, for a cut with a value, the value's. `data`
    may be None when every cut has a value."""
    first = slots[0][0] if slots else None
    if first is not None and all(slot[0] is first and slot[1].value is None for slot in slots):
        return shards_bytes(data, shape, first.dim, [slot[1] for slot in slots], first.segments)
    return [shard_bytes(data, shape, t.dim, c, t.segments) if c.value is None else value_bytes(t.dtype, c.value) for t, c, *_ in slots]


def _gather(piece: np.ndarray, view: np.ndarray, pieces: list[tuple[int, int, int]]) -> None:
    """Fill `piece` [outer, shard dim, bytes] from `view` [outer, source dim, bytes] run after run
    (tpshard.cuts.runs), each run's padding zeroed.

    Both are seen as rows of wide elements, the largest byte count that every run's start, length
    and padding and both rows are whole multiples of (for an even cut: a run's bytes), so numpy
    copies one element per run and row instead of a byte at a time: 3-4 x faster for the short runs
    of row-parallel cuts of small tensors, about 1.25 x for long ones (docs/performance.md)."""
    outer, rows, inner = view.shape
    width = piece.shape[1]
    unit = math.gcd(rows * inner, width * inner, *(n * inner for run in pieces for n in run))
    wide = np.dtype((np.void, unit))
    src = view.reshape(outer, rows * inner).view(wide)  # whole rows: view is row-contiguous
    dst = piece.reshape(outer, width * inner).view(wide)
    at = 0
    for start, length, pad in pieces:
        a, n, z = at * inner // unit, length * inner // unit, pad * inner // unit
        dst[:, a : a + n] = src[:, start * inner // unit : start * inner // unit + n]
        if z:
            piece[:, at + length : at + length + pad] = 0
        at += length + pad


def read_into(fd: int, buf: np.ndarray, offset: int, n: int) -> np.ndarray:
    """pread exactly n bytes at offset into buf; returns buf[:n]."""
    read_exact(fd, memoryview(buf)[:n], offset)
    return buf[:n]


def _zeros(at: int, n: int) -> Iterator[tuple[int, np.ndarray]]:
    zeros = np.zeros(min(n, CHUNK_BYTES), np.uint8)
    while n > 0:
        k = min(n, len(zeros))
        yield at, zeros[:k]
        at, n = at + k, n - k


class OpenFiles:
    """Read-only descriptors of an output's (or a source's) files, opened on first use, one per
    path, shared by the pool's threads; `close` closes them all. What a check reads many times."""

    def __init__(self) -> None:
        self._fds: dict = {}
        self._lock = threading.Lock()

    def fd(self, path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:  # checked again: another thread may have opened it meanwhile
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds = {}
