"""Checksums.

A weight file's checksum is sha256 over its header bytes followed by the digests of its tensors in
data order: the writer computes tensor digests while tensors arrive in any order from its threads,
and the per-tensor digests pinpoint the tensor that differs. Tensor digests are crc32 by default
(`crc32` below: 13 GB/s through libdeflate where the system has it, 3.5 GB/s through zlib, against
1.8 GB/s for sha256, which would be the largest cost of a split) or sha256
(`split --checksum sha256`) where a cryptographic digest is wanted. Source weight files get the
same shape with crc32: it identifies the checkpoint that was split. Other files use plain sha256.

range_digests and hash_range hash byte ranges of a file already written (check, an export's check,
reshard's read of an old output); the writer hashes what it writes as it writes it.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import sys
import zlib
from array import array
from collections.abc import Iterator
from pathlib import Path

from tpshard.safetensors_format import read_exact


ALGORITHMS = ("crc32", "sha256")
DIGEST_SIZE = {"crc32": 4, "sha256": 32}
assert array("I").itemsize == 4  # digest_slots' crc32s


@functools.cache
def _libdeflate_crc32():
    """libdeflate's crc32 (PCLMUL / AVX-512 folding, about 4 x zlib 1.2's table-driven one on this
    project's VMs), or None where the system has no libdeflate (Debian's and Ubuntu's libdeflate0;
    docs/performance.md). Same polynomial, same values: a manifest does not say which computed it.
    Loaded on the first large buffer: a plan or a rank's reader never pays for it."""
    try:
        lib = ctypes.CDLL("libdeflate.so.0")
    except OSError:  # another soname or system: ask the linker cache (a subprocess, ~8 ms)
        from ctypes.util import find_library

        name = find_library("deflate")
        try:
            lib = ctypes.CDLL(name) if name else None
        except OSError:
            lib = None
    fn = getattr(lib, "libdeflate_crc32", None)
    if fn is not None:
        fn.restype, fn.argtypes = ctypes.c_uint32, [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
    return fn


# Below these a call through ctypes costs more than it saves: ~1 us with the address of a writable
# buffer (what the writer and check hash: their own buffers), ~4 us through numpy for a read-only one.
FAST_CRC_BYTES, FAST_CRC_READONLY_BYTES = 8 << 10, 32 << 10


def crc32(data, value: int = 0) -> int:
    """zlib.crc32(data, value), computed by libdeflate for large buffers where it is installed."""
    view = data if isinstance(data, memoryview) else memoryview(data)
    n = view.nbytes
    fast = _libdeflate_crc32() if n >= FAST_CRC_BYTES else None
    if fast is None:
        return zlib.crc32(view, value)
    if not view.readonly:
        return fast(value, ctypes.addressof(ctypes.c_char.from_buffer(view)), n)
    if n < FAST_CRC_READONLY_BYTES:
        return zlib.crc32(view, value)
    import numpy as np  # only for buffers this large: a plan or a rank's reader need not import it

    return fast(value, np.frombuffer(view, np.uint8).ctypes.data, n)  # mmap, bytes: no ctypes view of them


def new_hash(algorithm: str):
    """A hashlib-style object for a tensor digest."""
    return Crc32() if algorithm == "crc32" else hashlib.new(algorithm)


def tensor_digest(algorithm: str, data) -> bytes:
    """The digest of one tensor's bytes, in one call (no hash object: ~460k of them at DeepSeek-V3 scale)."""
    return crc32(data).to_bytes(4, "big") if algorithm == "crc32" else hashlib.new(algorithm, data).digest()


def digest_slots(algorithm: str, n: int) -> array | list:
    """Room for n tensor digests, in order, each set to a digest_of (or hash_digest): crc32s as
    4-byte ints in an array (a bytes object each and its list slot take 45 bytes: 20 MB for
    DeepSeek-V3's 460k shards at tp 8), sha256s as bytes in a list."""
    return array("I", bytes(4 * n)) if algorithm == "crc32" else [b""] * n


def digest_of(algorithm: str, data) -> int | bytes:
    """tensor_digest as digest_slots holds it: a crc32 as an int."""
    return crc32(data) if algorithm == "crc32" else hashlib.new(algorithm, data).digest()


def hash_digest(h) -> int | bytes:
    """The digest of a new_hash object, as digest_slots holds it."""
    return h.value if isinstance(h, Crc32) else h.digest()


def packed_digests(slots: array | list) -> bytes:
    """The digests in `slots` (digest_slots) back to back, each as tensor_digest gives it."""
    if isinstance(slots, list):
        return b"".join(slots)
    if hasattr(slots, "packed"):  # tpshard.processes.SharedDigests
        return slots.packed()
    if isinstance(slots, memoryview):  # shared memory seen as 4-byte ints (tpshard.processes)
        big_endian = array("I")
        big_endian.frombytes(slots.cast("B"))
    else:
        big_endian = array("I", slots)
    if sys.byteorder == "little":
        big_endian.byteswap()
    return big_endian.tobytes()


class Crc32:
    """crc32 with hashlib's update/digest interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


def file_hash(header: bytes):
    """A file checksum under way: update() it with the tensor digests in data order, then hexdigest()."""
    return hashlib.sha256(header)


def file_digest(header: bytes, tensor_digests: list[bytes]) -> str:
    h = file_hash(header)
    for d in tensor_digests:
        h.update(d)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


# Tensors smaller than this are read together, up to this much at a time; larger ones are read
# this much at a time. 8 MiB held ~3 MiB more at 90k tensors, no faster.
RUN_BYTES = 1 << 20


def range_digests(fd: int, offsets: list[int], sizes: list[int], algorithm: str) -> Iterator[bytes]:
    """The digest of each byte range (offsets[i], sizes[i]) of a file, in order; adjacent small
    ranges (a file's tensors lie back to back) come from one read: DeepSeek-V3 at tp 8 has about
    460k shards, most of them a few KB. Every read goes into one buffer (a fresh one costs a page
    fault per 4 KiB, 3 s per GiB on this project's VMs: 50 ms for each large tensor)."""
    i, n = 0, len(offsets)
    buf = memoryview(bytearray(min(RUN_BYTES, sum(sizes))))
    while i < n:
        if sizes[i] >= RUN_BYTES:
            yield hash_range(fd, offsets[i], sizes[i], algorithm, buf)
            i += 1
            continue
        j, end = i, offsets[i]
        while j < n and offsets[j] == end and sizes[j] < RUN_BYTES and end + sizes[j] - offsets[i] <= RUN_BYTES:
            end += sizes[j]
            j += 1
        data = read_exact(fd, buf[: end - offsets[i]], offsets[i])
        for k in range(i, j):
            a = offsets[k] - offsets[i]
            yield tensor_digest(algorithm, data[a : a + sizes[k]])
        i = j


def hash_range(fd: int, offset: int, n: int, algorithm: str = "sha256", buf: memoryview | None = None) -> bytes:
    """The digest of n bytes at `offset`, read through `buf` (or a buffer of its own)."""
    h = new_hash(algorithm)
    buf = buf if buf is not None else memoryview(bytearray(min(n, 16 << 20)))
    while n > 0:
        k = min(n, len(buf))
        h.update(read_exact(fd, buf[:k], offset))
        offset, n = offset + k, n - k
    return h.digest()


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """crc32(A + B) from crc32(A), crc32(B) and len(B), as zlib's crc32_combine.

    Appending len2 bytes maps crc(A) through a fixed linear operator over GF(2); it is built once
    per length (tensor pieces come in a few sizes) as four byte-indexed tables, so a combine is four
    lookups: about a microsecond, less than crc32 over 1 KB.
    """
    t0, t1, t2, t3 = _shift_tables(len2)
    return t0[crc1 & 255] ^ t1[(crc1 >> 8) & 255] ^ t2[(crc1 >> 16) & 255] ^ t3[crc1 >> 24] ^ crc2


@functools.lru_cache(maxsize=256)
def _shift_tables(nbytes: int) -> tuple[list[int], ...]:
    """The shift operator applied to each byte value of each of the four bytes of a crc."""
    op = _shift_operator(nbytes)
    tables = []
    for k in range(4):
        table = [0] * 256
        for b in range(1, 256):
            low = b & -b  # table[b] = table[b without its lowest bit] ^ that bit's column
            table[b] = table[b ^ low] ^ op[8 * k + low.bit_length() - 1]
        tables.append(table)
    return tuple(tables)


def _gf2_times(matrix: tuple[int, ...], vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _gf2_compose(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """The operator a(b(x))."""
    return tuple(_gf2_times(a, column) for column in b)


@functools.lru_cache(maxsize=64)
def _shift_operator(nbytes: int) -> tuple[int, ...]:
    # One zero bit: the CRC-32 polynomial (reflected) in column 0, a shift elsewhere.
    op = (0xEDB88320,) + tuple(1 << (n - 1) for n in range(1, 32))
    for _ in range(3):  # one zero byte = eight zero bits
        op = _gf2_compose(op, op)
    result = tuple(1 << n for n in range(32))  # identity
    while nbytes:
        if nbytes & 1:
            result = _gf2_compose(op, result)
        op = _gf2_compose(op, op)
        nbytes >>= 1
    return result
