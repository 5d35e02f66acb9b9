"""What every rank does in `verify`, and how the ranks are started (torchrun, or spawned here).

Each rank reads the manifest, builds every sharded layer from it, loads its own files, runs the
layer and sends its output to rank 0, which computes the reference from the source and judges.
Ranks move in lockstep through the same list of layers (collectives inside the layers), so a
rank never raises between two collectives on account of bad data: problems are recorded and sent.
The report is built on rank 0 and broadcast, so under torchrun every process exits alike.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tpshard.errors import TpshardError
from tpshard.manifest import read_manifest
from tpshard.rank import open_rank
from tpshard.runtime import DistInfo, bind_groups
from tpshard.verify.build import build_layer, sharded_layers
from tpshard.verify.layers_check import SourceTensors, batch_of, compare_layer, layer_input, rank_outputs
from tpshard.verify.report import LAYER_TOLERANCE, VerifyReport

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Job:
    """One output to verify; picklable, sent to every spawned rank."""

    out: str
    source: str
    model: bool = False
    dtype: str = "float32"  # layer-level compute dtype; the model level is always float32
    seed: int = 0
    tokens: int = 16


def preflight(job: Job) -> None:
    """Everything that can be wrong before a process group exists: raise a TpshardError for it."""
    from tpshard.checkpoint import open_checkpoint

    manifest = read_manifest(job.out)
    plan = manifest.plan
    missing = [r for r in range(plan.topology.world_size) if r not in manifest.written_ranks]
    if missing:
        raise TpshardError(f"{job.out}: verify needs every rank's folder; ranks {missing} were not written (split --ranks)")
    ckpt = open_checkpoint(job.source)
    absent = sorted({s.source for s in plan.shards} - set(ckpt.tensors))
    differ = sorted({s.source for s in plan.shards if s.source in ckpt.tensors and ckpt.tensors[s.source].shape != s.source_shape})
    if absent or differ:
        what = f"has no {', '.join(absent[:3])}" if absent else f"{differ[0]} has another shape"
        raise TpshardError(f"{job.source}: {what}: not the checkpoint {job.out} was split from")
    if job.dtype not in DTYPES:
        raise TpshardError(f"--dtype {job.dtype}: expected one of {', '.join(DTYPES)}")
    if job.tokens < 1:
        raise TpshardError(f"--tokens must be positive, got {job.tokens}")
    if job.model:
        from tpshard.verify.model import unsupported_reason

        reason = unsupported_reason(plan, ckpt.config, job.tokens)
        if reason:
            raise TpshardError(f"--model: {reason}")


def rank_main(info: DistInfo, jobs: list[Job]) -> list[VerifyReport]:
    """Verify each job in turn on this rank; every rank returns the same reports (rank 0's)."""
    if info.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 must mean float32
        torch.backends.cudnn.allow_tf32 = False
    return [_verify_job(info, job) for job in jobs]


def _verify_job(info: DistInfo, job: Job) -> VerifyReport:
    start = time.perf_counter()
    manifest = read_manifest(job.out)
    plan = manifest.plan
    topo = plan.topology
    if info.world_size != topo.world_size:
        raise TpshardError(
            f"{job.out} was split for {topo.describe()}: it needs {topo.world_size} ranks, this world has {info.world_size}"
        )
    bind_groups(topo)
    rank, device = info.rank, info.device
    tensors = open_rank(job.out, rank)
    dtype = DTYPES[job.dtype]
    src = SourceTensors(job.source) if rank == 0 else None
    report = VerifyReport(
        out_dir=str(job.out), source=str(job.source), topology=topo, backend=info.backend, device=str(device),
        dtype=job.dtype, seed=job.seed, tokens=job.tokens,
    )  # fmt: skip
    keep = {}  # float32 layers the model-level forward reuses
    for lay in sharded_layers(plan):
        sent: dict = {"batch": batch_of(plan, lay.group, rank), "problems": [], "outputs": {}}
        try:
            built = build_layer(lay, plan, rank, tensors, dtype=dtype, device=device)
        except (ValueError, KeyError) as e:
            built = None
            sent["problems"].append(f"cannot build {lay.layer_class} on rank {rank}: {e}")
        # Every rank must agree to run the forward: it holds collectives.
        if _all_true(built is not None, device):
            sent["problems"] += built.problems
            x = layer_input(lay, sent["batch"], seed=job.seed, tokens=job.tokens, dtype=dtype).to(device)
            sent["outputs"] = rank_outputs(built, x, plan, seed=job.seed, tokens=job.tokens)
            if job.model and dtype == torch.float32:
                keep[lay.layer] = built
        gathered = [None] * info.world_size if rank == 0 else None
        dist.gather_object(sent, gathered, dst=0)
        if rank == 0:
            report.layers.append(
                compare_layer(
                    lay, plan, gathered, src, seed=job.seed, tokens=job.tokens, dtype=dtype,
                    tolerance=LAYER_TOLERANCE[job.dtype],
                )  # fmt: skip
            )
    if job.model:
        report.model = _verify_model(info, job, plan, tensors, keep)
    report.seconds = round(time.perf_counter() - start, 3)
    box = [report if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _all_true(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _verify_model(info: DistInfo, job: Job, plan, tensors, keep: dict):
    from tpshard.verify.model import TPDecoder, compare_logits, hf_logits, model_tokens
    from tpshard.verify.moe_layers import hf_config
    from tpshard.verify.moe_model import MoEDecoder, is_moe

    rank, device, topo = info.rank, info.device, plan.topology
    # Load problems are reported per layer already; here only the logits are judged.
    layers = {
        lay.layer: keep.get(lay.layer) or build_layer(lay, plan, rank, tensors, dtype=torch.float32, device=device)
        for lay in sharded_layers(plan)
    }
    norms = {
        s.name: tensors[s.name].to(device=device, dtype=torch.float32)
        for s in plan.rank_shards(rank)
        if s.layer_class == "Replicated"
    }
    if is_moe(plan):
        decoder = MoEDecoder(plan, rank, layers, norms, device, tensors.folder, hf_config(tensors))
    else:
        decoder = TPDecoder(plan, rank, layers, norms, device)
    batch = rank // topo.span("attn_tp")  # attention-DP replica
    ids = model_tokens(plan, batch, seed=job.seed, tokens=job.tokens)
    with torch.no_grad():
        logits = decoder.forward(ids)
    # One rank per replica sends its logits (all ranks of a replica hold the same, gathered ones).
    sent = logits.cpu() if rank % topo.span("attn_tp") == 0 else None
    gathered = [None] * info.world_size if rank == 0 else None
    dist.gather_object(sent, gathered, dst=0)
    if rank != 0:
        return None
    nbatch = topo.world_size // topo.span("attn_tp")
    ref = hf_logits(job.source, [model_tokens(plan, b, seed=job.seed, tokens=job.tokens) for b in range(nbatch)])
    tp = [gathered[b * topo.span("attn_tp")] for b in range(nbatch)]
    return compare_logits(plan, tp, ref, tokens=job.tokens)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
