"""Starting torch.distributed: under torchrun, or as N local processes spawned from Python.

`init_distributed` joins the world torchrun describes in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or the world of a TCPStore handed to it. `run_local`
spawns N processes on 127.0.0.1, runs a picklable `fn(info, *args)` in each and returns every
rank's result or error; `tpshard verify` on one machine and the tests use it.

Failures end the job fast and name their rank: a rank that raises reports its error with the time
it happened and leaves at once, without tearing down its process group (under NCCL that can block
on peers stuck in a collective); the parent gives its peers a few seconds and terminates them. The
root cause is the earliest failure: peers of a dead rank fail *after* it, with a transport error.

Rendezvous: the parent binds the TCPStore itself (port 0, the OS picks) and keeps the listening
socket for the whole job, so no other job can take the port between choosing and binding.

Progress: rank code calls `report_progress(done, total)` (verify: rank 0, layers judged); a
spawned rank sends it to the parent over the results queue, where run_local's `on_progress` hears
it; under torchrun the process's own `listening_to` callback does; elsewhere it goes nowhere.

Not here: process groups inside the world (groups.py), multi-node launching (use torchrun).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tpshard.errors import TpshardError
from tpshard.lifetime import die_with_parent, ignoring_sigint
from tpshard.runtime.groups import clear_groups

BACKENDS = ("nccl", "gloo")

# Where report_progress goes in this process (the module docstring): None = nowhere.
_progress: Callable[[int, int], None] | None = None


def report_progress(done: int, total: int) -> None:
    """Say how far this rank is (`done` of `total` steps) to whoever listens; nothing if nobody does."""
    if _progress is not None:
        _progress(done, total)


@contextlib.contextmanager
def listening_to(callback: Callable[[int, int], None] | None):
    """report_progress in this process calls `callback` (under torchrun, rank 0 is the command itself)."""
    global _progress
    before, _progress = _progress, callback
    try:
        yield
    finally:
        _progress = before


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device  # where this rank's tensors live: cuda:N (NCCL, or gloo sharing GPUs) or cpu


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _env_int(name: str, given: int | None, default: int | None = None) -> int:
    if given is not None:
        return given
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise TpshardError(f"{name} is not set; launch with torchrun or pass it explicitly")
        return default
    try:
        return int(value)
    except ValueError:
        raise TpshardError(f"{name}={value!r} is not an integer") from None


def rank_device(backend: str, local_rank: int, device: str = "auto") -> torch.device:
    """The device of a rank: NCCL needs cuda:LOCAL_RANK; gloo computes on the CPU unless told "cuda",
    then ranks share the GPUs round robin (collectives go through host memory, see groups.py)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl":
        if local_rank >= gpus:
            raise TpshardError(f"NCCL rank with LOCAL_RANK {local_rank} needs GPU {local_rank}; this node has {gpus}")
        return torch.device("cuda", local_rank)
    if device == "cuda":
        if gpus == 0:
            raise TpshardError("--device cuda: no CUDA GPU is visible here")
        return torch.device("cuda", local_rank % gpus)
    return torch.device("cpu")


def init_distributed(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    timeout_s: float = 600.0,
    store: dist.Store | None = None,
    device: str = "auto",
) -> DistInfo:
    """Join (or reuse) the default process group. Arguments override torchrun's environment.

    The backend is `backend`, else $TPSHARD_BACKEND, else NCCL when CUDA is available, else gloo.
    With `store` the world meets there; else torch's env:// rendezvous reads MASTER_ADDR /
    MASTER_PORT. A single process with no environment at all is a world of one (an in-memory store).
    LOCAL_RANK picks the GPU, so where a rank computes on a GPU it is required, not guessed.
    `timeout_s` bounds every collective: a peer that never arrives fails the job after it.
    """
    backend = backend or os.environ.get("TPSHARD_BACKEND") or default_backend()
    if backend not in BACKENDS:
        raise TpshardError(f"backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    world_size = _env_int("WORLD_SIZE", world_size, default=1)
    rank = _env_int("RANK", rank, default=0 if world_size == 1 else None)
    on_gpu = backend == "nccl" or device == "cuda"
    # One process, or CPU ranks: which local index a rank has changes nothing. A GPU rank must know.
    local_rank = _env_int("LOCAL_RANK", local_rank, default=rank if world_size == 1 or not on_gpu else None)
    dev = rank_device(backend, local_rank, device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)  # NCCL needs each rank on its GPU before the first collective
    if not dist.is_initialized():
        if store is None and world_size == 1 and "MASTER_PORT" not in os.environ:
            store = dist.HashStore()
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s),
        )  # fmt: skip
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, backend=backend, device=dev)


