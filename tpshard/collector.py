"""The cyclic garbage collector, paused while tpshard builds its large object graphs."""

from __future__ import annotations

import contextlib
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
