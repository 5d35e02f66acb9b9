"""Engine layers built from the manifest and loaded from one rank's own files, as an engine would.

Everything comes from the ShardSpecs of a layer: the class (layer_class), the pieces (piece), the
group it is sharded over (group), the global sizes (source_shape) and what each rank holds
(shape, group_rank, factor, kind). The tensors come from `open_rank(out, rank)`, never sliced here;
`load_shard` asserts their shapes. Each load is first compared with what the layer expects
(`shard_info`: group, replica factor, group rank, group size, shape), the seed's check 1.

How a spec's kind is applied is data too (`APPLIED`): a row-parallel bias recorded as `row_bias`
is added once per reduction group (group rank 0); the same bias recorded as `replicated` is, like
any replicated parameter, applied by every rank, so the all-reduce sums it group-size times. That
is exactly the mistake a rule table makes when it files o_proj.bias with the norms ("whole on every
rank, so replicated"), and verify must show its numbers, not repair it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from tpshard.manifest import Plan, ShardSpec
from tpshard.runtime import (
    ColumnParallelLinear,
    LogicalGroup,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tpshard.topology import Topology

# How a parameter of a sharded layer is applied, by the kind its spec records.
APPLIED = {
    "row_bias": "added once per reduction group, by group rank 0",
    "replicated": "applied by every rank (a replicated parameter), so a row layer's reduction sums it",
}

TIED_LM_HEAD = "lm_head"


@dataclass
class LayerSpecs:
    """All specs of one engine layer (every rank), and the ones naming a parameter of it."""

    layer: str
    layer_class: str
    specs: list[ShardSpec]

    @property
    def group(self) -> str:
        # The weights decide the group; a bias recorded over another group is an alignment problem.
        weights = [s for s in self.specs if s.name.endswith(".weight")] or self.specs
        return weights[0].group

    def pieces(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in self.specs:
            if s.name.endswith(".weight"):
                seen.setdefault(s.piece)
        order = {"q": 0, "k": 1, "v": 2, "gate": 0, "up": 1}
        return sorted(seen, key=lambda p: (order.get(p, 9), p))

    def first(self, piece: str = "", param: str = "weight") -> ShardSpec | None:
        for s in self.specs:
            if s.piece == piece and s.name.rsplit(".", 1)[1] == param:
                return s
        return None

    def has_bias(self, kind: str | None = None) -> bool:
        return any(s.name.endswith(".bias") and (kind is None or s.kind == kind) for s in self.specs)


def sharded_layers(plan: Plan) -> list[LayerSpecs]:
    """Every non-replicated engine layer of the plan, in plan order; a tied lm_head appended."""
    by_layer: dict[str, list[ShardSpec]] = defaultdict(list)
    for s in plan.shards:
        if s.layer_class != "Replicated":
            by_layer[s.layer].append(s)
    layers = [LayerSpecs(name, specs[0].layer_class, specs) for name, specs in by_layer.items()]
    if plan.model.tie_word_embeddings and TIED_LM_HEAD not in by_layer:
        embed = next((lay for lay in layers if lay.layer_class == "VocabParallelEmbedding"), None)
        if embed is not None:  # the engines' tie: lm_head reuses the embedding's shards and group
            layers.append(LayerSpecs(TIED_LM_HEAD, "ParallelLMHead", embed.specs))
    return sorted(layers, key=_forward_order)


_CLASS_ORDER = {"VocabParallelEmbedding": 0, "QKVParallelLinear": 1, "RowParallelLinear": 4, "ParallelLMHead": 9}


def _forward_order(lay: LayerSpecs) -> tuple:
    """Embedding, then each decoder layer (qkv, o_proj, gate_up, down), then lm_head."""
    m = re.search(r"\.layers\.(\d+)\.", lay.layer + ".")
    index = int(m.group(1)) if m else (-1 if _CLASS_ORDER.get(lay.layer_class) == 0 else 1 << 30)
    return (index, "mlp" in lay.layer, _CLASS_ORDER.get(lay.layer_class, 2), lay.layer)


@dataclass
class Built:
    """One rank's loaded layer, plus what went wrong loading it (alignment problems)."""

    spec: LayerSpecs
    module: torch.nn.Module
    group: LogicalGroup
    every_rank_bias: torch.Tensor | None = None  # a row bias recorded as replicated
    problems: list[str] = field(default_factory=list)