def shutdown_distributed() -> None:
    clear_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1. Racy (another process may take it before it is
    bound again): prefer `local_store()`, which keeps the port bound."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_store(timeout_s: float = 300.0) -> dist.TCPStore:
    """A rendezvous store listening on 127.0.0.1, on a port the OS picked and that stays bound."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))


@dataclass(frozen=True)
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # formatted traceback (or a TpshardError's message) when the rank failed
    failed_at: float = 0.0  # time.time() of the failure: the earliest failure is the root cause
    exit_code: int = 3  # a TpshardError's exit code (a user error is 2), else 3 (a crash)

    @property
    def ok(self) -> bool:
        return self.error is None

    def summary(self, lines: int = 3) -> str:
        """The last lines of the error: the exception and where it was raised."""
        return "\n".join((self.error or "").strip().splitlines()[-lines:])


class RankFailed(RuntimeError):
    """One or more spawned ranks raised or died; `root` is the first to fail (the cause)."""

    def __init__(self, results: list[RankResult]):
        self.results = results
        failed = [r for r in results if not r.ok]
        parts = [f"--- rank {r.rank} ---\n{r.error}" for r in sorted(failed, key=_failure_order)]
        super().__init__(f"{len(failed)} of {len(results)} ranks failed:\n" + "\n".join(parts))

    @property
    def root(self) -> RankResult:
        return min((r for r in self.results if not r.ok), key=_failure_order)


def _failure_order(r: RankResult) -> tuple:
    # A rank that reported its own error comes before one that died or timed out without a word
    # (failed_at 0 = never reported), and among reporters the earliest is the cause.
    return (r.failed_at == 0.0, r.failed_at, r.rank)


def _worker(
    rank: int, world_size: int, port: int, backend: str, device: str, timeout_s: float,
    fn: Callable[..., Any], args: tuple, results: Any, parent: int, progress: bool = False,
) -> None:
    global _progress
    die_with_parent(parent)  # a parent killed with SIGKILL takes its ranks with it (tpshard.lifetime)
    if progress:  # the parent listens (run_local's on_progress): a 3-tuple, told apart from results
        _progress = lambda done, total: results.put(("progress", done, total))  # noqa: E731
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )  # fmt: skip
    failed = False
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores; intra-op threads would fight
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
        info = init_distributed(backend, timeout_s=timeout_s, store=store, device=device)
        value = fn(info, *args)
        # Pickled here with plain pickle: tensors travel as bytes, not shared-memory handles that
        # die with this process.
        results.put((rank, pickle.dumps(value), None, 0.0, 0))
    except TpshardError as e:  # a user error found on this rank: its message is the news
        failed = True
        results.put((rank, None, f"{type(e).__name__}: {e}", time.time(), e.exit_code))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        failed = True
        results.put((rank, None, traceback.format_exc(), time.time(), 3))
    finally:
        if not failed:  # a failed rank leaves its group as it is: peers may be stuck in a collective
            try:
                shutdown_distributed()
            except Exception:  # noqa: BLE001 - a peer that died already; the error above is the news
                pass
        # Flush the result to the parent, then leave at once: the normal interpreter teardown of a
        # process that imported torch takes seconds per rank and does nothing we need.
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run_local(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    device: str = "auto",
    timeout_s: float = 300.0,
    grace_s: float = 5.0,
    raise_on_error: bool = True,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[RankResult]:
    """Run `fn(info: DistInfo, *args)` on `nprocs` spawned local ranks; return their results by rank.

    `fn` and `args` must be picklable (a module-level function). A rank that raises is reported
    with its traceback; once one rank fails the others get `grace_s` seconds to finish (they may be
    stuck in a collective with it) before they are terminated. `timeout_s` bounds the whole job
    and every collective. `device`: "cuda" lets gloo ranks compute on (shared) GPUs. `on_progress`
    is called here with each `report_progress(done, total)` of a rank.

    Example:
        results = run_local(check_layers, 4, seed, backend="gloo")
    """
    backend = backend or default_backend()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < nprocs:
        raise TpshardError(f"NCCL needs one GPU per rank: {nprocs} ranks, {gpus} GPUs")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    store = local_store(timeout_s)  # held until every rank is done: the port cannot be taken meanwhile
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, nprocs, store.port, backend, device, timeout_s, fn, args, results_q, os.getpid(), on_progress is not None),
            daemon=True,
        )  # fmt: skip
        for r in range(nprocs)
    ]
    try:
        with ignoring_sigint():  # Ctrl-C reaches the whole process group: the parent alone handles it
            for p in procs:
                p.start()
        got, first_failure = _collect(procs, results_q, timeout_s, grace_s, on_progress)
    except BaseException:  # Ctrl-C, or anything else here: no rank outlives the parent's wait
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5.0)
        raise
    for p in procs:
        p.join(timeout=0.5 if first_failure is not None else 5.0)
        if p.is_alive():
            p.kill()  # a peer of a failed rank, stuck in a collective: nothing left to say
            p.join()
    del store
    why = "stopped after another rank failed" if first_failure is not None else f"no result within {timeout_s:.0f} s (hung)"
    ordered = [got.get(r, RankResult(r, error=why)) for r in range(nprocs)]
    if raise_on_error and any(not r.ok for r in ordered):
        raise RankFailed(ordered)
    return ordered


def _collect(
    procs: list, results_q: Any, timeout_s: float, grace_s: float, on_progress: Callable[[int, int], None] | None = None
) -> tuple[dict[int, RankResult], float | None]:  # fmt: skip
    """Every rank's result as it arrives, until all are in, the timeout, or the grace after a failure;
    a rank's progress report on the way goes to `on_progress`."""
    nprocs = len(procs)
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    first_failure: float | None = None
    while len(got) < nprocs:
        remaining = deadline - time.monotonic()
        if first_failure is not None:
            remaining = min(remaining, first_failure + grace_s - time.monotonic())  # grace for the peers
        if remaining <= 0:
            break
        try:
            message = results_q.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            # A rank killed by a signal never reports; stop waiting for it once it is gone.
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead and results_q.empty():
                time.sleep(0.5)  # its last message may still be in flight
                if results_q.empty():
                    for r in dead:
                        got[r] = RankResult(r, error=f"process exited with code {procs[r].exitcode} without a result")
                    first_failure = first_failure or time.monotonic()
            continue
        if len(message) == 3:  # ("progress", done, total)
            if on_progress is not None:
                on_progress(message[1], message[2])
            continue
        rank, payload, error, failed_at, code = message
        if error is None:
            got[rank] = RankResult(rank, value=pickle.loads(payload))
        else:
            got[rank] = RankResult(rank, error=error, failed_at=failed_at, exit_code=code)
            first_failure = first_failure or time.monotonic()
    return got, first_failure
