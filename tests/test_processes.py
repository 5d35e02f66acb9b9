"""The split's copy on forked worker processes (tpshard.processes, docs/performance.md "Processes").

Compared with what: the same split on one worker (no fork) byte for byte; a fault in a worker
raised in the parent as it is raised without workers, with no process and no output left behind;
a Ctrl-C while workers run leaves none of them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tpshard.processes as processes
from tests.checkpoints import make_checkpoint
from tpshard import Topology, split
from tpshard.manifest import rank_dir
from tpshard.processes import run_forked

TESTS = Path(__file__).parent


def children() -> set[int]:
    """This process's live (not zombie) children, from /proc (other tests may leave some of their
    own, e.g. multiprocessing's resource tracker: compare before and after)."""
    pids = []
    for task in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            with open(f"/proc/{os.getpid()}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:  # a thread that ended since the listing (run_forked's feeder)
            pass
    live = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] != "Z":
                    live.append(pid)
        except OSError:
            pass
    return set(live)


@pytest.fixture(scope="module")
def many_files(tmp_path_factory) -> Path:
    """A tiny Llama in many files: many copy jobs, so two workers both get some."""
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    make_checkpoint(path, "llama", max_shard_size="20KB")
    return path


def files_of(out: Path) -> dict[str, bytes]:
    """Every file of an output, the manifest included, by path."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
def test_two_worker_processes_write_what_one_thread_writes(many_files, tmp_path, monkeypatch, checksum):
    from tpshard.manifest import Options

    before = children()
    forks = []
    real_fork = os.fork
    monkeypatch.setattr(processes.os, "fork", lambda: forks.append(1) or real_fork())
    seen = []
    split(many_files, tmp_path / "two", Topology(tp=4), Options(checksum=checksum), workers=2, on_tensor=seen.append)
    assert len(forks) == 2  # the copy ran on two processes
    forks.clear()
    split(many_files, tmp_path / "one", Topology(tp=4), Options(checksum=checksum), workers=1)
    assert not forks
    assert files_of(tmp_path / "two") == files_of(tmp_path / "one")
    from tpshard.checkpoint import open_checkpoint

    assert sum(seen) == sum(i.nbytes for i in open_checkpoint(many_files).tensors.values())  # every byte reported, once
    assert children() <= before


def test_a_fault_in_a_worker_is_the_parents_fault_and_leaves_nothing(many_files, tmp_path):
    before = children()
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in many_files.iterdir():
        (broken / p.name).write_bytes(p.read_bytes())
    last = sorted(broken.glob("*.safetensors"))[-1]
    os.truncate(last, last.stat().st_size - 100)  # the header says more data than the file holds
    errors = []
    for workers in (1, 2):
        with pytest.raises(Exception) as e:
            split(broken, tmp_path / f"out{workers}", Topology(tp=2), workers=workers)
        errors.append((type(e.value), str(e.value)))
        assert not (tmp_path / f"out{workers}").exists()
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging folder left
    assert errors[0] == errors[1]
    assert children() <= before


def _job(task, progress):
    """Reports its task as progress; "boom" raises, "kill" dies of SIGKILL."""
    if task == "boom":
        raise ValueError("task boom failed")
    if task == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    progress(task)


def test_run_forked_passes_progress_and_faults_on():
    before = children()
    seen = []
    run_forked(list(range(1, 101)), _job, 2, seen.append)
    assert sum(seen) == 5050
    with pytest.raises(ValueError, match="task boom failed"):
        run_forked([1, 2, "boom", 3], _job, 2, None)
    with pytest.raises(OSError, match="ended with signal 9"):
        run_forked([1, "kill", 2], _job, 2, None)
    assert children() <= before


def _slow_job(task, progress):
    time.sleep(task / 10)
    progress(task)


def _no_room():
    raise OSError(28, "No space left on device")


def test_what_the_parent_does_meanwhile_runs_once_and_its_fault_stops_the_workers():
    """meanwhile runs in the parent while the workers copy (split's headers), once; its fault is
    raised as itself, with no worker left running."""
    before = children()
    calls, seen = [], []

    def meanwhile():
        calls.append(len(children() - before))  # the workers it overlaps with

    run_forked([1, 2, 3], _slow_job, 2, seen.append, meanwhile=meanwhile)
    assert calls == [2] and sum(seen) == 6
    with pytest.raises(OSError, match="No space left"):
        run_forked([5, 5, 5], _slow_job, 2, None, meanwhile=_no_room)
    assert children() <= before


def test_a_header_that_fails_while_the_workers_copy_leaves_nothing(many_files, tmp_path, monkeypatch):
    """The parent writes the headers while the workers copy: a full disk there stops the workers and
    leaves no output, no staging folder and no process, as a full disk anywhere else does."""
    import tpshard.writer as writer
    from tpshard.errors import OutputError

    before = children()
    written = []

    def full(plan, i, fd):
        written.append(os.getpid())
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(writer, "_write_header", full)
    with pytest.raises(OutputError, match="No space left on device"):
        split(many_files, tmp_path / "out", Topology(tp=4), workers=2)
    assert written == [os.getpid()]  # in the parent, once
    assert list(tmp_path.iterdir()) == []
    assert children() <= before


def test_ctrl_c_while_workers_run_leaves_none_of_them():
    script = textwrap.dedent(
        """
        import os, signal, threading, time
        from tpshard.processes import run_forked

        def kids():
            return open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()

        def interrupt():  # once both workers run (not a fixed delay: the machine may be slow)
            end = time.monotonic() + 20
            while len(kids()) < 2 and time.monotonic() < end:
                time.sleep(0.05)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        try:
            run_forked(list(range(8)), lambda task, progress: time.sleep(60), 2, None)
        except KeyboardInterrupt:
            print("interrupted", len(kids()))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30, env=env)
    assert done.stdout.split() == ["interrupted", "0"], done.stderr


