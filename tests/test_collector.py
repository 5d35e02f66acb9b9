"""collector.paused: the cyclic collector is off inside and as it was after, also after a refusal."""

from __future__ import annotations

import gc

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
    import sys

    try:
        glibc = bool(ctypes.CDLL(None).gnu_get_libc_version)
    except (OSError, AttributeError):
        glibc = False
    assert one_arena() == (glibc and sys.platform == "linux")
