"""Issue 10 items 1, 2 and 7: tpshard deletes only what it wrote, one writer per output, a kill at any
point leaves the old or the new output whole, and faults (disk full, read-only, bad names, bad
options, broken merge parts, Ctrl-C) end in one line with the documented exit code and nothing
partial left."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tpshard
from tpshard import publish
from tpshard.errors import OutputError, TopologyError, UsageError
from tpshard.manifest import MANIFEST_NAME, read_manifest
from tpshard.merge import merge
from tpshard.topology import Topology


def split(src, out, tp=2, **kw):
    tpshard.split(src, out, Topology(tp=tp), **kw)
    return out


def listing(folder: Path) -> list[str]:
    return sorted(os.listdir(folder))


def whole(out: Path) -> int:
    """The tp of the complete output at `out` (check passes), or fail."""
    report = tpshard.check(out)
    assert report.ok, report.problems
    return read_manifest(out).plan.topology.tp


def run_python(code: str, *args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True, text=True, timeout=timeout)


def cli(capsys, *args) -> tuple[int, str]:
    """The CLI run in this process (a subprocess costs seconds of imports): exit code, stderr."""
    from tpshard.cli import main

    capsys.readouterr()
    argv = sys.argv
    sys.argv = ["tpshard", *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    return code, capsys.readouterr().err


def run_cli(*args) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    return p


# ---- 1. never delete what tpshard did not write ------------------------------------------------


def test_force_refuses_folders_tpshard_did_not_write(llama, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="is not a tpshard output; tpshard replaces only its own outputs"):
        split(llama, mine, force=True)
    assert (mine / "notes.txt").read_text() == "keep me"

    # A manifest alone does not make a folder ours: its other content must be rank folders.
    out = split(llama, tmp_path / "out")
    (out / "results.csv").write_text("1,2,3")
    with pytest.raises(OutputError, match="not a tpshard output"):
        split(llama, out, force=True)
    assert (out / "results.csv").exists()
    (out / "results.csv").unlink()
    (out / "rank-00000" / "sub").mkdir()
    with pytest.raises(OutputError, match="not a tpshard output"):
        split(llama, out, force=True)
    (out / "rank-00000" / "sub").rmdir()

    # Another program's manifest name with another format; a link to a real output.
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / MANIFEST_NAME).write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(OutputError, match="not a tpshard output"):
        split(llama, fake, force=True)
    link = tmp_path / "link"
    link.symlink_to(out)
    with pytest.raises(OutputError, match="not a tpshard output"):
        split(llama, link, force=True)
    assert whole(out) == 2

    # A file at -o.
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="not a tpshard output"):
        split(llama, tmp_path / "afile", force=True)


def test_output_equal_to_inside_or_holding_the_source_is_refused(llama, tmp_path, copy_of):
    src = copy_of(llama)
    before = {p: p.read_bytes() for p in src.iterdir()}
    for out, why in [
        (src, "is the input"),
        (src / "out", "lies inside the input"),
        (src / "a" / "b", "lies inside the input"),
        (src.parent, "holds the input"),
        (Path(os.path.relpath(src, Path.cwd())), "is the input"),
    ]:
        with pytest.raises(OutputError, match=why):
            split(src, out, force=True)
    assert {p: p.read_bytes() for p in src.iterdir()} == before
    # A link to the source counts as the source.
    link = tmp_path / "to-src"
    link.symlink_to(src)
    with pytest.raises(OutputError, match="is the input"):
        split(src, link, force=True)

    # merge: -o may not be one of the parts either.
    a = tpshard.split(src, tmp_path / "a", Topology(tp=2), ranks=[0]) and tmp_path / "a"
    b = tpshard.split(src, tmp_path / "b", Topology(tp=2), ranks=[1]) and tmp_path / "b"
    for out, why in [(a, "is the input"), (a / "m", "lies inside the input"), (tmp_path, "holds the input")]:
        with pytest.raises(OutputError, match=why):
            merge([a, b], out, force=True)
    assert whole(a) == 2 and whole(b) == 2


def test_empty_folder_and_force_replace(llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(OutputError, match="already exists; pass --force"):
        split(llama, out)
    split(llama, out, force=True)
    split(llama, out, tp=4, force=True)
    assert whole(out) == 4
    assert listing(tmp_path) == ["out"]  # no staging, lock or old copy left


# A subprocess that splits `argv[1]` to `argv[2]` at tp 4 with --force and kills itself (SIGKILL)
# at the chosen point; `fallback` makes the system lack renameat2.
KILLER = """
import os, signal, sys
import tpshard, tpshard.publish as pub
from tpshard.topology import Topology
src, out, point, mode = sys.argv[1:5]
if mode == "fallback":
    pub.exchange = lambda a, b: False
