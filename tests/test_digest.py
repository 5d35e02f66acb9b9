"""tpshard.digest's crc32: libdeflate's where the system has it, zlib's otherwise — the same values."""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest

import tpshard.digest as digest


def _sizes(rng: random.Random) -> list[int]:
    edge = [0, 1, 1 << 20]
    for threshold in (digest.FAST_CRC_BYTES, digest.FAST_CRC_READONLY_BYTES):
        edge += [threshold - 1, threshold, threshold + 1]
    return edge + [rng.randrange(1, 3 << 20) for _ in range(8)]


@pytest.mark.skipif(digest._libdeflate_crc32() is None, reason="no libdeflate on this system: zlib computes every crc32")
def test_libdeflate_crc32_equals_zlib_on_every_buffer_kind_and_running_value():
    rng = random.Random(1)
    for n in _sizes(rng):
        data, start = rng.randbytes(n), rng.getrandbits(32)
        for buffer in (data, bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
            assert digest.crc32(buffer) == zlib.crc32(data), n
            assert digest.crc32(buffer, start) == zlib.crc32(data, start), n
    floats = np.arange(50_000, dtype=np.float32).reshape(100, 500)  # a tensor's bytes as the writer passes them
    assert digest.crc32(floats) == zlib.crc32(floats.tobytes())


def test_without_libdeflate_zlib_computes_the_same(monkeypatch):
    monkeypatch.setattr(digest, "_libdeflate_crc32", lambda: None)
    rng = random.Random(2)
    for n in _sizes(rng)[:6]:
        data = rng.randbytes(n)
        assert digest.crc32(data, 7) == zlib.crc32(data, 7)
        h = digest.new_hash("crc32")
        h.update(data[: n // 2])
        h.update(data[n // 2 :])
        assert h.digest() == zlib.crc32(data).to_bytes(4, "big") == digest.tensor_digest("crc32", data)
