"""Manifest v2: compact, decoded against its schema, and every crafted manifest refused in one line.

Each crafted manifest is a real split's manifest with one field edited in its JSON; read_manifest,
check, open_rank and load_rank must refuse it with an OutputError naming the field (the CLI: exit 2,
one line, no traceback), never read outside the output folder, never hang or allocate by it.
"""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

import tpshard
from tpshard.errors import OutputError
from tpshard.digest import tensor_digest
from tpshard.manifest import MANIFEST_NAME, differing, read_manifest
from tpshard.topology import Topology


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("manifest") / "out"
    tpshard.split(llama, out, Topology(tp=4, attn_dp=2))
    return out


def test_manifest_is_compact_and_round_trips(good):
    raw = (good / MANIFEST_NAME).read_bytes()
    data = json.loads(raw)
    assert (data["format"], data["version"]) == ("tpshard-manifest", 3)
    assert b"\n" not in raw.rstrip(b"\n") and list(data) == sorted(data)  # compact, sorted keys
    m = read_manifest(good)
    assert len(raw) < 1024 * len(m.tensors)
    # Trailing defaults of a cut are left out: a dense cut is [group_rank, start, length, pad, file].
    assert {len(c) for t in data["tensors"] for c in t["cuts"]} == {5}
    # Every shard has one cut record; the per-rank views agree with the all-ranks view.
    assert len(m.plan.shards) == sum(len(t.cuts) for t in m.tensors)
    for r in range(4):
        assert m.plan.rank_shards(r) == [s for s in m.plan.shards if r in s.ranks]


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_differing_names_the_digests_that_differ(algorithm):
    """differing against the digests compared one by one: [] when equal, the flipped one's index
    otherwise, at each algorithm's width (4 and 32 bytes)."""
    digests = [tensor_digest(algorithm, bytes([i]) * 10) for i in range(5)]
    recorded = b"".join(digests).hex()
    assert differing(b"".join(digests), recorded, algorithm) == []
    for k in (0, 3, 4):
        flipped = list(digests)
        flipped[k] = bytes([flipped[k][0] ^ 1]) + flipped[k][1:]
        assert differing(b"".join(flipped), recorded, algorithm) == [k]
    assert differing(b"".join(reversed(digests)), recorded, algorithm) == [0, 1, 3, 4]
    assert differing(b"", "", algorithm) == []


def test_encoding_splices_cuts_only_where_the_keys_are(good):
    """encode_manifest splices each tensor's cuts and the tensors array into msgspec's encoding by
    their keys: names and paths that spell those keys must come back unchanged, and the JSON is the
    whole manifest as plain data (cuts trimmed of trailing defaults)."""
    import msgspec

    from tpshard.manifest import decode_manifest, encode_manifest

    m = read_manifest(good)
    odd = '"cuts":[]"tensors":[]\\'
    tensors = tuple(msgspec.structs.replace(t, name=t.name + odd) if i % 3 == 0 else t for i, t in enumerate(m.tensors))
    m = msgspec.structs.replace(m, tensors=tensors, source=msgspec.structs.replace(m.source, path=m.source.path + odd))
    raw = encode_manifest(m)
    assert decode_manifest(raw, "test") == m
    data = json.loads(json.dumps(msgspec.to_builtins(m)))

    def trim(cut: list) -> list:  # [group_rank, start, length, pad, file] + trailing non-defaults
        while len(cut) > 5 and cut[-1] == [0, 0, 0, None, 0, 0][len(cut) - 6]:
            cut = cut[:-1]
        return cut

    for t in data["tensors"]:
        t["cuts"] = [trim(c) for c in t["cuts"]]
    assert json.loads(raw) == data


def craft(good: Path, tmp_path: Path, edit) -> Path:
    """A copy of `good` with its manifest edited, written as tpshard writes one (compact, keys
    sorted): what the edit leaves alone keeps its text (check --source compares the tensors' text)."""
    out = tmp_path / "crafted"
    shutil.copytree(good, out, symlinks=True)
    data = json.loads((out / MANIFEST_NAME).read_bytes())
    edit(data)
    (out / MANIFEST_NAME).write_bytes(msgspec.json.encode(data, order="sorted") + b"\n")
    return out


def test_a_crafted_manifest_keeps_the_text_it_does_not_edit(good, tmp_path):
    assert (craft(good, tmp_path, lambda data: None) / MANIFEST_NAME).read_bytes() == (good / MANIFEST_NAME).read_bytes()


def _tensor(data: dict, suffix: str) -> dict:
    return next(t for t in data["tensors"] if t["name"].endswith(suffix))


def _set(path: str, value):
    """An edit setting data[path] (dotted, list indexes as numbers)."""

    def edit(data):
        *keys, last = [int(k) if k.lstrip("-").isdigit() else k for k in path.split(".")]
        for k in keys:
            data = data[k]
        data[last] = value

    return edit


def _cut(suffix: str, i: int, value):
    def edit(data):
        cut = _tensor(data, suffix)["cuts"][0]
        cut[i] = value

    return edit


