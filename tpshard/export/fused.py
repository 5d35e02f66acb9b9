"""Routed experts stored fused in the checkpoint ([E, ...] per projection: tpshard.arch.fused) in a
vLLM export: what vLLM 0.33.0's loader does to each rank's slice beyond slicing it.

gpt-oss bf16 (models/gpt_oss.py, GptOssModel._load_weights_other, no expert parallelism): the
rank's slice of `gate_up_proj` [E, H, 2I] (dim 2: its (gate_j, up_j) pairs) and of `down_proj`
[E, I, H] (dim 1) are `permute(0, 2, 1)`-ed into `w13_weight` [E, 2I/tp, H] and `w2_weight`
[E, H, I/tp]: each expert's matrix transposed ("transpose"); `down_proj_bias` is copied whole on
moe-tp rank 0 and zeroed on the others (`weight.zero_()`, so that the bias is added once after the
reduction): "rank0". Llama-4 (models/llama4.py): `w13_weight` / `w2_weight` the same transposes
of its segmented [gate | up] slices (load_moe_expert_weights L432-442: `transpose(-1, -2)`, then
`chunk(2)` of the rows into w1 / w3, each narrowed to the rank's rows: gate_r then up_r, what the
transposed segmented cut holds), and `qkv_proj` with each q/k head's rows reordered for the rotary
kernel: "rotary" (tpshard.export.rotary). A table names these engine keys (EngineTable.fused);
everything else about them (names, the cut) is the table's and the plan's.

A transposed engine tensor has `axis` TRANSPOSED: its bytes are not its shard's, so the writer
builds them in memory (assemble) and check reads them back into the shard's layout (split_back)
to compare them with the source. The zeroed bias is a constant (EngineTensor.value 0.0), which
check compares with the rules as it does the attention buffers.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import numpy as np

from tpshard.errors import PlanError

TRANSPOSED = -1  # EngineTensor.axis of a tensor whose every expert matrix is its shard's transposed


def fused_experts(plan, rank: int, tensors: list, rules: Iterable[tuple[str, str]]) -> list:
    """One rank's engine tensors (tpshard.export.layout.EngineTensor) with the table's fused-expert
    rules applied: (engine key regex, "transpose" | "rank0" | "rotary")."""
    compiled = [(re.compile(pattern), kind) for pattern, kind in rules]
    topo = plan.topology
    zeroed = topo.ep == 1 and topo.tp_rank(rank) != 0  # with --enable-expert-parallel vLLM slices experts and zeroes nothing
    out = []
    for t in tensors:
        kind = next((k for p, k in compiled if p.fullmatch(t.name)), None)
        if kind == "transpose":
            if len(t.parts) != 1 or len(t.shape) != 3:
                raise PlanError(f"{t.name}: a transposed expert tensor is one [E, a, b] shard, not {[p.name for p in t.parts]} of {list(t.shape)}")
            e, a, b = t.shape
            t = t._replace(shape=(e, b, a), axis=TRANSPOSED)
        elif kind == "rank0" and zeroed:
            t = t._replace(parts=(), value=0.0)
        elif kind == "rotary":
            hd = plan.model.head_dim
            if len(t.parts) != 3 or hd % 2 or any(p.shape[0] % hd for p in t.parts[:2]):
                raise PlanError(f"{t.name}: q/k rows permuted for the rotary kernel need [q; k; v] of whole heads of an even head_dim {hd}, not {[list(p.shape) for p in t.parts]}")
            t = t._replace(rotary=hd)
        elif kind not in (None, "rank0", "rotary"):
            raise PlanError(f"{t.name}: unknown fused-expert rule {kind!r}")
        out.append(t)
    return out


def transpose(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of an [E, a, b] shard as [E, b, a] (each expert's matrix transposed)."""
    e, a, b = shape
    size = len(data) // (e * a * b)
    return np.ascontiguousarray(data.reshape(e, a, b, size).transpose(0, 2, 1, 3)).reshape(-1)


def transpose_back(data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of `transpose`: an [E, b, a] engine tensor's bytes as its [E, a, b] shard's."""
    e, a, b = shape
    return transpose(data, (e, b, a))
