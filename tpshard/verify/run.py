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

from tpshard.errors import TpshardError
from tpshard.manifest import read_manifest
from tpshard.rank import open_rank
from tpshard.runtime import DistInfo, bind_groups, report_progress
from tpshard.runtime.objects import all_true, broadcast_from_root, gather_to_root
from tpshard.verify.build import build_layer
from tpshard.verify.layer_inputs import layer_input
from tpshard.verify.layer_specs import sharded_layers
from tpshard.verify.layers_check import SourceTensors, batch_of, compare_layer, rank_outputs
from tpshard.verify.report import LAYER_TOLERANCE, MODEL_TOLERANCE, ModelResult, VerifyReport
from tpshard.verify.tensors_check import judge_facts, rank_facts

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
    pp: int | None = None  # the pipeline stages the server will run (verify --pp): the output must be split for them
    pp_layers: str | None = None  # and their partition (--pp-layers 26,27,27)


def check_args(job: Job) -> None:
    if job.dtype not in DTYPES:
        raise TpshardError(f"--dtype {job.dtype}: expected one of {', '.join(DTYPES)}")
    if job.tokens < 1:
        raise TpshardError(f"--tokens must be positive, got {job.tokens}")
    if job.pp is not None or job.pp_layers is not None:  # a bad --pp / --pp-layers is refused before any rank starts
        from tpshard.stages import resolve_partition

        resolve_partition(read_manifest(job.out).plan.model.num_layers, job.pp, job.pp_layers)


def rank_preflight(job: Job, rank: int) -> list[str]:
    """What is wrong for `rank` before any collective: its own folder and files, and on rank 0 the source.

    Each rank needs only its own files (rank-NNNNN/) and the manifest; only rank 0 reads the
    source. Under torchrun every rank runs this for itself and the ranks exchange the answers, so
    rank 3's missing file ends every rank with rank 3's message; spawned here, the parent runs it
    for every rank.
    """
    from tpshard.manifest import rank_dir

    manifest = read_manifest(job.out)
    plan = manifest.plan
    problems = []
    if rank not in manifest.written_ranks:
        problems.append(f"{job.out} has no folder for rank {rank} (it holds ranks {list(manifest.written_ranks)})")
    else:
        for f in plan.rank_files(rank):
            path = os.path.join(job.out, rank_dir(rank), f.name)
            if not os.path.isfile(path):
                problems.append(f"{path} is missing")
            elif os.path.getsize(path) != f.size:
                problems.append(f"{path} has {os.path.getsize(path)} bytes, the manifest says {f.size}")
    if rank == 0:
        problems += source_problems(job, plan, manifest.source.files)
    return problems


def source_problems(job: Job, plan, recorded) -> list[str]:
    """Is `job.source` the checkpoint the output was split from (`recorded`: the manifest's
    source.files, compared in tpshard.source_identity), and can --model run on it?"""
    from tpshard.checkpoint import open_checkpoint
    from tpshard.source_identity import wrong_source

    try:
        ckpt = open_checkpoint(job.source)
    except TpshardError as e:
        return [str(e)]
    problem = wrong_source(ckpt, recorded, job.out, workers=os.cpu_count() or 4)
    if problem:
        return [problem]
    absent = sorted({s.source for s in plan.shards} - set(ckpt.tensors))
    differ = sorted({s.source for s in plan.shards if s.source in ckpt.tensors and ckpt.tensors[s.source].shape != s.source_shape})
    if absent or differ:
        what = f"has no {', '.join(absent[:3])}" if absent else f"{differ[0]} has another shape"
        return [f"{job.source}: {what}: not the checkpoint {job.out} was split from"]
    if job.model:
        from tpshard.verify.model import unsupported_reason

        reason = unsupported_reason(plan, ckpt.config, job.tokens)
        if reason:
            return [f"--model: {reason}"]
    return []


def preflight(job: Job, ranks: list[int] | None = None) -> None:
    """Everything that can be wrong before a process group exists, for `ranks` (default: all) on this
    machine: raise one TpshardError naming each rank's problem."""
    check_args(job)
    manifest = read_manifest(job.out)
    ranks = list(range(manifest.plan.topology.world_size)) if ranks is None else ranks
    missing = [r for r in ranks if r not in manifest.written_ranks]
    if missing:
        raise TpshardError(f"{job.out}: verify needs every rank's folder; ranks {missing} were not written (split --ranks)")
    problems = {r: rank_preflight(job, r) for r in ranks}
    raise_rank_problems(problems)


def raise_rank_problems(problems: dict[int, list[str]]) -> None:
    lines = [f"rank {r}: {p}" for r, ps in sorted(problems.items()) for p in ps]
    if lines:
        more = f"\n... {len(lines) - 8} more" if len(lines) > 8 else ""
        error = TpshardError("\n".join(lines[:8]) + more)
        error.every_rank = True  # raised alike on every rank: under torchrun only rank 0 prints it
        raise error


