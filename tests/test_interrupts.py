"""Ctrl-C and a killed parent (docs/reliability.md "Interrupted, or the parent killed").

Ctrl-C in a terminal sends SIGINT to the whole foreground process group, ranks included: here the
command runs in a pseudo-terminal, in a process group of its own, and the signal goes to that group
(os.killpg), at several points of a verify (the parent importing, the ranks starting, the ranks
computing). Compared with what: exit 130, the one "interrupted" line and no traceback, and no
rank process left afterwards. A parent killed with SIGKILL: its ranks must be gone within seconds
(the kernel's parent-death signal, tpshard.lifetime).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

def alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, seconds: float) -> list[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(alive(p) for p in pids):
        time.sleep(0.1)
    left = [p for p in pids if alive(p)]
    for p in left:  # the old behaviour: leave no process behind the test
        os.kill(p, signal.SIGKILL)
    return left


def in_a_terminal(cmd: list[str]):
    """`cmd` on a pseudo-terminal, leading a process group of its own; (process, its output so far)."""
    master, slave = os.openpty()
    env = {**os.environ, "COLUMNS": "160"}
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env)
    os.close(slave)
    out = bytearray()

    def read():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer has gone
                break
            if not data:
                break
            out.extend(data)
        os.close(master)

    threading.Thread(target=read, daemon=True).start()
    return proc, out


def loaded(pid: int, library: str) -> bool:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return library in f.read()
    except OSError:
        return False


def ranks_of(proc) -> list[int]:
    """The live processes below `proc` (from /proc: the test needs no tpshard code for it)."""
    found, todo = [], [proc.pid]
    while todo:
        pid = todo.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(c) for c in f.read().split()]
        except OSError:
            kids = []
        found += kids
        todo += kids
    return [p for p in found if alive(p)]


def interrupted_in_a_terminal(cmd: list[str], when: str) -> tuple[int, list[str], list[int]]:
    """Run `cmd` in a terminal, Ctrl-C its process group at `when`: (exit code, its output's lines
    but the launch lines, the processes below it that outlived it)."""
    proc, out = in_a_terminal(cmd)
    if when == "importing":  # tpshard's modules loading (msgspec mapped); not Python's own start-up before them
        end = time.monotonic() + 60
        while not loaded(proc.pid, "msgspec") and time.monotonic() < end:
            time.sleep(0.005)
    else:  # two ranks and multiprocessing's resource tracker (or torchrun's agent)
        end = time.monotonic() + 120
        while len(ranks_of(proc)) < 3 and time.monotonic() < end and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.2 if when == "ranks starting" else 4.0)
    below = ranks_of(proc)
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=60)
    left = wait_gone(below, 10)
    time.sleep(0.3)  # the last output through the terminal
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode(errors="replace"))  # colours, the spinner's redraws
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    launch = ("verify: ", "*****", "Setting OMP_NUM_THREADS")  # tpshard's launch line, torchrun's banner
    spinner = re.compile("[\u2800-\u28ff]")  # the transient progress line (its braille frames), redrawn in place
    lines = [line.strip() for line in text.splitlines()]
    return code, [line for line in lines if line and not line.startswith(launch) and not spinner.match(line)], left


@pytest.mark.parametrize(
    "when", ["importing", pytest.param("ranks starting", marks=pytest.mark.slow), pytest.param("ranks computing", marks=pytest.mark.slow)]
)
def test_ctrl_c_in_a_terminal_stops_every_rank_in_one_line_exit_130(llama_tp2, llama, when):
    cmd = [sys.executable, "-m", "tpshard", "verify", str(llama_tp2), "--source", str(llama)]
    if when == "ranks computing":  # --model: the ranks still compute 4 s after they start, also on a quiet machine
        cmd.append("--model")
    code, lines, left = interrupted_in_a_terminal(cmd, when)
    assert code == 130 and len(lines) == 1 and lines[0].startswith("interrupted"), (code, lines)
    assert not left, f"processes {left} outlived the interrupted verify"


@pytest.mark.slow
def test_ctrl_c_under_torchrun_stops_the_agent_and_every_rank(llama_tp2, llama):
    cmd = [sys.executable, "-m", "tpshard", "verify", str(llama_tp2), "--source", str(llama), "--torchrun", "--nproc-per-node 2"]
    code, lines, left = interrupted_in_a_terminal(cmd, "ranks starting")
    assert code == 130 and len(lines) == 1 and lines[0].startswith("interrupted"), (code, lines)
    assert not left, f"processes {left} outlived the interrupted verify"


SLEEPING_RANKS = textwrap.dedent(
    """
    import os, sys, time
    from tpshard.runtime import run_local

    def sleeper(info, folder):
        open(os.path.join(folder, f"rank-{info.rank}"), "w").write(str(os.getpid()))
        time.sleep(120)  # a long compute
        return info.rank

    if __name__ == "__main__":
        run_local(sleeper, 2, sys.argv[1], backend="gloo", timeout_s=300)
    """
)


def test_ranks_end_within_seconds_of_their_parent_killed(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(SLEEPING_RANKS)
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], start_new_session=True, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 120
    while len(list(tmp_path.glob("rank-*"))) < 2 and time.monotonic() < end:
        time.sleep(0.1)
    time.sleep(0.2)
    ranks = [int(p.read_text()) for p in tmp_path.glob("rank-*")]
    assert len(ranks) == 2 and all(alive(p) for p in ranks)
    parent.send_signal(signal.SIGKILL)  # kill -9: no handler, no cleanup in the parent
    parent.wait()
    left = wait_gone(ranks, 5)
    assert not left, f"ranks {left} kept running after their parent was killed"