def crash(where):
    if where == point:
        os.kill(os.getpid(), signal.SIGKILL)
pub.crash_point = crash
seen = [0]
def on_tensor(n):
    seen[0] += 1
    if point == "writing" and seen[0] == 5:
        os.kill(os.getpid(), signal.SIGKILL)
tpshard.split(src, out, Topology(tp=4), force=True, on_tensor=on_tensor, workers=1)
print("survived")
"""


@pytest.mark.parametrize(
    "point, mode, after",
    [
        ("writing", "exchange", 2),
        ("staged", "exchange", 2),  # data and manifest written, not yet published
        ("before-publish", "exchange", 2),
        ("exchanged", "exchange", 4),  # new in place, the old one under the staging name
        ("removed rank-00000", "exchange", 4),  # while the old one is being removed
        ("moved-old", "fallback", None),  # nothing at out for a moment: the next run puts the old back
        ("renamed-new", "fallback", 4),
        ("removed rank-00001", "fallback", 4),
    ],
)
def test_a_kill_at_any_point_leaves_the_old_or_the_new_output_whole(llama, tmp_path, point, mode, after):
    out = split(llama, tmp_path / "out", tp=2)
    # Hidden-looking folders that tpshard did not write are never touched.
    mine = tmp_path / ".out.tpshard-staging-mine"
    mine.mkdir()
    (mine / "data").write_text("user data")
    p = run_python(KILLER, llama, out, point, mode)
    assert p.returncode == -signal.SIGKILL, p.stderr
    if after is None:
        assert not out.exists()
        with pytest.raises(OutputError, match="already exists"):  # the next run restores the old output ...
            split(llama, out, tp=8)
        assert whole(out) == 2  # ... whole
    else:
        assert whole(out) == after
    split(llama, out, tp=8, force=True)  # the next run cleans up what the kill left, and only that
    assert whole(out) == 8
    assert listing(tmp_path) == [".out.tpshard-staging-mine", "out"]
    assert (mine / "data").read_text() == "user data"


def test_kill_during_a_first_split_leaves_no_output(llama, tmp_path):
    out = tmp_path / "out"
    p = run_python(KILLER, llama, out, "before-publish", "exchange")
    assert p.returncode == -signal.SIGKILL
    assert not out.exists()
    split(llama, out)
    assert whole(out) == 2 and listing(tmp_path) == ["out"]


def test_exchange_swaps_two_folders(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    if not publish.exchange(a, b):
        pytest.skip("this system has no renameat2 RENAME_EXCHANGE; the fallback is tested above")
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


# ---- 2. one writer per output ------------------------------------------------------------------

# A split that stops once its output is staged, says so, and waits for a go file.
WAITER = """
import os, sys, time
import tpshard, tpshard.publish as pub
from tpshard.topology import Topology
src, out, ready, go = sys.argv[1:5]
def pause(where):
    if where == "staged":
        open(ready, "w").close()
        while not os.path.exists(go):
            time.sleep(0.02)