def test_check_source_on_two_processes_finds_what_one_thread_finds(many_files, tmp_path, monkeypatch):
    """check --source's reassembly on forked workers: the same findings, in the same order, as on
    one thread, for an output with a byte flipped in two of its files and a file of another rank."""
    from tpshard import check

    before = children()
    out = tmp_path / "out"
    split(many_files, out, Topology(tp=4))
    files = sorted((out / rank_dir(1)).glob("*.safetensors"))
    for f in files[:2]:
        data = bytearray(f.read_bytes())
        data[-3] ^= 0x10
        os.unlink(f)  # a hard link shared with other ranks: break this copy only
        f.write_bytes(bytes(data))
    other = next(f for f in sorted((out / rank_dir(2)).glob("*.safetensors")) if not (out / rank_dir(1) / f.name).samefile(f))
    mine = out / rank_dir(1) / other.name
    os.unlink(mine)
    mine.write_bytes(other.read_bytes())
    forks = []
    real_fork = os.fork
    monkeypatch.setattr(processes.os, "fork", lambda: forks.append(1) or real_fork())
    two = check(out, source=many_files, workers=2)
    assert len(forks) == 2
    one = check(out, source=many_files, workers=1)
    assert len(forks) == 2
    assert not two.ok and two.found >= 3
    assert [(p.check, p.message) for p in two.problems] == [(p.check, p.message) for p in one.problems]
    assert two.tensors_reassembled == one.tensors_reassembled
    assert children() <= before


@pytest.mark.parametrize("workers", [1, 2])
def test_check_source_reports_the_output_findings_first_and_in_order(many_files, tmp_path, workers):
    """check --source makes the findings that read no tensor byte (layout, each rank's index) while
    its reassembly reads: they are reported as check without a source reports them, in its order,
    before those against the source."""
    from tpshard import check

    out = tmp_path / "out"
    split(many_files, out, Topology(tp=4))
    (out / rank_dir(3) / "notes.txt").write_text("stray")
    index = out / rank_dir(1) / "model.safetensors.index.json"
    index.write_bytes(index.read_bytes().replace(b'"weight_map"', b'"weight_map" ', 1))
    f = sorted((out / rank_dir(2)).glob("*.safetensors"))[0]
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01
    os.unlink(f)
    f.write_bytes(bytes(data))
    alone = [(p.check, p.message) for p in check(out, workers=workers).problems]
    assert [c for c, _ in alone] == ["stray", "files", "checksum", "checksum"]
    against = [(p.check, p.message) for p in check(out, source=many_files, workers=workers).problems]
    assert against[: len(alone)] == alone
    assert [c for c, _ in against[len(alone) :]] == ["reassembly"]
