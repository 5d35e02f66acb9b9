"""Starting torch.distributed: under torchrun, or as N local processes spawned from Python.

`init_distributed` joins the world torchrun describes in the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT); NCCL when CUDA is available, gloo otherwise. `run_local`
spawns N processes on 127.0.0.1, runs a picklable `fn(info, *args)` in each and returns every
rank's result or traceback; `tpshard verify` on one machine and the tests use it.

Not here: process groups inside the world (groups.py), multi-node launching (use torchrun).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
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

from tpshard.runtime.groups import clear_groups


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device  # where this rank's tensors live: cuda:LOCAL_RANK under NCCL, else cpu


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _env_int(name: str, given: int | None, default: int | None = None) -> int:
    if given is not None:
        return given
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"{name} is not set; launch with torchrun or pass it explicitly")
        return default
    return int(value)


def init_distributed(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    timeout_s: float = 600.0,
) -> DistInfo:
    """Join (or reuse) the default process group. Arguments override torchrun's environment.

    The backend is `backend`, else $TPSHARD_BACKEND, else NCCL when CUDA is available, else gloo.
    MASTER_ADDR / MASTER_PORT are read by torch's env:// rendezvous; a single process with no
    environment at all becomes a world of one on 127.0.0.1.
    """
    backend = backend or os.environ.get("TPSHARD_BACKEND") or default_backend()
    world_size = _env_int("WORLD_SIZE", world_size, default=1)
    rank = _env_int("RANK", rank, default=0 if world_size == 1 else None)
    local_rank = _env_int("LOCAL_RANK", local_rank, default=rank)
    if world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device("cpu")
    if backend == "nccl":
        # NCCL needs each rank on its own GPU before the first collective.
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
        )
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, backend=backend, device=device)


def shutdown_distributed() -> None:
    clear_groups()
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the OS picks; a race with another process is unlikely)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankResult:
    rank: int
    value: Any = None
    error: str | None = None  # formatted traceback when the rank raised

    @property
    def ok(self) -> bool:
        return self.error is None


class RankFailed(RuntimeError):
    """One or more spawned ranks raised or died; the message holds each failing rank's traceback."""

    def __init__(self, results: list[RankResult]):
        self.results = results
        failed = [r for r in results if not r.ok]
        parts = [f"--- rank {r.rank} ---\n{r.error}" for r in failed]
        super().__init__(f"{len(failed)} of {len(results)} ranks failed:\n" + "\n".join(parts))


def _worker(
    rank: int, world_size: int, port: int, backend: str, timeout_s: float,
    fn: Callable[..., Any], args: tuple, results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
    )
    try:
        torch.set_num_threads(1)  # N ranks share the machine's cores; intra-op threads would fight
        info = init_distributed(backend, timeout_s=timeout_s)
        value = fn(info, *args)
        # Pickled here with plain pickle: tensors travel as bytes, not shared-memory handles that
        # die with this process.
        results.put((rank, pickle.dumps(value), None))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, None, traceback.format_exc()))
    finally:
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
    timeout_s: float = 300.0,
    raise_on_error: bool = True,
) -> list[RankResult]:
    """Run `fn(info: DistInfo, *args)` on `nprocs` spawned local ranks; return their results by rank.

    `fn` and `args` must be picklable (a module-level function). A rank that raises is reported
    with its traceback; once one rank fails the others get a few seconds to finish (they may be
    stuck in a collective with it) before they are terminated.

    Example:
        results = run_local(check_layers, 4, seed, backend="gloo")
    """
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.device_count() < nprocs:
        raise RuntimeError(f"NCCL needs one GPU per rank: {nprocs} ranks, {torch.cuda.device_count()} GPUs")
    ctx = mp.get_context("spawn")
    results_q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, nprocs, port, backend, timeout_s, fn, args, results_q), daemon=True)
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    got: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < nprocs:
        remaining = deadline - time.monotonic()
        if any(not r.ok for r in got.values()):
            remaining = min(remaining, 5.0)  # grace period for peers of a failed rank
        if remaining <= 0:
            break
        try:
            rank, payload, error = results_q.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            # A rank killed by a signal never reports; stop waiting for it once it is gone.
            dead = [r for r, p in enumerate(procs) if r not in got and p.exitcode is not None]
            if dead and results_q.empty():
                time.sleep(0.5)  # its last message may still be in flight
                if results_q.empty():
                    for r in dead:
                        got[r] = RankResult(r, error=f"process exited with code {procs[r].exitcode} without a result")
            continue
        got[rank] = RankResult(rank, value=pickle.loads(payload)) if error is None else RankResult(rank, error=error)
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.terminate()
            p.join()
    ordered = [got.get(r, RankResult(r, error=f"no result within {timeout_s:.0f} s (hung or killed)")) for r in range(nprocs)]
    if raise_on_error and any(not r.ok for r in ordered):
        raise RankFailed(ordered)
    return ordered
