"""verify: load the shards into real tensor-parallel layers, run them, compare with the source.

    report = tpshard.verify.verify("out/", "model/")              # layer level, every sharded layer
    report = tpshard.verify.verify("out/", "model/", model=True)  # plus the whole decoder vs transformers
    report.ok, report.failures()

Under torchrun (RANK and WORLD_SIZE set) it runs in place on every rank; otherwise it spawns one
local process per rank (pp x tp of them). With pipeline stages each stage's ranks run the layers
their stage holds inside the stage's TP group, and `model=True` passes the hidden states from stage
to stage (tpshard.runtime.send_forward / recv_forward). Backend: `choose_launch` (NCCL with a GPU per rank, else gloo
on shared GPUs or the CPU; announced). Only rank 0 reads the source.
Not here: the layers (tpshard.runtime), the slicing rules (the plan); verify only reads the manifest.

Modules, each importing only those listed before it: report (results, tolerances, report.json,
junit.xml), layer_specs (a layer's specs, a rank's loaded layer), layer_inputs (the seeded inputs),
moe_layers (the FusedMoE and ReplicatedLinear kinds), build (layers from ShardSpecs), layers_check
(layer-level), tensors_check (every byte: checksums, whole copies, padding), decoder (the dense TP
decoder), moe_model (the MoE / MLA decoder), hybrid_model (Qwen3-Next's and Qwen3.5's), model (what
--model runs, the logits' verdict), run (what each rank does, preflight), verdict (exit codes under
torchrun).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tpshard.errors import TpshardError
from tpshard.verify.report import LAYER_TOLERANCE, MODEL_TOLERANCE, VerifyReport, write_junit, write_report

__all__ = [
    "LAYER_TOLERANCE", "MODEL_TOLERANCE", "Launch", "LaunchFailed", "VerifyReport", "choose_backend", "choose_launch",
    "verify", "verify_many", "write_junit", "write_report",
]  # fmt: skip

DEFAULT_TIMEOUT_S = 1800.0


class LaunchFailed(TpshardError):
    """A rank crashed or hung: not a verdict on the output. Exit code 3."""

    exit_code = 3


@dataclass(frozen=True)
class Launch:
    """How the ranks run: the backend, where they compute, and why (said out loud before the run)."""

    backend: str  # nccl or gloo
    device: str  # cuda or cpu
    why: str

    def describe(self, ranks: int) -> str:
        where = "one GPU per rank" if self.backend == "nccl" else ("GPUs shared by the ranks" if self.device == "cuda" else "CPU")
        return f"verify: {ranks} ranks, backend {self.backend} on {where}: {self.why}"


def choose_launch(local_ranks: int, backend: str | None = None, device: str | None = None) -> Launch:
    """Backend and device for `local_ranks` ranks on this node.

    backend: "nccl", "gloo", or "auto"/None ($TPSHARD_BACKEND, else automatic); device: "cuda",
    "cpu", or "auto"/None. Automatic: NCCL when every local rank gets its own GPU; with fewer GPUs,
    gloo with the ranks computing on the GPUs they share (NCCL cannot put two ranks on one GPU);
    without a GPU, gloo on the CPU. Never silently the CPU on a GPU machine: only `--device cpu`
    (or no GPU) computes there. Asked for and impossible is an error, not a fallback.
    """
    import torch

    backend = backend if backend not in (None, "auto") else (os.environ.get("TPSHARD_BACKEND") or "auto")
    device = device or "auto"
    if backend not in ("nccl", "gloo", "auto"):
        raise TpshardError(f"--backend {backend}: expected auto, nccl or gloo")
    if device not in ("cuda", "cpu", "auto"):
        raise TpshardError(f"--device {device}: expected auto, cuda or cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    have = f"{local_ranks} ranks here, {gpus} GPU{'s' if gpus != 1 else ''}"
    if backend == "nccl":
        if device == "cpu":
            raise TpshardError("--backend nccl runs on GPUs; --device cpu needs --backend gloo")
        if gpus < local_ranks:
            raise TpshardError(
                f"--backend nccl needs one GPU per rank: {have}; use --backend gloo (ranks share the GPUs,"
                " or --device cpu) or run on a node with enough GPUs"
            )
        return Launch("nccl", "cuda", f"asked for ({have})")
    if device == "cuda" and gpus == 0:
        raise TpshardError("--device cuda: no CUDA GPU is visible here")
    if backend == "gloo":
        on = "cuda" if device == "cuda" or (device == "auto" and gpus) else "cpu"
        return Launch("gloo", on, f"asked for ({have}{', --device cpu' if device == 'cpu' else ''})")
    if device == "cpu":
        return Launch("gloo", "cpu", f"--device cpu ({have})")
    if gpus >= local_ranks:
        return Launch("nccl", "cuda", f"auto: {have}")
    if gpus:
        return Launch("gloo", "cuda", f"auto: {have}, and NCCL needs one GPU per rank; collectives go through host memory")
    return Launch("gloo", "cpu", f"auto: {have}")


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """The backend `choose_launch` picks (kept for callers that only need its name)."""
    return choose_launch(world_size, backend).backend


def verify(
    out: str | Path, source: str | Path, *, model: bool = False, backend: str | None = None, device: str | None = None,
    dtype: str = "float32", seed: int = 0, tokens: int = 16, timeout_s: float = DEFAULT_TIMEOUT_S,
    announce: Callable[[str], None] | None = None, pp: int | None = None, pp_layers: str | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:  # fmt: skip
    """Verify the tpshard output at `out` against the checkpoint it was split from.

    Args:
        out: a tpshard output folder (all ranks written; under torchrun, this node's ranks).
        source: the Hugging Face checkpoint folder it was split from (read by rank 0 only).
        model: also run the tensor-parallel decoder and compare logits with transformers.
        backend, device: see `choose_launch` (default automatic, announced).
        dtype: layer-level compute dtype (float32, bfloat16, float16); the model level is float32.
        seed, tokens: the random inputs (tokens rows per layer input, sequence length for the model).
        timeout_s: the whole launch, and each collective (a rank that never arrives).
        announce: called with one line saying which backend was chosen and why (rank 0 only).
        pp, pp_layers: the pipeline stages (and partition, "26,27,27") the server will run; the
            output must be split for them (findings in the report's `stages`, as `check --pp`).
        on_progress: called here with (steps done, steps) as rank 0 judges each layer (and the
            model, a last step with `model`).
    Returns:
        The VerifyReport (the same on every rank under torchrun). Never raises on a mismatch; raises
        TpshardError for a user error (exit 2) and LaunchFailed when a rank crashed or hung (exit 3),
        naming the rank that failed first and its error.
    """
    return verify_many(
        [out], [source], model=model, backend=backend, device=device, dtype=dtype, seed=seed, tokens=tokens,
        timeout_s=timeout_s, announce=announce, pp=pp, pp_layers=pp_layers, on_progress=on_progress,
    )[0]  # fmt: skip


def verify_many(
    outs: list[str | Path], sources: list[str | Path], *, model: bool = False, backend: str | None = None,
    device: str | None = None, dtype: str = "float32", seed: int = 0, tokens: int = 16,
    timeout_s: float = DEFAULT_TIMEOUT_S, announce: Callable[[str], None] | None = None, pp: int | None = None,
    pp_layers: str | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> list[VerifyReport]:  # fmt: skip
    """Verify several outputs of the same world size in one launch (one process start per rank)."""
    from tpshard.manifest import read_manifest
    from tpshard.verify.run import Job, check_args, preflight, under_torchrun

    jobs = [
        Job(str(o), str(s), model=model, dtype=dtype, seed=seed, tokens=tokens, pp=pp, pp_layers=pp_layers)
        for o, s in zip(outs, sources, strict=True)
    ]
    sizes = set()
    for job in jobs:
        check_args(job)
        sizes.add(read_manifest(job.out).plan.topology.world_size)
    if len(sizes) != 1:
        raise TpshardError(f"outputs verified in one launch must share the world size, got {sorted(sizes)}")
    world = sizes.pop()
    if timeout_s <= 0:
        raise TpshardError(f"--timeout must be positive, got {timeout_s:g}")
    start = time.perf_counter()
    if under_torchrun():
        from tpshard.runtime import listening_to

        with listening_to(on_progress):  # rank 0 is this process
            reports = _in_place(jobs, world, backend, device, timeout_s, announce)
    else:
        for job in jobs:
            preflight(job)  # every rank is local: its files, and the source, before anything starts
        reports = _spawned(jobs, world, backend, device, timeout_s, announce, on_progress)
    seconds = round(time.perf_counter() - start, 3)
    for r in reports:
        r.seconds = seconds if len(reports) == 1 else r.seconds
    return reports


def _in_place(jobs, world: int, backend, device, timeout_s: float, announce) -> list[VerifyReport]:
    from tpshard.runtime import init_distributed, shutdown_distributed
    from tpshard.runtime.objects import all_gather_objects
    from tpshard.verify.run import raise_rank_problems, rank_main, rank_preflight

    from tpshard.lifetime import die_with_parent

    die_with_parent()  # the elastic agent killed (or tpshard verify --torchrun above it): this rank ends too
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world:
        error = TpshardError(
            f"torchrun started {launched} processes, but {jobs[0].out} was split for {_world_text(jobs[0].out)}:"
            f" run torchrun with nnodes x nproc-per-node = {world}"
        )
        error.every_rank = True  # every rank finds the same: rank 0 says it
        raise error
    launch = choose_launch(int(os.environ.get("LOCAL_WORLD_SIZE", world)), backend, device)
    if announce and os.environ.get("RANK") == "0":
        announce(launch.describe(world))
    info = init_distributed(launch.backend, device=launch.device, timeout_s=timeout_s)
    # Each rank checks what it alone can see (its files; the source on rank 0), then all ranks
    # learn every rank's answer: one rank's missing file stops all of them with its message.
    mine = [p for job in jobs for p in rank_preflight(job, info.rank)]
    raise_rank_problems(dict(enumerate(all_gather_objects(mine))))
    reports = rank_main(info, jobs)
    shutdown_distributed()  # only after success: a failed rank leaves at once (see tpshard.runtime.launch)
    return reports


def _world_text(out: str) -> str:
    """tp=8, or pp=2 x tp=8 = 16 ranks: what the world size of an output is made of."""
    from tpshard.manifest import read_manifest

    topo = read_manifest(out).plan.topology
    return f"tp={topo.tp}" if topo.pp == 1 else f"pp={topo.pp} x tp={topo.tp} = {topo.world_size} ranks"


def _spawned(jobs, world: int, backend, device, timeout_s: float, announce, on_progress=None) -> list[VerifyReport]:
    from tpshard.runtime import RankFailed, run_local
    from tpshard.verify.run import rank_main

    launch = choose_launch(world, backend, device)
    if announce:
        announce(launch.describe(world))
    try:
        results = run_local(
            rank_main, world, jobs, backend=launch.backend, device=launch.device, timeout_s=timeout_s, on_progress=on_progress
        )  # fmt: skip
    except RankFailed as e:
        root = e.root
        if root.exit_code != 3:  # a user error found by one rank (its file, its data)
            message = (root.error or "").partition(": ")[2]  # "OutputError: <message>"
            raise TpshardError(f"rank {root.rank} of {world}: {message}") from None
        raise LaunchFailed(f"verify: rank {root.rank} of {world} failed first:\n{root.summary()}") from None
    return results[0].value
