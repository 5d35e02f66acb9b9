"""The manifest's specs of one engine layer (`LayerSpecs`), and one rank's loaded layer (`Built`).

A LayerSpecs gathers every rank's ShardSpecs of an engine layer (qkv_proj, gate_up_proj,
mlp.experts, ...) and answers what building, feeding and judging it need: its pieces in the
engines' fused order, the spec that carries a piece's cut, its logical [N, K], its group and the
pipeline stages holding it. `sharded_layers` lists a plan's in forward order. Built is what
tpshard.verify.build (and .moe_layers for the MoE kinds) make of one on a rank.

Not here: building the layers, their inputs, the reference math.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tpshard.manifest import Plan, ShardSpec
from tpshard.runtime import LogicalGroup, RowParallelLinear
from tpshard.topology import Topology

TIED_LM_HEAD = "lm_head"


def reduction_group(layer_class: str) -> str | None:
    """The group a layer's outputs are reduced over when it is not its weights' group: the routed
    experts are cut over moe_tp inside EP slots, and their partial sums are all-reduced over tp."""
    return "tp" if layer_class in ("FusedMoE", "FusedExperts") else None


@dataclass
class LayerSpecs:
    """All specs of one engine layer (every rank), and the ones naming a parameter of it."""

    layer: str
    layer_class: str
    specs: list[ShardSpec]
    hidden: int = 0  # the model's hidden size: the uncut dim of a quantized linear

    @property
    def quant(self) -> str:
        """The quantized format of the layer's weights ("" for a dense layer)."""
        return next((s.quant for s in self.specs if s.quant), "")

    @property
    def group(self) -> str:
        """The group the layer's outputs are reduced or gathered over, which decides its inputs."""
        if reduction_group(self.layer_class):
            return reduction_group(self.layer_class)
        # The weights decide the group; a bias recorded over another group is an alignment problem.
        w = self.main(self.pieces()[0]) if self.pieces() else None
        return (w or self.specs[0]).group

    def _is_weight(self, s: ShardSpec) -> bool:
        return bool(s.quant) or s.name.endswith(".weight")

    def pieces(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.specs:
            if self._is_weight(s):
                seen.setdefault(s.piece)
        order = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1, "q_a": 0, "kv_a": 1}  # the engines' fused order
        return sorted(seen, key=lambda p: (order.get(p, 9), p))

    def first(self, piece: str = "", param: str = "weight") -> ShardSpec | None:
        for s in self.specs:
            if s.piece == piece and s.name.rsplit(".", 1)[1] == param:
                return s
        return None

    def main(self, piece: str = "") -> ShardSpec | None:
        """The spec that carries a piece's cut: its dense weight, or a quantized tensor cut along N or K."""
        if not self.quant:
            return self.first(piece)
        quant = [s for s in self.specs if s.quant and s.piece == piece]
        return next((s for s in quant if s.logical_dim is not None), quant[0] if quant else None)

    def module(self, piece: str = "") -> str:
        """The HF module of a piece (model.layers.0.self_attn.q_proj): its QuantSpec's key in the plan."""
        return self.main(piece).source.rpartition(".")[0]

    def logical_shape(self, piece: str = "") -> tuple[int, int]:
        """[N, K] of one piece: the source weight's shape; for a quantized piece the logical size
        along its cut dim and the hidden size on the other."""
        w = self.main(piece)
        if w is None:
            raise ValueError(f"{self.layer}: the manifest has no weight for piece {piece!r}")
        if not w.quant:
            return w.source_shape[0], w.source_shape[-1]
        fp8 = self.first(piece)  # FP8 weights hold one value per byte: their shape is the logical [N, K]
        if fp8 is not None and fp8.quant and fp8.dtype.startswith("F8"):
            return fp8.source_shape[0], fp8.source_shape[-1]
        if w.logical_dim is None:
            raise ValueError(f"{w.name}: a quantized tensor with no logical cut; verify cannot size {self.layer}")
        nk = [self.hidden, self.hidden]  # packed formats: q/k/v/gate/up read, o/down write the residual stream
        nk[w.logical_dim] = w.logical_size
        return nk[0], nk[1]

    def per_rank(self, piece: str = "") -> int:
        """A quantized piece's logical size per rank along its cut dim, padding included (a segmented
        cut's slices of every segment together)."""
        w = self.main(piece)
        return (w.logical_length + w.logical_pad) * (sum(w.segments) or 1)

    def stages(self, topo: Topology) -> tuple[int, ...]:
        """The pipeline stages whose ranks hold any tensor of the layer, as the manifest records them:
        every rank of these stages builds and runs it (a rank of such a stage that lacks a piece
        reports it as never loaded); ranks of other stages skip it."""
        return tuple(sorted({topo.pp_rank(r) for s in self.specs for r in s.ranks}))

    def has_bias(self, kind: str | None = None) -> bool:
        return any(s.name.endswith(".bias") and (kind is None or s.kind == kind) for s in self.specs)


