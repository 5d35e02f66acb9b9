"""The dense load rules: how one tensor is cut over its layer's group, from its rule and shape.

What this file is: `cut_tensor`, the only slicing rule of unquantized weights (column, row, QKV with
GQA replicas, merged gate/up, vocab padding, --pad of non-divisible MLP dims), the group a rule's
layer is cut over (`group_of`), and `dense_kind`, which makes the per-rank records of one kind of
unquantized tensor from that cut. A quantized linear is cut by the same rules in its logical [N, K]
coordinates (`logical_layers`), then per tensor of its format by tpshard.quant.layers.

What it is not: no walk over a checkpoint (tpshard.plan.make), no refusal of a topology
(tpshard.plan.refusals), no file layout (tpshard.plan.files).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from tpshard.arch import HEAD_COUNTS, PARTITIONS, SEGMENTS, SHAPES, Arch, Rule
from tpshard.cuts import Cutting, ceil_div, even_cuts
from tpshard.errors import PlanError
from tpshard.manifest import Cut, Kind, ModelInfo, Options
from tpshard.plan.fused import fused_cut, sinks_cut
from tpshard.plan.kinds import TensorKind
from tpshard.quant.formats import QuantSpec
from tpshard.quant.layers import LogicalLayer
from tpshard.safetensors_format import TensorInfo
from tpshard.topology import GroupName, Topology

# MLP roles whose intermediate dim may be zero-padded (--pad, --pad-blocks): plain linears over
# tp, where padded gate/up rows meet padded down columns. Routed experts are never padded
# (SGLang's FusedMoE asserts I_e % moe_tp == 0), attention never (whole heads).
PADDED_ROLES = ("mlp", "dense_mlp", "shared_expert")


class Layout(NamedTuple):
    """Everything a rule is applied with, besides the tensor itself."""

    topology: Topology
    model: ModelInfo
    options: Options
    arch: Arch


def group_of(rule: Rule, ctx: Layout) -> GroupName:
    """The group a rule's layer is cut over: the architecture says which for attention and embedding."""
    match rule.role:
        case "attn":
            return ctx.arch.attn_group
        case "embed":
            if ctx.arch.embed_group == "replicated" and ctx.topology.attn_dp == 1:
                return "tp"  # whole only under attention DP (gpt-oss: enable_tp=not is_dp_attention_enabled())
            return ctx.arch.embed_group
        case "lm_head":
            return "attn_tp" if ctx.options.dp_lm_head else "tp"
        case "dense_mlp":
            return "replicated" if ctx.topology.dense_tp == 1 else "tp"
        case "expert":
            # Fused [E, ...] tensors under EP (moe_tp 1): cut on the experts axis, one slot a tp rank.
            return "tp" if rule.layer_class == "FusedExperts" and ctx.topology.ep > 1 else "moe_tp"
        case "shared_expert":  # SGLang builds them "replicated" under the all-to-all backends of a2a_shared
            shared_whole = ctx.arch.a2a_shared and ctx.topology.moe_a2a_backend in ctx.arch.a2a_shared
            return "replicated" if shared_whole else "tp"
        case "mlp":
            return "tp"
    return "replicated"


def expected_shape(rule: Rule, model: ModelInfo) -> tuple[int, ...] | None:
    """[out, in] of a weight according to config.json ([n] of a norm cut by heads)."""
    return SHAPES[rule.shape](model) if rule.shape else None


