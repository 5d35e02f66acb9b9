"""Layer-level verification: every sharded layer's tensor-parallel output against the source math.

Every rank runs its shard of a layer on a seeded random input (token ids for an embedding) and
sends its local output to rank 0. One input per group instance: a layer over `tp` sees one batch;
a layer over `attn_tp` under attention DP sees one batch per DP replica, and its reduction runs
inside the replica only. Rank 0 regenerates the same inputs and computes the reference in float64
from the *source* tensors, then compares:

- column-style outputs (q/k/v, gate/up, column, MiniMax-M2's q/k norms cut by heads): the group ranks' pieces concatenated in group-rank
  order (the combined result the next layer consumes), padding included and expected zero; replica
  ranks (GQA kv heads, DP replicas of nothing) must agree with each other;
- reduced outputs (row-parallel, embedding, lm_head): every rank's output, which already went
  through the layer's all-reduce or all-gather.

A quantized layer's reference weight is the dequantized *source* tensor: `dequantize(spec, source
tensors of the module)` (float32, the format's own arithmetic, as the ranks dequantize their shards)
promoted to float64; the GEMM and the bias are float64 as for dense layers, so a correct split
differs from it only by the ranks' float32 GEMM.

A failure names the layer, the piece, the group rank and world ranks, and what the numbers look
like (another group rank's slice, a bias counted N times, the vocab rows of one group rank).
"""

from __future__ import annotations

from collections import defaultdict
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

import tpshard.verify.fused_layers as fused_layers
import tpshard.verify.moe_layers as moe_layers
from tpshard.arch import SEGMENTS, Matcher, arch_for
from tpshard.manifest import ModelInfo, Plan
from tpshard.quant.formats import dequantize
from tpshard.runtime.reference_quant import INPUT_SCALES, quant_spec_of, quantize_input
from tpshard.verify.layer_inputs import layer_input
from tpshard.verify.layer_specs import Built, LayerSpecs, run_row
from tpshard.verify.report import LayerResult, conclude, sent_problems

COLUMN = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear")


def batch_of(plan: Plan, group: str, rank: int) -> int:
    """Which input a world rank runs: one per instance of the layer's group (its DP replica) inside
    its pipeline stage; every stage holding the layer runs the same inputs."""
    topo = plan.topology
    return topo.tp_rank(rank) // topo.span(group)  # type: ignore[arg-type]


def batches(plan: Plan, group: str) -> int:
    """Distinct inputs of a layer over `group`: its group instances in one stage."""
    topo = plan.topology
    return topo.tp // topo.span(group)  # type: ignore[arg-type]


def rank_outputs(built: Built, x: torch.Tensor, plan: Plan | None = None, *, seed: int = 0, tokens: int = 16) -> dict[str, tuple[int, torch.Tensor]]:
    """This rank's outputs of one layer: piece -> (group rank of the piece, tensor on the CPU)."""
    module, cls = built.module, built.spec.layer_class
    if cls in fused_layers.FUSED_CLASSES:
        return fused_layers.rank_outputs(built, x, built.spec, plan, seed=seed, tokens=tokens)
    if cls in moe_layers.MOE_CLASSES:
        return moe_layers.rank_outputs(built, x, built.spec, plan, seed=seed, tokens=tokens)
    with torch.no_grad():
        if cls == "RMSNormTP":  # the input is the whole projection; the rank normalises its heads' slice
            return {built.spec.pieces()[0]: (module.shard, module(module.local(x)).double().cpu())}
        if cls in COLUMN:
            out = module(x)
            pieces = built.spec.pieces()
            parts = module.split(out) if hasattr(module, "split") else (out,)
            return {
                p: (module.shard_info(p or None).group_rank, part.double().cpu()) for p, part in zip(pieces, parts)
            }
        if cls == "RowParallelLinear":
            module.input_is_parallel = False
            out = run_row(built, x)
        else:
            out = module(x)
    return {"": (built.group.rank, out.double().cpu())}


class SourceTensors:
    """Source checkpoint tensors by name, in float64, read through safetensors' memory map."""

    def __init__(self, source: str | Path):
        from tpshard.checkpoint import open_checkpoint

        self.ckpt = open_checkpoint(source)
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt.tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.raw(name).double()

    def raw(self, name: str) -> torch.Tensor:
        """A tensor as the file holds it (packed codes, scales in their dtype)."""
        from safetensors import safe_open

        file = self.ckpt.tensors[name].file
        if file not in self._handles:
            self._handles[file] = safe_open(self.ckpt.path / file, framework="pt")
        return self._handles[file].get_tensor(name)


