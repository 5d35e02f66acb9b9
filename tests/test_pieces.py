"""The byte-level cut (tpshard.pieces) against an independent reference: numpy's `take` with the
index list a cut stands for, on random shapes, dtypes, dims, segments, padding and leading-dim
ranges. check's reassembly reads through the same module, so split + check cannot catch a fault
here that both share; this test can."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import numpy as np
import pytest

import tpshard.pieces as pieces
from tpshard.safetensors_format import TensorInfo


def reference(data: np.ndarray, shape: tuple, itemsize: int, cut) -> bytes:
    """The shard's bytes from first principles: the indices it holds along `dim`, then zeros."""
    x = data.reshape(*shape, itemsize)
    if cut.lead_length:
        x = x[cut.lead_start : cut.lead_start + cut.lead_length]
    if cut.dim is None:
        return x.tobytes()
    size = x.shape[cut.dim]
    index, pad = [], 0
    if cut.segments:
        unit, off = size // sum(cut.segments), 0
        parts = []
        for m in cut.segments:
            parts.append((list(range(off + m * cut.start, off + m * (cut.start + cut.length))), m * cut.pad))
            off += m * unit
    else:
        parts = [(list(range(cut.start, cut.start + cut.length)), cut.pad)]
    blocks = []
    for index, pad in parts:
        blocks.append(np.take(x, index, axis=cut.dim))
        zshape = list(x.shape)
        zshape[cut.dim] = pad
        blocks.append(np.zeros(zshape, np.uint8))
    return np.concatenate(blocks, axis=cut.dim).tobytes()


def random_cut(rng: random.Random) -> tuple[tuple, int, SimpleNamespace]:
    ndim = rng.randint(1, 4)
    shape = [rng.randint(1, 9) for _ in range(ndim)]
    itemsize = rng.choice((1, 2, 4))
    dim = rng.choice([None, *range(ndim)])
    segments: tuple = ()
    lead_start = lead_length = 0
    if dim is not None and rng.random() < 0.3:
        segments = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
        shape[dim] = sum(segments) * rng.randint(1, 4)
    if dim and rng.random() < 0.4:  # a leading-dim range (fused experts under EP)
        lead_start = rng.randint(0, shape[0] - 1)
        lead_length = rng.randint(1, shape[0] - lead_start)
    start = length = pad = 0
    if dim is not None:
        units = shape[dim] // sum(segments) if segments else shape[dim]
        start = rng.randint(0, units - 1)
        length = rng.randint(0, units - start)
        pad = 0 if segments else rng.randint(0, 3)  # segmented cuts are unpadded (manifest validation)
    cut = SimpleNamespace(dim=dim, start=start, length=length, pad=pad, segments=segments, lead_start=lead_start, lead_length=lead_length)
    return tuple(shape), itemsize, cut


@pytest.mark.parametrize("seed", range(3))
def test_shard_bytes_and_cut_pieces_match_the_reference(seed, tmp_path, monkeypatch):
    rng = random.Random(seed)
    monkeypatch.setattr(pieces, "CHUNK_BYTES", 64)  # many chunks: every chunk boundary is crossed
    path = tmp_path / "src"
    for _ in range(200):
        shape, itemsize, cut = random_cut(rng)
        nbytes = int(np.prod(shape)) * itemsize
        data = np.frombuffer(rng.randbytes(nbytes), np.uint8)
        want = reference(data, shape, itemsize, cut)
        assert pieces.shard_bytes(data, shape, cut.dim, cut, cut.segments).tobytes() == want, (shape, itemsize, vars(cut))
        if cut.dim is None:
            continue
        path.write_bytes(b"\0" * 8 + data.tobytes())  # the tensor at an offset, as in a safetensors file
        info = TensorInfo(file="src", dtype="U8", shape=(*shape, itemsize), begin=8, end=8 + nbytes)
        spec = SimpleNamespace(**vars(cut))
        fd = os.open(path, os.O_RDONLY)
        try:
            got = bytearray(len(want))
            for from_fd in (True, False):
                got[:] = b"\xff" * len(want)
                for k, at, piece in pieces.cut_pieces(fd, info, [spec], None, None if from_fd else data):
                    assert k == 0
                    got[at : at + len(piece)] = piece.tobytes()
                assert bytes(got) == want, (shape, itemsize, vars(cut), from_fd)
        finally:
            os.close(fd)


@pytest.mark.parametrize("parts", [2, 3, 8])
def test_every_piece_of_a_row_parallel_cut_at_once_is_each_piece(parts, monkeypatch):
    """shards_bytes' one-copy path (equal, unpadded pieces of an inner dim) against the reference,
    for every piece and for a subset of them (a split of some ranks)."""
    rng = random.Random(parts)
    for _ in range(30):
        shape = [rng.randint(1, 5) for _ in range(rng.randint(2, 4))]
        dim = rng.randint(1, len(shape) - 1)
        shape[dim] = parts * rng.randint(1, 4)
        itemsize = rng.choice((1, 2, 4))
        data = np.frombuffer(bytearray(rng.randbytes(int(np.prod(shape)) * itemsize)), np.uint8)
        n = shape[dim] // parts
        cuts = [SimpleNamespace(dim=dim, start=k * n, length=n, pad=0, segments=(), lead_start=0, lead_length=0) for k in range(parts)]
        some = rng.sample(cuts, rng.randint(1, parts))
        for chosen in (cuts, some):
            want = [reference(data, tuple(shape), itemsize, c) for c in chosen]
            with monkeypatch.context() as m:
                if len(chosen) > 1:  # the one-copy path, not the cut-by-cut one
                    m.setattr(pieces, "shard_bytes", None)
                got = pieces.shards_bytes(data, tuple(shape), dim, chosen)
            assert [g.tobytes() for g in got] == want


def test_a_cut_one_index_off_is_not_the_reference():
    """The reference tells cuts apart: the same cut moved by one index gives other bytes."""
    data = np.arange(2 * 8 * 2, dtype=np.uint8)
    shape = (2, 8)
    cut = SimpleNamespace(dim=1, start=2, length=2, pad=0, segments=(), lead_start=0, lead_length=0)
    moved = SimpleNamespace(**{**vars(cut), "start": 3})
    assert pieces.shard_bytes(data, shape, 1, cut).tobytes() == reference(data, shape, 2, cut)
    assert pieces.shard_bytes(data, shape, 1, moved).tobytes() != reference(data, shape, 2, cut)
