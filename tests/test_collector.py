"""collector: the cyclic collector is off inside paused() and as it was after, also after a refusal;
the command freezes its objects at exit (no last collections over them) and keeps its output."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tpshard.checkpoint import open_checkpoint
from tpshard.collector import one_arena, paused
from tpshard.errors import CheckpointError


def test_paused_restores_the_collector_state():
    assert gc.isenabled()
    with paused():
        assert not gc.isenabled()
        with paused():  # nested: the outer one turns it back on, not the inner
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with paused():
            pass
        assert not gc.isenabled()  # off before: left off
    finally:
        gc.enable()


def test_a_refusal_inside_a_paused_function_turns_the_collector_back_on(tmp_path):
    with pytest.raises(CheckpointError):
        open_checkpoint(tmp_path / "missing")
    assert gc.isenabled()


def test_one_arena_is_set_where_glibc_is():
    """The command keeps worker threads to one C heap (glibc); elsewhere it asks nothing."""
    import ctypes

    try:
        glibc = bool(ctypes.CDLL(None).gnu_get_libc_version)
    except (OSError, AttributeError):
        glibc = False
    assert one_arena() == (glibc and sys.platform == "linux")


_AT_EXIT = """
import atexit, gc, sys
atexit.register(lambda: print(f"frozen {gc.get_freeze_count()}", file=sys.stderr))  # runs after main's (last in, first out)
sys.argv = ["tpshard", *sys.argv[1:]]
from tpshard.cli import main
main()
"""


@pytest.mark.parametrize("args, code", [(["plan", "examples/tiny-llama", "--tp", "2", "--json"], 0), (["plan", "no-such-folder", "--json"], 2)])
def test_the_command_freezes_its_objects_at_exit_and_keeps_its_output_and_exit_code(args, code):
    """The last collections of the interpreter's shutdown are skipped (gc.freeze at exit, ~0.1 s of
    every command here); what the command printed and its exit status are as without."""
    repo = Path(__file__).resolve().parent.parent
    p = subprocess.run([sys.executable, "-c", _AT_EXIT, *args], capture_output=True, text=True, cwd=repo, timeout=120)
    assert p.returncode == code, p.stderr[-500:]
    frozen = int(p.stderr.rsplit("frozen ", 1)[1])
    assert frozen > 10_000  # typer's, numpy's and the plan's objects, not a handful
    out = json.loads(p.stdout)  # whole: flushed before the interpreter went
    assert ("error" in out) == (code != 0)