def source_weight(lay: LayerSpecs, plan: Plan, src: SourceTensors, piece: str) -> torch.Tensor:
    """The unsharded weight [N, K] of one piece in float64: the source tensor, or its dequantization."""
    if not lay.quant:
        return src[lay.main(piece).source]
    spec = quant_spec_of(plan, lay.module(piece))
    names = {s.source for s in lay.specs if s.quant and s.piece == piece}
    tensors = {name.rpartition(".")[2]: src.raw(name) for name in names}
    return dequantize(spec, tensors, k=lay.logical_shape(piece)[1]).double()  # float32 math, as on the ranks


def reference(
    lay: LayerSpecs, plan: Plan, w: torch.Tensor, src: SourceTensors, piece: str, x: torch.Tensor
) -> torch.Tensor:
    """The unsharded output of one piece, float64, from its source weight `w` and the source bias.

    A quantized layer with static activation scales (input_scale, input_global_scale) first
    fake-quantizes its input with the *source* scale, as the ranks do with theirs."""
    if lay.layer_class == "VocabParallelEmbedding":
        return F.embedding(x, w)
    if lay.layer_class == "RMSNormTP":  # transformers' MiniMaxM2RMSNorm over the whole width
        x = x.double()
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + plan.model.rms_norm_eps)
    if lay.quant:
        spec = quant_spec_of(plan, lay.module(piece))
        names = {s.source.rpartition(".")[2]: s.source for s in lay.specs if s.quant and s.piece == piece}
        scale = next((src.raw(names[n]) for n in INPUT_SCALES if n in names), None)
        if spec.static_input and scale is not None:
            x = quantize_input(spec, x.to(torch.float32), scale)
    b = lay.first(piece, "bias")
    return F.linear(x.double(), w, src[b.source] if b is not None else None)


@lru_cache(maxsize=4)
def _matcher(model: ModelInfo) -> Matcher:
    return Matcher(arch_for(model).table(model))


