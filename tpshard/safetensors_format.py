"""The safetensors file format, read and written without loading tensors.

A file is: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data, offsets relative to the end of the header. Reading headers ourselves gives every tensor's
absolute byte range, so the writer can copy just the bytes a rank needs and can lay out an output
file's header before any data exists.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from pathlib import Path
from typing import Annotated, Literal

import msgspec

# Bytes per element of each safetensors dtype tpshard moves. Sub-byte types are stored packed in
# U8/I32 containers by the quantized formats, so they never appear here.
DTYPE_SIZE = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip

ALIGN = 8  # safetensors pads the header with spaces so data starts 8-byte aligned


class TensorInfo(msgspec.Struct, frozen=True, gc=False):  # no cycles; ~90k of them in DeepSeek-V3
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


# The safetensors library refuses a longer header (MAX_HEADER_SIZE); so does tpshard.
MAX_HEADER_BYTES = 100_000_000


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen: dict = {}
    for key, value in pairs:
        if key in seen:
            raise HeaderError(f"the name {key!r} appears twice")
        seen[key] = value
    return seen


def _decode_unique(text: str) -> object:
    """json.loads with duplicate names refused; a header object's values come back as msgspec.Raw
    (decoded one by one later, into their types: no generic dict or list per entry is built) when
    msgspec read the text. msgspec is ~5x faster than json but keeps the last of duplicate keys: when
    each entry's one `"dtype"`, `"shape"` and `"data_offsets"` keys are counted more often than the
    entries decoded, or the text is not what msgspec reads, json decides and names the fault. (A
    quote inside a name is escaped, so these texts occur only as keys and in `__metadata__`, where
    a count that disagrees only sends a sound header the slower way.)"""
    try:
        header = _RAW_HEADER.decode(text)
    except msgspec.DecodeError:
        header = None
    if header is not None:
        entries = len(header) - ("__metadata__" in header)
        if all(text.count(key) == entries for key in _ENTRY_KEYS) and text.count('"__metadata__"') <= 1:
            return header
    return json.loads(text, object_pairs_hook=_unique_keys)


_RAW_HEADER = msgspec.json.Decoder(dict[str, msgspec.Raw])
_ENTRY_KEYS = ('"dtype"', '"shape"', '"data_offsets"')


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Tensor name -> TensorInfo (absolute offsets) and the metadata of one safetensors file.

    As strict as the safetensors library: a header length that fits the file and is at most 100 MB,
    a UTF-8 JSON object, unique names, known dtypes, shapes of non-negative integers whose
    size is the byte range, ranges that start at 0 and follow each other without gap or overlap
    up to the exact end of the file. Anything else is a HeaderError naming the file and the fault.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise HeaderError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER_BYTES:
            raise HeaderError(f"{path}: header length {n} is over the {MAX_HEADER_BYTES} bytes safetensors allows")
        if n > size - 8:
            raise HeaderError(f"{path}: header length {n} does not fit the file ({size} bytes)")
        text = f.read(n)
    try:
        header = _decode_unique(text.decode("utf-8"))
    except HeaderError as e:
        raise HeaderError(f"{path}: header: {e}") from None
    except (ValueError, RecursionError) as e:
        raise HeaderError(f"{path}: header is not UTF-8 JSON ({str(e)[:100]})") from None
    if not isinstance(header, dict):
        raise HeaderError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else _plain(metadata)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings")
    data_size = size - 8 - n
    try:  # every entry's types (C speed); the first fault is then named by _tensor_info
        entries = {name: _ENTRY.decode(e) if e.__class__ is msgspec.Raw else msgspec.convert(e, _Entry) for name, e in header.items()}
    except msgspec.ValidationError:
        entries = None
    if entries is None:
        tensors = {name: _tensor_info(path, name, _plain(entry), 8 + n, data_size) for name, entry in header.items()}
        raise AssertionError(f"{path}: header refused by its schema but by no rule")  # _tensor_info raised
    tensors = {}
    one = {}.setdefault  # equal dtypes and shapes decoded apart made one object: 10 MB at 90k tensors
    for name, e in entries.items():
        begin, end = e.data_offsets
        if end < begin or end - begin != DTYPE_SIZE[e.dtype] * math.prod(e.shape) or end > data_size:
            _tensor_info(path, name, _plain(header[name]), 8 + n, data_size)  # raises, naming the fault
        tensors[name] = TensorInfo(path.name, one(e.dtype, e.dtype), one(e.shape, e.shape), 8 + n + begin, 8 + n + end)
    end = 0
    for info in sorted(tensors.values(), key=lambda i: (i.begin, i.end)):
        if info.begin - 8 - n != end:
            what = "overlaps the tensor before it" if info.begin - 8 - n < end else "leaves a gap before it"
            name = next(k for k, v in tensors.items() if v is info)
            raise HeaderError(f"{path}: tensor {name} at [{info.begin - 8 - n}, {info.end - 8 - n}) {what} (data must be contiguous)")
        end = info.end - 8 - n
    if end != data_size:
        raise HeaderError(f"{path}: the tensors end at byte {end} of the data, but the file holds {data_size} bytes of data (truncated or extended)")
    return tensors, metadata


def _plain(value: object) -> object:
    """A header value as json gives it (a msgspec.Raw decoded)."""
    return msgspec.json.decode(value) if value.__class__ is msgspec.Raw else value


_DType = Literal[tuple(DTYPE_SIZE)]  # type: ignore[valid-type]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """A header entry as safetensors writes it; what _tensor_info checks one by one."""

    dtype: _DType
    shape: tuple[_Count, ...]
    data_offsets: tuple[_Count, _Count]


_ENTRY = msgspec.json.Decoder(_Entry)


def _tensor_info(path: Path, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise HeaderError(f"{path}: tensor {name}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZE:
        raise HeaderError(f"{path}: tensor {name} has unsupported dtype {dtype!r}; tpshard moves {', '.join(DTYPE_SIZE)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise HeaderError(f"{path}: tensor {name}: shape {shape!r} is not a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) and o >= 0 for o in offsets)):
        raise HeaderError(f"{path}: tensor {name}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    expected = nbytes_of(dtype, tuple(shape))
    if end < begin or end - begin != expected or end > data_size:
        raise HeaderError(
            f"{path}: tensor {name} {dtype}{list(shape)} needs {expected} bytes, but data_offsets are"
            f" [{begin}, {end}) in {data_size} bytes of data (truncated or corrupt)"
        )
    return TensorInfo(path.name, dtype, tuple(shape), data_start + begin, data_start + end)


def build_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors laid out in the given order.

    Returns the header and each tensor's absolute data offset in the file. The bytes are those of
    json.dumps(separators=(",", ":")) of {metadata, name: {dtype, shape, data_offsets}}.
    """
    names = [name for name, _, _ in tensors]
    unique = set(names) | ({"__metadata__"} if metadata else set())
    if plain_json("".join(names)) and len(unique) == len(names) + bool(metadata):
        body, relative = _plain_body(tensors, metadata)
    else:
        body, relative = _escaped_body(tensors, metadata)
    body += b" " * (-(len(body) + 8) % ALIGN)
    head = struct.pack("<Q", len(body)) + body
    return head, [len(head) + r for r in relative]


