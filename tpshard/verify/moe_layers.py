"""Layer-level verify of the MoE and MLA layer kinds: routed experts (FusedMoE) and ReplicatedLinear.

The column and row layers of MLA (q_b_proj, q_proj, kv_b_proj by heads, o_proj) and the shared
experts are ordinary Column/Merged/RowParallelLinear layers and go through tpshard.verify's dense
path. This module adds the two layer classes the MoE plans bring:

- **FusedMoE** (`L.mlp.experts`, Mixtral `L.block_sparse_moe.experts`): built on every rank from
  its expert specs (global expert id, EP slot, MoE-TP rank and size, per-rank shape), each compared
  with what the layer expects before loading; an expert the manifest puts on a rank outside the
  expert's EP slot is refused by the layer and missing on the rank that should hold it.
  Run twice on `max(--tokens, E)` seeded tokens:
  1. *routed*: every token picks k distinct experts with positive weights, every expert picked;
     the forward adds the rank's local experts over its slice of I and all-reduces over tp. Each
     rank's output must equal sum_k w_k expert_k(x) computed in float64 from the source tensors.
  2. *one expert per token* (token t -> expert t mod E, weight 1), not reduced: each rank's partial
     output of each of its experts must equal that expert's MoE-TP slice computed from the source
     (silu(x G_m^T) * (x U_m^T) D_m^T). This says which expert on which rank is wrong, and what it
     holds instead (another expert's weights, another MoE-TP rank's slice of down or of gate/up).
- **ReplicatedLinear** (router `mlp.gate` with DeepSeek-V3's `e_score_correction_bias`, MLA's
  `fused_qkv_a_proj_with_mqa` (pieces q_a, kv_a) or `kv_a_proj_with_mqa`, Qwen2-MoE's
  `shared_expert_gate`, the MTP `eh_proj`): whole on every rank; each rank's output of each piece
  must equal the source's. A router also routes its input (tpshard.runtime.moe.route with the
  model's RouterConfig) and every rank's routing weights [T, E] must equal the source's, which is
  what exercises the correction bias.

Not here: the slicing rules (the plan), the dense layer kinds (build.py, layers_check.py), the
seeded inputs (layer_inputs.py).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from tpshard.arch import RouterConfig, router_config
from tpshard.manifest import Plan
from tpshard.quant.formats import dequantize
from tpshard.runtime import ColumnParallelLinear, LogicalGroup, MergedColumnParallelLinear
from tpshard.runtime.moe import FusedMoE, route
from tpshard.runtime.reference_quant import quant_spec_of
from tpshard.verify.layer_inputs import generator, layer_input
from tpshard.verify.layer_specs import Built
from tpshard.verify.report import LayerResult, conclude, sent_problems

MOE_CLASSES = ("FusedMoE", "ReplicatedLinear")
# HF names of an expert's three projections, by the plan's piece (SGLang's w1 / w3 / w2)
EXPERT_PIECE = {"w1": "gate", "w3": "up", "w2": "down"}
CORRECTION_BIAS = "e_score_correction_bias"


def hf_config(tensors) -> dict:
    """config.json as the rank's own folder holds it (split copies it into every rank folder)."""
    path = Path(tensors.folder) / "config.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model config {path}: {e}") from None


def is_router(lay) -> bool:
    """A ReplicatedLinear that is a MoE router: the HF module `...mlp.gate` / `...block_sparse_moe.gate`
    (gpt-oss: `...mlp.router`)."""
    return lay.layer_class == "ReplicatedLinear" and lay.layer.rsplit(".", 1)[-1] in ("gate", "router")


# ---------------------------------------------------------------- building


