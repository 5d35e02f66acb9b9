"""Issue 10 item 8: random mutations of headers, configs, indexes, outputs and (issue 29 item 9)
export manifests. Each is refused
cleanly (a TpshardError, a failing check) or handled correctly; never another exception, never a
false ok. The default run is short; `-m slow` runs the same properties with many more examples.

Oracles: a header tpshard accepts, the safetensors library accepts too, and its tensors tile the
data exactly; a config tpshard plans gives a plan whose alignment checks pass; an index naming
anything but a plain file inside the folder is refused; a mutated output never checks ok.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tpshard
from tpshard.check import CheckReport, check_plan
from tpshard.checkpoint import open_checkpoint
from tpshard.errors import TpshardError
from tpshard.inputs import CONFIG_FIELDS
from tpshard.plan import make_plan
from tpshard.safetensors_format import DTYPE_SIZE, HeaderError, read_header
from tpshard.topology import Topology
from test_inputs import safetensors_accepts  # noqa: E402 (tests/ is on the path)

SHORT, LONG = 25, 400


def fuzz(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], derandomize=examples == SHORT)


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8)
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)


# ---- safetensors headers ------------------------------------------------------------------------

BASE_TENSORS = {
    "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
    "c": {"dtype": "U8", "shape": [0], "data_offsets": [32, 32]},
}


@st.composite
def mutated_files(draw) -> bytes:
    header = json.loads(json.dumps(BASE_TENSORS))
    data_len = 32
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["field", "entry", "dtype", "shape", "offsets", "data", "prefix", "bytes"]))
        name = draw(st.sampled_from(sorted(header) + ["__metadata__", "new"]))
        if kind == "field" and isinstance(header.get(name), dict):
            header[name][draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))] = draw(json_values)
        elif kind == "entry":
            header[name] = draw(json_values)
        elif kind == "dtype" and isinstance(header.get(name), dict):
            header[name]["dtype"] = draw(st.sampled_from(sorted(DTYPE_SIZE) + ["F4", "C64", "f32", ""]))
        elif kind == "shape" and isinstance(header.get(name), dict):
            header[name]["shape"] = draw(st.lists(st.integers(-2, 2**33), max_size=3))
        elif kind == "offsets" and isinstance(header.get(name), dict):
            header[name]["data_offsets"] = draw(st.lists(st.integers(-1, 40), min_size=2, max_size=2))
        elif kind == "data":
            data_len = draw(st.integers(0, 48))
    body = json.dumps(header).encode()
    raw = struct.pack("<Q", len(body)) + body + bytes(data_len)
    if draw(st.booleans()):  # byte-level damage anywhere in the prefix or header
        for _ in range(draw(st.integers(1, 3))):
            at = draw(st.integers(0, 8 + len(body) - 1))
            raw = raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    return raw


def header_property(raw: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "f.safetensors"
        path.write_bytes(raw)
        try:
            tensors, _ = read_header(path)
        except HeaderError:
            return  # refused cleanly; tpshard may be stricter than the library (dtypes, duplicates)
        assert safetensors_accepts(path), "tpshard accepted a file the safetensors library refuses"
        spans = sorted((t.begin, t.end) for t in tensors.values())
        end = spans[0][0] if spans else None
        for begin, stop in spans:
            assert begin == end and stop >= begin
            end = stop
        assert end is None or end == len(raw)


test_header_fuzz = fuzz(SHORT)(given(mutated_files())(header_property))
test_header_fuzz_long = pytest.mark.slow(fuzz(LONG)(given(mutated_files())(header_property)))


# ---- config.json --------------------------------------------------------------------------------

FIELDS = [f.key for f in CONFIG_FIELDS] + ["num_experts", "quantization_config", "zzz"]


@pytest.fixture(scope="module")
def scratch(llama, tmp_path_factory) -> Path:
    """One private copy of the checkpoint whose config/index the examples rewrite in turn."""
    dst = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(llama, dst)
    outside = dst.parent / "outside.safetensors"
    shutil.copyfile(next(dst.glob("model-00001*.safetensors")), outside)
    return dst


def config_property(scratch: Path, changes: list[tuple[str, object]], under_text: bool) -> None:
    original = (scratch / "config.json").read_text()
    config = json.loads(original)
    for key, value in changes:
        (config.setdefault("text_config", {}) if under_text and isinstance(config.get("text_config", {}), dict) else config)[key] = value
    try:
        (scratch / "config.json").write_text(json.dumps(config))
        try:
            plan = make_plan(open_checkpoint(scratch), Topology(tp=2))
        except TpshardError:
            return
        report = CheckReport(out_dir="", source=None)
        check_plan(plan, report)
        assert report.ok, report.problems
        m = plan.model
        assert m.num_layers >= 1 and m.hidden_size >= 1 and m.num_heads % m.num_kv_heads == 0
    finally:
        (scratch / "config.json").write_text(original)


config_changes = st.lists(st.tuples(st.sampled_from(FIELDS), json_values), min_size=1, max_size=3)


@fuzz(SHORT)
@given(changes=config_changes, under_text=st.booleans())
def test_config_fuzz(scratch, changes, under_text):
    config_property(scratch, changes, under_text)


@pytest.mark.slow
@fuzz(LONG)
@given(changes=config_changes, under_text=st.booleans())
def test_config_fuzz_long(scratch, changes, under_text):
    config_property(scratch, changes, under_text)


# ---- model.safetensors.index.json --------------------------------------------------------------

names = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["../outside.safetensors", "/etc/passwd", ".", "..", "sub/x.safetensors", ".hidden", "model-00001-of-00002.safetensors"]),
)


def index_property(scratch: Path, edits: list[tuple[str, object]], replace_map: object | None) -> None:
    path = scratch / "model.safetensors.index.json"
    original = path.read_text()
    index = json.loads(original)
    if replace_map is not None:
        index["weight_map"] = replace_map
    else:
        keys = sorted(index["weight_map"])
        for which, value in edits:
            key = keys[hash(which) % len(keys)] if which != "new" else "model.extra.weight"
            index["weight_map"][key] = value
    try:
        path.write_text(json.dumps(index))
        try:
            ckpt = open_checkpoint(scratch)
        except TpshardError:
            return
        for f in ckpt.weight_files:  # accepted: every file read is a plain name inside the folder
            assert "/" not in f and not f.startswith(".") and (scratch / f).resolve().parent == scratch.resolve()
        try:
            make_plan(ckpt, Topology(tp=2))
        except TpshardError:
            return
    finally:
        path.write_text(original)


index_edits = st.lists(st.tuples(st.text(max_size=3), st.one_of(names, json_values)), min_size=1, max_size=3)


@fuzz(SHORT)
@given(edits=index_edits, replace_map=st.one_of(st.none(), json_values))
def test_index_fuzz(scratch, edits, replace_map):
    index_property(scratch, edits, replace_map)


@pytest.mark.slow
@fuzz(LONG)
@given(edits=index_edits, replace_map=st.one_of(st.none(), json_values))
def test_index_fuzz_long(scratch, edits, replace_map):
    index_property(scratch, edits, replace_map)


# ---- outputs: never a false ok -----------------------------------------------------------------


@pytest.fixture(scope="module")
def good_output(llama_tp2) -> Path:
    return llama_tp2


@st.composite
def output_damage(draw):
    return [
        (
            draw(st.sampled_from(["flip", "truncate", "append", "stray", "symlink", "swap"])),
            draw(st.integers(0, 10**6)),  # which file
            draw(st.integers(0, 10**9)),  # where in it
            draw(st.integers(1, 255)),  # xor mask
        )
        for _ in range(draw(st.integers(1, 2)))
    ]


def output_property(good_output: Path, damage) -> None:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out"
        shutil.copytree(good_output, out)  # copies, not links: each file is damaged on its own
        files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "tpshard-manifest.json")
        for kind, which, where, mask in damage:
            path = files[which % len(files)]
            if path.is_symlink() or not path.exists():
                continue
            data = bytearray(path.read_bytes())
            if kind == "flip" and data:
                data[where % len(data)] ^= mask
            elif kind == "truncate":
                data = data[: where % max(1, len(data))]
            elif kind == "append":
                data += bytes([mask])
            elif kind == "stray":
                (path.parent / f"stray-{mask}.safetensors").write_bytes(b"x")
                continue
            elif kind == "symlink":
                target = Path(d) / f"target-{which}"
                target.write_bytes(bytes(data))
                path.unlink()
                path.symlink_to(target)
                continue
            elif kind == "swap":
                other = files[(which + 1 + where) % len(files)]
                if other == path or other.read_bytes() == bytes(data):
                    data[0] ^= mask  # swapping identical files changes nothing: damage it instead
                else:
                    other_data = other.read_bytes()
                    other.write_bytes(bytes(data))
                    data = bytearray(other_data)
            path.write_bytes(bytes(data))
        if snapshot(out) == snapshot(good_output):
            return  # the damage undid itself (the same byte flipped twice)
        report = tpshard.check(out)
        assert not report.ok, f"a damaged output checked ok: {damage}"


def snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): (p.is_symlink(), p.read_bytes() if p.is_file() else None) for p in sorted(out.rglob("*"))}


@fuzz(SHORT)
@given(damage=output_damage())
def test_output_fuzz_never_false_ok(good_output, damage):
    output_property(good_output, damage)


@pytest.mark.slow
@fuzz(LONG)
@given(damage=output_damage())
def test_output_fuzz_never_false_ok_long(good_output, damage):
    output_property(good_output, damage)


# ---- manifests ---------------------------------------------------------------------------------


def _paths(node, prefix=()):
    """Every (path, value) inside a decoded JSON document, containers included."""
    yield prefix, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


@st.composite
def manifest_edits(draw):
    """1-3 edits of a real manifest: a value replaced (by any JSON value, or a huge or negative
    number, or a name that leaves the folder), a key dropped, or a list entry duplicated."""
    edits = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "number", "name", "drop", "dup"]))
        edits.append((kind, draw(st.integers(0, 10**6)), draw(json_values), draw(st.sampled_from([-1, 2**31, 2**63, 10**20]))))
    return edits


def _apply(data: dict, edits, within: str | None = None) -> dict:
    """`data` with `edits` made, each at a place whose path holds the key `within` if one is given."""
    for kind, at, value, number in edits:
        places = [(path, node) for path, node in _paths(data) if path and (within is None or within in path)]
        path, node = places[at % len(places)]
        parent = data
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        if kind == "value":
            parent[key] = value
        elif kind == "number":
            parent[key] = number
        elif kind == "name":
            parent[key] = "../../etc/passwd.safetensors"
        elif kind == "drop" and isinstance(parent, dict):
            del parent[key]
        elif kind == "dup" and isinstance(parent, list):
            parent.append(parent[key])
    return data


def manifest_property(good_output: Path, source: Path, edits) -> None:
    """A crafted manifest is refused in one line, or accepted only where nothing changes: a rank
    loaded through it holds exactly the tensors of the untouched output, and `check --source`
    passes only if the output still is what the rules make of the source. Never another exception."""
    import torch

    from tpshard.manifest import MANIFEST_NAME

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        shutil.copytree(good_output, out)
        data = _apply(json.loads((out / MANIFEST_NAME).read_text()), edits)
        (out / MANIFEST_NAME).write_text(json.dumps(data))
        for rank in (0, 1):
            try:
                loaded = tpshard.load_rank(out, rank)
            except TpshardError as e:
                assert "\n" not in str(e), str(e)
                continue
            good = tpshard.load_rank(good_output, rank)
            assert loaded.keys() == good.keys() and all(torch.equal(loaded[k], good[k]) for k in good), edits
        try:
            report = tpshard.check(out, source)
        except TpshardError as e:
            assert "\n" not in str(e), str(e)
            return
        if report.ok:
            assert tpshard.read_manifest(out).plan.tensors == tpshard.read_manifest(good_output).plan.tensors, edits


@fuzz(SHORT)
@given(edits=manifest_edits())
def test_manifest_fuzz_refused_cleanly(good_output, llama, edits):
    manifest_property(good_output, llama, edits)


@pytest.mark.slow
@fuzz(LONG)
@given(edits=manifest_edits())
def test_manifest_fuzz_refused_cleanly_long(good_output, llama, edits):
    manifest_property(good_output, llama, edits)


@pytest.fixture(scope="module")
def good_export(good_output, tmp_path_factory) -> Path:
    from tpshard.export import export

    dest = tmp_path_factory.mktemp("fuzz-export") / "vllm"
    export(good_output, dest, "vllm")
    return dest


def export_manifest_property(good_export: Path, source: Path, edits, within: str | None) -> None:
    """A crafted export manifest (issue 29 item 9) is refused in one line by check, with and
    without the source, or checked; `check --source` passes only where the files the manifest
    lists (names, ranks, tensors) are still those of the untouched export. Never another exception."""
    from tpshard.export import EXPORT_MANIFEST_NAME, read_export_manifest

    with tempfile.TemporaryDirectory() as tmp:
        dest = Path(tmp) / "vllm"
        shutil.copytree(good_export, dest)
        data = _apply(json.loads((dest / EXPORT_MANIFEST_NAME).read_text()), edits, within)
        (dest / EXPORT_MANIFEST_NAME).write_text(json.dumps(data))
        try:
            tpshard.check(dest)
            report = tpshard.check(dest, source)
        except TpshardError as e:
            assert "\n" not in str(e), str(e)
            return
        if report.ok:
            have, want = read_export_manifest(dest), read_export_manifest(good_export)
            assert [(f.name, f.rank, f.tensors) for f in have.files] == [(f.name, f.rank, f.tensors) for f in want.files], edits


# Most of an export manifest's values are its tensors' names, dtypes and shapes: half the examples
# edit only those, or the short run would seldom reach one.
export_scopes = st.sampled_from([None, "tensors"])


@fuzz(SHORT)
@given(edits=manifest_edits(), within=export_scopes)
def test_export_manifest_fuzz_refused_cleanly(good_export, llama, edits, within):
    export_manifest_property(good_export, llama, edits, within)


@pytest.mark.slow
@fuzz(LONG)
@given(edits=manifest_edits(), within=export_scopes)
def test_export_manifest_fuzz_refused_cleanly_long(good_export, llama, edits, within):
    export_manifest_property(good_export, llama, edits, within)


@fuzz(SHORT)
@given(names=st.lists(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x2FF), min_size=1, max_size=12), min_size=1, max_size=6, unique=True))
def test_header_bytes_are_json_dumps_bytes(names):
    """build_header's fast encoder writes exactly what json.dumps writes (escapes included)."""
    from tpshard.safetensors_format import build_header

    tensors = [(n, "BF16", (i + 1, 2)) for i, n in enumerate(names)]
    head, _ = build_header(tensors, {"format": "pt"})
    entries, offset = {"__metadata__": {"format": "pt"}}, 0
    for n, dtype, shape in tensors:
        entries[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + 2 * shape[0] * shape[1]]}
        offset += 2 * shape[0] * shape[1]
    assert head[8:].rstrip(b" ") == json.dumps(entries, separators=(",", ":")).encode()


@fuzz(SHORT)
@given(
    names=st.lists(st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), min_size=1, max_size=12), min_size=0, max_size=8),
    shapes=st.lists(st.lists(st.integers(0, 5), max_size=3), min_size=8, max_size=8),
    metadata=st.booleans(),
)
def test_header_bytes_plain_names(names, shapes, metadata):
    """The direct writer of printable-ASCII names (quotes, backslashes and repeated names fall back
    to json.dumps) writes json.dumps's bytes, repeated shapes included."""
    from tpshard.safetensors_format import build_header

    tensors = [(n, "F32" if i % 2 else "BF16", tuple(shapes[i])) for i, n in enumerate(names)]
    head, offsets = build_header(tensors, {"format": "pt"} if metadata else None)
    entries, offset, starts = ({"__metadata__": {"format": "pt"}} if metadata else {}), 0, []
    for n, dtype, shape in tensors:
        nbytes = (4 if dtype == "F32" else 2) * math.prod(shape)
        entries[n] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        starts.append(offset)
        offset += nbytes
    assert head[8:].rstrip(b" ") == json.dumps(entries, separators=(",", ":")).encode()
    assert offsets == [len(head) + s for s in starts]
