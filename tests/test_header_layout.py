"""Issue 12: a plan sizes its output files without building their headers. header_layout's count is
compared with len(build_header(...)) on crafted inputs; a plan's offsets with those of the header
built; a planned size that is wrong stops the writer before any file is put in place."""

from __future__ import annotations

import json
import os

import pytest

import tpshard
from tpshard.checkpoint import open_checkpoint
from tpshard.manifest import Options, read_manifest
from tpshard.plan import FILE_METADATA, file_header, make_plan
from tpshard.plan import files as plan_files  # where make_plan lays out its files
from tpshard import safetensors_format
from tpshard.safetensors_format import ALIGN, DTYPE_SIZE, build_header, by_kind, header_layout, kinds_header_pieces, nbytes_of, plain_json
from tpshard.topology import Topology

# (name, dtype, shape) lists: every dtype, 0-d and zero-size shapes, offsets that cross powers of
# ten (a digit more in `data_offsets`), names JSON escapes, repeated names.
CASES = {
    "empty": [],
    "every dtype": [(f"t.{d}", d, (3, 5)) for d in DTYPE_SIZE],
    "0-d and zero dims": [("scalar", "F32", ()), ("none", "BF16", (0,)), ("inner zero", "I8", (3, 0, 2)), ("after", "U8", (1,))],
    "powers of ten": [(f"p{i}", "U8", (n,)) for i, n in enumerate((9, 1, 89, 1, 899, 1, 8999, 1, 10**10, 7))],
    "ends at a power of ten": [("a", "U8", (10,)), ("b", "U8", (90,)), ("c", "U8", (900,))],
    "one kind, many tensors": [(f"model.layers.{i}.mlp.down_proj.weight", "BF16", (32, 8)) for i in range(2000)],
    "quote": [('say "hi"', "F16", (2,)), ("plain", "F16", (2,))],
    "backslash": [("a\\b", "F16", (2,))],
    "control": [("tab\there", "F16", (2,)), ("nl\n", "F16", (2,))],
    "non-ASCII": [("poids.é", "F16", (2,)), ("重み", "BF16", (4, 4))],
    "astral": [("emoji \U0001f600", "F32", (1,))],
    "repeated name": [("w", "F16", (2,)), ("w", "F32", (3,))],
    "named __metadata__": [("__metadata__", "F16", (2,)), ("x", "F16", (2,))],
}


@pytest.mark.parametrize("metadata", [None, FILE_METADATA, {"k": 'é"'}])
@pytest.mark.parametrize("case", CASES)
def test_header_layout_is_the_length_of_the_built_header(case, metadata):
    """The counted size and offsets are build_header's, for plain names (counted) and the others."""
    head, offsets = build_header(CASES[case], metadata)
    assert header_layout(CASES[case], metadata) == (len(head), offsets)