def refuse_heads(name: str, rule: Rule, ctx: Layout) -> None:
    """Attention is cut by whole heads: QKV's k and v by kv heads (split, or replicated when the group
    is larger), everything else cut by heads (q, o, MLA's projections) by the attention heads.
    MiniMax-M2's RMSNormTP q_norm / k_norm follow their projection's heads (q, or k)."""
    if rule.layer_class not in _BY_HEADS and not rule.heads:
        return
    group = group_of(rule, ctx)
    g, model = ctx.topology.group_size(group), ctx.model
    if rule.head_counts:
        counts = HEAD_COUNTS[rule.head_counts](model)
        if any(n % g for _, n in counts):
            raise PlanError(f"{name}: {' and '.join(f'{n} {what}' for what, n in counts)} must each divide over the {group} group of {g} ranks")
    elif rule.layer_class in _BY_HEADS and rule.piece != "q":
        kv, dcp = model.num_kv_heads, kv_replicas(rule, ctx)
        if (g // dcp) % kv and kv % (g // dcp):
            where = f"the {group} group of {g} ranks" + (f" in DCP groups of {dcp} (qwen3_5.py L1287-1297)" if dcp > 1 else "")
            raise PlanError(f"{name}: {kv} kv heads and {where}: neither divides the other, so kv heads can be neither split nor replicated evenly")
    elif model.num_heads % g:
        raise PlanError(f"{name}: {model.num_heads} attention heads do not divide over the {group} group of {g} ranks")


def kv_replicas(rule: Rule, ctx: Layout) -> int:
    """Consecutive ranks of the attention group that hold the same K/V partition: Qwen3.5's
    QKVParallelLinear takes kv_parallel_group=ReplicatedParallelGroup("attn_tp", dcp) (SGLang
    models/qwen3_5.py L1287-1297; layers/linear.py _ReplicatedGroup: rank // dcp of size attn_tp / dcp),
    every other class cuts K/V over the attention group itself (1), and so does Qwen3.5's MTP draft
    layer (`dcp_size = 1 if is_nextn`, qwen3_5.py L1287)."""
    return ctx.topology.dcp_size if ctx.arch.dcp == "kv" and rule.layer_class == "QKVParallelLinear" and not rule.nextn else 1


# Cut by whole heads along dim 0, kv pieces replicated when the group outnumbers the kv heads:
# QKVParallelLinear's q / k / v, and MiniMax-M2's q_norm / k_norm (sglang/srt/models/minimax_m2.py,
# MiniMaxM2RMSNormTP: num_head_replicas = attn_tp_size // num_heads, as QKVParallelLinear's kv).
_BY_HEADS = ("QKVParallelLinear", "RMSNormTP")


def cut_tensor(name: str, info: TensorInfo, rule: Rule, param: str, ctx: Layout) -> Cutting:
    """How one tensor is cut over its layer's group: the load contract of one weight."""
    topology, model, options = ctx.topology, ctx.model, ctx.options
    group = group_of(rule, ctx)
    g = topology.group_size(group)
    shape = info.shape
    cls = rule.layer_class

    if param == "bias" and not rule.bias:
        raise PlanError(
            f"{name}: SGLang {ctx.arch.engine} builds {name.rpartition('.')[0]} without a bias and its loader skips"
            " this tensor unread, so the engine would serve the model without it; remove it from the checkpoint"
            " rather than split a weight the engine ignores"
        )
    expected = expected_shape(rule, model)
    if expected and param == "weight" and shape != expected:
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies {list(expected)}")
    if expected and param == "bias" and shape != (expected[0],):
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies [{expected[0]}]")

    def whole(kind: Kind) -> Cutting:
        length = shape[0] if shape else 1
        # factor = group size: every rank of the group holds the one replica
        return Cutting(kind, None, g, 1, [Cut(0, 0, length, 0, 0)])

    if cls in ("Replicated", "ReplicatedLinear"):
        return whole("replicated")
    if cls == "RowParallelLinear" and param == "bias":
        return whole("row_bias")
    if cls == "FusedExperts":
        return fused_cut(name, shape, param, ctx.arch, model, topology)
    if cls == "AttentionSinks":
        refuse_heads(name, rule, ctx)
        return sinks_cut(name, shape, param, model, g)
    if cls == "HeadParameter":  # any parameter name (A_log, dt_bias), cut by the heads checked above
        refuse_heads(name, rule, ctx)
        if expected and shape != (expected[0],):
            raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies [{expected[0]}]")
        return Cutting("column", 0, 1, g, even_cuts(shape[0], g, shape[0] // g))
    if param not in ("weight", "bias"):
        raise PlanError(f"{name}: no rule for parameter '{param}' of {cls} {rule.layer}")

    if cls in ("VocabParallelEmbedding", "ParallelLMHead"):
        v = shape[0]
        v_pad = ceil_div(v, options.vocab_multiple) * options.vocab_multiple
        if v_pad % g:
            raise PlanError(
                f"{name}: vocab {v} padded to {v_pad} (multiple of {options.vocab_multiple}) does not"
                f" divide over the {group} group of {g} ranks"
            )
        return Cutting("vocab", 0, 1, g, even_cuts(v, g, v_pad // g))

    refuse_heads(name, rule, ctx)
    if rule.segments:  # each segment cut over the group, the rank's slices concatenated (ShardSpec.segments)
        return segmented_cut(name, shape, rule, model, g)
    if cls in _BY_HEADS:  # RMSNormTP.weight_loader: shard attn_tp_rank // num_head_replicas, as QKV's q / k
        if cls == "RMSNormTP" and param != "weight":
            raise PlanError(f"{name}: no rule for parameter '{param}' of {cls} {rule.layer}")
        if rule.piece == "q":  # whole heads of the rows per head on disk (a gated q holds [q_h | gate_h] per head)
            per = model.num_heads // g * (shape[0] // model.num_heads)
            return Cutting("qkv_q", 0, 1, g, even_cuts(shape[0], g, per))
        kv, dcp = model.num_kv_heads, kv_replicas(rule, ctx)
        head_rows = shape[0] // kv  # v_head_dim may differ from head_dim
        if g // dcp >= kv:  # each rank holds 1 kv head; `g // kv` consecutive ranks share it
            return Cutting(f"qkv_{rule.piece}", 0, g // kv, kv, even_cuts(shape[0], kv, head_rows))  # type: ignore[arg-type]
        # kv / (g / dcp) heads per rank, the same on the dcp consecutive ranks of a DCP group
        return Cutting(f"qkv_{rule.piece}", 0, dcp, g // dcp, even_cuts(shape[0], g // dcp, kv // (g // dcp) * head_rows))  # type: ignore[arg-type]

    if cls == "FusedMoE":  # w1/w3 by rows, w2 by columns, over the MoE-TP ranks of the expert's slot
        dim = 1 if rule.piece == "w2" else 0
        n = shape[dim]
        if n % g:
            raise PlanError(
                f"{name}: expert intermediate size {n} does not divide over moe_tp {g} (tp {topology.tp} / ep"
                f" {topology.ep}); SGLang's FusedMoE asserts it. Choose --ep so that tp / ep divides {n}"
            )
        return Cutting("row" if dim else "merged", dim, 1, g, even_cuts(n, g, n // g))

    if cls in ("MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear"):
        kind: Kind = {"MergedColumnParallelLinear": "merged", "ColumnParallelLinear": "column"}.get(cls, "row")  # type: ignore[assignment]
        dim = 1 if kind == "row" else 0
        n = shape[dim]
        if n % g:
            if not (options.pad and rule.role in PADDED_ROLES):
                hint = " (pass --pad to zero-pad it)" if rule.role in PADDED_ROLES else ""
                raise PlanError(f"{name}: dim {dim} of size {n} does not divide over the {group} group of {g} ranks{hint}")
            return Cutting(kind, dim, 1, g, even_cuts(n, g, ceil_div(n, g)))
        return Cutting(kind, dim, 1, g, even_cuts(n, g, n // g))

    raise PlanError(f"{name}: layer class {cls} has no load rule")


def segmented_cut(name: str, shape: tuple[int, ...], rule: Rule, model: ModelInfo, g: int) -> Cutting:
    """A cut of each of the rule's segments of dim 0 over the group, the rank's slices concatenated
    (ShardSpec.segments): in units of the segments' greatest common size, segment i of m_i units."""
    sizes = SEGMENTS[rule.segments](model)
    if not shape or shape[0] != sum(sizes):
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies {sum(sizes)} rows ({' + '.join(map(str, sizes))}) along dim 0")
    unit = math.gcd(*sizes)
    if unit % g:
        raise PlanError(f"{name}: its segments of {' + '.join(map(str, sizes))} rows do not each divide over the group of {g} ranks")
    return Cutting("segmented", 0, 1, g, even_cuts(unit, g, unit // g), tuple(n // unit for n in sizes))


def dense_kind(
    name: str, info: TensorInfo, rule: Rule, param: str, ep_slot: int | None, stages: tuple[int, ...] | None,
    ctx: Layout, kinds: dict[tuple, TensorKind],
) -> TensorKind:  # fmt: skip
    """The kind of an unquantized tensor (`name` only names refusals)."""
    key = (rule, param, info.dtype, info.shape, ep_slot, stages)
    if key not in kinds:
        cutting = cut_tensor(name, info, rule, param, ctx)
        group = group_of(rule, ctx) if cutting.kind != "replicated" else "replicated"
        records = []
        for cut in cutting.cuts:
            shape = list(info.shape)
            if cutting.dim is not None:
                shape[cutting.dim] = (cut.length + cut.pad) * (sum(cutting.segments) or 1)
            if cut.lead_length:  # a leading-dim range too (ShardSpec.lead_start): a fused expert tensor's EP block
                shape[0] = cut.lead_length
            records.append(
                dict(
                    layer_class=rule.layer_class, piece=rule.piece, kind=cutting.kind, dtype=info.dtype,
                    source_shape=info.shape, shape=tuple(shape), dim=cutting.dim, start=cut.start, length=cut.length,
                    pad=cut.pad, group=group, factor=cutting.factor, group_rank=cut.group_rank,
                    group_size=cutting.group_size, ep_slot=ep_slot, segments=cutting.segments,
                    lead_start=cut.lead_start, lead_length=cut.lead_length,
                    ranks=ctx.topology.ranks_of(group, cut.group_rank, cutting.factor, ep_slot, stages),
                )  # fmt: skip
            )
        kinds[key] = TensorKind(records, ctx.topology)
    return kinds[key]


def logical_layers(ctx: Layout) -> Callable[[str, TensorInfo, QuantSpec, Rule], LogicalLayer]:
    """The dense rules' cut of each quantized linear, in its logical [N, K] (QuantLayers' `layer_of`):
    one LogicalLayer per kind of layer, the same object for every module of the kind."""
    layers: dict[tuple, LogicalLayer] = {}

    def layer_of(module: str, info: TensorInfo, qspec: QuantSpec, rule: Rule) -> LogicalLayer:
        shape = expected_shape(rule, ctx.model)
        if shape is None:
            raise PlanError(f"{module}: quantized ({qspec.format}), but {rule.layer_class} has no quantized load rule")
        n, k = shape
        # Every expert (and every layer) of one kind cuts the same way: work it out once.
        key = (rule.layer_class, rule.role, rule.piece, n, k)
        if key not in layers:
            cutting = cut_tensor(f"{module}.weight", msgspec.structs.replace(info, shape=(n, k)), rule, "weight", ctx)
            group = group_of(rule, ctx) if cutting.dim is not None else "replicated"
            g = ctx.topology.group_size(group)
            partitions = tuple(p // g for p in PARTITIONS[rule.shape](ctx.model)) if rule.shape in PARTITIONS else ()
            layers[key] = LogicalLayer(rule.layer_class, rule.piece, rule.role in PADDED_ROLES, n, k, cutting, group, partitions)
        return layers[key]

    return layer_of