def build(lay, plan: Plan, rank: int, tensors, *, dtype: torch.dtype, device: torch.device):
    """The Built of a FusedMoE or ReplicatedLinear layer on `rank`, loaded from its own files."""
    if lay.layer_class == "FusedMoE":
        return _build_experts(lay, plan, rank, tensors, dtype=dtype, device=device)
    group = LogicalGroup.of(plan.topology, "replicated", rank)
    pieces = lay.pieces()
    mine = [s for s in lay.specs if rank in s.ranks]
    problems = [
        f"{s.name}: recorded as {s.kind} over {s.group}; a ReplicatedLinear holds it whole on every rank"
        for s in mine if s.kind != "replicated" or s.dim is not None
    ]  # fmt: skip
    mine = [s for s in mine if s.kind == "replicated" and s.dim is None]
    weights: dict[str, torch.Tensor] = {}  # piece -> this rank's float weight [N, K]
    loaded: dict[tuple[str, str], torch.Tensor] = {}  # (piece, param) -> tensor, biases and the correction bias
    for piece in pieces:
        quant = [s for s in mine if s.quant and s.piece == piece]
        try:
            if quant:  # dequantized with torch, as the reference quant method does for the sharded kinds
                weights[piece] = dequantize_specs(plan, quant, {s.name.rpartition(".")[2]: tensors[s.name] for s in quant})
            else:
                w = next((s for s in mine if s.piece == piece and s.name.endswith(".weight")), None)
                if w is not None:
                    weights[piece] = tensors[w.name]
        except (ValueError, KeyError, RuntimeError) as e:
            problems.append(f"{lay.layer} piece {piece!r} on rank {rank}: cannot dequantize its {lay.quant} tensors: {e}")
    for s in mine:
        param = s.name.rpartition(".")[2]
        if not s.quant and not s.name.endswith(".weight"):
            loaded[(s.piece, param)] = tensors[s.name]
    if set(weights) != set(pieces):
        raise ValueError(f"rank {rank} has no weight for pieces {sorted(set(pieces) - set(weights))}: {'; '.join(problems)}")
    k = {w.shape[-1] for w in weights.values()}
    if len(k) != 1:
        raise ValueError(f"pieces {pieces} read inputs of different sizes {sorted(k)}")
    wdtype = torch.float32 if lay.quant else dtype
    kw = dict(group=group, dtype=wdtype, name=lay.layer, bias=any(param == "bias" for _, param in loaded))
    sizes = [weights[p].shape[0] for p in pieces]
    if len(pieces) == 1 and pieces[0] == "":
        module = ColumnParallelLinear(k.pop(), sizes[0], **kw)
    else:
        module = MergedColumnParallelLinear(k.pop(), sizes, piece_names=pieces, **kw)
    module.to(device)
    built = Built(lay, module, group, problems=problems)
    module.correction_bias = None
    for piece, w in weights.items():
        _load(built, lay.layer, rank, lambda: module.load_shard(piece or None, w.to(device=device, dtype=wdtype)))
    for (piece, param), t in loaded.items():
        t = t.to(device=device, dtype=wdtype)
        if param == CORRECTION_BIAS:
            module.correction_bias = t
        else:
            _load(built, lay.layer, rank, lambda: module.load_shard(piece or None, t, param=param))
    missing = module.missing_shards()
    if missing:
        built.problems.append(f"{lay.layer} on rank {rank}: never loaded {missing}")
    if is_router(lay):
        module.router = router_config(hf_config(tensors))
        if module.router.correction_bias and module.correction_bias is None:
            built.problems.append(f"{lay.layer} on rank {rank}: the router needs {CORRECTION_BIAS}; the manifest has none for it")
    return built


def _load(built, layer: str, rank: int, load) -> None:
    try:
        load()
    except (ValueError, KeyError) as e:
        built.problems.append(f"{layer} on rank {rank}: {e.args[0]}")


def dequantize_specs(plan: Plan, specs, tensors: dict, k: int | None = None) -> torch.Tensor:
    """float32 [N, K] of one quantized linear's tensors (by suffix), with the QuantSpec the plan recorded."""
    modules = {s.source.rpartition(".")[0] for s in specs}
    if len(modules) != 1:
        raise ValueError(f"tensors of several modules {sorted(modules)} in one piece")
    spec = quant_spec_of(plan, modules.pop())
    if spec is None:
        raise ValueError(f"the plan records no quantized format for {specs[0].source.rpartition('.')[0]}")
    return dequantize(spec, tensors, k=k)


