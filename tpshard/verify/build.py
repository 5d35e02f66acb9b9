"""Engine layers built from the manifest and loaded from one rank's own files, as an engine would.

Everything comes from the ShardSpecs of a layer: the class (layer_class), the pieces (piece), the
group it is sharded over (group), the global sizes (source_shape) and what each rank holds
(shape, group_rank, factor, kind). The tensors come from `open_rank(out, rank)`, never sliced here;
`load_shard` asserts their shapes. Each load is first compared with what the layer expects
(`shard_info`: group, replica factor, group rank, group size, shape), the seed's check 1.

Quantized layers (specs carrying `quant`) are built with `ReferenceQuantMethod(quant_spec_of(plan,
module))`: each on-disk tensor goes in as the rank's file holds it (`load_quant`), and
`process_weights_after_loading` dequantizes every piece with torch into a float32 weight, placed
by `load_shard` (which asserts its per-rank logical shape). Sizes come from the manifest's logical
cut: per rank `logical_length + logical_pad` along the cut dim (what --pad-blocks may make larger
than ceil(n / size)), `logical_size` in total; the other dim of a quantized linear is the hidden
size (q/k/v/gate/up read the residual stream, o/down write it), checked against every tensor's
on-disk shape. Their alignment check compares the same group numbers with the logical shape.

How a spec's kind is applied is data too (`APPLIED`): a row-parallel bias recorded as `row_bias`
is added once per reduction group (group rank 0); the same bias recorded as `replicated` is, like
any replicated parameter, applied by every rank, so the all-reduce sums it group-size times. That
is exactly the mistake a rule table makes when it files o_proj.bias with the norms ("whole on every
rank, so replicated"), and verify must show its numbers, not repair it.
"""

from __future__ import annotations

import torch

