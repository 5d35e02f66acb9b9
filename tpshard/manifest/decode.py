"""Reading a manifest: decode_manifest, read_manifest, and the frame check --source reads.

What this file holds: decode_manifest (JSON bytes decoded against the schema, in batches of
DECODE_BATCH tensors, and validated), read_manifest (the manifest of an output folder, bounded in
size), ManifestFrame, read_manifest_frame and manifest_with_tensors (a manifest whose tensors are
the rules', without decoding them), and the text twins of the records that decoding goes through.

What it is not: the checks run (tpshard.manifest.validation), one rank's lean reader
(tpshard.manifest.rank_records), the envelope's refusals (tpshard.manifest.envelope), writing
(tpshard.manifest.encode).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from tpshard.collector import paused
from tpshard.manifest.document import Manifest
from tpshard.manifest.encode import tensor_pieces
from tpshard.manifest.envelope import decode_versioned, refuse_envelope
from tpshard.manifest.plan import Plan
from tpshard.manifest.records import MANIFEST_FORMAT, MANIFEST_NAME, MANIFEST_VERSIONS, MAX_MANIFEST_BYTES, TensorPlan
from tpshard.manifest.validation import _CutKind, _frame_problem, _located, _TensorChecks, _tensors_problem


def _decode(decoder: msgspec.json.Decoder, data: bytes, where: str):
    """A split manifest decoded against the schema of `decoder` (decode_versioned)."""
    refuse = partial(refuse_envelope, where, expected=(MANIFEST_FORMAT, MANIFEST_VERSIONS), what="tpshard split manifest", again="re-run tpshard split", label="manifest version")
    return decode_versioned(decoder, data, where, refuse, "not a valid tpshard manifest", "not a tpshard manifest")


def _text_twin(struct: type, **types: Any) -> type:
    """A struct with the fields and defaults of `struct`, those named in `types` typed so instead:
    what a manifest is decoded into before the cuts that tensors share are decoded once each. Its
    format and version are the document's, None where it has none (refused): `struct`'s defaults
    are the ones written."""
    fields = []
    for f in msgspec.structs.fields(struct):
        typ = types.get(f.name, f.type)
        if f.name in ("format", "version"):
            fields.append((f.name, Any, None))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, typ, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ))
    return msgspec.defstruct(f"_{struct.__name__}Text", fields, kw_only=True, gc=False)


# Tensors of a kind share their cuts: decoded as text, decoded and checked once per kind (dtype,
# shape, dim, group size and text: _tensors_problem), each tensor given the kind's tuple (90k tensors
# at tp 8 are 460k Cut structs otherwise: 45 MB).
_TensorText = _text_twin(TensorPlan, cuts=msgspec.Raw)
# A quantized module's spec is text too, decoded once per distinct text (_quant_specs).
_decoder = msgspec.json.Decoder(_text_twin(Manifest, tensors=list[_TensorText], quant_layers=dict[str, msgspec.Raw]))  # a list: replaced in place
# The lean way: the tensors left as text, then decoded DECODE_BATCH at a time.
_frame_decoder = msgspec.json.Decoder(_text_twin(Manifest, tensors=msgspec.Raw, quant_layers=dict[str, msgspec.Raw]))
_spec_decoder = msgspec.json.Decoder(dict)
_items_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_batch_decoder = msgspec.json.Decoder(list[_TensorText])
DECODE_BATCH = 4096


def _decode_text(decoder: msgspec.json.Decoder, data: bytes, where: str):
    """The manifest as `decoder` decodes it (_decode), its quantized modules' specs decoded."""
    text = _decode(decoder, data, where)
    return msgspec.structs.replace(text, quant_layers=_quant_specs(text.quant_layers, where))


def _quant_specs(texts: dict[str, msgspec.Raw], where: str) -> dict[str, dict]:
    """Each module's spec, decoded once per distinct text and shared between the modules that have
    it, as make_plan shares them (DeepSeek-V3's FP8 release: ~46k modules of one spec, a dict each
    was 20 MB in every reader of its manifest)."""
    from tpshard.errors import OutputError

    specs: dict[bytes, dict] = {}
    out = {}
    for module, raw in texts.items():
        key = bytes(raw)
        spec = specs.get(key)
        if spec is None:
            try:
                spec = specs[key] = _spec_decoder.decode(key)
            except (msgspec.DecodeError, RecursionError) as e:
                raise OutputError(f"{where}: not a valid tpshard manifest ({_located(e, f'$.quant_layers[{module!r}]')})") from None
        out[module] = spec
    return out


def decode_manifest(data: bytes, where: str) -> Manifest:
    """A manifest from JSON bytes, decoded against its schema and validated (docs/format.md):
    OutputError otherwise, naming the field.

    Its tensors are decoded DECODE_BATCH at a time, each batch's records made TensorPlans before
    the next is decoded: the records of all of them at once were ~50 MB at DeepSeek-V3's count, the
    peak of every reader of a manifest. At the first fault the whole document is decoded and
    checked at once (_decode_whole), which names the first fault as it always has: the same
    schema and checks, in the order of the document."""
    text = _decode_text(_frame_decoder, data, where)
    tensors = None if _frame_problem(text) else _tensor_plans(text)
    if tensors is None:
        return _decode_whole(data, where)
    return _manifest_of(text, tensors)