def rank_main(info: DistInfo, jobs: list[Job]) -> list[VerifyReport]:
    """Verify each job in turn on this rank; every rank returns the same reports (rank 0's)."""
    if info.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 must mean float32
        torch.backends.cudnn.allow_tf32 = False
        # bf16/fp16 GEMMs accumulate in float32 end to end (no split-K sums in half precision), as
        # on the CPU: the tolerances in docs/verify.md were measured so.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
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
    # Digests are checked file by file below (rank_facts) and reported as findings, not raised.
    tensors = open_rank(job.out, rank, verify=False)
    dtype = DTYPES[job.dtype]
    src = SourceTensors(job.source) if rank == 0 else None
    report = VerifyReport(
        out_dir=str(job.out), source=str(job.source), topology=topo, backend=info.backend, device=str(device),
        dtype=job.dtype, seed=job.seed, tokens=job.tokens,
    )  # fmt: skip
    # Every byte: each rank checks its own files and sends digests of its whole copies.
    facts = gather_to_root(rank_facts(job.out, manifest, rank, tensors))
    if rank == 0:
        report.tensors = judge_facts(manifest, facts, src)
    if rank == 0 and (topo.pp > 1 or job.pp is not None or job.pp_layers is not None):
        report.stages = stage_problems(plan, job.pp, job.pp_layers)
    stage = topo.pp_rank(rank)
    keep = {}  # float32 layers the model-level forward reuses
    loaded = True  # every layer built on every rank of the stages holding it (else the decoder cannot run)
    layers = sharded_layers(plan)
    steps = len(layers) + job.model  # rank 0 reports each layer judged, then the model (verify's progress)
    for done, lay in enumerate(layers, 1):
        # Pipeline stages: only the ranks of the stages holding the layer build and run it (its
        # collectives stay inside each stage's groups); the others send nothing about it.
        mine = stage in lay.stages(topo)
        sent: dict = {"batch": batch_of(plan, lay.group, rank), "problems": [], "outputs": {}, "probe": {}}
        built = None
        if mine:
            try:
                built = build_layer(lay, plan, rank, tensors, dtype=dtype, device=device)
            except Exception as e:  # noqa: BLE001 - a shape the layer refuses, a file that cannot be read
                sent["problems"].append(f"cannot build {lay.layer_class} on rank {rank}: {type(e).__name__}: {e}")
        # Every rank must agree to run the forward: it holds collectives.
        if not all_true(built is not None or not mine, device):
            loaded = False
        elif mine:
            sent["problems"] += built.problems
            x = layer_input(lay, sent["batch"], seed=job.seed, tokens=job.tokens, dtype=dtype).to(device)
            sent["outputs"] = rank_outputs(built, x, plan, seed=job.seed, tokens=job.tokens)
            if lay.has_bias():
                # A zero input isolates the bias: its output must be the source bias exactly.
                sent["probe"] = rank_outputs(built, torch.zeros_like(x), plan, seed=job.seed, tokens=job.tokens)
            if job.model and dtype == torch.float32:
                keep[lay.layer] = built
        gathered = gather_to_root(sent if mine else None)
        if rank == 0:
            held = {r: m for r, m in enumerate(gathered) if m is not None}
            kw = dict(seed=job.seed, tokens=job.tokens, dtype=dtype, tolerance=LAYER_TOLERANCE[job.dtype])
            result = compare_layer(lay, plan, held, src, **kw)
            if all(msg["probe"] for msg in held.values()):
                probe = compare_layer(lay, plan, {r: {**m, "outputs": m["probe"]} for r, m in held.items()}, src, probe=True, **kw)
                result.problems += [f"bias (zero input): {p}" for p in probe.problems if p not in result.problems]
            if topo.pp > 1:
                result.stages = list(lay.stages(topo))
            report.layers.append(result)
            report_progress(done, steps)
    if job.model and loaded:
        report.model = _verify_model(info, job, plan, tensors, keep, src)
        if rank == 0:
            report_progress(steps, steps)
    elif job.model and rank == 0:
        report.model = ModelResult(
            architecture=plan.model.architecture, batches=0, sequences=0, tokens=job.tokens,
            tolerance=dict(MODEL_TOLERANCE), problems=["not run: a layer could not be built on some rank (see above)"],
        )  # fmt: skip
    report.seconds = round(time.perf_counter() - start, 3)
    return broadcast_from_root(report)


