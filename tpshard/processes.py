"""Copy jobs on forked worker processes, for split's writer and check's reassembly (docs/performance.md, "Processes").

Why processes: a copy of many small tensors is Python per tensor and per shard, and two threads
share one interpreter lock (a second thread gained 14 % on 9k tensors; a second process nearly
doubles it). The plan is made and the output files laid out first; then each worker is a fork of
this process, so it shares the plan, the open files and the read-only tables without sending
them anywhere. What a job produces it writes into shared memory (`shared_slots`, `shared_bytes`)
that the parent reads once every worker has ended; what it returns (check's findings) comes back
pickled, by task index.

Workers take tasks by index from one pipe (a 4-byte read of a pipe written in whole 4-byte
records is atomic), so a worker that drew small tasks takes more of them. A worker that fails
sends its exception back through shared memory and exits; the parent stops the others and raises
it, so a fault in a worker reads as it would in the parent. Workers ignore SIGINT and die with the
parent (tpshard.lifetime): a Ctrl-C is the parent's to handle, and it stops them all.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from tpshard.lifetime import die_with_parent

ERROR_BYTES = 64 << 10  # each worker's room for its pickled exception
POLL_S = 0.05  # how often the parent looks for ended workers and passes progress on


def can_fork() -> bool:
    """Whether copy jobs can run on forked processes here (Linux; elsewhere the writer uses threads)."""
    return sys.platform == "linux" and hasattr(os, "fork")


def shared_bytes(n: int) -> memoryview:
    """n zero bytes of memory shared with the worker processes forked after this call."""
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


def shared_slots(algorithm_size: int, n: int) -> memoryview | SharedDigests:
    """Room for n digests shared with the workers: crc32s (size 4) as a memoryview of 4-byte ints,
    which a job indexes as it would digest_slots' array; sha256s (32) as SharedDigests."""
    if algorithm_size == 4:
        return shared_bytes(4 * n).cast("I")
    return SharedDigests(n, algorithm_size)


class SharedDigests:
    """n digests of `size` bytes each in shared memory, indexed as digest_slots' list of bytes."""

    def __init__(self, n: int, size: int):
        self.size, self.data = size, shared_bytes(n * size)

    def __len__(self) -> int:
        return len(self.data) // self.size

    def __getitem__(self, k: int) -> bytes:
        return bytes(self.data[k * self.size : (k + 1) * self.size])

    def __setitem__(self, k: int, digest: bytes) -> None:
        self.data[k * self.size : (k + 1) * self.size] = digest

    def packed(self) -> bytes:
        return bytes(self.data)


def run_forked(
    tasks: Sequence,
    job: Callable[[object, Callable[[int], None]], object],
    workers: int,
    on_progress: Callable[[int], None] | None,
    meanwhile: Callable[[], None] | None = None,
) -> dict[int, object]:
    """Run job(task, progress) for every task on `workers` forked processes; return, once all are
    done, what the jobs returned by task index (None left out: most jobs write shared memory and
    return nothing). `progress(n)` in a job adds n to a shared count that the parent passes to
    on_progress as it grows. `meanwhile()`, if given, runs in the parent once the workers are
    forked: work the jobs do not need (split's headers and index files), done while they copy
    rather than before. A worker's exception is raised here, and so is meanwhile's once the workers
    are stopped; KeyboardInterrupt stops every worker."""
    counts = shared_bytes(8 * workers).cast("Q")
    errors = shared_bytes(ERROR_BYTES * workers)
    # Each worker's results, pickled into a file of this private folder as it ends: no pipe to
    # keep drained while the parent waits.
    results = Path(tempfile.mkdtemp(prefix="tpshard-jobs-"))
    feed_r, feed_w = os.pipe()
    # The workers hold ended_w open until they exit: the parent's wait wakes at its end of file,
    # the moment the last worker is gone, instead of at the next of its 50 ms polls for progress.
    ended_r, ended_w = os.pipe()
    parent = os.getpid()
    pids: list[int] = []
    try:
        try:
            for k in range(workers):
                pid = os.fork()
                if pid == 0:  # the worker: never returns
                    os.close(feed_w)
                    os.close(ended_r)
                    _work(k, tasks, job, feed_r, counts, errors, parent, results / str(k))
                pids.append(pid)
        except BaseException:
            _stop(pids)
            os.close(feed_w)
            raise
        finally:
            os.close(feed_r)  # the workers hold it; with them gone, the feeder's write fails instead of blocking
            os.close(ended_w)
        feeder = threading.Thread(target=_feed, args=(feed_w, len(tasks)), daemon=True)
        feeder.start()
        running = set(pids)
        try:
            if meanwhile is not None:
                meanwhile()
            _wait(pids, running, counts, errors, on_progress, ended_r)
        finally:
            _stop(running)
            feeder.join()
        found: dict[int, object] = {}
        for k in range(workers):
            found.update(pickle.loads((results / str(k)).read_bytes()))
        return found
    finally:
        os.close(ended_r)
        shutil.rmtree(results, ignore_errors=True)


