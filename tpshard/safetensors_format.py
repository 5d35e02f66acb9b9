"""The safetensors file format, read and written without loading tensors.

A file is: 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`, then the
data, offsets relative to the end of the header. Reading headers ourselves gives every tensor's
absolute byte range, so the writer can copy just the bytes a rank needs and can lay out an output
file's header before any data exists.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from operator import itemgetter
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from tpshard.errors import CheckpointError

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
    tensors, file = {}, path.name  # one file name for its tensors (a copy each was 5 MB at 90k tensors)
    shapes = {}  # equal shapes decoded apart made one tuple (a Literal dtype is one object already)
    for name, e in entries.items():
        begin, end = e.data_offsets
        if end < begin or end - begin != DTYPE_SIZE[e.dtype] * math.prod(e.shape) or end > data_size:
            _tensor_info(path, name, _plain(header[name]), 8 + n, data_size)  # raises, naming the fault
        tensors[name] = TensorInfo(file, e.dtype, shapes.setdefault(e.shape, e.shape), 8 + n + begin, 8 + n + end)
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


Shapes = list[tuple[str, tuple[int, ...]]]  # distinct (dtype, shape): a file's few dozen kinds of tensor


def build_header(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[int]]:
    """Header bytes (length prefix included) for tensors laid out in the given order.

    Returns the header and each tensor's absolute data offset in the file. The bytes are those of
    json.dumps(separators=(",", ":")) of {metadata, name: {dtype, shape, data_offsets}}.
    """
    return build_kinds_header(*by_kind(tensors), metadata)


def build_kinds_header(names: list[str], kinds: Sequence[int], shapes: Shapes, metadata: dict[str, str] | None = None) -> tuple[bytes, list[int]]:
    """build_header of tensors given by kind (by_kind): their names and each one's (dtype, shape)
    as an index in `shapes`. DeepSeek-V3's rank files hold ~90k tensors of a few dozen kinds: each
    kind's text is made once, and no shape is hashed per tensor."""
    size, relative, pieces = kinds_header_pieces(names, kinds, shapes, metadata)
    return b"".join(pieces), list(map(size.__add__, relative))


def kinds_header_pieces(
    names: list[str], kinds: Sequence[int], shapes: Shapes, metadata: dict[str, str] | None = None
) -> tuple[int, list[int], Iterator[bytes]]:
    """build_kinds_header as (the header's length, each tensor's data offset from the header's end,
    its bytes in pieces made as they are asked for): a writer holds a few hundred KB of a header at
    a time (a file's is 5 MB at 90k tensors and tp 8, and built whole it took ~15 MB on the way)."""
    if plain_names(names, metadata):
        size, relative, pieces = _plain_header(names, kinds, shapes, metadata)
    else:  # names JSON escapes: built whole, by json
        body, relative = _escaped_body([(name, *shapes[k]) for name, k in zip(names, kinds)], metadata)
        body += b" " * (-(len(body) + 8) % ALIGN)
        size, pieces = 8 + len(body), iter([struct.pack("<Q", len(body)), body])
    return size, relative, pieces


def header_layout(
    tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None = None
) -> tuple[int, list[int]]:
    """len(build_header(tensors, metadata)[0]) and the same offsets, without building the header:
    a plan sizes every output file, and DeepSeek-V3's headers at tp 8 are ~50 MB that only the
    writer needs, one file at a time."""
    return kinds_header_layout(*by_kind(tensors), metadata)


def kinds_header_layout(names: list[str], kinds: Sequence[int], shapes: Shapes, metadata: dict[str, str] | None = None) -> tuple[int, list[int]]:
    """header_layout of tensors given by kind: kinds_header_pieces' count, its pieces never made
    (names that JSON escapes, or that repeat, are measured by building the header)."""
    size, relative, _ = kinds_header_pieces(names, kinds, shapes, metadata)
    return size, list(map(size.__add__, relative))