def rank_major(lay: LayerSpecs, plan: Plan, piece: str, ref: torch.Tensor) -> torch.Tensor:
    """A reference output in the order the engine's group ranks hold it: itself, or where the
    architecture's rule cuts the piece by segments (Rule.segments, from config.json, not from the
    manifest) each group rank's slice of each segment, rank after rank."""
    spec = lay.main(piece)
    found = _matcher(plan.model).match(spec.source.rpartition(".")[0]) if spec is not None else None
    if found is None or not found[0].segments:
        return ref
    g, sizes = spec.group_size, SEGMENTS[found[0].segments](plan.model)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return torch.cat([ref[..., a + gr * n // g : a + (gr + 1) * n // g] for gr in range(g) for a, n in zip(starts, sizes)], dim=-1)


def compare_layer(
    lay: LayerSpecs, plan: Plan, sent: dict[int, dict], src: SourceTensors, *, seed: int, tokens: int,
    dtype: torch.dtype, tolerance: float, probe: bool = False,
) -> LayerResult:  # fmt: skip
    """Rank 0: every rank's output of `lay` (sent[world rank], the ranks of the stages holding it)
    against the float64 reference.

    probe: the outputs are of a zero input, so they must equal the source bias rounded to the
    compute dtype, exactly (tolerance 0): a bias a few ULPs off is invisible next to x @ W.T."""
    if lay.layer_class in fused_layers.FUSED_CLASSES:
        return fused_layers.compare(lay, plan, sent, src, seed=seed, tokens=tokens, dtype=dtype, tolerance=tolerance)
    if lay.layer_class in moe_layers.MOE_CLASSES:
        return moe_layers.compare(lay, plan, sent, src, seed=seed, tokens=tokens, dtype=dtype, tolerance=tolerance, probe=probe)
    nbatch = batches(plan, lay.group)
    result = LayerResult(
        layer=lay.layer, layer_class=lay.layer_class, group=lay.group, pieces=lay.pieces(), batches=nbatch,
        tolerance=tolerance, quant=lay.quant,
    )  # fmt: skip
    problems = sent_problems(sent)
    inputs = [layer_input(lay, b, seed=seed, tokens=tokens, dtype=dtype) for b in range(nbatch)]
    if probe:
        inputs = [torch.zeros_like(x) for x in inputs]
        tolerance = result.tolerance = 0.0
    weights = {p: source_weight(lay, plan, src, p) for p in lay.pieces()}
    refs = {p: [rank_major(lay, plan, p, reference(lay, plan, weights[p], src, p, x)) for x in inputs] for p in lay.pieces()}
    if probe:
        refs = {p: [r.to(dtype).double() for r in rs] for p, rs in refs.items()}
    scale = max(r.abs().max().item() for rs in refs.values() for r in rs) or 1.0
    max_abs = 0.0
    findings: dict[str, list[int]] = defaultdict(list)  # diagnosis -> world ranks

    if lay.layer_class in COLUMN + ("RMSNormTP",):
        for p in lay.pieces():
            spec = lay.main(p)
            for b in range(nbatch):
                blocks: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
                for rank, msg in sent.items():
                    if msg["batch"] == b and p in msg["outputs"]:
                        gr, t = msg["outputs"][p]
                        blocks[gr].append((rank, t))
                missing = [gr for gr in range(spec.group_size) if gr not in blocks]
                if missing:
                    problems.setdefault(f"piece {p}: no rank of batch {b} holds group ranks {missing}")
                    continue
                for gr, holders in blocks.items():
                    first = holders[0][1]
                    for rank, t in holders[1:]:
                        if t.shape != first.shape or (t - first).abs().max().item() > tolerance * scale:
                            findings[f"piece {p}: replicas of group rank {gr} disagree"].append(rank)
                combined = torch.cat([blocks[gr][0][1] for gr in range(spec.group_size)], dim=-1)  # [T, padded]
                ref = refs[p][b]
                if combined.shape[-1] < ref.shape[-1]:
                    problems.setdefault(f"piece {p}: ranks give {combined.shape[-1]} outputs, the source has {ref.shape[-1]}")
                    continue
                ref = F.pad(ref, (0, combined.shape[-1] - ref.shape[-1]))  # padding outputs must be zero
                max_abs = max(max_abs, (combined - ref).abs().max().item())
                width = combined.shape[-1] // spec.group_size
                for gr in range(spec.group_size):
                    block = combined[:, gr * width : (gr + 1) * width]
                    err = (block - ref[:, gr * width : (gr + 1) * width]).abs().max().item() / scale
                    if err <= tolerance:
                        continue
                    ranks = [r for r, _ in blocks[gr]]
                    other = [
                        k for k in range(spec.group_size)
                        if k != gr and (block - ref[:, k * width : (k + 1) * width]).abs().max().item() / scale <= tolerance
                    ]  # fmt: skip
                    what = f"it is group rank {other[0]}'s slice" if other else f"rel error {err:.3g}"
                    findings[f"piece {p or lay.layer_class} of group rank {gr}/{spec.group_size} differs ({what})"].extend(ranks)
    else:
        spec = lay.main("")
        for rank, msg in sent.items():
            if "" not in msg["outputs"]:
                continue  # the layer was not built on every rank: its problems say why
            _, out = msg["outputs"][""]
            ref = refs[""][msg["batch"]]
            if out.shape != ref.shape:
                problems.setdefault(f"rank {rank}: output shape {list(out.shape)}, reference {list(ref.shape)}")
                continue
            diff = out - ref
            err = diff.abs().max().item()
            max_abs = max(max_abs, err)
            if err / scale > tolerance:
                findings[_diagnose_reduced(lay, spec, src, inputs[msg["batch"]], diff, scale, tolerance)].append(rank)

    return conclude(result, problems, findings, max_abs, scale)


def _diagnose_reduced(
    lay: LayerSpecs, spec, src: SourceTensors, x: torch.Tensor, diff: torch.Tensor, scale: float, tol: float
) -> str:
    """Say what a wrong reduced output looks like: a bias counted N times, or one rank's vocab rows."""
    rel = diff.abs().max().item() / scale
    bias = lay.first("", "bias")
    if lay.layer_class == "RowParallelLinear" and bias is not None:
        b = src[bias.source]  # [N]
        c = (diff * b).sum().item() / (diff.shape[0] * (b * b).sum().item())
        if round(c) and abs(c - round(c)) < 0.05 and (diff - round(c) * b).abs().max().item() / scale <= tol:
            return f"the bias is added {round(c) + 1} times instead of once"
    if lay.layer_class in ("VocabParallelEmbedding", "ParallelLMHead"):
        rows = spec.shape[0]  # vocab rows per group rank, padding included
        if lay.layer_class == "VocabParallelEmbedding":
            bad = diff.abs().amax(dim=-1) > tol * scale  # [n] per looked-up id
            ranks = sorted({int(i) // rows for i in x[bad]})  # ids whose rows came out wrong
            what = "rows for the token ids"
        else:
            bad = diff.abs().amax(dim=0) > tol * scale  # [V] per vocab column
            ranks = sorted({int(i) // rows for i in bad.nonzero().flatten()})
            what = "logits for the vocab rows"
        holders = sorted({r for s in lay.specs if s.group_rank in ranks and s.name.endswith(".weight") for r in s.ranks})
        return f"wrong {what} of group rank(s) {ranks} (shards held by world ranks {holders})"
    return f"output differs from the reference (rel error up to {rel:.1g})"

