"""Human summaries of a plan: per weight kind, per rank, and the seed's per-layer walk-through."""

from __future__ import annotations

import re
from collections import defaultdict

from tpshard.cuts import runs
from tpshard.manifest import Plan, ShardSpec, TensorPlan, shard_shape
from tpshard.render import human_bytes, plural, ranges  # noqa: F401 (human_bytes: callers take it from here too)
from tpshard.safetensors_format import nbytes_of
from tpshard.stages import launch_hint, layer_of, stage_ranges

REDUCTION = {
    "VocabParallelEmbedding": "mask ids outside the rank's rows, all-reduce over {g}",
    "ParallelLMHead": "all-gather logits over {g}, drop vocab padding",
    "QKVParallelLinear": "none (heads stay local to the rank)",
    "MergedColumnParallelLinear": "none (output stays sharded)",
    "ColumnParallelLinear": "none (output stays sharded)",
    "RowParallelLinear": "all-reduce partial sums over {g}; bias added by group rank 0 only",
    "FusedMoE": "each rank runs the tokens routed to its EP slot's experts on its I_e slice; all-reduce over tp",
    "ReplicatedLinear": "none (computed whole on every rank)",
    "Replicated": "none",
    "RMSNormTP": "all-reduce the sum of squares over {g}; the weight stays with the rank's heads",
    "AttentionSinks": "none (one extra logit per local head in the softmax)",
    "FusedExperts": "each rank runs its EP slot's experts (every expert at ep 1) on its I_e slice of the fused [E, ...] tensors; all-reduce over tp, down bias added once",
    "HeadParameter": "none (each rank applies its heads' values)",
}


def slice_text(s: ShardSpec) -> str:
    if s.dim is None:
        return "whole"
    # a leading-dim range first (ShardSpec.lead_start: a fused expert tensor's EP block), then the cut
    lead = f"dim 0 [{s.lead_start}, {s.lead_start + s.lead_length}) x " if s.lead_length else ""
    if s.segments:  # its slice of each segment: [a, b) + [c, d) + ...
        return lead + f"dim {s.dim} " + " + ".join(f"[{a}, {a + n})" for a, n, _ in runs(s.segments, s.source_shape[s.dim], s))
    text = lead + f"dim {s.dim} [{s.start}, {s.start + s.length})"
    if s.pad:
        text += f" + {s.pad} zero"
    return text


def layer_index(name: str, num_layers: int = 0) -> int | None:
    """The decoder layer of a tensor: model.layers.N (DeepSeek-V4's native layers.N; its MTP layer
    mtp.K is layer num_layers + K, as is Qwen3.5's / Qwen3-Next's mtp.layers.K)."""
    m = _LAYER_INDEX.search(name)
    if m is None:
        return None
    return int(m.group(2)) + (num_layers if m.group(1) in ("mtp", "mtp.layers") else 0)


_LAYER_INDEX = re.compile(r"(?:^|\.)(mtp\.layers|layers|mtp)\.(\d+)\.")
_LAYER_NUMBER = re.compile(r"(^|\.)layers\.\d+\.")
_EXPERT_NUMBER = re.compile(r"\.experts\.\d+\.")


def generic_name(name: str) -> str:
    """model.layers.3.mlp.experts.17.up_proj.weight -> model.layers.N.mlp.experts.E.up_proj.weight"""
    return _EXPERT_NUMBER.sub(".experts.E.", _LAYER_NUMBER.sub(r"\1layers.N.", name))


# What each part of the model is cut over, as the plan records it: the first tensor of the part names its group.
PARTS = (("attention", lambda t: ".self_attn." in t.name and t.group != "replicated"),
         ("embedding", lambda t: t.layer_class == "VocabParallelEmbedding"), ("lm_head", lambda t: t.layer_class == "ParallelLMHead"))  # fmt: skip


def part_groups(plan: Plan) -> dict[str, str]:
    """{'attention': 'tp', 'embedding': 'tp', 'lm_head': 'tp'}: the group each part follows (the
    architecture's SGLang model class decides it, docs/architectures.md); parts the model lacks left out."""
    found: dict[str, str] = {}
    for t in plan.tensors:
        for part, test in PARTS:
            if part not in found and test(t):
                found[part] = t.group
        if len(found) == len(PARTS):
            break
    return {part: found[part] for part, _ in PARTS if part in found}


def topology_text(plan: Plan, parts: bool = True) -> str:
    """The topology, and which group attention, the embedding and lm_head follow: under attention
    DP some architectures keep attention over the full tp group (Llama), and `attn_tp=4` alone
    would say otherwise. `parts=False`: the topology alone, `attn_tp` left out where nothing follows it."""
    t = plan.topology
    text = t.describe()
    if not attn_coordinates_used(plan):
        text = text.replace(f" (attn_tp={t.attn_tp})", "")
    groups = ", ".join(f"{part} over {g} ({plural(t.span(g), 'rank')})" for part, g in part_groups(plan).items()) if parts else ""
    return f"{text}; {groups}" if groups else text


