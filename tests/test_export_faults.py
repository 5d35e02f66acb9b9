"""Issue 29 items 4-9: an engine export under attack. Crafted export manifests end in one line and
exit 2 (deep nesting in the split manifest too, for every command and loader); a symbolic link in
an export fails its check; --force replaces only the files an export lists; a killed
`split --format` leaves a scratch folder that the next run removes; the export's copied files are
compared with the source; every option `check` takes on an export is honoured or refused."""

from __future__ import annotations

import hashlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import tpshard
from tpshard.errors import OutputError
from tpshard.export import EXPORT_MANIFEST_NAME, export, read_export_manifest
from tpshard.manifest import MANIFEST_NAME

DEEP = 60_000  # past msgspec's recursion limit (the issue: 50k-100k levels)


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300)


def one_line_exit_2(r: subprocess.CompletedProcess, *wanted: str) -> None:
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    for w in wanted:
        assert w in lines[0], lines[0]


@pytest.fixture(scope="module")
def export_tp2(tmp_path_factory, llama_tp2):
    dest = tmp_path_factory.mktemp("faults") / "vllm"
    export(llama_tp2, dest, "vllm")
    return dest


def edited(copy_of, folder: Path, name: str, edit) -> Path:
    """A copy of `folder` whose file `name` is edit(its text)."""
    dest = copy_of(folder)
    path = dest / name
    path.write_text(edit(path.read_text()))
    return dest


def nested(text: str) -> str:
    """The document with a key nested DEEP arrays deep added to its first object."""
    return '{"zz": ' + "[" * DEEP + "]" * DEEP + ", " + text.lstrip()[1:]


def nested_format(text: str) -> str:
    """The format replaced by DEEP nested arrays: the schema fails on it before any nesting, the
    envelope read after it recurses."""
    data = json.loads(text)
    del data["format"]
    return '{"format": ' + "[" * DEEP + "]" * DEEP + ", " + json.dumps(data)[1:]


# --- item 9: crafted export manifests -----------------------------------------------------------


def _shape(d):
    d["files"][0]["tensors"][0]["shape"][0] = -3


def _dtype(d):
    d["files"][0]["tensors"][0]["dtype"] = "Q7"


def _constant(d):
    d["files"][0]["tensors"][0]["value"] = [1.0, 2.0]  # two values for a [128, 64] tensor


@pytest.mark.parametrize(
    "edit, wanted",
    [
        (_shape, "`$.files[0].tensors[0].shape[0]`"),
        (_dtype, "files[0].tensors[0] (model.embed_tokens.weight).dtype: 'Q7' is not a safetensors dtype"),
        (_constant, "files[0].tensors[0] (model.embed_tokens.weight).value: [1.0, 2.0] is not a constant tpshard writes as BF16 [128, 64]"),
    ],
)
def test_a_crafted_export_manifest_is_one_line_exit_2(export_tp2, copy_of, llama, edit, wanted):
    dest = copy_of(export_tp2)
    path = dest / EXPORT_MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    one_line_exit_2(run_cli("check", dest), wanted)
    one_line_exit_2(run_cli("check", dest, "--source", llama), wanted)


@pytest.mark.parametrize("how", [nested, nested_format])
def test_deep_nesting_in_an_export_manifest_is_one_line_exit_2(export_tp2, copy_of, llama, llama_tp2, how):
    dest = edited(copy_of, export_tp2, EXPORT_MANIFEST_NAME, how)
    one_line_exit_2(run_cli("check", dest), "nested deeper than any tpshard document")
    one_line_exit_2(run_cli("check", dest, "--source", llama), "nested deeper than any tpshard document")
    # --force replaces it? Not a folder tpshard can show it wrote: refused, left as it is.
    one_line_exit_2(run_cli("export", llama_tp2, "-o", dest, "--format", "vllm", "--force"), "is not a tpshard output")