def header_layout(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[int, list[int]]:
    """len(build_header(tensors, metadata)[0]) and the same offsets, without building the header:
    a plan sizes every output file, and DeepSeek-V3's headers at tp 8 are ~50 MB that only the
    writer needs, one file at a time.

    Counted from the text _plain_body writes: per entry `"name":{"dtype":..,"shape":[..],
    "data_offsets":[` (its length fixed by the entry's dtype and shape) then `begin,end]}`.
    Names that JSON escapes (or that repeat) are measured by building the header.
    """
    names = [name for name, _, _ in tensors]
    unique = set(names) | ({"__metadata__"} if metadata else set())
    if not (plain_json("".join(names)) and len(unique) == len(names) + bool(metadata)):
        head, offsets = build_header(tensors, metadata)
        return len(head), offsets
    kinds: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    text, sizes = 0, []
    for _, dtype, shape in tensors:
        kind = kinds.get((dtype, shape))
        if kind is None:
            kind = kinds[(dtype, shape)] = (len(_kind_text(dtype, shape)), nbytes_of(dtype, shape))
        text += kind[0]
        sizes.append(kind[1])
    ends = list(itertools.accumulate(sizes, initial=0))  # each tensor's begin, then the last end
    # begins are ends[:-1], ends ends[1:]: every number written twice but the first 0 and the last end
    digits = 2 * sum(map(len, map(str, ends))) - 1 - len(str(ends[-1]))
    parts = len(tensors) + bool(metadata)
    body = (
        2 + max(parts - 1, 0)  # the braces, the commas between parts
        + (len(_metadata_part(metadata)) if metadata else 0)
        + sum(map(len, names)) + text + digits + 4 * len(tensors)  # `"`, `,` and `]}` around each entry's own text
    )  # fmt: skip
    head = 8 + body + (-(body + 8) % ALIGN)
    return head, [head + r for r in ends[:-1]]


def plain_json(text: str) -> bool:
    """Text that JSON writes as it is: printable ASCII without quote or backslash."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _plain_body(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    """The header JSON written directly: DeepSeek-V3's rank files hold ~90k entries, and most of an
    entry is its (dtype, shape), the same for every layer and expert."""
    parts = [_metadata_part(metadata)] if metadata else []
    offset, relative, kinds = 0, [], {}
    for name, dtype, shape in tensors:
        kind = kinds.get((dtype, shape))
        if kind is None:
            kind = kinds[(dtype, shape)] = (_kind_text(dtype, shape), nbytes_of(dtype, shape))
        text, nbytes = kind
        relative.append(offset)
        parts.append(f'"{name}{text}{offset},{offset + nbytes}]}}')
        offset += nbytes
    return ("{" + ",".join(parts) + "}").encode(), relative


def _metadata_part(metadata: dict[str, str]) -> str:
    return f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}'


def _kind_text(dtype: str, shape: tuple[int, ...]) -> str:
    """An entry's text between its name and its offsets: the same for every tensor of a (dtype, shape)."""
    return f'":{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],"data_offsets":['


def _escaped_body(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> tuple[bytes, list[int]]:
    entries: dict[str, object] = {}
    if metadata:
        entries["__metadata__"] = metadata
    offset, relative = 0, []
    for name, dtype, shape in tensors:
        nbytes = nbytes_of(dtype, shape)
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        relative.append(offset)
        offset += nbytes
    return json.dumps(entries, separators=(",", ":")).encode(), relative


def nbytes_of(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPE_SIZE[dtype] * math.prod(shape)


def read_header_bytes(path: Path) -> bytes:
    """The length prefix and JSON header of a file, exactly as stored."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return struct.pack("<Q", n) + f.read(n)