@pytest.mark.parametrize("metadata", [None, FILE_METADATA])
@pytest.mark.parametrize("batch", [1, 2, 7])
@pytest.mark.parametrize("case", ["empty", "every dtype", "powers of ten", "one kind, many tensors", "0-d and zero dims"])
def test_a_header_in_pieces_is_json_dumps(case, batch, metadata, monkeypatch):
    """The writer's header comes HEADER_BATCH entries a piece (a commas at each seam): the pieces
    joined are json.dumps's text of the whole header, as long as counted, the offsets its own."""
    monkeypatch.setattr(safetensors_format, "HEADER_BATCH", batch)
    entries, offset, starts = dict({"__metadata__": metadata} if metadata else {}), 0, []
    for name, dtype, shape in CASES[case]:
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes_of(dtype, shape)]}
        starts.append(offset)
        offset += nbytes_of(dtype, shape)
    size, relative, pieces = kinds_header_pieces(*by_kind(CASES[case]), metadata)
    pieces = list(pieces)
    head = b"".join(pieces)
    assert head[8:].rstrip(b" ") == json.dumps(entries, separators=(",", ":")).encode()
    assert (len(head), relative) == (size, starts)
    assert len(pieces) == 2 + -(-len(CASES[case]) // batch)  # opening, the batches, closing


def test_a_header_text_longer_than_counted_is_refused(monkeypatch):
    """The length prefix is written first, from the count: a text that turns out another length
    raises at its last piece (the writer then publishes nothing: the test below)."""
    counted = safetensors_format._unpadded_size
    monkeypatch.setattr(safetensors_format, "_unpadded_size", lambda *a: counted(*a) - 8)
    _, _, pieces = kinds_header_pieces(*by_kind(CASES["every dtype"]), FILE_METADATA)
    with pytest.raises(AssertionError, match="a header counted as"):
        list(pieces)


def test_plain_json_is_printable_ascii_without_quote_or_backslash():
    for c in map(chr, range(0x100)):
        assert plain_json(f"a{c}b") == (c.isascii() and c.isprintable() and c not in '"\\'), repr(c)


def test_every_padding_of_the_header():
    """Names one character longer each time: the header's padding to 8 bytes takes every value."""
    paddings = set()
    for n in range(1, 3 * ALIGN):
        tensors = [("x" * n, "F32", (2, 3)), ("y", "I64", ())]
        head, offsets = build_header(tensors, FILE_METADATA)
        paddings.add(len(head) - len(head.rstrip(b" ")))
        assert header_layout(tensors, FILE_METADATA) == (len(head), offsets)
    assert paddings == set(range(ALIGN))


@pytest.mark.parametrize("max_file_bytes", [Options().max_file_bytes, 2_000])
def test_a_plan_holds_sizes_and_offsets_not_headers(llama, max_file_bytes):
    """make_plan keeps per file its header size and offsets, no header bytes; Plan.header builds the
    one the offsets were laid out with (files in parts too)."""
    plan = make_plan(open_checkpoint(llama), Topology(tp=8), Options(max_file_bytes=max_file_bytes))
    assert any("-part-" in f.name for f in plan.files) == (max_file_bytes == 2_000)
    assert not any(isinstance(v, bytes) for layout in plan.__dict__["_layouts"].values() for v in layout)
    for f in plan.files:
        header = plan.header(f.name)
        _, offsets = file_header([(s.name, s.dtype, s.shape) for s in plan.shards if s.file == f.name])
        assert (plan.header_size(f.name), list(plan.offsets(f.name))) == (len(header), offsets)
    assert not any(isinstance(v, bytes) for layout in plan.__dict__["_layouts"].values() for v in layout)


def test_make_plan_lays_out_alike_both_ways(llama, monkeypatch):
    """make_plan counts a file's header from its names' and kinds' text lengths when every name is
    plain JSON, and else through kinds_header_layout (which builds the header of names JSON
    escapes): the same layout."""
    counted = make_plan(open_checkpoint(llama), Topology(tp=8))
    monkeypatch.setattr(plan_files, "plain_names", lambda names, metadata: False)
    built = make_plan(open_checkpoint(llama), Topology(tp=8))
    assert built.__dict__["_layouts"] == counted.__dict__["_layouts"]


def test_a_plan_read_from_a_manifest_lays_out_alike(llama, tmp_path):
    """A manifest's plan (no sizes recorded) counts the same sizes and offsets as make_plan."""
    tpshard.split(llama, tmp_path / "out", Topology(tp=4))
    read = read_manifest(tmp_path / "out").plan
    made = make_plan(open_checkpoint(llama), Topology(tp=4))
    for f in made.files:
        assert (read.header_size(f.name), list(read.offsets(f.name))) == (made.header_size(f.name), list(made.offsets(f.name)))
        assert read.header(f.name) == made.header(f.name)


def test_a_wrong_planned_header_size_is_refused_not_written(llama, tmp_path, monkeypatch):
    """A header whose length is not the planned one would put every tensor at the wrong offset: the
    writer raises before any output is put in place."""
    counted = plan_files.plain_layout

    def eight_bytes_short(text, sizes, metadata=None):
        size, offsets = counted(text, sizes, metadata)
        return size - 8, [o - 8 for o in offsets]

    monkeypatch.setattr(plan_files, "plain_layout", eight_bytes_short)
    with pytest.raises(AssertionError, match="the header built is .* bytes, the plan laid it out as"):
        tpshard.split(llama, tmp_path / "out", Topology(tp=2))
    assert [e for e in os.listdir(tmp_path) if e == "out" or e.startswith(".out.")] == []


def test_headers_built_by_json_write_the_same_output(llama, tmp_path, monkeypatch):
    """Names JSON escapes take json.dumps's way (the header built whole, written in two pieces):
    forced for plain names, it writes the very bytes of the direct way, and check finds them right."""
    tpshard.split(llama, tmp_path / "direct", Topology(tp=4))
    monkeypatch.setattr(safetensors_format, "plain_names", lambda names, metadata: False)
    monkeypatch.setattr(plan_files, "plain_names", lambda names, metadata: False)
    tpshard.split(llama, tmp_path / "by-json", Topology(tp=4))
    for path in sorted((tmp_path / "direct").rglob("*")):
        if path.is_file():
            assert path.read_bytes() == (tmp_path / "by-json" / path.relative_to(tmp_path / "direct")).read_bytes(), path.name
    assert tpshard.check(tmp_path / "by-json", llama).ok