def _verify_model(info: DistInfo, job: Job, plan, tensors, keep: dict, src):
    from tpshard.arch import arch_for
    from tpshard.verify.decoder import TPDecoder, rope_config
    from tpshard.verify.model import compare_logits, hf_logits, is_quantized, model_tokens
    from tpshard.verify.moe_layers import hf_config
    from tpshard.verify.moe_model import MoEDecoder, is_moe

    rank, device, topo = info.rank, info.device, plan.topology
    stage = topo.pp_rank(rank)
    # Load problems are reported per layer already; here only the logits are judged. A rank builds
    # the layers of its own pipeline stage.
    layers = {
        lay.layer: keep.get(lay.layer) or build_layer(lay, plan, rank, tensors, dtype=torch.float32, device=device)
        for lay in sharded_layers(plan)
        if stage in lay.stages(topo)
    }
    if is_quantized(plan):  # the reference is the dequantized source, without activation quantization
        from tpshard.verify.source_dequant import weights_only

        weights_only(layers)
    norms = {
        s.name: tensors[s.name].to(device=device, dtype=torch.float32)
        for s in plan.rank_shards(rank)
        if s.layer_class == "Replicated"
    }
    if arch_for(plan.model).verify == "llama4":
        from tpshard.verify.llama4_model import Llama4Decoder

        decoder = Llama4Decoder(plan, rank, layers, norms, device, hf_config(tensors))
    elif arch_for(plan.model).verify == "deepseek_v4":
        from tpshard.verify.v4_model import V4Decoder

        decoder = V4Decoder(plan, rank, layers, norms, device, hf_config(tensors))
    elif arch_for(plan.model).verify == "hybrid":
        from tpshard.verify.hybrid_model import HybridDecoder

        decoder = HybridDecoder(plan, rank, layers, norms, device, tensors)
    elif is_moe(plan):
        decoder = MoEDecoder(plan, rank, layers, norms, device, tensors.folder, hf_config(tensors))
    else:
        # Only rank 0 reads the source: the RoPE parameters travel from there.
        rope = broadcast_from_root(rope_config(src.ckpt.config) if rank == 0 else None)
        decoder = TPDecoder(plan, rank, layers, norms, device, rope=rope)
    # Attention-DP replicas run different tokens; a replica is the architecture's attention group
    # (Llama, Mistral and Qwen2 keep attention over the whole tp group under --attn-dp: one replica).
    # Every stage's replicas run the same batches: the hidden states go from a rank to its tp_rank
    # on the next stage.
    span = topo.span(arch_for(plan.model).attn_group)
    batch = topo.tp_rank(rank) // span
    ids = model_tokens(plan, batch, seed=job.seed, tokens=job.tokens)
    # A stage lacking a layer would fail between two collectives: every rank checks its own first.
    missing = decoder.missing()
    if not all_true(not missing, device):
        gaps = gather_to_root(missing)
        if rank != 0:
            return None
        lines = [m for g in gaps for m in g]
        return ModelResult(
            architecture=plan.model.architecture, batches=0, sequences=0, tokens=job.tokens, tolerance=dict(MODEL_TOLERANCE),
            problems=[f"not run: {'; '.join(lines[:4])}" + (f"; ... {len(lines) - 4} more" if len(lines) > 4 else "")],
        )  # fmt: skip
    with torch.no_grad():
        logits = decoder.forward(ids)  # None except on the last stage
    # Every rank of the last stage sends its logits: each rank's own norms and layers must give the
    # reference (earlier stages' reach them through the hidden states they pass on).
    gathered = gather_to_root({"batch": batch, "logits": None if logits is None else logits.cpu(), "disagree": decoder.disagree})
    if rank != 0:
        return None
    nbatch = topo.tp // span
    batches = [model_tokens(plan, b, seed=job.seed, tokens=job.tokens) for b in range(nbatch)]
    if arch_for(plan.model).verify == "deepseek_v4" and plan.quant_layers:  # the FP8 + FP4 release, dequantized
        from tpshard.verify.v4_model import dequantized_logits

        ref = dequantized_logits(job.source, batches)
    else:
        ref = hf_logits(job.source, batches, dequantized=is_quantized(plan))
    return compare_logits(plan, dict(enumerate(gathered)), ref, tokens=job.tokens)


def stage_problems(plan, pp: int | None = None, pp_layers: str | None = None) -> list[str]:
    """At pp > 1: tensors on other stages than the engine builds them on (tpshard.check's stage
    check, run on the manifest): the layer-level numbers cannot see a layer run by the wrong stage.
    With `pp` / `pp_layers` (verify --pp, --pp-layers), as `check --pp`: the output must be split
    for the stages the server will run."""
    from tpshard.check import CheckReport, check_pipeline_request, check_stages

    found = CheckReport(out_dir="", source=None)
    check_stages(plan, found)
    if pp is not None or pp_layers is not None:
        check_pipeline_request(plan, pp, pp_layers, found)
    return [p.message for p in found.problems if p.check == "stages"]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
