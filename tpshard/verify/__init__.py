"""verify: load the shards into real tensor-parallel layers, run them, compare with the source.

    report = tpshard.verify.verify("out/", "model/")              # layer level, every sharded layer
    report = tpshard.verify.verify("out/", "model/", model=True)  # plus the whole decoder vs transformers
    report.ok, report.failures()

Under torchrun (RANK and WORLD_SIZE set) it runs in place on every rank; otherwise it spawns one
local process per rank (tp of them): NCCL when there is a GPU per rank, gloo on the CPU otherwise.
Not here: the layers (tpshard.runtime), the slicing rules (the plan); verify only reads the manifest.

Modules: build (layers from ShardSpecs), layers_check (layer-level), model (the TP decoder),
run (what each rank does), report (results, tolerances, report.json, junit.xml).
"""

from __future__ import annotations

import time
from pathlib import Path

from tpshard.errors import TpshardError
from tpshard.verify.report import LAYER_TOLERANCE, MODEL_TOLERANCE, VerifyReport, write_junit, write_report

__all__ = [
    "LAYER_TOLERANCE", "MODEL_TOLERANCE", "VerifyReport", "choose_backend", "verify", "verify_many", "write_junit",
    "write_report",
]  # fmt: skip


class LaunchFailed(TpshardError):
    """A rank crashed or hung: not a verdict on the output. Exit code 3."""

    exit_code = 3


def choose_backend(world_size: int, backend: str | None = None) -> str:
    """--backend, else $TPSHARD_BACKEND, else NCCL when every rank gets its own GPU, else gloo."""
    import os

    import torch

    backend = backend or os.environ.get("TPSHARD_BACKEND")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= world_size else "gloo"
    if backend not in ("nccl", "gloo"):
        raise TpshardError(f"--backend {backend}: expected nccl or gloo")
    if backend == "nccl" and gpus < world_size:
        raise TpshardError(
            f"--backend nccl needs one GPU per rank: {world_size} ranks, {gpus} GPUs here;"
            " use --backend gloo (CPU ranks) or run on a node with enough GPUs"
        )
    return backend


def verify(
    out: str | Path, source: str | Path, *, model: bool = False, backend: str | None = None, dtype: str = "float32",
    seed: int = 0, tokens: int = 16, timeout_s: float = 1800.0,
) -> VerifyReport:  # fmt: skip
    """Verify the tpshard output at `out` against the checkpoint it was split from.

    Args:
        out: a tpshard output folder (all ranks written).
        source: the Hugging Face checkpoint folder it was split from.
        model: also run the tensor-parallel decoder and compare logits with transformers.
        backend: "nccl" or "gloo"; default NCCL with a GPU per rank, else gloo.
        dtype: layer-level compute dtype (float32, bfloat16, float16); the model level is float32.
        seed, tokens: the random inputs (tokens rows per layer input, sequence length for the model).
    Returns:
        The VerifyReport (the same on every rank under torchrun). Never raises on a mismatch.
    """
    return verify_many([out], [source], model=model, backend=backend, dtype=dtype, seed=seed, tokens=tokens, timeout_s=timeout_s)[0]


def verify_many(
    outs: list[str | Path], sources: list[str | Path], *, model: bool = False, backend: str | None = None,
    dtype: str = "float32", seed: int = 0, tokens: int = 16, timeout_s: float = 1800.0,
) -> list[VerifyReport]:  # fmt: skip
    """Verify several outputs of the same world size in one launch (one process start per rank)."""
    from tpshard.manifest import read_manifest
    from tpshard.verify.run import Job, preflight, under_torchrun

    jobs = [Job(str(o), str(s), model=model, dtype=dtype, seed=seed, tokens=tokens) for o, s in zip(outs, sources, strict=True)]
    sizes = set()
    for job in jobs:
        preflight(job)
        sizes.add(read_manifest(job.out).plan.topology.world_size)
    if len(sizes) != 1:
        raise TpshardError(f"outputs verified in one launch must share the world size, got {sorted(sizes)}")
    world = sizes.pop()
    start = time.perf_counter()
    if under_torchrun():
        reports = _in_place(jobs, world, backend)
    else:
        reports = _spawned(jobs, world, backend, timeout_s)
    seconds = round(time.perf_counter() - start, 3)
    for r in reports:
        r.seconds = seconds if len(reports) == 1 else r.seconds
    return reports


def _in_place(jobs, world: int, backend: str | None) -> list[VerifyReport]:
    import os

    from tpshard.runtime import init_distributed, shutdown_distributed
    from tpshard.verify.run import rank_main

    launched = int(os.environ["WORLD_SIZE"])
    if launched != world:
        raise TpshardError(
            f"torchrun started {launched} processes, but {jobs[0].out} was split for tp={world}:"
            f" run torchrun with nnodes x nproc-per-node = {world}"
        )
    info = init_distributed(choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", world)), backend))
    try:
        return rank_main(info, jobs)
    finally:
        shutdown_distributed()


def _spawned(jobs, world: int, backend: str | None, timeout_s: float) -> list[VerifyReport]:
    from tpshard.runtime import RankFailed, run_local
    from tpshard.verify.run import rank_main

    try:
        results = run_local(rank_main, world, jobs, backend=choose_backend(world, backend), timeout_s=timeout_s)
    except RankFailed as e:
        first = next(r for r in e.results if not r.ok)
        tail = "\n".join(first.error.strip().splitlines()[-3:])
        raise LaunchFailed(f"verify: rank {first.rank} of {world} failed:\n{tail}") from None
    return results[0].value
