"""Checksums.

An output weight file's checksum is sha256 over its header bytes followed by the sha256 digests of
its tensors in data order: it can be computed while tensors are written in any order, and the
per-tensor digests pinpoint the tensor that differs. A source weight file's checksum has the same
shape with crc32 per tensor: it identifies the checkpoint that was split, and crc32 (several GB/s)
keeps that from costing the split a second full hash of the model. Other files use plain sha256.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path


class Crc32:
    """crc32 with hashlib's update/digest interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "big")


def file_digest(header: bytes, tensor_digests: list[bytes]) -> str:
    h = hashlib.sha256(header)
    for d in tensor_digests:
        h.update(d)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()
