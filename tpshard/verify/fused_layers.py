"""Layer-level verify of routed experts stored fused (FusedExperts: gpt-oss, Llama-4) and attention
sinks (AttentionSinks, gpt-oss).

- **FusedExperts** (gpt-oss `L.mlp.experts`, Llama-4 `L.feed_forward.experts`): each rank loads its
  shards of the fused tensors into a tpshard.runtime.fused_moe InterleavedExperts or
  SegmentedExperts, by the family's gate/up layout (tpshard.arch.fused; the experts of its EP slot,
  every expert at ep 1, over its moe_tp slice of I), each shape compared with what the layer expects. Run on `max(--tokens, E)` seeded tokens:
  1. *routed*: every token picks k distinct experts with positive weights, every expert picked,
     all-reduced over tp: each rank's output must equal sum_k w_k expert_k(x) computed in float64
     from the source tensors (gpt-oss: gate/up de-interleaved as transformers' GptOssExperts does,
     the clamped SwiGLU, both biases; Llama-4: the [gate | up] halves, silu(gate) * up);
  2. *one expert per token*, unreduced, without the down bias: each rank's partial output of each
     expert must equal that expert over the rank's slice of I, which says which rank holds what
     (another MoE-TP rank's slice, the gate/up axis read in the other layout).
- **AttentionSinks** (`L.self_attn.sinks`): each rank's sinks, concatenated in group-rank order,
  must be the source's, and each group rank's must be its own heads' (not another rank's, not
  every head).

Not here: the plan's cuts, the sinks in attention (tpshard.verify.sinks_model runs them in the decoder).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tpshard.arch import ARCHITECTURES
from tpshard.manifest import Plan
from tpshard.runtime import LogicalGroup
from tpshard.runtime.fused_moe import InterleavedExperts, SegmentedExperts, mxfp4_dequantize, silu_halves, swiglu
from tpshard.verify.layer_inputs import generator
from tpshard.verify.layer_specs import Built
from tpshard.verify.moe_layers import hf_config, judge_routed
from tpshard.verify.report import LayerResult, conclude, sent_problems

FUSED_CLASSES = ("FusedExperts", "AttentionSinks")


def swiglu_numbers(config: dict) -> tuple[float, float]:
    """(alpha, limit) of gpt-oss's clamped SwiGLU (transformers GptOssConfig swiglu_alpha / swiglu_limit)."""
    return float(config.get("swiglu_alpha", 1.702)), float(config.get("swiglu_limit", 7.0))


def _param(s) -> str:
    return s.name.rpartition(".")[2]


def _layout(plan: Plan) -> str:
    """The family's gate/up layout of the fused experts: interleaved (gpt-oss) or segmented (Llama-4)."""
    return ARCHITECTURES[plan.model.architecture].fused_experts.params["gate_up_proj"].layout


def out_in(plan: Plan) -> bool:
    """The family stores each expert [out, in] (Qwen3.5: gate_up_proj [E, 2I, H], down_proj [E, H, I]),
    the transpose of the runtime's [E, in, out]: loaded and read transposed, the bytes as they are."""
    return ARCHITECTURES[plan.model.architecture].fused_experts.params["gate_up_proj"].shape == "e_2i_h"


def _experts_class(plan: Plan):
    return SegmentedExperts if _layout(plan) == "segmented" else InterleavedExperts