pub.crash_point = pause
tpshard.split(src, out, Topology(tp=4), force=True)
"""


def test_two_writers_one_refuses(llama, tmp_path, capsys):
    out, ready, go = tmp_path / "out", tmp_path / "ready", tmp_path / "go"
    split(llama, out, tp=2)
    first = subprocess.Popen([sys.executable, "-c", WAITER, str(llama), str(out), str(ready), str(go)], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.02)
        with pytest.raises(OutputError, match="another tpshard is writing it"):
            split(llama, out, tp=8, force=True)
        code, stderr = cli(capsys, "split", llama, "-o", out, "--tp", 8, "--force")
        assert code == 2 and "another tpshard is writing it" in stderr
        a = tpshard.split(llama, tmp_path / "a", Topology(tp=4), ranks=[0]) and tmp_path / "a"
        with pytest.raises(OutputError, match="another tpshard is writing it"):
            merge([a], out, force=True)
        assert whole(out) == 2  # the old output is untouched while the writer works
    finally:
        go.touch()
        assert first.wait(60) == 0, first.stderr.read()
    assert whole(out) == 4


def test_lock_is_released_and_taken_again(tmp_path):
    out = tmp_path / "out"
    with publish.output_lock(out):
        with pytest.raises(OutputError, match="another tpshard"):
            with publish.output_lock(out):
                pass
    with publish.output_lock(out):
        pass
    assert listing(tmp_path) == []


# ---- 7. faults end in one line, nothing partial ------------------------------------------------


def test_disk_full_leaves_nothing_and_keeps_the_old_output(llama, tmp_path, monkeypatch):
    out = split(llama, tmp_path / "out", tp=2)
    calls = [0]

    def full(real):  # the disk fills after 20 writes, single or gathering
        def write(fd, data, offset):
            calls[0] += 1
            if calls[0] > 20:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real(fd, data, offset)

        return write

    monkeypatch.setattr(os, "pwrite", full(os.pwrite))
    monkeypatch.setattr(os, "pwritev", full(os.pwritev))
    with pytest.raises(OutputError, match="No space left on device.*nothing was written; free space"):
        split(llama, out, tp=4, force=True)
    with pytest.raises(OutputError, match="No space left on device"):
        split(llama, tmp_path / "new", tp=4)
    monkeypatch.undo()
    assert whole(out) == 2 and listing(tmp_path) == ["out"]


@pytest.fixture
def tmpfs(tmp_path):
    """A real small file system (root only; skipped elsewhere)."""
    mounted = []

    def mount(name: str, size: str, *opts: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        options = ",".join((f"size={size}",) + opts)
        if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
            pytest.skip("needs root to mount a tmpfs")
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def test_a_real_full_disk_and_a_read_only_one(llama, tmp_path, tmpfs, capsys):
    small = tmpfs("small", "96k")
    code, stderr = cli(capsys, "split", llama, "-o", small / "out", "--tp", 4)
    assert code == 2 and "No space left on device" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert listing(small) == []
    ro = tmpfs("ro", "1m", "ro")
    code, stderr = cli(capsys, "split", llama, "-o", ro / "out", "--tp", 2)
    assert code == 2 and "Read-only file system" in stderr, stderr
    assert listing(ro) == []


def test_read_only_folder_without_root(llama, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "ro"))

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(OutputError, match="Read-only file system.*choose a writable -o"):
        split(llama, tmp_path / "ro" / "out")


def test_bad_output_names(llama, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match="afile is a file, not a folder"):
        split(llama, tmp_path / "afile" / "sub" / "out")
    with pytest.raises(OutputError, match="choose a shorter name"):
        split(llama, tmp_path / ("x" * 240))
    with pytest.raises(OutputError, match="choose a shorter name"):
        split(llama, tmp_path / ("x" * 300))
    with pytest.raises(OutputError, match="name a new folder"):
        split(llama, tmp_path / "..")
    assert listing(tmp_path) == ["afile"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers", "0"], "--workers 0: must be an integer from 1 to 256"),
        (["--workers", "100000"], "--workers 100000"),
        (["--ranks", "3-1"], "is not a range of ranks"),
        (["--ranks", "0-9999999999"], "is not a range of ranks"),
        (["--ranks", "-1"], "expected a list like"),
        (["--ranks", "a"], "expected a list like"),
        (["--tp", "0"], "--tp must be an integer from 1 to 65536"),
        (["--tp", "100000000"], "--tp must be an integer from 1 to 65536"),
        (["--workers", "x"], "Invalid value for '--workers'"),
    ],
)
def test_out_of_range_options_exit_2_in_one_line(llama, tmp_path, capsys, args, message):
    code, stderr = cli(capsys, "split", llama, "-o", tmp_path / "out", *args)
    assert code == 2 and message in " ".join(stderr.split()), stderr
    assert listing(tmp_path) == []


def test_library_refuses_bad_workers(llama, tmp_path):
    with pytest.raises(UsageError):
        split(llama, tmp_path / "out", workers=0)
    with pytest.raises(UsageError):
        tpshard.check(tmp_path, workers=-1)
    with pytest.raises(TopologyError):
        Topology(tp=True)


def test_merge_parts_with_missing_or_odd_folders(llama, tmp_path):
    copies = iter(range(100))

    def copy_of(path: Path) -> Path:
        dst = tmp_path / f"copy-{next(copies)}"
        subprocess.run(["cp", "-a", str(path), str(dst)], check=True)
        return dst

    a = tpshard.split(llama, tmp_path / "a", Topology(tp=2), ranks=[0]) and tmp_path / "a"
    b = tpshard.split(llama, tmp_path / "b", Topology(tp=2), ranks=[1]) and tmp_path / "b"
    out = tmp_path / "m"

    def refused(parts, message):
        with pytest.raises(OutputError, match=message):
            merge(parts, out)
        assert not out.exists()

    refused([a, tmp_path / "nope"], "no such folder")
    refused([a, tmp_path], "not a tpshard output")
    broken = copy_of(b)
    os.rename(broken / "rank-00001", broken / "rank-1")
    refused([a, broken], "rank-00001 is missing or not a folder")
    broken = copy_of(b)
    (broken / "rank-00001" / "config.json").unlink()
    refused([a, broken], "rank-00001/config.json is missing or not a plain file")
    broken = copy_of(b)
    victim = next((broken / "rank-00001").glob("model-tp-*.safetensors"))
    victim.unlink()
    victim.symlink_to(next((a / "rank-00000").glob("model-tp-*.safetensors")))
    refused([a, broken], "is missing or not a plain file")
    broken = copy_of(b)
    with open(next((broken / "rank-00001").glob("model-tp-*.safetensors")), "ab") as f:
        f.write(b"\0")
    refused([a, broken], "bytes, the manifest says")
    # Stray files in a part are not taken into the merged output.
    (b / "rank-00001" / "stray.txt").write_text("x")
    merge([a, b], out)
    assert "stray.txt" not in os.listdir(out / "rank-00001")
    assert tpshard.check(out, llama).ok
    p = run_cli("merge", a, tmp_path / "nope", "-o", tmp_path / "m2")  # a real process: no traceback
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1


# Ctrl-C: SIGINT sent to the process at a chosen point of a command run as the CLI runs it.
INTERRUPT = """
import os, signal, sys
import tpshard.publish as pub, tpshard.writer as writer
from tpshard.cli import main
import tpshard.digest as digest  # check hashes a file's tensors with its range_digests
point = sys.argv[1]
def stop(*args):
    os.kill(os.getpid(), signal.SIGINT)
