"""Copy worker counts (processes for split and check --source, tpshard.processes; threads elsewhere):
the default from the CPU count, and a --workers value checked.

Apart from the writer so that `check` without a source, which needs only this of it, does not
import the writer (and numpy, and the planner with it)."""

from __future__ import annotations

import os

from tpshard.errors import UsageError

MAX_WORKERS = 256


def default_workers() -> int:
    return min(8, max(2, os.cpu_count() or 2))


def check_workers(workers: int | None) -> int:
    """The worker count to use: `workers` if given (1..MAX_WORKERS), else from the CPU count."""
    if workers is None:
        return default_workers()
    if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= MAX_WORKERS:
        raise UsageError(f"--workers {workers!r}: must be an integer from 1 to {MAX_WORKERS}")
    return workers
