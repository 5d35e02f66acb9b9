"""Memory: the cyclic garbage collector paused while tpshard builds its large object graphs, and
skipped at the command's exit; the C heap's free memory given back."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc


@contextlib.contextmanager
def paused():
    """No cyclic collection inside (a context manager, or a decorator: `@paused()`).

    A checkpoint's headers, a plan or a manifest of 90k tensors are about a million small objects
    that live until the command ends and form no cycles; the collector walked them all again and
    again as they were made, 20-30 % of a plan or a split. Reference counting still frees
    everything else, and cycles made inside are collected after."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


@functools.cache  # once a process (tests run main() many times in one)
def frozen_at_exit() -> None:
    """At the interpreter's exit, move every live object out of the collector's reach (gc.freeze)
    before the last collections of its shutdown walk them: with typer, pydantic, numpy and a
    9k-tensor plan loaded, the exit took 90-130 ms on this project's VMs, ~28 ms with the objects
    frozen (docs/performance.md). Memory goes back to the system with the process either way;
    atexit handlers and the flushing of stdout and stderr still run, and everything tpshard writes
    is closed and synced before its command returns. For the command only: registered at its
    start, it runs after every handler registered later (atexit runs them last first)."""
    atexit.register(gc.freeze)


def libc(name: str, *argtypes: str):
    """A function of the C library, or None where it has none (not Linux, not glibc)."""
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = [getattr(ctypes, t) for t in argtypes]
    return fn


_malloc_trim = libc("malloc_trim", "c_size_t")
_mallopt = libc("mallopt", "c_int", "c_int")
M_ARENA_MAX = -8  # glibc's malloc.h


def one_arena() -> bool:
    """Let every thread allocate from the one C heap (glibc mallopt M_ARENA_MAX 1); True if set.

    glibc gives threads heaps of their own, and what a worker frees in its heap stays resident:
    check at 90k tensors held 26 MB more with two workers (each built file headers and digest
    lists in its own). tpshard's threads allocate with the GIL held, so they do not contend for
    one heap. For the command only: a library does not change its host process's allocator."""
    return _mallopt is not None and _mallopt(M_ARENA_MAX, 1) == 1


def release_freed_memory() -> None:
    """Give the free memory of the C heap back to the system (glibc malloc_trim). Large objects
    freed inside the heap stay resident otherwise, and Python's small objects, which have arenas
    of their own, never reuse it: a checkpoint's header texts, read and decoded, are 20 MB at 90k
    tensors, a file's header built to be written 5 MB at tp 8."""
    if _malloc_trim is not None:
        _malloc_trim(0)