def _feed(fd: int, n: int) -> None:
    """Write task indices 0..n-1 into the pipe, in whole records of 4 bytes, then close it."""
    try:
        step = 1024  # 4 KiB a write: within PIPE_BUF, so no record is split between readers
        for a in range(0, n, step):
            os.write(fd, b"".join(i.to_bytes(4, "little") for i in range(a, min(n, a + step))))
    except OSError:  # BrokenPipeError: every worker has ended (a failure); the parent reports it
        pass
    finally:
        os.close(fd)


def _work(k: int, tasks: Sequence, job: Callable, feed: int, counts: memoryview, errors: memoryview, parent: int, results: Path) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent)
    status = 0
    found: dict[int, object] = {}

    def progress(n: int) -> None:
        counts[k] += n

    try:
        while True:
            record = os.read(feed, 4)
            if not record:
                break
            i = int.from_bytes(record, "little")
            result = job(tasks[i], progress)
            if result is not None:
                found[i] = result
        results.write_bytes(pickle.dumps(found))
    except BaseException as e:  # noqa: BLE001 - any fault goes back to the parent, as itself
        status = 1
        _send_error(errors[k * ERROR_BYTES : (k + 1) * ERROR_BYTES], e)
    finally:
        os._exit(status)  # no atexit handlers, no flush of the parent's buffered output


def _send_error(room: memoryview, e: BaseException) -> None:
    try:
        data = pickle.dumps(e)
        pickle.loads(data)  # an exception that does not unpickle would fail in the parent
    except Exception:  # noqa: BLE001
        data = pickle.dumps(OSError(f"{type(e).__name__}: {e}"))
    if len(data) + 4 > len(room):
        data = pickle.dumps(OSError(f"{type(e).__name__}: {str(e)[:1000]}"))
    room[4 : 4 + len(data)] = data
    room[:4] = len(data).to_bytes(4, "little")


def _wait(pids: list[int], running: set[int], counts: memoryview, errors: memoryview, on_progress: Callable[[int], None] | None, ended: int) -> None:
    """Until every worker has ended (each reaped is taken out of `running`): pass progress on; on
    a failure, raise the worker's exception. `ended` reads end of file once every worker has exited."""
    reported = 0
    all_ended = False
    while running:
        if not all_ended:
            all_ended = bool(select.select([ended], [], [], POLL_S)[0])  # readable only at end of file: no worker writes it
        for pid in list(running):
            done, status = os.waitpid(pid, 0 if all_ended else os.WNOHANG)
            if done:
                running.discard(pid)
                if status:
                    raise _error_of(pids.index(pid), errors, status)
        if on_progress is not None:
            total = sum(counts)
            if total > reported:
                on_progress(total - reported)
                reported = total


def _error_of(k: int, errors: memoryview, status: int) -> BaseException:
    room = errors[k * ERROR_BYTES : (k + 1) * ERROR_BYTES]
    n = int.from_bytes(room[:4], "little")
    if n:
        return pickle.loads(room[4 : 4 + n])
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
    return OSError(f"a copy worker process ended with {how}")


def _stop(running: set[int] | list[int]) -> None:
    """Kill the workers not yet reaped, and reap them (no zombies left behind). Only those: the pid
    of a reaped one may already be another process's."""
    for pid in running:
        os.kill(pid, signal.SIGKILL)  # unreaped, so still ours (a zombie at worst)
    for pid in running:
        os.waitpid(pid, 0)