def by_kind(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[list[str], list[int], Shapes]:
    """(names, kinds, shapes) of (name, dtype, shape) tensors: each (dtype, shape) numbered in order."""
    numbers = Numbering()
    kinds = list(map(numbers.__getitem__, map(itemgetter(1, 2), tensors)))
    return list(map(itemgetter(0), tensors)), kinds, list(numbers)


class Numbering(dict):
    """Key -> its number, 0, 1, ... in the order keys are first asked for (iterating gives them so)."""

    def __missing__(self, key: object) -> int:
        self[key] = len(self)
        return self[key]


def plain_layout(text: int, sizes: list[int], metadata: dict[str, str] | None = None) -> tuple[int, list[int]]:
    """header_layout of tensors whose names JSON writes as they are (plain_json), none twice, from
    what their entries add up to: `text`, their names' and entry_text's lengths summed, and `sizes`,
    each one's nbytes in order. For a caller that knows these per kind of tensor (make_plan).

    Counted from the text _plain_header writes: per entry `"`, the name, its entry_text, then
    `begin,end]}`."""
    ends = list(itertools.accumulate(sizes, initial=0))  # each begin, then the last end
    unpadded = _unpadded_size(text, ends, metadata)
    head = unpadded + -unpadded % ALIGN
    return head, list(map(head.__add__, ends[:-1]))


def _text_size(names: list[str], kinds: Sequence[int], texts: list[int]) -> int:
    """plain_layout's `text`: the names' lengths and their kinds' entry_text lengths (`texts`), summed."""
    return sum(map(len, names)) + sum(map(texts.__getitem__, kinds))


def _unpadded_size(text: int, ends: list[int], metadata: dict[str, str] | None) -> int:
    """The length of a plain header (plain_layout) but its padding, its tensors beginning at
    ends[:-1] and ending at ends[1:]."""
    entries = len(ends) - 1
    # `begin,end` for each entry: every number of `ends` written twice but the first 0 and the last end
    digits = 2 * _digit_count(ends) - 1 - len(str(ends[-1]))
    body = (
        2 + max(entries + bool(metadata) - 1, 0)  # the braces, the commas between entries
        + (len(_metadata_part(metadata)) if metadata else 0)
        + text + digits + 4 * entries  # each entry's `"`, `,` and `]}`
    )  # fmt: skip
    return 8 + body


def _digit_count(ascending: list[int]) -> int:
    """The digits of all these non-negative numbers, in ascending order, written out: each power of
    ten is found by bisection, not each number converted (a file holds up to ~90k)."""
    count, power = len(ascending), 10
    while ascending and power <= ascending[-1]:
        count += len(ascending) - bisect.bisect_left(ascending, power)
        power *= 10
    return count


def plain_json(text: str) -> bool:
    """Text that JSON writes as it is: printable ASCII without quote or backslash."""
    # deleting the plain bytes leaves nothing: twice as fast as str.isprintable (a header's names
    # are ~16M characters at 90k tensors and tp 8)
    return text.isascii() and not text.encode("ascii").translate(None, _PLAIN_BYTES)


_PLAIN_BYTES = bytes(c for c in range(0x20, 0x7F) if chr(c) not in '"\\')


def plain_names(names: list[str], metadata: dict[str, str] | None) -> bool:
    """Whether the header can be written directly: names JSON writes as they are, none twice
    (json.dumps of a dict keeps the last)."""
    unique = set(names)
    return plain_json("".join(names)) and len(unique) == len(names) and not (metadata and "__metadata__" in unique)


HEADER_BATCH = 4096  # entries per piece of a header (kinds_header_pieces)


def _plain_header(names: list[str], kinds: Sequence[int], shapes: Shapes, metadata: dict[str, str] | None) -> tuple[int, list[int], Iterator[bytes]]:
    """The header written directly: its length counted first (_plain_size), then length prefix,
    JSON and padding in pieces of HEADER_BATCH entries, each entry joined from its pieces in C (no
    Python code runs per entry: ~2x faster than formatting each). Returns its length, each
    tensor's data offset relative to its end, and its pieces; the last piece checks that the text
    is as long as it was counted."""
    texts = [entry_text(*shape) for shape in shapes]
    sizes = [nbytes_of(*shape) for shape in shapes]
    ends = list(itertools.accumulate(map(sizes.__getitem__, kinds), initial=0))
    unpadded = _unpadded_size(_text_size(names, kinds, list(map(len, texts))), ends, metadata)
    size = unpadded + -unpadded % ALIGN

    def pieces() -> Iterator[bytes]:
        opening = struct.pack("<Q", size - 8) + ("{" + (_metadata_part(metadata) if metadata else "")).encode()
        total = len(opening)
        yield opening
        for a in range(0, len(names), HEADER_BATCH):
            b = a + HEADER_BATCH
            numbers = list(map(str, ends[a : b + 1]))
            # `"` name `":{"dtype":..,"data_offsets":[` begin `,` end `]}`, after a `,` but the first entry
            commas = itertools.chain([',"' if a or metadata else '"'], itertools.repeat(',"'))
            entries = zip(commas, names[a:b], map(texts.__getitem__, kinds[a:b]), numbers, itertools.repeat(","), itertools.islice(numbers, 1, None), itertools.repeat("]}"))  # fmt: skip
            piece = "".join(map("".join, entries)).encode("ascii")
            total += len(piece)
            yield piece
        closing = ("}" + " " * (size - unpadded)).encode()
        if total + len(closing) != size:  # the count and the text disagree: the prefix would be wrong
            raise AssertionError(f"a header counted as {size} bytes is {total + len(closing)}")
        yield closing

    return size, ends[:-1], pieces()


def _metadata_part(metadata: dict[str, str]) -> str:
    return f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}'


def entry_text(dtype: str, shape: tuple[int, ...]) -> str:
    """A header entry's text between its name and its offsets: the same for every tensor of a
    (dtype, shape)."""
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


def read_exact(fd: int, view: memoryview, offset: int) -> memoryview:
    """pread len(view) bytes at `offset` into `view` (threads share one fd: no seek); returns it."""
    done, n = 0, len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CheckpointError(f"file ended early at byte {offset + done} (truncated?)")
        done += got
    return view
