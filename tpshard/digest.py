"""Checksums. A weight file's checksum is sha256 over its header bytes followed by the sha256
digests of its tensors in data order: it can be computed while tensors are written in any order,
and it pinpoints the tensor that differs when recomputed. Other files use plain sha256."""

from __future__ import annotations

import hashlib
from pathlib import Path


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
