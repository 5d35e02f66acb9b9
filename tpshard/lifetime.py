"""A rank process lives no longer than the process that started it (docs/reliability.md).

A parent killed with SIGKILL (kill -9, an OOM kill, a CI runner's timeout) cannot stop its ranks:
they are re-parented to init and would keep computing, and on a GPU box keep the GPUs. Linux's
parent-death signal (prctl PR_SET_PDEATHSIG, man 2 prctl) has the kernel SIGKILL the rank when its
parent goes: `tpshard verify`'s parent for a spawned rank, torchrun's elastic agent under torchrun,
and, for `verify --torchrun`, the agent itself when tpshard's parent goes. The signal follows the
parent *thread* that started the child; tpshard starts its children from the main thread.

Ctrl-C: the ranks ignore SIGINT (`ignoring_sigint` around their start: an ignored signal stays
ignored across exec, and Python keeps it so), so a terminal's Ctrl-C, which reaches the whole
foreground process group, is handled by the parent alone: it stops every rank, says one line and
exits 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

from tpshard.collector import libc

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_prctl = libc("prctl", "c_int", "c_ulong")


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent exits; exit now if it has already.

    `parent`: the pid the parent had (the child cannot learn it once the parent is gone); without
    it, a parent of pid 1 means the original one is gone (a subreaper aside). Nothing where there
    is no prctl (not Linux)."""
    if _prctl is None:
        return
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before the call above: the kernel would never send the signal.
    gone = os.getppid() != parent if parent is not None else os.getppid() == 1
    if gone:
        os._exit(1)


def set_death_signal() -> None:
    """For subprocess.Popen(preexec_fn=...): the child is SIGKILLed when this process exits."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@contextlib.contextmanager
def ignoring_sigint():
    """Processes started inside inherit SIGINT ignored: Ctrl-C is the parent's to handle (only the
    main thread may set a handler: elsewhere, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (Linux; [] where it cannot be read)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except (OSError, ValueError):
                continue
            found += kids
            todo += kids
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL `pid`, its process group and every process below it (torchrun's workers each lead
    a session of their own, so the agent's group alone would leave them running)."""
    below = descendants(pid)
    for target in (pid, *below):
        with contextlib.suppress(OSError):
            os.kill(target, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)