def no_runtime(s: ShardSpec) -> bool:
    """A sharded tensor verify has no runtime layer for: a gated DeltaNet's per-head A_log / dt_bias
    (HeadParameter) and a plain linear class's weight of more than 2 dims (its conv1d; stacked
    [E, ...] experts have their MoE layers). tpshard.verify.tensors_check compares each rank's
    bytes of it with the source's cut instead."""
    return s.dim is not None and (s.layer_class == "HeadParameter" or (len(s.source_shape) > 2 and s.layer_class in _LINEAR))


# The plain linear classes, whose runtime layers take a 2-D weight.
_LINEAR = ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear", "RowParallelLinear")


def sharded_layers(plan: Plan) -> list[LayerSpecs]:
    """Every non-replicated engine layer of the plan with a runtime layer, in plan order; a tied lm_head appended."""
    by_layer: dict[str, list[ShardSpec]] = defaultdict(list)
    for s in plan.shards:
        if s.layer_class != "Replicated" and not no_runtime(s):
            by_layer[s.layer].append(s)
    hidden = plan.model.hidden_size
    layers = [LayerSpecs(name, specs[0].layer_class, specs, hidden) for name, specs in by_layer.items()]
    if plan.model.tie_word_embeddings and TIED_LM_HEAD not in by_layer:
        embed = next((lay for lay in layers if lay.layer_class == "VocabParallelEmbedding"), None)
        if embed is not None:  # the engines' tie: lm_head reuses the embedding's shards and group
            layers.append(LayerSpecs(TIED_LM_HEAD, "ParallelLMHead", embed.specs, hidden))
    return sorted(layers, key=_forward_order)


_CLASS_ORDER = {"VocabParallelEmbedding": 0, "QKVParallelLinear": 1, "ReplicatedLinear": 1, "RowParallelLinear": 4, "ParallelLMHead": 9}


def _forward_order(lay: LayerSpecs) -> tuple:
    """Embedding, then each decoder layer (qkv, o_proj, gate_up, down), then lm_head."""
    m = re.search(r"\.layers\.(\d+)\.", lay.layer + ".")
    index = int(m.group(1)) if m else (-1 if _CLASS_ORDER.get(lay.layer_class) == 0 else 1 << 30)
    mlp = "mlp" in lay.layer or "block_sparse_moe" in lay.layer
    return (index, mlp, _CLASS_ORDER.get(lay.layer_class, 2), lay.layer)


@dataclass
class Built:
    """One rank's loaded layer, plus what went wrong loading it (alignment problems)."""

    spec: LayerSpecs
    module: torch.nn.Module
    group: LogicalGroup
    every_rank_bias: torch.Tensor | None = None  # a row bias recorded as replicated
    problems: list[str] = field(default_factory=list)


def run_row(built: Built, x: torch.Tensor) -> torch.Tensor:
    """A row layer's forward with its bias applied as recorded (once, or by every rank)."""
    module: RowParallelLinear = built.module  # type: ignore[assignment]
    if built.every_rank_bias is None:
        return module(x)
    module.reduce_results = False
    partial = module(x) + built.every_rank_bias  # [..., N], this rank's partial sum plus the bias
    return module.group.all_reduce(partial)