def test_deep_nesting_in_a_split_manifest_is_one_line_exit_2_for_every_command(llama_tp2, copy_of, tmp_path, llama):
    for how in (nested, nested_format):
        bad = edited(copy_of, llama_tp2, MANIFEST_NAME, how)
        for args in (
            ("check", bad),
            ("check", bad, "--source", llama),
            ("check", llama_tp2, "--from", bad),
            ("reshard", bad, "-o", tmp_path / "r", "--tp", "1"),
            ("export", bad, "-o", tmp_path / "e", "--format", "vllm"),
            ("merge", bad, "-o", tmp_path / "m"),
        ):
            one_line_exit_2(run_cli(*args), "nested deeper than any tpshard document")
        for load in (tpshard.open_rank, tpshard.load_rank):
            with pytest.raises(OutputError, match="nested deeper than any tpshard document"):
                load(bad, 0)
        shutil.rmtree(bad)


# --- item 7: links ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["model-rank-1-part-0.safetensors", "config.json"])
def test_a_symbolic_link_in_an_export_fails_its_check(export_tp2, copy_of, tmp_path, llama, name):
    """The link points at the very bytes that were there: only the link itself is wrong."""
    dest = copy_of(export_tp2)
    target = tmp_path / f"elsewhere-{name}"
    shutil.move(dest / name, target)
    (dest / name).symlink_to(target)
    for report in (tpshard.check(dest), tpshard.check(dest, llama)):
        assert not report.ok and any(f"{name} is a symbolic link to {target}" in p.message for p in report.problems), report.problems
    r = run_cli("check", dest)
    assert r.returncode == 1 and "symbolic link" in r.stdout


# --- item 6: --force replaces only what tpshard wrote ----------------------------------------------


def test_force_keeps_an_export_that_holds_a_file_the_user_added(export_tp2, copy_of, llama_tp2):
    dest = copy_of(export_tp2)
    (dest / "notes.txt").write_text("mine")
    one_line_exit_2(run_cli("export", llama_tp2, "-o", dest, "--format", "sglang", "--force"), "is not a tpshard output")
    assert (dest / "notes.txt").read_text() == "mine" and tpshard.check(dest).ok
    (dest / "notes.txt").unlink()
    export(llama_tp2, dest, "sglang", force=True)  # only its own files again: replaced
    assert read_export_manifest(dest).engine == "sglang"


# --- item 8: a killed split --format --------------------------------------------------------------

# `split --format vllm` of argv[1] to argv[2] at tp 2, killed (SIGKILL) when its hidden tpshard
# output is staged (written whole, not yet in place in its scratch folder).
KILL_SPLIT_FORMAT = """
import os, signal, sys
import tpshard.publish as pub
pub.crash_point = lambda where: os.kill(os.getpid(), signal.SIGKILL) if where == "staged" else None
from tpshard.cli import main
sys.argv = ["tpshard", "split", sys.argv[1], "-o", sys.argv[2], "--tp", "2", "--format", "vllm"]
main()
"""