def build_layer(
    lay: LayerSpecs, plan: Plan, rank: int, tensors, *, dtype: torch.dtype, device: torch.device
) -> Built:
    """Construct `lay` for world rank `rank` from its specs and load this rank's tensors into it."""
    topo: Topology = plan.topology
    model = plan.model
    group = LogicalGroup.of(topo, lay.group, rank)  # type: ignore[arg-type]
    kw = dict(group=group, dtype=dtype, name=lay.layer)
    cls = lay.layer_class
    w = lay.first(lay.pieces()[0] if lay.pieces() else "")
    if w is None:
        raise ValueError(f"{lay.layer}: the manifest has no weight for it")
    out_size, in_size = w.source_shape[0], w.source_shape[-1]
    if cls == "QKVParallelLinear":
        q, k = lay.first("q"), lay.first("k")
        hd = model.head_dim
        module = QKVParallelLinear(
            in_size, hd, q.source_shape[0] // hd, k.source_shape[0] // hd, bias=lay.has_bias(),
            v_head_size=lay.first("v").source_shape[0] // (k.source_shape[0] // hd), **kw,
        )  # fmt: skip
    elif cls == "MergedColumnParallelLinear":
        pieces = lay.pieces()
        sizes = [lay.first(p).source_shape[0] for p in pieces]
        module = MergedColumnParallelLinear(in_size, sizes, piece_names=pieces, bias=lay.has_bias(), pad=True, **kw)
    elif cls == "ColumnParallelLinear":
        module = ColumnParallelLinear(in_size, out_size, bias=lay.has_bias(), pad=True, **kw)
    elif cls == "RowParallelLinear":
        # The full input goes in; the layer narrows it to this rank's columns (input_is_parallel=False).
        module = RowParallelLinear(
            in_size, out_size, bias=lay.has_bias("row_bias"), input_is_parallel=False, pad=True, **kw
        )  # fmt: skip
    elif cls in ("VocabParallelEmbedding", "ParallelLMHead"):
        layer_cls = VocabParallelEmbedding if cls == "VocabParallelEmbedding" else ParallelLMHead
        module = layer_cls(out_size, in_size, padding_size=plan.options.vocab_multiple, **kw)
    else:
        raise ValueError(f"{lay.layer}: verify has no layer for class {cls}")
    module.to(device)
    built = Built(lay, module, group)

    for s in lay.specs:
        if rank not in s.ranks:
            continue
        param = s.name.rsplit(".", 1)[1]
        if lay.layer == TIED_LM_HEAD and s.layer != TIED_LM_HEAD:
            where = f"{s.name} (tied lm_head)"
        else:
            where = s.name
        tensor = tensors[s.name].to(device=device, dtype=dtype)
        if s.kind == "replicated":
            # Applied by every rank, whatever the layer: see APPLIED and the module docstring.
            built.problems.append(
                f"{where}: recorded as replicated ({APPLIED['replicated']}); {cls} expects "
                + ("row_bias, " + APPLIED["row_bias"] if cls == "RowParallelLinear" and param == "bias" else "a sharded tensor")
            )
            if cls == "RowParallelLinear" and param == "bias":
                built.every_rank_bias = tensor
            continue
        shard_id = s.piece or None
        try:
            info = module.shard_info(shard_id, param)
        except KeyError as e:
            built.problems.append(f"{where}: {e.args[0]}")
            continue
        got = (s.group, s.factor, s.group_rank, s.group_size, tuple(s.shape))
        want = (info.group, info.factor, info.group_rank, info.group_size, tuple(info.shape))
        if got != want:
            built.problems.append(
                f"{where} on rank {rank}: manifest says group {got[0]} x{got[1]} rank {got[2]}/{got[3]} shape"
                f" {list(got[4])}; the {cls} expects group {want[0]} x{want[1]} rank {want[2]}/{want[3]} shape {list(want[4])}"
            )
        try:
            module.load_shard(shard_id, tensor, param=param)
        except (ValueError, KeyError) as e:
            built.problems.append(f"{where} on rank {rank}: {e}")
    missing = module.missing_shards()
    if missing:
        built.problems.append(f"{lay.layer} on rank {rank}: never loaded {missing}")
    module.process_weights_after_loading()
    return built


def run_row(built: Built, x: torch.Tensor) -> torch.Tensor:
    """A row layer's forward with its bias applied as recorded (once, or by every rank)."""
    module: RowParallelLinear = built.module  # type: ignore[assignment]
    if built.every_rank_bias is None:
        return module(x)
    module.reduce_results = False
    partial = module(x) + built.every_rank_bias  # [..., N], this rank's partial sum plus the bias
    return module.group.all_reduce(partial)
