"""The safetensors file format, read and written without loading tensors.

A file is: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data, offsets relative to the end of the header. Reading headers ourselves gives every tensor's
absolute byte range, so the writer can copy just the bytes a rank needs and can lay out an output
file's header before any data exists.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import msgspec

# Bytes per element of each safetensors dtype tpshard moves. Sub-byte types are stored packed in
# U8/I32 containers by the quantized formats, so they never appear here.
DTYPE_SIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip

ALIGN = 8  # safetensors pads the header with spaces so data starts 8-byte aligned


class TensorInfo(msgspec.Struct, frozen=True):
    file: str  # file name inside the checkpoint folder
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset of the data in the file
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class HeaderError(ValueError):
    pass


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor name -> TensorInfo (absolute offsets) and the metadata of one safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise HeaderError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        size = path.stat().st_size
        if n > size - 8 or n > 100 << 20:
            raise HeaderError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise HeaderError(f"{path}: header is not JSON ({e})") from None
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        dtype, shape = entry["dtype"], tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        if dtype not in DTYPE_SIZE:
            raise HeaderError(f"{path}: tensor {name} has unsupported dtype {dtype}")
        expected = nbytes_of(dtype, shape)
        if end - begin != expected or 8 + n + end > size:
            raise HeaderError(
                f"{path}: tensor {name} {dtype}{list(shape)} needs {expected} bytes at"
                f" [{begin}, {end}) but the file is {size} bytes (truncated or corrupt)"
            )
        tensors[name] = TensorInfo(path.name, dtype, shape, 8 + n + begin, 8 + n + end)
    return tensors, metadata


def build_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors laid out in the given order.

    Returns the header and each tensor's absolute data offset in the file.
    """
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = metadata
    offset = 0
    relative = []
    for name, dtype, shape in tensors:
        nbytes = nbytes_of(dtype, shape)
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative.append(offset)
        offset += nbytes
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-(len(body) + 8) % ALIGN)
    head = struct.pack("<Q", len(body)) + body
    return head, [len(head) + r for r in relative]


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_SIZE[dtype]
    for d in shape:
        n *= d
    return n


def read_header_bytes(path: Path) -> bytes:
    """The length prefix and JSON header of a file, exactly as stored."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return struct.pack("<Q", n) + f.read(n)