def test_the_next_split_format_removes_what_a_killed_one_left(llama, tmp_path):
    dest = tmp_path / "vllm"
    mine = tmp_path / ".vllm.tpshard-split-mine"  # hidden-looking, but not tpshard's: kept
    mine.mkdir()
    (mine / "data").write_text("user data")
    p = subprocess.run([sys.executable, "-c", KILL_SPLIT_FORMAT, str(llama), str(dest)], capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    left = sorted(e.name for e in tmp_path.iterdir())
    assert len(left) == 2 and not dest.exists(), left  # the killed run's scratch folder, beside mine
    r = run_cli("split", llama, "-o", dest, "--tp", "2", "--format", "vllm")
    assert r.returncode == 0, r.stderr
    assert sorted(e.name for e in tmp_path.iterdir()) == [".vllm.tpshard-split-mine", "vllm"]
    assert (mine / "data").read_text() == "user data" and tpshard.check(dest, llama).ok


def test_a_live_runs_scratch_folder_is_left_alone(tmp_path):
    """A second run for the same destination (refused later by the lock) never removes the
    scratch folder of one that is still running."""
    from tpshard.publish import scratch_folder

    dest = tmp_path / "vllm"
    with scratch_folder(dest) as first:
        (first / "out").mkdir()
        with scratch_folder(dest) as second:
            assert first.is_dir() and (first / "out").is_dir() and second != first
        assert first.is_dir() and not second.exists()
    assert not first.exists()


# --- item 4: the copied files against the source ---------------------------------------------------


def reseal_config(folder: Path, manifest_name: str, change, copies=(".",)) -> None:
    """config.json changed (`change(config)`, or removed when None) in each folder of `copies`
    (inside `folder`) and its record in the manifest made to agree: only the source can tell."""
    path = folder / manifest_name
    data = json.loads(path.read_text())
    extras = data["source"]["extra_files"]
    if change is None:
        extras[:] = [e for e in extras if e["name"] != "config.json"]
    for copy in copies:
        config_path = folder / copy / "config.json"
        if change is None:
            config_path.unlink()
            continue
        config = json.loads(config_path.read_text())
        change(config)
        raw = json.dumps(config).encode()
        config_path.write_bytes(raw)
        for e in extras:
            if e["name"] == "config.json":
                e["checksum"], e["size"] = hashlib.sha256(raw).hexdigest(), len(raw)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change, finding", [(lambda c: c.update(rms_norm_eps=0.5), "config.json: differs from the source's"), (None, "config.json: in the source, but not copied into the export")])
def test_check_source_compares_the_exports_copied_files(export_tp2, copy_of, llama, llama_tp2, change, finding):
    dest = copy_of(export_tp2)
    reseal_config(dest, EXPORT_MANIFEST_NAME, change)
    assert tpshard.check(dest).ok  # consistent with its manifest
    for report in (tpshard.check(dest, llama), tpshard.check(dest, from_output=llama_tp2)):
        assert not report.ok and any(p.check == "extras" and finding in p.message for p in report.problems), report.problems


def test_a_config_changed_in_the_output_before_the_export_is_caught(llama_tp2, copy_of, tmp_path, llama):
    out = copy_of(llama_tp2)
    reseal_config(out, MANIFEST_NAME, lambda c: c.update(rms_norm_eps=0.5), ("rank-00000", "rank-00001"))
    assert not tpshard.check(out, llama).ok  # as check OUT --source catches it ...
    export(out, tmp_path / "vllm", "vllm")
    report = tpshard.check(tmp_path / "vllm", llama)  # ... so does check DEPLOY --source
    assert not report.ok and any("config.json: differs from the source's" in p.message for p in report.problems), report.problems


# --- item 5: every option check takes on an export is honoured ----------------------------------------


def test_check_from_another_checkpoints_output_fails(export_tp2, tmp_path, llama_tp2):
    from checkpoints import make_checkpoint

    other = make_checkpoint(tmp_path / "other", "llama", max_shard_size="100KB", seed=1)
    tpshard.split(other, tmp_path / "other-tp2", tpshard.Topology(tp=2))
    r = run_cli("check", export_tp2, "--from", tmp_path / "other-tp2")
    assert r.returncode == 1 and "bit-exact" not in r.stdout + r.stderr and "not the one" in r.stdout, r.stdout + r.stderr
    report = tpshard.check(export_tp2, from_output=llama_tp2)
    assert report.ok and report.tensors_reassembled == len(tpshard.read_manifest(llama_tp2).tensors)
    one_line_exit_2(run_cli("check", export_tp2, "--from", llama_tp2, "--source", tmp_path / "other"), "give one")


def test_check_pp_on_an_export_is_honoured(llama, tmp_path, export_tp2):
    assert tpshard.check(export_tp2, pp=1).ok and tpshard.check(export_tp2, pp_layers="2").ok
    report = tpshard.check(export_tp2, pp=2)
    assert not report.ok and "the output was split for pp 1, not --pp 2" in report.problems[0].message
    pp2 = tmp_path / "pp2"
    assert run_cli("split", llama, "-o", pp2, "--tp", "1", "--pp", "2", "--format", "vllm").returncode == 0
    for args, code in ((("--pp", "3"), 1), (("--pp", "1"), 1), (("--pp-layers", "2"), 1), (("--pp", "2"), 0), (("--pp-layers", "1,1"), 0)):
        r = run_cli("check", pp2, *args)
        assert r.returncode == code, (args, r.stdout + r.stderr)
        if code:
            assert "[stages] the output was split for pp 2 (layers 1,1)" in r.stdout, r.stdout
    one_line_exit_2(run_cli("check", pp2, "--pp-layers", "2,0"), "every stage needs at least one layer")