def _tensor_plans(text) -> tuple[TensorPlan, ...] | None:
    """The TensorPlans of a manifest whose tensors are text (_frame_decoder), validated as
    _tensors_problem does; None at the first fault."""
    checks, out, one = _TensorChecks(text), [], {}.setdefault
    try:
        items = _items_decoder.decode(text.tensors)
        for start in range(0, len(items), DECODE_BATCH):
            for i, t in enumerate(_batch_decoder.decode(b"[" + b",".join(items[start : start + DECODE_BATCH]) + b"]"), start):
                problem, kind = checks.tensor(i, t)
                if problem:
                    return None
                out.append(_tensor_plan(t, kind, one))
    except (msgspec.DecodeError, RecursionError):  # _decode_whole names the fault
        return None
    return None if checks.files(text) else tuple(out)


def _tensor_plan(t, kind: _CutKind, one: Callable) -> TensorPlan:
    """A decoded tensor record as the TensorPlan it describes, with its kind's cuts. `one`: a
    dict's setdefault, through which equal values decoded apart become one object (90k tensors
    have a few dtypes, layer classes and shapes: 16 MB of copies at tp 8)."""
    return TensorPlan(**(msgspec.structs.asdict(t) | {"cuts": kind.cuts, "dtype": one(t.dtype, t.dtype), "layer_class": one(t.layer_class, t.layer_class), "shape": one(t.shape, t.shape)}))  # fmt: skip


def _decode_whole(data: bytes, where: str) -> Manifest:
    """decode_manifest in one piece: the first fault named, or the manifest."""
    from tpshard.errors import OutputError

    text = _decode_text(_decoder, data, where)
    kinds: list[_CutKind] = []
    problem = _frame_problem(text) or _tensors_problem(text, kinds)
    if problem:
        raise OutputError(f"{where}: not a valid tpshard manifest ({problem})")
    tensors, one = text.tensors, {}.setdefault
    for i, (t, kind) in enumerate(zip(tensors, kinds)):  # each record replaced as its TensorPlan is made
        tensors[i] = _tensor_plan(t, kind, one)
    return _manifest_of(text, tuple(tensors))


def _manifest_bytes(out_dir: str | Path) -> tuple[bytes, str]:
    from tpshard.errors import OutputError

    path = Path(out_dir) / MANIFEST_NAME
    if not Path(out_dir).is_dir():
        raise OutputError(f"{out_dir}: no such folder")
    if not path.is_file():
        from tpshard.manifest.foreign import not_an_output

        raise OutputError(not_an_output(Path(out_dir)))
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise OutputError(f"{path}: {size} bytes, more than any tpshard manifest ({MAX_MANIFEST_BYTES})")
    return path.read_bytes(), str(path)


@paused()
def read_manifest(out_dir: str | Path) -> Manifest:
    return decode_manifest(*_manifest_bytes(out_dir))


class ManifestFrame(NamedTuple):
    """A manifest read and checked but for its tensors, of which only the sha256 of their text is
    kept: check --source takes the tensors the rules make for the source instead, when their text
    is the same (decoding the manifest's own beside the rules' was a fifth of its peak at 90k tensors)."""

    text: Any  # decoded by _frame_decoder, its tensors left out
    tensors_sha256: bytes


@paused()
def read_manifest_frame(out_dir: str | Path) -> ManifestFrame:
    """The frame of the manifest at `out_dir`; OutputError, naming the fault, where read_manifest would raise one."""
    data, where = _manifest_bytes(out_dir)
    text = _decode_text(_frame_decoder, data, where)
    if _frame_problem(text):
        _decode_whole(data, where)  # raises, naming the first fault
    return ManifestFrame(msgspec.structs.replace(text, tensors=msgspec.Raw()), hashlib.sha256(text.tensors).digest())


def manifest_with_tensors(frame: ManifestFrame, plan: Plan) -> Manifest | None:
    """The manifest `frame` was read from, when its tensors are those of `plan`: their text (as
    manifest_pieces writes it) has the frame's sha256 and they pass decode_manifest's checks
    against the frame; None otherwise (read_manifest then says what it holds). That text decodes
    to `plan`'s tensors, field for field (test_manifest checks it for every kind of model)."""
    tensors, h = plan.tensors, hashlib.sha256(b"[")
    for piece in tensor_pieces(tensors):
        h.update(piece)
    h.update(b"]")
    if h.digest() != frame.tensors_sha256:
        return None
    manifest = _manifest_of(frame.text, tensors)
    if _tensors_problem(manifest, []):
        return None
    manifest.plan.share_layout(plan)
    return manifest


def _manifest_of(text, tensors: tuple[TensorPlan, ...]) -> Manifest:
    """The Manifest of a decoded text (_frame_decoder, _decoder) with these TensorPlans."""
    return Manifest(**(msgspec.structs.asdict(text) | {"tensors": tensors}))
