"""The manifest's bytes and a rank's index, as written; write_manifest, the manifest's file.

What this file holds: encode_manifest and manifest_pieces (compact JSON, keys sorted, defaults left
out, trailing ones of each cut array too: docs/format.md), tensor_pieces (its tensors' text, which
check --source also hashes), rank_index_pieces (a rank's model.safetensors.index.json), and
write_manifest, the one place a tpshard-manifest.json is written (split, reshard and merge).

What it is not: reading a manifest back (tpshard.manifest.decode), the output folder's staging and
publication (tpshard.publish).
"""

from __future__ import annotations

import heapq
import itertools
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec

from tpshard.manifest.document import Manifest
from tpshard.manifest.plan import Plan
from tpshard.manifest.records import MANIFEST_NAME, TensorPlan
from tpshard.safetensors_format import plain_json


def rank_index_pieces(plan: Plan, rank: int) -> Iterator[bytes]:
    """The model.safetensors.index.json of rank `rank`, byte for byte (check compares it so), in
    pieces: json.dumps(indent=2) of {"metadata": {"total_size"}, "weight_map"}, written line by line
    where names need no escape (a rank's index at 90k tensors and tp 8 is 7 MB, and a dict, its JSON
    and its indented copy held ~25 MB at once)."""
    held = [i for i, f in enumerate(plan.files) if rank in f.ranks]
    # the data follows each header, without gaps
    total = sum(plan.files[i].size - plan.header_size(plan.files[i].name) for i in held)
    # One sorted run per file (a rank holds one piece of each tensor): merged, they are the sorted map.
    runs = [plan.index_names(i) for i in held]
    pairs = heapq.merge(*(zip(names, itertools.repeat(plan.files[i].name)) for i, names in zip(held, runs)))
    if not runs or not all(plain_json("".join(names)) for names in runs):
        yield (json.dumps({"metadata": {"total_size": total}, "weight_map": dict(pairs)}, indent=2) + "\n").encode()
        return
    yield f'{{\n  "metadata": {{\n    "total_size": {total}\n  }},\n  "weight_map": {{\n'.encode()
    lines = (f'    "{name}": "{file}"' for name, file in pairs)
    first = True
    while batch := list(itertools.islice(lines, 4096)):
        yield ("" if first else ",\n").encode() + ",\n".join(batch).encode()
        first = False
    yield b"\n  }\n}\n"


_encoder = msgspec.json.Encoder(order="sorted")
_DEFAULT_TAIL = [0, 0, 0, None, 0, 0]  # a cut's logical_start ... value, lead_start, lead_length


def encode_manifest(manifest: Manifest) -> bytes:
    """Compact JSON, keys sorted, defaults left out (trailing ones of each cut array too)."""
    return b"".join(manifest_pieces(manifest))


MANIFEST_BATCH = 4096  # tensors per piece of manifest_pieces


def manifest_pieces(manifest: Manifest) -> Iterator[bytes | memoryview]:
    """encode_manifest's bytes in pieces, MANIFEST_BATCH tensors each: a writer need not hold them
    all (at 90k tensors the manifest is ~30 MB, and its tensors' parts as much again).

    Each tensor is encoded from its struct with its cuts spliced in, each distinct cuts tuple
    encoded once (make_plan shares one between the tensors of a kind): no tree of Python dicts for
    ~90k tensors. The splices are safe: inside strings JSON escapes every quote, so `"cuts":[]`
    and `"tensors":[]` occur only as the keys themselves."""
    # All but the tensors: the files' digests are 4 MB of it at 90k tensors and tp 8, not held
    # while the tensors are encoded (the part after them, a few fields, is copied out).
    rest = _encoder.encode(msgspec.structs.replace(manifest, tensors=()))
    at = rest.index(b'"tensors":[]') + len(b'"tensors":[')
    tail = rest[at:]
    yield memoryview(rest)[:at]
    del rest
    yield from tensor_pieces(manifest.tensors)
    yield tail + b"\n"


def tensor_pieces(tensors: Sequence[TensorPlan]) -> Iterator[bytes]:
    """The text of a manifest's "tensors" array, without its brackets, MANIFEST_BATCH tensors a piece."""
    cuts_json: dict[int, bytes] = {}
    for start in range(0, len(tensors), MANIFEST_BATCH):
        pieces = []
        for t in tensors[start : start + MANIFEST_BATCH]:
            cuts = cuts_json.get(id(t.cuts))
            if cuts is None:
                cuts = cuts_json[id(t.cuts)] = b'"cuts":' + _encoder.encode([_trim(msgspec.to_builtins(c)) for c in t.cuts])
            pieces.append(_encoder.encode(msgspec.structs.replace(t, cuts=())).replace(b'"cuts":[]', cuts, 1))
        yield (b"," if start else b"") + b",".join(pieces)


def _trim(cut) -> list:
    cut = list(cut)
    if cut[5:] == _DEFAULT_TAIL:
        return cut[:5]
    while len(cut) > 5 and cut[-1] == _DEFAULT_TAIL[len(cut) - 6]:
        cut.pop()
    return cut


def write_manifest(out_dir: str | Path, manifest: Manifest) -> None:
    """Write `manifest` as `out_dir`/tpshard-manifest.json and fsync it: the last file of an output
    (its presence means the output is complete), in pieces (manifest_pieces): never the whole JSON
    at once."""
    # Here, not at the top: only the writers need it, not a reader of one rank.
    from tpshard.publish import write_durably

    write_durably(Path(out_dir) / MANIFEST_NAME, manifest_pieces(manifest))