def server_hints(t, architecture: str = "") -> list[str]:
    """split and reshard: how the server must be started for this topology's layout (a Topology),
    and for any output of `architecture` (Arch.server_hint)."""
    from tpshard.arch import ARCHITECTURES

    hints = [launch_hint(t.placed_for, t.pp_layers)] if t.pp > 1 else []
    arch = ARCHITECTURES.get(architecture)
    if arch is not None and arch.server_hint:
        hints.append(arch.server_hint)
    if t.moe_a2a_backend:  # UNSET (none) is falsy
        hints.append(f"start SGLang with --moe-a2a-backend {t.moe_a2a_backend} --ep-size {t.tp}: the layout of the experts and shared experts this output holds")
    if t.dcp:  # UNSET (1) is falsy
        flags = f"--dcp-size {t.dcp}" + (" --dcp-replicate-q-proj" if t.dcp_replicate_q_proj else "")
        hints.append(f"start SGLang with {flags}: the decode-context-parallel layout this output was split for")
    return hints


def attn_coordinates_used(plan: Plan) -> bool:
    """Whether any tensor follows attn_tp: else a rank's attn_dp / attn_cp / attn_tp place nothing."""
    return any(t.group == "attn_tp" for t in plan.tensors)


def kind_rows(plan: Plan) -> list[dict]:
    """One row per (layer class, kind, role of the tensor), with the layer-0 example."""
    groups: dict[tuple, list[TensorPlan]] = defaultdict(list)
    for t in plan.tensors:
        groups[(generic_name(t.name), t.layer_class, t.kind)].append(t)
    rows = []
    for (generic, cls, kind), tensors in groups.items():
        t = tensors[0]
        rows.append(
            dict(
                tensor=generic,
                layer_class=cls,
                kind=kind,
                group=f"{t.group}" + (f" (x{t.factor} replicas)" if t.factor > 1 and t.dim is not None else ""),
                source_shape=list(t.shape),
                rank_shape=list(shard_shape(t, t.cuts[0])),
                distinct=t.group_size,
                padding=max(c.pad for cuts in {id(t.cuts): t.cuts for t in tensors}.values() for c in cuts),  # shared cuts once
            )
        )
    return rows


def rank_rows(plan: Plan) -> list[dict]:
    """Per rank: its coordinates, tensors and bytes; for MoE models its EP slot, MoE-TP rank, the
    routed experts it holds and their bytes."""
    topo = plan.topology
    moe = plan.model.num_experts > 0
    files = _file_totals(plan)
    rows = []
    for r in range(topo.world_size):
        held = [files[i] for i, f in enumerate(plan.files) if r in f.ranks]
        row = dict(rank=r) | (dict(pp=topo.pp_rank(r), tp=topo.tp_rank(r)) if topo.pp > 1 else {})
        row |= dict(attn_dp=topo.attn_dp_rank(r), attn_cp=topo.attn_cp_rank(r), attn_tp=topo.attn_tp_rank(r))
        if moe:
            row |= dict(
                ep_slot=topo.ep_rank(r),
                moe_tp=topo.moe_tp_rank(r),
                experts=ranges(sorted(set().union(*(f.experts for f in held)))),
                expert_bytes=sum(f.expert_bytes for f in held),
            )
        row |= dict(tensors=sum(f.tensors for f in held), bytes=sum(f.bytes for f in held), files=len(held))
        rows.append(row)
    return rows


class _FileTotals:
    """What one output file holds: tensors, bytes, routed expert ids and their bytes."""

    def __init__(self) -> None:
        self.tensors = self.bytes = self.expert_bytes = 0
        self.experts: set[int] = set()


def _file_totals(plan: Plan) -> list[_FileTotals]:
    """Per output file, summed over the plan's cuts once per kind of tensor (a rank is the sum of its files)."""
    totals = [_FileTotals() for _ in plan.files]
    # Tensors of one kind share dtype, shape, dim and cuts (make_plan shares the cuts tuple itself):
    # counted per kind, their cuts summed once. kind -> [a tensor, tensors, experts' tensors, expert ids]
    kinds: dict[tuple, list] = {}
    for t in plan.tensors:
        key = (t.dtype, t.shape, t.dim, id(t.cuts))
        kind = kinds.get(key)
        if kind is None:
            kind = kinds[key] = [t, 0, 0, set()]
        kind[1] += 1
        if t.expert is not None:
            kind[2] += 1
            kind[3].add(t.expert)
    for t, count, expert_count, experts in kinds.values():
        for c in t.cuts:
            f, nbytes = totals[c.file], nbytes_of(t.dtype, shard_shape(t, c))
            f.tensors += count
            f.bytes += nbytes * count
            f.experts |= experts
            f.expert_bytes += nbytes * expert_count
    return totals


def rank_bytes(plan: Plan) -> list[int]:
    """Bytes of tensor data each world rank holds."""
    files = _file_totals(plan)
    per_rank = [0] * plan.topology.world_size
    for f, totals in zip(plan.files, files):
        for r in f.ranks:
            per_rank[r] += totals.bytes
    return per_rank