if point == "staged":
    pub.crash_point = lambda where: stop() if where == "staged" else None
elif point == "writing":
    real = writer._copy_small
    n = [0]
    def copy(*a):
        n[0] += 1
        if n[0] == 3:
            stop()
        return real(*a)
    writer._copy_small = copy
elif point == "check":
    real_digest = digest.tensor_digest
    calls = [0]
    def tensor_digest(*a, **k):
        calls[0] += 1
        if calls[0] == 2:
            stop()
        return real_digest(*a, **k)
    digest.tensor_digest = tensor_digest
sys.argv = ["tpshard", *sys.argv[2:]]
main()
"""


@pytest.mark.parametrize("point", ["staged", "writing"])
def test_ctrl_c_in_split_exits_130_and_leaves_the_old_output(llama, tmp_path, point):
    out = split(llama, tmp_path / "out", tp=2)
    p = run_python(INTERRUPT, point, "split", llama, "-o", out, "--tp", 4, "--force", "--workers", 1)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 130 and "interrupted" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert whole(out) == 2 and listing(tmp_path) == ["out"]


def test_ctrl_c_in_check_exits_130(llama, tmp_path):
    out = split(llama, tmp_path / "out", tp=2)
    p = run_python(INTERRUPT, "check", "check", out, "--workers", 1)
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 130 and "interrupted" in p.stderr, p.stderr