CRAFTED = {
    "dotdot file name": (_set("files.0.name", "../../../etc/passwd.safetensors"), "files[0].name"),
    "absolute file name": (_set("files.0.name", "/etc/passwd"), "files[0].name"),
    "hidden file name": (_set("files.0.name", ".model.safetensors"), "files[0].name"),
    "not a safetensors name": (_set("files.0.name", "config.json"), "files[0].name"),
    "duplicate file name": (lambda d: d["files"][1].update(name=d["files"][0]["name"]), "listed twice"),
    "dotdot extra file": (_set("source.extra_files.0.name", "../config.json"), "extra_files[0].name"),
    "file index out of range": (_cut("q_proj.weight", 4, 999), "file index 999"),
    "negative file index": (_cut("q_proj.weight", 4, -1), "cuts[0]"),
    "group rank out of range": (_cut("q_proj.weight", 0, 7), "group rank 7"),
    "cut past the dim": (_cut("q_proj.weight", 2, 10**6), "does not fit dim"),
    "huge padding": (_cut("q_proj.weight", 3, 2**49), "does not fit dim"),
    "huge shape": (lambda d: _tensor(d, "q_proj.weight").update(shape=[2**40, 2**40]), "more than"),
    "negative shape": (lambda d: _tensor(d, "q_proj.weight").update(shape=[-1, 64]), "shape"),
    "dim out of range": (lambda d: _tensor(d, "q_proj.weight").update(dim=5), "dim: 5"),
    "unknown dtype": (lambda d: _tensor(d, "q_proj.weight").update(dtype="F128"), "dtype"),
    "unknown group": (lambda d: _tensor(d, "q_proj.weight").update(group="pp"), "group"),
    "EP slot out of range": (lambda d: _tensor(d, "q_proj.weight").update(ep_slot=3), "ep_slot: 3 but --ep is 1"),
    "expert id of a dense model": (lambda d: _tensor(d, "q_proj.weight").update(expert=0), "expert: 0 but the model has 0 routed experts"),
    "file rank out of world": (_set("files.0.ranks", [0, 99]), "rank 99 outside the world"),
    "written rank out of world": (_set("written_ranks", [0, 99]), "written_ranks"),
    "huge world": (_set("topology.tp", 10**9), "tp must be an integer from 1 to 65536"),  # Topology refuses it while decoding, in its field names
    "digests miscounted": (lambda d: d["files"][0].update(digests=d["files"][0]["digests"][:-8]), "files[0].digests"),
    "digest not hex": (lambda d: d["files"][0].update(digests="z" + d["files"][0]["digests"][1:]), "files[0].digests: not lower-case hex"),
    "digests as a list (version 2)": (lambda d: d["files"][0].update(digests=[d["files"][0]["digests"][:8]]), "files[0].digests"),
    "string for a number": (_set("files.0.size", "12"), "files[0].size"),
    "version 1": (_set("version", 1), "older tpshard"),
    "version 2": (lambda d: [d.update(version=2), *(f.update(digests=[f["digests"][:8]]) for f in d["files"])], "older tpshard"),
    "future version": (_set("version", 5), "newer tpshard"),
    "no version": (lambda d: d.pop("version"), "no manifest version; not a tpshard split manifest this tpshard can read"),
    "no format": (lambda d: d.pop("format"), "format None is not 'tpshard-manifest'"),
    "another format": (_set("format", "safetensors-index"), "not 'tpshard-manifest'"),
    "missing field": (lambda d: d.pop("tensors"), "tensors"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_manifest_is_refused_in_one_line(good, llama, tmp_path, case):
    """By every reader; check --source too, which decodes only the frame of a manifest whose tensors'
    text is the rules' (here: every edit that leaves the tensors alone) and checks the rules' tensors against it."""
    edit, needle = CRAFTED[case]
    out = craft(good, tmp_path, edit)
    readers = (read_manifest, tpshard.check, lambda o: tpshard.check(o, llama), lambda o: tpshard.open_rank(o, 0), lambda o: tpshard.load_rank(o, 0))
    for call in readers:
        with pytest.raises(OutputError) as e:
            call(out)
        message = str(e.value)
        assert needle in message and "\n" not in message, message


def test_crafted_manifest_cli_exit_2_one_line(good, tmp_path):
    out = craft(good, tmp_path, _set("files.0.name", "../../outside.safetensors"))
    p = subprocess.run([sys.executable, "-m", "tpshard", "check", str(out)], capture_output=True, text=True, timeout=120)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "files[0].name" in lines[0], p.stderr


def test_not_json_and_oversized_manifest(good, tmp_path):
    out = tmp_path / "crafted"
    shutil.copytree(good, out)
    (out / MANIFEST_NAME).write_bytes(b'{"format": "tpshard-manifest", "version": 2, "tensors": [')
    with pytest.raises(OutputError, match="not a tpshard manifest"):
        read_manifest(out)
    with open(out / MANIFEST_NAME, "wb") as f:  # sparse: a size no tpshard writes, refused unread
        f.truncate(3 << 30)
    with pytest.raises(OutputError, match="more than any tpshard manifest"):
        read_manifest(out)


@pytest.mark.parametrize("batch", [1, 2, 5])
def test_tensors_decoded_in_batches_are_the_whole_documents(good, batch, monkeypatch):
    """decode_manifest decodes the tensors DECODE_BATCH at a time: the manifest is the one the
    whole document decoded at once gives (_decode_whole)."""
    from tpshard.manifest import decode as decode_module

    raw = (good / MANIFEST_NAME).read_bytes()
    monkeypatch.setattr(decode_module, "DECODE_BATCH", batch)
    assert decode_module.decode_manifest(raw, "test") == decode_module._decode_whole(raw, "test")


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_fault_found_in_a_batch_is_named_as_the_whole_document_names_it(good, tmp_path, case, monkeypatch):
    """At a fault anywhere (the frame, a later batch of tensors, the files' digests) the message is
    the whole document's: the first fault, named by its field."""
    from tpshard.manifest import decode as decode_module

    raw = (craft(good, tmp_path, CRAFTED[case][0]) / MANIFEST_NAME).read_bytes()
    monkeypatch.setattr(decode_module, "DECODE_BATCH", 2)
    with pytest.raises(OutputError) as whole:
        decode_module._decode_whole(raw, "test")
    with pytest.raises(OutputError) as batched:
        decode_module.decode_manifest(raw, "test")
    assert str(batched.value) == str(whole.value)


def test_check_source_decodes_no_tensors_of_a_manifest_that_is_the_rules(good, llama, tmp_path, monkeypatch):
    """check --source takes the rules' tensors when their text is the manifest's (the manifest is
    not read whole); a manifest written another way is read whole, and is as good."""
    rules_module = importlib.import_module("tpshard.check.rules")  # where check --source reads the manifest

    def read_whole(out):
        raise AssertionError("read whole")

    monkeypatch.setattr(rules_module, "read_manifest", read_whole)
    assert tpshard.check(good, llama).ok
    out = tmp_path / "indented"
    shutil.copytree(good, out)
    (out / MANIFEST_NAME).write_text(json.dumps(json.loads((good / MANIFEST_NAME).read_bytes()), indent=1))
    with pytest.raises(AssertionError, match="read whole"):
        tpshard.check(out, llama)
    monkeypatch.undo()
    report = tpshard.check(out, llama)
    assert report.ok and report.tensors_reassembled == len(read_manifest(good).tensors)


def test_a_plan_shares_its_layout_only_with_the_same_tensors_and_file_names(good):
    plan = read_manifest(good).plan
    plan.offsets(plan.files[0].name)  # laid out: cached
    same = msgspec.structs.replace(plan, warnings=("another",))
    renamed = msgspec.structs.replace(same, files=(msgspec.structs.replace(plan.files[0], name="x.safetensors"), *plan.files[1:]))
    retensored = msgspec.structs.replace(same, tensors=plan.tensors[:1] + plan.tensors[1:])  # equal, not the same tuple
    for other in (same, renamed, retensored):
        assert "_layouts" not in other.__dict__
        other.share_layout(plan)
    assert same.__dict__["_layouts"] is plan.__dict__["_layouts"]
    assert "_layouts" not in renamed.__dict__ and "_layouts" not in retensored.__dict__


@pytest.mark.parametrize(
    "fixture,topology",
    [
        ("llama", Topology(tp=8, attn_dp=2)),
        ("qwen2_tied", Topology(tp=2, pp_layers=(1, 1))),
        ("qwen3_moe", Topology(tp=4, ep=2)),
        ("mixtral", Topology(tp=8, ep=4)),
        ("deepseek_v3", Topology(tp=8, attn_dp=2, ep=8)),
        ("deepseek_fp8", Topology(tp=4, ep=2)),
    ],
)
def test_the_rules_tensors_are_what_their_manifest_text_decodes_to(request, fixture, topology):
    """check --source takes the rules' tensors for the manifest's when the two texts are the same:
    that text must decode to those tensors, field for field, for every kind of model."""
    from tpshard.checkpoint import open_checkpoint
    from tpshard.manifest import Manifest, Source, decode_manifest, encode_manifest
    from tpshard.plan import make_plan

    plan = make_plan(open_checkpoint(request.getfixturevalue(fixture)), topology)
    m = Manifest.of(plan, tool_version="test", source=Source(path="x", files=()), written_ranks=(), files=plan.files)
    decoded = decode_manifest(encode_manifest(m), "test")
    assert decoded.tensors == plan.tensors and decoded.model == plan.model and decoded.warnings == plan.warnings


def test_check_source_compares_what_readers_take_besides_the_tensors(good, llama, tmp_path):
    """The model a verify builds (rope_theta) and the warnings: an edit to either is a [rules] finding."""
    for field, edit in (("model", _set("model.rope_theta", 20000.0)), ("warnings", _set("warnings", ["edited"]))):
        report = tpshard.check(craft(good, tmp_path / field, edit), llama)
        assert f"the manifest's {field} is not what the rules give" in " ".join(p.message for p in report.problems), report.problems
        assert report.tensors_reassembled == 0