def _ids(experts) -> str:
    ids = sorted(experts)
    return str(ids[:8])[:-1] + (f", ... {len(ids) - 8} more]" if len(ids) > 8 else "]")


def _experts_numbers(lay, plan: Plan) -> tuple[int, int, int]:
    """(E, I_e, H) from the model info and the expert specs (the specs win: they are what was cut)."""
    w1 = [s for s in lay.specs if s.piece == "w1" and s.expert is not None]
    if not w1:
        raise ValueError(f"{lay.layer}: the manifest has no gate (w1) expert tensors for it")
    e = plan.model.num_experts or max(s.expert for s in w1) + 1
    if w1[0].quant:  # the logical cut: I_e along N; the hidden size on K
        return e, w1[0].logical_size, plan.model.hidden_size
    return e, w1[0].source_shape[0], w1[0].source_shape[-1]


def _build_experts(lay, plan: Plan, rank: int, tensors, *, dtype, device):
    topo = plan.topology
    tp = LogicalGroup.of(topo, "tp", rank)
    e, i, h = _experts_numbers(lay, plan)
    wdtype = torch.float32 if lay.quant else dtype  # quantized: dequantized float32, as ReferenceQuantMethod
    module = FusedMoE(e, h, i, group=tp, ep_size=topo.ep, dtype=wdtype, name=lay.layer).to(device)
    built = Built(lay, module, tp)
    misplaced: dict[int, int] = {}  # expert -> EP slot the manifest gives it, where that is not its block
    quant: dict[tuple[int, str], list] = defaultdict(list)  # (expert, piece) -> its quantized specs on this rank
    for s in lay.specs:
        if rank not in s.ranks:
            continue
        piece = EXPERT_PIECE.get(s.piece)
        if piece is None or s.expert is None:
            built.problems.append(f"{s.name}: recorded as piece {s.piece!r} of expert {s.expert}; FusedMoE has w1/w3/w2 of a global expert")
            continue
        if s.expert not in module.local_experts:
            # SGLang's FusedMoE skips it at load: this rank computes without it, another rank misses it.
            misplaced[s.expert] = s.ep_slot
            continue
        info = module.shard_info(s.expert, piece)
        shape = tuple(s.shape)
        if s.quant:
            quant[(s.expert, piece)].append(s)
            if s.logical_dim is None:
                continue
            shape = [h, h]  # the logical per-rank [N, K]: I_p along the cut dim, hidden on the other
            shape[s.logical_dim] = s.logical_length + s.logical_pad
            shape = tuple(shape)
        got = (s.group, s.ep_slot, s.group_rank, s.group_size, shape)
        expect = ("moe_tp", module.ep_rank, module.moe_tp_rank, module.moe_tp_size, info.shape)
        if got != expect:
            built.problems.append(
                f"{s.name} on rank {rank}: manifest says group {got[0]} EP slot {got[1]} rank {got[2]}/{got[3]} shape"
                f" {list(got[4])}; the FusedMoE of this rank is group moe_tp EP slot {expect[1]} rank {expect[2]}/{expect[3]}"
                f" shape {list(expect[4])}"
            )
        if s.quant:
            continue
        try:
            module.load_expert(s.expert, piece, tensors[s.name].to(device=device, dtype=dtype))
        except (ValueError, KeyError) as err:
            built.problems.append(f"{s.name} on rank {rank}: {err.args[0]}")
    for (expert, piece), specs in quant.items():
        try:
            w = dequantize_specs(plan, specs, {x.name.rpartition(".")[2]: tensors[x.name] for x in specs})
            module.load_expert(expert, piece, w.to(device))
        except (ValueError, KeyError, RuntimeError, IndexError) as err:
            built.problems.append(f"{lay.layer} expert {expert} {piece} on rank {rank}: cannot load its {lay.quant} tensors: {err}")
    if misplaced:
        slots = sorted({v for v in misplaced.values() if v is not None})
        built.problems.append(
            f"rank {rank} ({module.describe()}) holds experts {_ids(misplaced)}, which the manifest puts on EP slot(s)"
            f" {slots}; experts are dealt to EP slots in contiguous blocks of {module.num_local_experts}, so they belong"
            f" to EP slot(s) {sorted({e // module.num_local_experts for e in misplaced})}"
        )
    missing = sorted({int(m.split()[1]) for m in module.missing_shards()})
    if missing:
        built.problems.append(f"rank {rank} ({module.describe()}) never loaded experts {_ids(missing)}")
    return built