def build(lay, plan: Plan, rank: int, tensors, *, dtype: torch.dtype, device: torch.device) -> Built:
    topo, m = plan.topology, plan.model
    if lay.layer_class == "AttentionSinks":
        group = LogicalGroup.of(topo, lay.group, rank)
        built = Built(lay, torch.nn.Module(), group)
        mine = [s for s in lay.specs if rank in s.ranks]
        want = (m.num_heads // group.size,)
        for s in mine:
            if (s.group, s.group_rank, tuple(s.shape)) != (lay.group, group.rank, want):
                built.problems.append(
                    f"{s.name} on rank {rank}: manifest says group {s.group} rank {s.group_rank}/{s.group_size} shape"
                    f" {list(s.shape)}; this rank's attention holds {want[0]} heads as {lay.group} rank {group.rank}/{group.size}"
                )
        built.module.sinks = tensors[mine[0].name].to(device=device, dtype=dtype) if mine else None
        if not mine:
            built.problems.append(f"{lay.layer} on rank {rank}: never loaded")
        return built
    group = LogicalGroup.of(topo, "tp", rank)
    alpha, limit = swiglu_numbers(hf_config(tensors))
    per = per_rank(plan)
    module = _experts_class(plan)(
        m.num_experts, m.hidden_size, m.moe_intermediate_size, group=group, alpha=alpha, limit=limit, dtype=dtype,
        name=lay.layer, per_rank=per[1] if m.expert_block else None, ep_size=topo.ep,
    ).to(device)  # fmt: skip
    built = Built(lay, module, group)
    held = {_param(s): tensors[s.name] for s in lay.specs if rank in s.ranks}
    try:
        held = dequantized(held)
    except (KeyError, RuntimeError, IndexError) as e:
        built.problems.append(f"{lay.layer} on rank {rank}: cannot dequantize its MXFP4 tensors: {e!r}")
    for param, t in held.items():
        try:
            module.load(param, (t.transpose(1, 2) if out_in(plan) else t).to(device=device, dtype=dtype))
        except (ValueError, KeyError) as e:
            built.problems.append(f"{lay.layer}.{param} on rank {rank}: {e.args[0]}")
    if module.missing_shards():
        built.problems.append(f"{lay.layer} on rank {rank}: never loaded {module.missing_shards()}")
    return built


def dequantized(held: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused experts' tensors in transformers' float layout: MXFP4 `*_blocks` / `*_scales`
    ([E, out, in] blocks) dequantized and transposed to gate_up_proj [E, H, 2I] / down_proj [E, I, H],
    as transformers' convert_moe_packed_tensors (integrations/mxfp4.py) does."""
    out = {p: t for p, t in held.items() if not p.endswith(("_blocks", "_scales"))}
    for p in ("gate_up_proj", "down_proj"):
        if f"{p}_blocks" in held or f"{p}_scales" in held:
            out[p] = mxfp4_dequantize(held[f"{p}_blocks"], held[f"{p}_scales"]).transpose(1, 2)
    return out


def per_rank(plan: Plan) -> tuple[list[range], int]:
    """Each MoE-TP rank's intermediate range, and the per-rank size padding included: I / moe_tp,
    or MXFP4's whole 32-blocks, ceil(blocks / moe_tp) a rank, the last rank short."""
    i, g, b = plan.model.moe_intermediate_size, plan.topology.moe_tp, plan.model.expert_block
    per = -(-(i // b) // g) * b if b else i // g
    return [range(m * per, min((m + 1) * per, i)) for m in range(g)], per


def experts_inputs(lay, plan: Plan, *, seed: int, tokens: int, dtype: torch.dtype):
    """(x [T, H], ids [T, k], weights [T, k]) of the routed run: T >= E so that every expert is picked."""
    e, h = plan.model.num_experts, plan.model.hidden_size
    k = max(1, min(plan.model.num_experts_per_tok or 2, e))
    t = max(tokens, e)
    g = generator(seed, lay.layer, 0)
    x = torch.randn(t, h, generator=g).to(dtype)
    ids = (torch.arange(t)[:, None] * k + torch.arange(k)[None, :]) % e  # distinct for k <= E
    return x, ids, (torch.rand(t, k, generator=g) + 0.5).to(dtype)


def rank_outputs(built: Built, x: torch.Tensor, lay, plan: Plan, *, seed: int, tokens: int) -> dict:
    module = built.module
    with torch.no_grad():
        if lay.layer_class == "AttentionSinks":
            return {} if module.sinks is None else {"": (built.group.rank, module.sinks.double().cpu())}
        x, ids, w = (t.to(x.device) for t in experts_inputs(lay, plan, seed=seed, tokens=tokens, dtype=x.dtype))
        out = module(x, ids, w)
        partial = torch.stack([module.expert(e, x, bias=False) for e in range(module.num_local_experts)])  # [E / ep, T, H]
    return {"": (built.group.rank, out.double().cpu()), "partial": (built.group.rank, partial.double().cpu())}


def _source_experts(lay, src, params: tuple[str, ...], transposed: bool = False) -> dict[str, torch.Tensor]:
    names = {_param(s): s.source for s in lay.specs}
    full = dequantized({p: src.raw(n) for p, n in names.items()})
    return {p: (full[p].transpose(1, 2) if transposed else full[p]).double() for p in params if p in full}


def _expert(w: dict, e: int, x: torch.Tensor, cols: slice, alpha: float, limit: float, bias: bool) -> torch.Tensor:
    """Expert e over the intermediate range `cols` (of I) from the source, in float64: gpt-oss's
    interleaved gate/up with its biases, or (no gate_up_proj_bias) Llama-4's [gate | up] halves."""
    g = w["gate_up_proj"][e]
    if "gate_up_proj_bias" not in w:
        i = g.shape[-1] // 2
        return silu_halves(torch.cat((x @ g[:, cols], x @ g[:, i + cols.start : i + cols.stop]), -1)) @ w["down_proj"][e][cols]
    gu = x @ g[:, 2 * cols.start : 2 * cols.stop] + w["gate_up_proj_bias"][e][2 * cols.start : 2 * cols.stop]
    y = swiglu(gu, alpha, limit) @ w["down_proj"][e][cols]
    return y + w["down_proj_bias"][e] if bias else y


def compare(lay, plan: Plan, sent: dict[int, dict], src, *, seed: int, tokens: int, dtype: torch.dtype, tolerance: float) -> LayerResult:
    """Rank 0: every rank's outputs of a FusedExperts or AttentionSinks layer against the source."""
    result = LayerResult(layer=lay.layer, layer_class=lay.layer_class, group=lay.group, pieces=[""], batches=1, tolerance=tolerance)
    problems = sent_problems(sent)
    findings: dict[str, list[int]] = defaultdict(list)
    if lay.layer_class == "AttentionSinks":
        max_abs, scale = _compare_sinks(lay, sent, src, tolerance, findings, problems)
    else:
        max_abs, scale = _compare_experts(lay, plan, sent, src, seed=seed, tokens=tokens, dtype=dtype, tol=tolerance, findings=findings, problems=problems)
    return conclude(result, problems, findings, max_abs, scale)


def _compare_sinks(lay, sent, src, tol, findings, problems) -> tuple[float, float]:
    full = src[lay.specs[0].source]  # [heads]
    scale = full.abs().max().item() or 1.0
    max_abs = 0.0
    for rank, msg in sent.items():
        if "" not in msg["outputs"]:
            continue
        gr, got = msg["outputs"][""]
        n = got.shape[0]
        want = full[gr * n : (gr + 1) * n]
        if want.shape != got.shape:
            findings[f"sinks of {got.shape[0]} heads for group rank {gr}, the source has {full.shape[0]}"].append(rank)
            continue
        err = (got - want).abs().max().item()
        max_abs = max(max_abs, err)
        if err / scale > tol:
            other = [k for k in range(full.shape[0] // n) if k != gr and torch.equal(got, full[k * n : (k + 1) * n])]
            what = f"it holds group rank {other[0]}'s heads" if other else f"rel error {err / scale:.3g}"
            findings[f"sinks of group rank {gr} differ ({what})"].append(rank)
    return max_abs, scale


def _compare_experts(lay, plan, sent, src, *, seed, tokens, dtype, tol, findings, problems) -> tuple[float, float]:
    alpha, limit = swiglu_numbers(src.ckpt.config)
    params = _experts_class(plan).params
    w = _source_experts(lay, src, params, out_in(plan))
    if set(w) != set(params):
        problems.setdefault(f"the manifest has no {sorted(set(params) - set(w))} for {lay.layer}")
        return 0.0, 1.0
    e_total, i = plan.model.num_experts, plan.model.moe_intermediate_size
    x, ids, weights = experts_inputs(lay, plan, seed=seed, tokens=tokens, dtype=dtype)
    x = x.double()
    full = slice(0, i)
    routed = lambda e, rows: _expert(w, e, x[rows], full, alpha, limit, True)  # noqa: E731
    max_abs, scale = judge_routed(sent, x, ids, weights, e_total, routed, tol, findings)
    moe_tp, local = plan.topology.moe_tp, e_total // plan.topology.ep
    ranges = [slice(r.start, r.stop) for r in per_rank(plan)[0]]
    for rank, msg in sent.items():
        if "partial" not in msg["outputs"]:
            continue
        tp_rank, partial = msg["outputs"]["partial"]
        m, start = tp_rank % moe_tp, tp_rank // moe_tp * local  # the MoE-TP rank and first expert of its EP slot
        for j in range(partial.shape[0]):
            e = start + j
            want = _expert(w, e, x, ranges[m], alpha, limit, False)
            err = (partial[j] - want).abs().max().item() / scale
            if err <= tol:
                continue
            others = [k for k in range(moe_tp) if k != m and (partial[j] - _expert(w, e, x, ranges[k], alpha, limit, False)).abs().max().item() / scale <= tol]
            other = [k for k in range(e_total) if k != e and (partial[j] - _expert(w, k, x, ranges[m], alpha, limit, False)).abs().max().item() / scale <= tol]
            what = f"it holds MoE-TP rank {others[0]}'s slice" if others else f"it holds expert {other[0]}" if other else f"rel error {err:.3g}"
            findings[f"expert {e} on MoE-TP rank {m}/{moe_tp} differs ({what})"].append(rank)
    return max_abs, scale