import tpshard.verify.fused_layers as fused_layers
import tpshard.verify.moe_layers as moe_layers
from tpshard.arch import arch_for
from tpshard.manifest import Plan, ShardSpec
from tpshard.quant.shards import expected_physical_shape
from tpshard.runtime import (
    ColumnParallelLinear,
    LogicalGroup,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tpshard.runtime.norms import RMSNormTP
from tpshard.runtime.reference_quant import ReferenceQuantMethod, quant_spec_of
from tpshard.topology import Topology
from tpshard.verify.layer_specs import TIED_LM_HEAD, Built, LayerSpecs

# How a parameter of a sharded layer is applied, by the kind its spec records.
APPLIED = {
    "row_bias": "added once per reduction group, by group rank 0",
    "replicated": "applied by every rank (a replicated parameter), so a row layer's reduction sums it",
}

def build_layer(
    lay: LayerSpecs, plan: Plan, rank: int, tensors, *, dtype: torch.dtype, device: torch.device
) -> Built:
    """Construct `lay` for world rank `rank` from its specs and load this rank's tensors into it."""
    if lay.layer_class in fused_layers.FUSED_CLASSES:  # gpt-oss's fused experts and attention sinks
        return fused_layers.build(lay, plan, rank, tensors, dtype=dtype, device=device)
    if lay.layer_class in moe_layers.MOE_CLASSES:  # routed experts, replicated linears (MoE / MLA plans)
        return moe_layers.build(lay, plan, rank, tensors, dtype=dtype, device=device)
    topo: Topology = plan.topology
    model = plan.model
    group = LogicalGroup.of(topo, lay.group, rank)  # type: ignore[arg-type]
    method = _quant_method(lay, plan) if lay.quant else None
    kw = dict(group=group, dtype=dtype, name=lay.layer, quant_method=method)
    cls = lay.layer_class
    if lay.main(lay.pieces()[0] if lay.pieces() else "") is None:
        raise ValueError(f"{lay.layer}: the manifest has no weight for it")
    pieces = lay.pieces()
    out_size, in_size = lay.logical_shape(pieces[0])
    if method is not None and cls not in _QUANT_CLASSES:
        raise ValueError(f"{lay.layer}: quantized ({lay.quant}), but verify has no quantized {cls}")
    if cls == "QKVParallelLinear":
        (nq, _), (nk, _), (nv, _) = (lay.logical_shape(p) for p in ("q", "k", "v"))
        hd = model.head_dim
        # SGLang's class decides the K/V group (Arch.dcp; qwen3_5.py: ReplicatedParallelGroup("attn_tp", dcp)), not the
        # manifest; the MTP draft layer (mtp.*) is built with is_nextn, dcp 1 (qwen3_5.py L1287)
        replicas = topo.dcp_size if arch_for(model).dcp == "kv" and not lay.layer.startswith("mtp.") else 1
        module = QKVParallelLinear(
            in_size, hd, nq // hd, nk // hd, bias=lay.has_bias(), v_head_size=nv // (nk // hd), kv_replicas=replicas, **kw,
        )  # fmt: skip
    elif cls == "MergedColumnParallelLinear":
        sizes = [lay.logical_shape(p)[0] for p in pieces]
        if method is not None:  # the manifest's per-rank size (--pad-blocks may exceed ceil(n / size))
            sizes = [lay.per_rank(p) * group.size for p in pieces]
        module = MergedColumnParallelLinear(in_size, sizes, piece_names=pieces, bias=lay.has_bias(), pad=True, **kw)
    elif cls == "ColumnParallelLinear":
        n = out_size if method is None else lay.per_rank() * group.size
        module = ColumnParallelLinear(in_size, n, bias=lay.has_bias(), pad=True, **kw)
    elif cls == "RowParallelLinear":
        k = in_size if method is None else lay.per_rank() * group.size
        # The full input goes in; the layer narrows it to this rank's columns (input_is_parallel=False).
        module = RowParallelLinear(
            k, out_size, bias=lay.has_bias("row_bias"), input_is_parallel=False, pad=True, **kw
        )  # fmt: skip
    elif cls in ("VocabParallelEmbedding", "ParallelLMHead"):
        layer_cls = VocabParallelEmbedding if cls == "VocabParallelEmbedding" else ParallelLMHead
        module = layer_cls(out_size, in_size, padding_size=plan.options.vocab_multiple, **kw)
    elif cls == "RMSNormTP":  # MiniMax-M2's q_norm / k_norm: the RMS all-reduced over the group
        hd = model.head_dim
        module = RMSNormTP(out_size // hd, hd, group=group, piece=pieces[0], eps=model.rms_norm_eps, dtype=dtype, name=lay.layer)
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
        if s.quant:
            _load_quant(built, s, rank, tensors[s.name])
            continue
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
        _compare_info(built, where, rank, s, tuple(s.shape), info)
        try:
            module.load_shard(shard_id, tensor, param=param)
        except (ValueError, KeyError) as e:
            built.problems.append(f"{where} on rank {rank}: {e}")
    if method is not None:
        # Dequantize every piece into the float32 weight; a tensor missing or of the wrong shape is this layer's failure.
        try:
            module.process_weights_after_loading()
        except (ValueError, KeyError, RuntimeError, IndexError) as e:
            built.problems.append(f"{lay.layer} on rank {rank}: cannot dequantize its {lay.quant} shards: {e}")
    missing = module.missing_shards()
    if missing:
        built.problems.append(f"{lay.layer} on rank {rank}: never loaded {missing}")
    if method is None:
        module.process_weights_after_loading()
    return built


# Layer classes a quantized linear can be (the plan's quantized load rules).
_QUANT_CLASSES = ("QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear")


def _quant_method(lay: LayerSpecs, plan: Plan) -> ReferenceQuantMethod:
    """The reference quant method of a quantized layer: one QuantSpec, shared by all its pieces."""
    specs = {p: quant_spec_of(plan, lay.module(p)) for p in lay.pieces()}
    if None in specs.values() or len(set(specs.values())) != 1:
        raise ValueError(
            f"{lay.layer}: its pieces need one quantized format, the plan records "
            + ", ".join(f"{lay.module(p)}: {q}" for p, q in specs.items())
        )
    return ReferenceQuantMethod(next(iter(specs.values())))


def _load_quant(built: Built, s: ShardSpec, rank: int, tensor: torch.Tensor) -> None:
    """Keep one on-disk tensor of a quantized piece as the file holds it (dequantized after loading).

    First the tensor's on-disk source shape is checked against the layer's logical [N, K], and, for
    a tensor cut along N or K, the spec's group numbers and per-rank logical shape against the
    layer's `shard_info` of the dequantized weight (the alignment check).
    """
    lay, module = built.spec, built.module
    method: ReferenceQuantMethod = module.quant_method  # type: ignore[assignment]
    shard_id = s.piece or None
    suffix = s.name.rpartition(".")[2]
    n, k = lay.logical_shape(s.piece)
    try:
        want = expected_physical_shape(method.spec, method.spec.role(suffix), s.source_shape, n, k)
    except KeyError as e:
        built.problems.append(f"{s.name}: {e.args[0]}")
        return
    if want != tuple(s.source_shape):
        built.problems.append(
            f"{s.name}: source shape {list(s.source_shape)} is not a {method.spec.format} [N={n}, K={k}] layer's {list(want)}"
        )
    if s.logical_dim is not None:
        try:
            info = module.shard_info(shard_id, "weight")
        except KeyError as e:
            built.problems.append(f"{s.name}: {e.args[0]}")
            return
        logical = [n, k]
        logical[s.logical_dim] = (s.logical_length + s.logical_pad) * (sum(s.segments) or 1)  # a segmented cut: each segment's slice
        _compare_info(built, f"{s.name} ({s.quant}, logical)", rank, s, tuple(logical), info)
    method.load_quant(module, shard_id, suffix, tensor)  # on the CPU, bit patterns untouched


def _compare_info(built: Built, where: str, rank: int, s: ShardSpec, shape: tuple, info) -> None:
    """The seed's check 1: the spec's group, replica factor, group rank and shape vs the layer's shard_info."""
    got = (s.group, s.factor, s.group_rank, s.group_size, shape)
    want = (info.group, info.factor, info.group_rank, info.group_size, tuple(info.shape))
    if got != want:
        built.problems.append(
            f"{where} on rank {rank}: manifest says group {got[0]} x{got[1]} rank {got[2]}/{got[3]} shape"
            f" {list(got[4])}; the {built.spec.layer_class} expects group {want[0]} x{want[1]} rank {want[2]}/{want[3]} shape {list(want[4])}"
        )