# ---------------------------------------------------------------- inputs, shared by the ranks and rank 0


def experts_inputs(lay, plan: Plan, *, seed: int, tokens: int, dtype: torch.dtype):
    """(x [T, H], ids [T, k], weights [T, k]) of the routed run: T >= E so that every expert is picked."""
    e, _, h = _experts_numbers(lay, plan)
    k = max(1, min(plan.model.num_experts_per_tok or 2, e))
    t = max(tokens, e)
    g = generator(seed, lay.layer, 0)
    x = torch.randn(t, h, generator=g).to(dtype)
    # token j picks experts j*k .. j*k + k-1 (mod E): distinct for k <= E, every expert within E tokens
    ids = (torch.arange(t)[:, None] * k + torch.arange(k)[None, :]) % e  # [T, k]
    weights = (torch.rand(t, k, generator=g) + 0.5).to(dtype)  # [T, k] in [0.5, 1.5)
    return x, ids, weights


def one_expert_ids(t: int, e: int) -> torch.Tensor:
    return (torch.arange(t) % e)[:, None]  # [T, 1]: token j -> expert j mod E


def rank_outputs(built, x: torch.Tensor, lay, plan: Plan, *, seed: int, tokens: int) -> dict:
    """This rank's outputs of a FusedMoE (reduced, and unreduced per expert) or a ReplicatedLinear."""
    module = built.module
    with torch.no_grad():
        if lay.layer_class == "FusedMoE":
            x, ids, weights = experts_inputs(lay, plan, seed=seed, tokens=tokens, dtype=x.dtype)
            x, ids, weights = x.to(module.w13_weight.device), ids.to(module.w13_weight.device), weights.to(module.w13_weight.device)
            module.reduce_results = True
            out = module(x, ids, weights)
            module.reduce_results = False
            partial = module(x, one_expert_ids(x.shape[0], module.num_experts).to(x.device), torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device))
            return {"": (built.group.rank, out.double().cpu()), "partial": (built.group.rank, partial.double().cpu())}
        out = module(x)
        parts = module.split(out) if hasattr(module, "split") else (out,)
        sent = {p: (0, part.double().cpu()) for p, part in zip(lay.pieces(), parts)}
        if getattr(module, "router", None) is not None:
            routing = _dense_routing(module.router, x, module.weight, module.correction_bias, getattr(module, "bias", None))
            sent["routing"] = (0, routing.double().cpu())
    return sent


