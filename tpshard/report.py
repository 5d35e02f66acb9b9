"""Human summaries of a plan: per weight kind, per rank, and the seed's per-layer walk-through."""

from __future__ import annotations

import re
from collections import defaultdict

from tpshard.manifest import Plan, ShardSpec
from tpshard.safetensors_format import nbytes_of

REDUCTION = {
    "VocabParallelEmbedding": "mask ids outside the rank's rows, all-reduce over {g}",
    "ParallelLMHead": "all-gather logits over {g}, drop vocab padding",
    "QKVParallelLinear": "none (heads stay local to the rank)",
    "MergedColumnParallelLinear": "none (output stays sharded)",
    "ColumnParallelLinear": "none (output stays sharded)",
    "RowParallelLinear": "all-reduce partial sums over {g}; bias added by group rank 0 only",
    "Replicated": "none",
}


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def slice_text(s: ShardSpec) -> str:
    if s.dim is None:
        return "whole"
    text = f"dim {s.dim} [{s.start}, {s.start + s.length})"
    if s.pad:
        text += f" + {s.pad} zero"
    return text


def layer_index(name: str) -> int | None:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def kind_rows(plan: Plan) -> list[dict]:
    """One row per (layer class, kind, role of the tensor), with the layer-0 example."""
    groups: dict[tuple, list[ShardSpec]] = defaultdict(list)
    for s in plan.shards:
        generic = re.sub(r"\.layers\.\d+\.", ".layers.N.", s.name)
        groups[(generic, s.layer_class, s.kind)].append(s)
    rows = []
    for (generic, cls, kind), specs in groups.items():
        s = specs[0]
        rows.append(
            dict(
                tensor=generic,
                layer_class=cls,
                kind=kind,
                group=f"{s.group}" + (f" (x{s.factor} replicas)" if s.factor > 1 and s.dim is not None else ""),
                source_shape=list(s.source_shape),
                rank_shape=list(s.shape),
                distinct=s.group_size,
                padding=max(x.pad for x in specs),
            )
        )
    return rows


def rank_rows(plan: Plan) -> list[dict]:
    topo = plan.topology
    rows = []
    for r in range(topo.world_size):
        specs = plan.rank_shards(r)
        rows.append(
            dict(
                rank=r,
                attn_dp=topo.attn_dp_rank(r),
                attn_cp=topo.attn_cp_rank(r),
                attn_tp=topo.attn_tp_rank(r),
                tensors=len(specs),
                bytes=sum(nbytes_of(s.dtype, s.shape) for s in specs),
                files=len(plan.rank_files(r)),
            )
        )
    return rows


# Forward order for the walk-through; names not listed keep their place at the end.
FORWARD = ("embed_tokens", "input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj",
           "post_attention_layernorm", "gate_proj", "up_proj", "down_proj", "model.norm", "lm_head")  # fmt: skip


def _forward_position(name: str) -> int:
    return next((i for i, part in enumerate(FORWARD) if part in name), len(FORWARD))


def explain_rows(plan: Plan, layer: int) -> list[dict]:
    """The seed's walk-through for one decoder layer (plus embedding and lm_head at layer 0)."""
    rows = []
    for s in sorted(plan.shards, key=lambda s: (_forward_position(s.name), s.name, s.group_rank)):
        idx = layer_index(s.name)
        if idx != layer and not (idx is None and layer == 0 and s.layer_class != "Replicated"):
            continue
        rows.append(
            dict(
                tensor=s.name,
                layer=f"{s.layer_class} {s.layer}",
                group=f"{s.group} rank {s.group_rank}/{s.group_size}",
                ranks=list(s.ranks),
                shape=list(s.shape),
                loads=slice_text(s),
                reduction=REDUCTION[s.layer_class].format(g=s.group),
            )
        )
    return rows