def stage_rows(plan: Plan) -> list[dict]:
    """Per pipeline stage: its ranks, its decoder layers (global indices), what else it holds (the
    embedding, final norm, lm_head, the MTP layer) and the largest rank's bytes; [] at pp 1."""
    topo, model = plan.topology, plan.model
    if topo.pp == 1:
        return []
    others: list[set[str]] = [set() for _ in range(topo.pp)]
    for t in plan.tensors:
        layer = layer_of(t.name)
        if layer is not None and layer < model.num_layers:
            continue
        what = f"MTP layer {layer}" if layer is not None else t.name.rpartition(".")[0]
        for st in {r // topo.tp for c in t.cuts for r in plan.files[c.file].ranks}:
            others[st].add(what)
    rows, per_rank = [], rank_bytes(plan)
    for st, (first, end) in enumerate(stage_ranges(topo.pp_layers)):
        ranks = topo.stage_ranks(st)
        largest = max(per_rank[r] for r in ranks)
        rows.append(
            dict(
                stage=st, ranks=ranges(list(ranks)), layers=ranges(list(range(first, end))), layer_count=end - first,
                also=", ".join(sorted(others[st], key=_forward_position)) or "-", bytes_per_rank=largest,
            )
        )  # fmt: skip
    return rows




# Forward order for the walk-through: (part of the name, position), the first part found decides;
# names not listed keep their place at the end. ".gate." is the router, ".experts." the routed
# experts (not shared_experts), MLA's q_a/kv_a before q_b/kv_b, the MTP module's pieces in place.
FORWARD = (
    ("embed_tokens", 0), ("enorm", 1), ("hnorm", 1), ("eh_proj", 2), ("input_layernorm", 3),
    ("q_a_proj", 4), ("q_a_layernorm", 5), ("q_b_proj", 6), ("q_proj", 6), ("kv_a_proj_with_mqa", 7),
    ("kv_a_layernorm", 8), ("kv_b_proj", 9), ("k_proj", 7), ("v_proj", 8), ("q_norm", 10), ("k_norm", 10),
    ("o_proj", 11), ("post_attention_layernorm", 12), (".gate.", 13), (".experts.", 14),
    ("shared_expert_gate", 16), ("shared_expert", 15), ("gate_proj", 17), ("up_proj", 18), ("down_proj", 19),
    ("shared_head.norm", 20), ("model.norm", 21), ("shared_head.head", 22), ("lm_head", 22),
    # DeepSeek-V4's native names: mHC and norm, LoRA query, kv, compressor / indexer, sink, grouped output
    ("embed.", 0), ("hc_attn", 3), ("attn_norm", 3), ("indexer", 9), ("compressor", 9), ("wq_a", 4), ("wq_b", 6),
    ("wkv", 7), ("kv_norm", 8), ("attn_sink", 10), ("wo_a", 11), ("wo_b", 11), ("hc_ffn", 12), ("ffn_norm", 12),
    ("hc_head", 21), ("head.", 22),
)  # fmt: skip


def _forward_position(name: str) -> int:
    return next((pos for part, pos in FORWARD if part in name), 99)


def explain_rows(plan: Plan, layer: int) -> list[dict]:
    """The seed's walk-through for one decoder layer (plus embedding and lm_head at layer 0).

    Routed experts are folded: one row per projection, EP slot and MoE-TP rank, naming the block of
    experts (model.layers.3.mlp.experts.[32-63].gate_proj.weight)."""
    rows = []
    experts: dict[tuple, list[ShardSpec]] = {}
    for s in sorted(plan.shards, key=lambda s: (_forward_position(s.name), s.expert or 0, s.name, s.group_rank)):
        idx = layer_index(s.name, plan.model.num_layers)
        if idx != layer and not (idx is None and layer == 0 and s.layer_class != "Replicated"):
            continue
        if s.expert is not None:
            key = (generic_name(s.name), s.ep_slot, s.group_rank)
            if key in experts:
                experts[key].append(s)
                continue
            experts[key] = [s]
        rows.append(
            dict(
                tensor=s.name,
                layer=f"{s.layer_class} {s.layer}",
                group=f"{s.group} rank {s.group_rank}/{s.group_size}" + (f", EP slot {s.ep_slot}/{plan.topology.ep}" if s.ep_slot is not None else ""),
                ranks=list(s.ranks),
                shape=list(s.shape),
                loads=slice_text(s),
                reduction=REDUCTION[s.layer_class].format(g=s.group),
            )
        )
    for row in rows:  # name the whole block of experts in the row of its first one
        spec = re.search(r"\.experts\.(\d+)\.", row["tensor"])
        if spec:
            first = next(v for v in experts.values() if v[0].name == row["tensor"] and list(v[0].ranks) == row["ranks"])
            ids = ranges(sorted(x.expert for x in first))
            row["tensor"] = row["tensor"].replace(f".experts.{spec.group(1)}.", f".experts.[{ids}].")
    return rows