def _dense_routing(
    cfg: RouterConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logit_bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Routing as a [T, E] matrix: each token's top-k weights at their experts, zero elsewhere."""
    if cfg.correction_bias and bias is None:
        bias = torch.zeros(cfg.num_experts, dtype=weight.dtype, device=weight.device)  # reported at build
    ids, w = route(cfg, x, weight, bias, logit_bias)
    return torch.zeros(x.shape[0], cfg.num_experts, dtype=w.dtype, device=w.device).scatter(1, ids, w)


# ---------------------------------------------------------------- rank 0: the reference and the verdict


def _source_weight(lay, plan: Plan, src, specs) -> torch.Tensor:
    """The unsharded float64 weight [N, K] of one matrix (a piece, or an expert's projection), from
    the source: the tensor itself, or the dequantization of its source tensors."""
    quant = [s for s in specs if s.quant]
    if not quant:
        return src[next(s for s in specs if s.name.endswith(".weight")).source]
    sources = {s.source for s in quant}
    return dequantize_specs(plan, quant, {n.rpartition(".")[2]: src.raw(n) for n in sources}).double()


def _expert_out(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def compare(
    lay, plan: Plan, sent: dict[int, dict], src, *, seed: int, tokens: int, dtype: torch.dtype, tolerance: float, probe: bool = False
) -> LayerResult:
    """Rank 0: every rank's outputs (sent[world rank], the ranks of the stages holding the layer) of a
    FusedMoE or ReplicatedLinear against the float64 source reference. probe: the ranks ran a zero
    input (a ReplicatedLinear with a bias, gpt-oss's router: the bias alone)."""
    nbatch = 1 if lay.layer_class == "FusedMoE" else len(sent)
    result = LayerResult(
        layer=lay.layer, layer_class=lay.layer_class, group="tp" if lay.layer_class == "FusedMoE" else "replicated",
        pieces=lay.pieces(), batches=nbatch, tolerance=tolerance, quant=lay.quant,
    )  # fmt: skip
    problems = sent_problems(sent)
    findings: dict[str, list[int]] = defaultdict(list)
    if lay.layer_class == "FusedMoE":
        max_abs, scale = _compare_experts(lay, plan, sent, src, seed=seed, tokens=tokens, dtype=dtype, tol=tolerance, findings=findings, problems=problems)
    else:
        max_abs, scale = _compare_replicated(lay, plan, sent, src, seed=seed, tokens=tokens, dtype=dtype, tol=tolerance, findings=findings, problems=problems, probe=probe)
    return conclude(result, problems, findings, max_abs, scale)


def _compare_replicated(lay, plan, sent, src, *, seed, tokens, dtype, tol, findings, problems, probe=False) -> tuple[float, float]:
    weights = {p: _source_weight(lay, plan, src, [s for s in lay.specs if s.piece == p]) for p in lay.pieces()}
    biases = {p: (src[b.source] if (b := lay.first(p, "bias")) is not None else None) for p in lay.pieces()}
    router = None
    if is_router(lay):
        router = router_config(src.ckpt.config)
        cb = next((s for s in lay.specs if s.name.endswith(CORRECTION_BIAS)), None)
        cbias = src[cb.source] if cb is not None else None
    refs = {}
    for rank, msg in sent.items():
        x = layer_input(lay, msg["batch"], seed=seed, tokens=tokens, dtype=dtype).double()
        x = torch.zeros_like(x) if probe else x
        refs[rank] = {p: F.linear(x, weights[p], biases[p]) for p in lay.pieces()}
        if router is not None:
            refs[rank]["routing"] = _dense_routing(router, x, weights[""], cbias, biases[""])
    scale = max((r.abs().max().item() for per in refs.values() for r in per.values()), default=1.0) or 1.0
    max_abs = 0.0
    for rank, msg in sent.items():
        for p, ref in refs[rank].items():
            if p not in msg["outputs"]:
                problems.setdefault(f"rank {rank} sent no output for {'piece ' + p if p else 'the layer'}")
                continue
            out = msg["outputs"][p][1]
            if out.shape != ref.shape:
                problems.setdefault(f"rank {rank}: piece {p!r} output shape {list(out.shape)}, reference {list(ref.shape)}")
                continue
            err = (out - ref).abs().max().item()
            max_abs = max(max_abs, err)
            if err / scale > tol:
                what = "routing (top-k experts and weights)" if p == "routing" else (f"piece {p}" if p else "output")
                findings[f"{what} differs from the source's"].append(rank)
    return max_abs, scale


def judge_routed(sent, x, ids, w, e_total: int, expert_out, tol: float, findings) -> tuple[float, float]:
    """The routed run of an experts layer judged: each rank's all-reduced output against
    sum_k w_k expert_k(x) in float64, where expert_out(e, rows) is expert e of the source on
    x[rows]. Returns (the largest error, the reference's scale)."""
    ref = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        for e in range(e_total):
            rows = ids[:, j] == e
            ref[rows] += w[rows, j, None].double() * expert_out(e, rows)
    scale = ref.abs().max().item() or 1.0
    max_abs = 0.0
    for rank, msg in sent.items():
        if "" not in msg["outputs"]:
            continue
        err = (msg["outputs"][""][1] - ref).abs().max().item()
        max_abs = max(max_abs, err)
        if err / scale > tol:
            findings["routed output differs from the source's"].append(rank)
    return max_abs, scale


def _compare_experts(lay, plan, sent, src, *, seed, tokens, dtype, tol, findings, problems) -> tuple[float, float]:
    topo = plan.topology
    e_total, i_e, _ = _experts_numbers(lay, plan)
    by_expert: dict[tuple[int, str], list] = defaultdict(list)
    for s in lay.specs:
        if s.expert is not None and s.piece in EXPERT_PIECE:
            by_expert[(s.expert, EXPERT_PIECE[s.piece])].append(s)
    absent = sorted({e for e in range(e_total) for p in ("gate", "up", "down") if (e, p) not in by_expert})
    if absent:
        problems.setdefault(f"the manifest has no tensors of experts {absent[:8]}")
        return 0.0, 1.0
    x, ids, w = experts_inputs(lay, plan, seed=seed, tokens=tokens, dtype=dtype)
    x = x.double()
    full = {e: [_source_weight(lay, plan, src, by_expert[(e, p)]) for p in ("gate", "up", "down")] for e in range(e_total)}
    per_expert = {e: _expert_out(x, *full[e]) for e in range(e_total)}  # [T, H] each, unweighted
    max_abs, scale = judge_routed(sent, x, ids, w, e_total, lambda e, rows: per_expert[e][rows], tol, findings)

    # One expert per token, unreduced: which expert on which rank, and what it holds instead.
    moe_tp, per_slot = topo.moe_tp, e_total // topo.ep
    i_p = i_e // moe_tp
    one = one_expert_ids(x.shape[0], e_total)[:, 0]  # [T]

    def sliced(e: int, m_gu: int, m_down: int, rows) -> torch.Tensor:
        g, u, d = full[e]
        return _expert_out(x[rows], g[m_gu * i_p : (m_gu + 1) * i_p], u[m_gu * i_p : (m_gu + 1) * i_p], d[:, m_down * i_p : (m_down + 1) * i_p])

    for rank, msg in sent.items():
        if "partial" not in msg["outputs"]:
            continue
        partial = msg["outputs"]["partial"][1]
        slot, m = topo.ep_rank(rank), topo.moe_tp_rank(rank)
        for e in range(slot * per_slot, (slot + 1) * per_slot):
            rows = one == e
            want = sliced(e, m, m, rows)
            got = partial[rows]
            if (got - want).abs().max().item() / scale <= tol:
                continue
            findings[f"expert {e} (EP slot {slot}/{topo.ep}, MoE-TP rank {m}/{moe_tp}) differs ({_diagnose(e, m, got, rows, sliced, e_total, moe_tp, scale, tol)})"].append(rank)
    return max_abs, scale


def _diagnose(e, m, got, rows, sliced, e_total, moe_tp, scale, tol) -> str:
    """What an expert's partial output looks like: another expert's weights, another MoE-TP slice."""
    def close(t: torch.Tensor) -> bool:
        return (got - t).abs().max().item() / scale <= tol

    if got.abs().max().item() / scale <= tol:
        return "its output is zero: weights not loaded"
    for other in range(e_total):
        if other != e and close(sliced(other, m, m, rows)):
            return f"it holds expert {other}'s weights"
    for m2 in range(moe_tp):
        if m2 == m:
            continue
        if close(sliced(e, m2, m2, rows)):
            return f"it holds MoE-TP rank {m2}'s slice of every projection"
        if close(sliced(e, m, m2, rows)):
            return f"its down_proj is MoE-TP rank {m2}'s slice"
        if close(sliced(e, m2, m, rows)):
            return f"its gate/up_proj are MoE-TP rank {m2}'s slice"
    return f"rel error {(got - sliced(e, m, m, rows)).abs().max().item() / scale:.3g}"
