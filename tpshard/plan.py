"""make_plan: the one pure function that decides what every rank holds.

Inputs are headers and config only (no tensor data, no torch.distributed). Every cut is one
narrow of one source tensor along one dim plus zero padding at its end; this covers column, row,
QKV with GQA replicas, merged gate/up, vocab padding and padding of non-divisible MLP dims.
`split` executes the result, `check` inverts it; nothing else derives a slicing rule.
"""

from __future__ import annotations

import functools
import itertools
import re
from array import array
from collections.abc import Callable, Mapping
from operator import add, attrgetter
from typing import NamedTuple

import msgspec

from tpshard.arch import SHAPES, Arch, Matcher, Rule, arch_for
from tpshard.arch.base import DROPPED, VOCAB
from tpshard.checkpoint import Checkpoint, model_info
from tpshard.collector import paused
from tpshard.completeness import check_complete
from tpshard.errors import PlanError
from tpshard.manifest import FILE_METADATA, SPEC_DEFAULTS, TENSOR_FIELDS, Cut as ManifestCut, FileShards, Kind, ModelInfo, Options, OutputFile, Plan, ShardSpec, TensorPlan
from tpshard.quant.config import read_quant_config
from tpshard.quant.formats import QuantSpec, alignment
from tpshard.quant import shards as qshards
from tpshard.safetensors_format import Numbering, TensorInfo, build_header, entry_text, kinds_header_layout, nbytes_of, plain_layout, plain_names
from tpshard.stages import Placement, layer_of, placement, refuse_engine_layout, tensor_stages
from tpshard.topology import GroupName, Topology

# MLP roles whose intermediate dim may be zero-padded (--pad, --pad-blocks): plain linears over
# tp, where padded gate/up rows meet padded down columns. Routed experts are never padded
# (SGLang's FusedMoE asserts I_e % moe_tp == 0), attention never (whole heads).
PADDED_ROLES = ("mlp", "dense_mlp", "shared_expert")


class Cut(NamedTuple):
    """One group rank's piece of a tensor: source[dim][start : start+length] then `pad` zeros."""

    group_rank: int
    start: int
    length: int
    pad: int


class Layout(NamedTuple):
    """Everything a rule is applied with, besides the tensor itself."""

    topology: Topology
    model: ModelInfo
    options: Options
    arch: Arch


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def even_cuts(n: int, parts: int, per: int) -> list[Cut]:
    """`parts` pieces of `per` along a dim of size n; trailing pieces are zero-padded past n."""
    return [
        Cut(r, r * per, max(0, min(per, n - r * per)), per - max(0, min(per, n - r * per)))
        for r in range(parts)
    ]


def group_of(rule: Rule, ctx: Layout) -> GroupName:
    """The group a rule's layer is cut over: the architecture says which for attention and embedding."""
    match rule.role:
        case "attn":
            return ctx.arch.attn_group
        case "embed":
            return ctx.arch.embed_group
        case "lm_head":
            return "attn_tp" if ctx.options.dp_lm_head else "tp"
        case "dense_mlp":
            return "replicated" if ctx.topology.dense_tp == 1 else "tp"
        case "expert":
            return "moe_tp"
        case "mlp" | "shared_expert":
            return "tp"
    return "replicated"


def expected_shape(rule: Rule, model: ModelInfo) -> tuple[int, int] | None:
    """[out, in] of a weight according to config.json."""
    return SHAPES[rule.shape](model) if rule.shape else None


class _Cutting(NamedTuple):
    kind: Kind
    dim: int | None
    factor: int
    group_size: int
    cuts: list[Cut]


def cut_tensor(name: str, info: TensorInfo, rule: Rule, param: str, ctx: Layout) -> _Cutting:
    """How one tensor is cut over its layer's group: the load contract of one weight."""
    topology, model, options = ctx.topology, ctx.model, ctx.options
    group = group_of(rule, ctx)
    g = topology.group_size(group)
    shape = info.shape
    cls = rule.layer_class

    expected = expected_shape(rule, model)
    if expected and param == "weight" and shape != expected:
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies {list(expected)}")
    if expected and param == "bias" and shape != (expected[0],):
        raise PlanError(f"{name}: shape {list(shape)} on disk, but config.json implies [{expected[0]}]")

    def whole(kind: Kind) -> _Cutting:
        length = shape[0] if shape else 1
        # factor = group size: every rank of the group holds the one replica
        return _Cutting(kind, None, g, 1, [Cut(0, 0, length, 0)])

    if cls in ("Replicated", "ReplicatedLinear"):
        return whole("replicated")
    if cls == "RowParallelLinear" and param == "bias":
        return whole("row_bias")
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
        return _Cutting("vocab", 0, 1, g, even_cuts(v, g, v_pad // g))

    if (cls == "QKVParallelLinear" or rule.heads) and model.num_heads % g:
        raise PlanError(
            f"{name}: {model.num_heads} attention heads do not divide over the {group} group of {g} ranks"
        )

    if cls == "QKVParallelLinear":
        if rule.piece == "q":
            per = model.num_heads // g * model.head_dim
            return _Cutting("qkv_q", 0, 1, g, even_cuts(shape[0], g, per))
        kv = model.num_kv_heads
        if g % kv and kv % g:
            raise PlanError(
                f"{name}: {kv} kv heads and the {group} group of {g} ranks: neither divides the other,"
                " so kv heads can be neither split nor replicated evenly"
            )
        head_rows = shape[0] // kv  # v_head_dim may differ from head_dim
        if g >= kv:  # each rank holds 1 kv head; `g // kv` consecutive ranks share it
            return _Cutting(f"qkv_{rule.piece}", 0, g // kv, kv, even_cuts(shape[0], kv, head_rows))  # type: ignore[arg-type]
        return _Cutting(f"qkv_{rule.piece}", 0, 1, g, even_cuts(shape[0], g, kv // g * head_rows))  # type: ignore[arg-type]

    if cls == "FusedMoE":  # w1/w3 by rows, w2 by columns, over the MoE-TP ranks of the expert's slot
        dim = 1 if rule.piece == "w2" else 0
        n = shape[dim]
        if n % g:
            raise PlanError(
                f"{name}: expert intermediate size {n} does not divide over moe_tp {g} (tp {topology.tp} / ep"
                f" {topology.ep}); SGLang's FusedMoE asserts it. Choose --ep so that tp / ep divides {n}"
            )
        return _Cutting("row" if dim else "merged", dim, 1, g, even_cuts(n, g, n // g))

    if cls in ("MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear"):
        kind: Kind = {"MergedColumnParallelLinear": "merged", "ColumnParallelLinear": "column"}.get(cls, "row")  # type: ignore[assignment]
        dim = 1 if kind == "row" else 0
        n = shape[dim]
        if n % g:
            if not (options.pad and rule.role in PADDED_ROLES):
                hint = " (pass --pad to zero-pad it)" if rule.role in PADDED_ROLES else ""
                raise PlanError(f"{name}: dim {dim} of size {n} does not divide over the {group} group of {g} ranks{hint}")
            return _Cutting(kind, dim, 1, g, even_cuts(n, g, ceil_div(n, g)))
        return _Cutting(kind, dim, 1, g, even_cuts(n, g, n // g))

    raise PlanError(f"{name}: layer class {cls} has no load rule")


def refuse_topology(ctx: Layout, config: dict) -> list[str]:
    """Topologies the engine refuses or would not build as asked (one line each); else warnings."""
    t, m, a, o = ctx.topology, ctx.model, ctx.arch, ctx.options
    engine = f"SGLang {a.engine}"
    if a.check:
        a.check(config, m)
    if t.attn_dp > 1 and not a.attn_dp:
        raise PlanError(
            f"--attn-dp {t.attn_dp}: {m.architecture} has no attention-DP layout in {engine} (attention, embedding"
            " and lm_head stay over the full tp group); split without --attn-dp"
        )
    if o.dp_lm_head and t.attn_dp == 1:
        raise PlanError(
            "--dp-lm-head needs --attn-dp > 1: SGLang turns --enable-dp-lm-head off without attention DP,"
            " so lm_head would be cut over tp, not the layout asked for"
        )
    if o.dp_lm_head and not a.dp_lm_head:
        raise PlanError(
            f"--dp-lm-head: {engine} builds the {m.architecture} lm_head over the full tp group whatever"
            " --enable-dp-lm-head says; split without --dp-lm-head"
        )
    warnings = []
    if t.attn_dp > 1 and a.attn_group == "tp" and a.embed_group == "tp":
        warnings.append(
            f"{m.architecture}: {engine} cuts attention and the embedding over the full tp group also under"
            f" attention DP, so --attn-dp {t.attn_dp} gives the layout of --attn-dp 1"
            + (" except lm_head (--dp-lm-head)" if o.dp_lm_head else "")
        )
    elif t.attn_dp > 1 and a.attn_group == "tp":
        warnings.append(
            f"{m.architecture}: {engine} cuts attention over the full tp group also under attention DP;"
            f" only the embedding follows --attn-dp {t.attn_dp}"
        )
    if not m.num_experts or a.sparse is None:
        if t.ep > 1:
            raise PlanError(f"--ep {t.ep}: {m.architecture} has no routed experts; expert parallelism needs a MoE model")
    else:
        e = m.num_experts
        if e % t.ep:
            raise PlanError(f"--ep {t.ep} does not divide the {e} routed experts of {m.architecture}: every EP slot holds experts / ep")
        if a.experts_limit and t.span(a.experts_limit) > e:
            raise PlanError(
                f"{a.experts_limit} size {t.span(a.experts_limit)} is greater than the {e} routed experts of"
                f" {m.architecture}; {engine} refuses it"
            )
        if m.moe_intermediate_size % t.moe_tp:
            raise PlanError(
                f"expert intermediate size {m.moe_intermediate_size} does not divide over moe_tp {t.moe_tp}"
                f" (tp {t.tp} / ep {t.ep}); SGLang's FusedMoE asserts it. Choose --ep so that tp / ep divides it"
            )
    if t.moe_dense_tp is not None and not any(r.role == "dense_mlp" for r in a.rules):
        raise PlanError(f"--moe-dense-tp applies to DeepSeek's dense MLP layers; {m.architecture} has none")
    return warnings


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
_LAYER_OR_EXPERT = re.compile(r"\.\d+\.")


class _Experts:
    """Per-tensor facts of MoE models: layer index bounds, dense vs MoE layers, EP slots, and the
    expert set of every MoE layer complete."""

    def __init__(self, ctx: Layout):
        self.ctx = ctx
        self.seen: dict[int, set[tuple[int, str]]] = {}

    def place(self, name: str, rule: Rule, expert: int | None) -> int | None:
        """The EP slot of `name` (None: not a routed expert); refuses tensors the config has no home for."""
        m, a, t = self.ctx.model, self.ctx.arch, self.ctx.topology
        found = _LAYER_INDEX.match(name)
        if found is None:
            return None
        index = int(found.group(1))
        if index >= m.num_layers + m.num_nextn_predict_layers:
            mtp = f" and {m.num_nextn_predict_layers} MTP layer(s)" if m.num_nextn_predict_layers else ""
            raise PlanError(f"{name}: layer {index}, but config.json has {m.num_layers} layers{mtp}")
        if a.sparse is not None and rule.moe is not None and a.sparse(m, index) != rule.moe:
            raise PlanError(
                f"{name}: {'an expert' if rule.moe else 'a dense'} MLP tensor in layer {index}, which config.json makes a"
                f" {'dense' if rule.moe else 'MoE'} layer (first_k_dense_replace {m.first_k_dense_replace},"
                f" moe_layer_freq {m.moe_layer_freq})"
            )
        if expert is None:
            return None
        if expert >= m.num_experts:
            raise PlanError(f"{name}: expert {expert}, but config.json has {m.num_experts} routed experts")
        if name.endswith(".weight"):
            self.seen.setdefault(index, set()).add((expert, rule.piece))
        return expert // (m.num_experts // t.ep)

    def finish(self) -> None:
        m, a = self.ctx.model, self.ctx.arch
        if a.sparse is None or not m.num_experts:
            return
        layers = {i for i in range(m.num_layers) if a.sparse(m, i)} | set(self.seen)
        for index in sorted(layers):
            have = self.seen.get(index, set())
            missing = sorted({(e, p) for e in range(m.num_experts) for p in ("w1", "w3", "w2")} - have)
            if missing:
                e, p = missing[0]
                raise PlanError(
                    f"model.layers.{index}: {len(missing)} of {3 * m.num_experts} routed expert weights are missing"
                    f" from the checkpoint (first: expert {e} {p}); a MoE layer needs every expert"
                )


def refuse_pipeline(ctx: Layout, tensors: Mapping[str, TensorInfo]) -> tuple[Callable[[str], tuple[int, ...]], Placement] | None:
    """At pp > 1: the stages holding each tensor (by name) and the engine's placement, or a
    one-line refusal of a layout the engine cannot serve or tpshard does not know. None at pp 1."""
    t, m, a = ctx.topology, ctx.model, ctx.arch
    if t.pp == 1:
        return None
    where = placement(a, t.placed_for, tied=m.tie_word_embeddings, pp=t.pp)
    refuse_engine_layout(t.placed_for, t, ctx.options.dp_lm_head)
    if sum(t.pp_layers) != m.num_layers:
        raise PlanError(f"--pp-layers {','.join(map(str, t.pp_layers))} adds up to {sum(t.pp_layers)} layers; the model has {m.num_layers}")
    mtp = any((i := layer_of(name)) is not None and i >= m.num_layers for name in tensors)
    counts = t.pp_layers

    def stages_of(name: str) -> tuple[int, ...]:
        stages = tensor_stages(name, counts, head=where.head, mtp=mtp, embed_last=where.embed_last)
        if stages is None:
            raise PlanError(f"{name}: no pipeline stage is known to hold it (not in a decoder layer, the embedding, the final norm or lm_head)")
        return stages

    return stages_of, where


class _KindCut(NamedTuple):
    """One cut of a kind of tensor, with what the file layout needs of it."""

    fields: tuple  # Cut's fields before `file`: group_rank, start, length, pad
    logical: tuple  # Cut's fields after `file`, trailing defaults left out
    ranks: tuple[int, ...]
    dtype: str
    shape: tuple[int, ...]  # the shard's shape
    nbytes: int
    text: int  # the length of its header entry but the name and offsets (entry_text)
    label: str  # the file-name part of its rank set (_file_label)


class _Kind:
    """What every tensor of one kind shares: TensorPlan's fields but the names, and its cuts.

    The cut depends on the rule, the parameter, the shape, the EP slot and the stages, not on the
    name: DeepSeek-V3 has ~92k tensors but a few dozen kinds, so each kind is worked out once and
    each tensor is a (names, kind) entry."""

    def __init__(self, records: list[dict], topology: Topology):
        first = {**SPEC_DEFAULTS, **records[0]} if records else {}
        self.shared = {f: first[f] for f in _KIND_FIELDS} | {"shape": tuple(first["source_shape"])} if records else {}
        self.cuts: list[_KindCut] = []
        self.padded = False  # zero-padded by --pad / --pad-blocks (vocab padding is expected)
        for r in records:
            r = {**SPEC_DEFAULTS, **r}
            if any(r[f] != first[f] for f in _KIND_FIELDS) or r["source_shape"] != first["source_shape"]:
                raise AssertionError(f"the cuts of one kind of tensor disagree: {first} / {r}")
            logical = (r["logical_start"], r["logical_length"], r["logical_pad"], r["value"])
            while logical and logical[-1] == _LOGICAL_DEFAULTS[len(logical) - 1]:
                logical = logical[:-1]
            self.cuts.append(_KindCut(
                (r["group_rank"], r["start"], r["length"], r["pad"]), logical, r["ranks"], r["dtype"], tuple(r["shape"]),
                nbytes_of(r["dtype"], r["shape"]), len(entry_text(r["dtype"], tuple(r["shape"]))), _file_label(r, topology),
            ))  # fmt: skip
            self.padded |= bool(r["pad"]) and r["kind"] != "vocab"
        self._cuts: dict[tuple[int, ...], tuple[ManifestCut, ...]] = {}

    def plan_cuts(self, files: tuple[int, ...]) -> tuple[ManifestCut, ...]:
        """The manifest cuts of a tensor of this kind whose shards lie in `files`: shared by every
        tensor whose shards land in the same files (most of them)."""
        if files not in self._cuts:
            self._cuts[files] = tuple(ManifestCut(*c.fields, f, *c.logical) for c, f in zip(self.cuts, files))
        return self._cuts[files]


# TensorPlan's fields that a kind fixes (the names, layer and expert id are each tensor's own).
_KIND_FIELDS = tuple(f for f in TENSOR_FIELDS if f not in ("layer", "expert"))
_LOGICAL_DEFAULTS = (0, 0, 0, None)


class _Entry(NamedTuple):
    name: str
    source: str
    layer: str
    expert: int | None
    kind: _Kind


def _dense_kind(
    name: str, info: TensorInfo, rule: Rule, param: str, ep_slot: int | None, stages: tuple[int, ...] | None,
    ctx: Layout, kinds: dict[tuple, _Kind],
) -> _Kind:  # fmt: skip
    """The kind of an unquantized tensor (`name` only names refusals)."""
    key = (rule, param, info.dtype, info.shape, ep_slot, stages)
    if key not in kinds:
        cutting = cut_tensor(name, info, rule, param, ctx)
        group = group_of(rule, ctx) if cutting.kind != "replicated" else "replicated"
        records = []
        for cut in cutting.cuts:
            shape = list(info.shape)
            if cutting.dim is not None:
                shape[cutting.dim] = cut.length + cut.pad
            records.append(
                dict(
                    layer_class=rule.layer_class, piece=rule.piece, kind=cutting.kind, dtype=info.dtype,
                    source_shape=info.shape, shape=tuple(shape), dim=cutting.dim, start=cut.start, length=cut.length,
                    pad=cut.pad, group=group, factor=cutting.factor, group_rank=cut.group_rank,
                    group_size=cutting.group_size, ep_slot=ep_slot,
                    ranks=ctx.topology.ranks_of(group, cut.group_rank, cutting.factor, ep_slot, stages),
                )  # fmt: skip
            )
        kinds[key] = _Kind(records, ctx.topology)
    return kinds[key]


@paused()
def make_plan(ckpt: Checkpoint, topology: Topology, options: Options | None = None) -> Plan:
    """Every distinct per-rank tensor of the split, and the files that will hold them."""
    options = options or Options()
    model = model_info(ckpt)
    arch = arch_for(model)
    ctx = Layout(topology, model, options, arch)
    warnings = refuse_topology(ctx, ckpt.config)
    stages_of, where = refuse_pipeline(ctx, ckpt.tensors) or (None, None)  # None: one stage
    head_copy = where is not None and where.head_copy  # tied: SGLang's last stage has its own lm_head.weight
    matcher = Matcher(arch.table(model))
    if model.tie_word_embeddings and stages_of is None:
        warnings.append(
            "lm_head is tied to model.embed_tokens (no lm_head.weight on disk): engines reuse the"
            f" embedding shard, over the {group_of(VOCAB[0], ctx)} group"
        )
    elif model.tie_word_embeddings and not head_copy:
        warnings.append(
            "lm_head is tied to model.embed_tokens: the last stage holds the embedding too, cut as the first"
            " stage's (vLLM builds it there and ties the head to it)"
        )
    elif model.tie_word_embeddings:
        warnings.append(
            f"lm_head is tied to model.embed_tokens: the last stage holds its own lm_head.weight, a copy of the"
            f" embedding cut over the {group_of(VOCAB[1], ctx)} group (SGLang {arch.engine} fills it from the embedding)"
        )

    entries: list[_Entry] = []
    unknown: list[str] = []
    kinds: dict[tuple, _Kind] = {}  # unquantized tensors (_dense_kind)
    quant = read_quant_config(ckpt.path, ckpt.config)
    qlayers = _QuantLayers(ctx)
    experts = _Experts(ctx)
    # Source order by (file, offset): the writer then reads each file front to back.
    for name, info in sorted(ckpt.tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
        if name.endswith("inv_freq") and DROPPED.fullmatch(name):  # the test alone: a regex a tensor costs 5 % of a plan
            warnings.append(f"{name}: dropped (engines recompute it)")
            continue
        module, _, param = name.rpartition(".")
        found = matcher.match(module)
        if found is None:
            unknown.append(name)
            continue
        rule, layer, expert = found
        ep_slot = experts.place(name, rule, expert)
        stages = stages_of(name) if stages_of else None
        qspec = quant.spec_for(module, rule.layer_class in _LINEAR) if quant else None
        if qspec is not None and rule.layer_class in ("ReplicatedLinear", "ParallelLMHead"):
            # Quantized only if the checkpoint stores it so: DeepSeek-V3's FP8 checkpoint keeps the MTP
            # layer's eh_proj and shared_head.head in bf16 though its config names no exception.
            if not any(f"{module}.{r.suffix}" in ckpt.tensors for r in qspec.roles() if r.suffix not in ("weight", "bias")):
                qspec = None
        if qspec is not None and param != "bias":
            if head_copy and name == "model.embed_tokens.weight":
                raise PlanError(f"{name}: quantized ({qspec.format}) and tied to lm_head; a pipeline's lm_head copy of it is not built")
            entries.append(_Entry(name, name, layer, expert, qlayers.kind(name, info, module, param, qspec, rule, layer, ep_slot, stages)))
            continue
        targets = [(name, rule, layer, stages)]
        if head_copy and name == "model.embed_tokens.weight":
            # Tied at pp > 1: the last stage's own lm_head, filled from the embedding (PIPELINE.md §3).
            targets.append(("lm_head.weight", VOCAB[1], VOCAB[1].layer, stages_of("lm_head.weight")))
        for target, rule, layer, stages in targets:
            entries.append(_Entry(target, name, layer, expert, _dense_kind(target, info, rule, param, ep_slot, stages, ctx, kinds)))
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise PlanError(
            f"no {model.architecture} rule covers {', '.join(unknown[:5])}{more}; tpshard never"
            " replicates a tensor it does not understand"
        )
    experts.finish()
    # After the rules: a tensor in the wrong place is named by them, more precisely than a missing one.
    check_complete(model, ckpt.config, ckpt.tensors, lambda m: quant is not None and quant.spec_for(m, True) is not None)
    warnings.extend(qlayers.finish())
    pad_notes = sorted({f"{e.kind.shared['layer_class']} {e.name.rsplit('.', 3)[-2]}" for e in entries if e.kind.padded})
    if pad_notes:
        warnings.append(f"zero-padded to divide: {', '.join(pad_notes)}")

    layouts: dict[str, tuple[int, array]] = {}
    shards: list[FileShards] = []
    files, first, file_of = _layout_files(entries, options, layouts, shards)
    plan = Plan(
        topology=topology,
        options=options,
        model=model,
        tensors=_tensor_plans(entries, first, file_of),
        files=tuple(files),
        warnings=tuple(warnings),
        quant_layers=qlayers.builtins(),
    )
    # The files laid out above, so that Plan.offsets and Plan.header need not redo it. Their shards
    # name tensors by entry: the same index in plan.tensors when no entry was left out (every entry
    # has cuts once _QuantLayers.finish has passed).
    plan.take_layout(layouts, shards if len(plan.tensors) == len(entries) else None)
    return plan


_LINEAR = (
    "QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "ParallelLMHead",
    "FusedMoE", "ReplicatedLinear",
)  # fmt: skip


class _QuantLayers:
    """Specs of quantized linears: the layer's logical cut (dense rules) converted per tensor.

    Collects alignment errors over the whole checkpoint, so that `finish` refuses once with every
    (tensor, rank, misalignment), and engine-kernel warnings.
    """

    def __init__(self, ctx: Layout):
        self.ctx = ctx
        self.topology, self.model, self.options = ctx.topology, ctx.model, ctx.options
        self.layers: dict[str, tuple] = {}  # module -> (logical cutting, n, k, misaligned suffixes)
        self.suffixes: dict[str, tuple[QuantSpec, set[str]]] = {}
        self.cuttings: dict[tuple, tuple] = {}  # (layer kind, n, k, format) -> _logical_cut(...)
        self.errors: list[tuple[str, str]] = []  # (tensor, message)
        self.engine = qshards.group_findings()
        self.kinds: dict[tuple, _Kind] = {}

    def _layer(self, module: str, info: TensorInfo, qspec: QuantSpec, rule: Rule, layer: str, ep_slot: int | None):
        if module in self.layers:
            return self.layers[module]
        shape = expected_shape(rule, self.model)
        if shape is None:
            raise PlanError(f"{module}: quantized ({qspec.format}), but {rule.layer_class} has no quantized load rule")
        n, k = shape
        # Every expert (and every layer) of one kind cuts the same way: work it out once.
        key = (rule.layer_class, rule.role, rule.piece, n, k, qspec)
        if key not in self.cuttings:
            self.cuttings[key] = self._logical_cut(module, info, qspec, rule, n, k)
        cutting, cuts, group, bad, pad_hint = self.cuttings[key]
        if cutting.dim is not None:
            full = (n, k)[cutting.dim]
            by_role: dict[str, tuple] = {}
            for role, c, step, atom in bad:
                ranks = self.topology.ranks_of(group, c.group_rank, cutting.factor, ep_slot)
                by_role.setdefault(role.suffix, (role, step, atom, []))[3].append((c, ranks))
            for role, step, atom, cut_ranks in by_role.values():
                self.errors.append((f"{module}.{role.suffix}", qshards.misalignment_message(
                    module, qspec, role, cut_ranks, step, atom, cutting.dim, full, group, cutting.group_size, pad_hint,
                )))  # fmt: skip
            self._engine_check(module, qspec, rule, group, cutting, n, k)
            if bad:
                cuts = []  # refused in finish(); no spec is made from a misaligned cut
        self.layers[module] = (cutting, cuts, n, k, group)
        return self.layers[module]

    def _logical_cut(self, module: str, info: TensorInfo, qspec: QuantSpec, rule: Rule, n: int, k: int):
        """(cutting, logical cuts, group, misalignments, --pad-blocks hint) of a layer [n, k]."""
        logical = msgspec.structs.replace(info, shape=(n, k))
        cutting = cut_tensor(f"{module}.weight", logical, rule, "weight", self.ctx)
        cuts = [qshards.LogicalCut(*c) for c in cutting.cuts]
        group = group_of(rule, self.ctx) if cutting.dim is not None else "replicated"
        bad, pad_hint = [], ""
        if cutting.dim is not None:
            full = (n, k)[cutting.dim]
            roles = qspec.roles()
            bad = qshards.misalignments(qspec, roles, cutting.dim, full, cuts)
            if bad and qspec.format in qshards.PAD_BLOCK_FORMATS and rule.role in PADDED_ROLES:
                atom = alignment(qspec, n, k)[cutting.dim]
                per = qshards.pad_blocks_per(qspec, full, cutting.group_size, atom)
                if self.options.pad_blocks:
                    cuts = [qshards.LogicalCut(*c) for c in even_cuts(full, cutting.group_size, per)]
                    cutting = cutting._replace(cuts=[Cut(*c) for c in cuts])
                    bad = qshards.misalignments(qspec, roles, cutting.dim, full, cuts)
                else:
                    pad_hint = f" Pass --pad-blocks to zero-pad each rank to {per} ({per // atom} blocks)."
            elif bad and rule.layer_class == "FusedMoE":
                pad_hint = (
                    f" SGLang's FusedMoE refuses it too: choose --ep so that moe_tp = tp / ep leaves whole"
                    f" {bad[0][3]}-blocks of the expert intermediate size {full} per rank."
                )
        return cutting, cuts, group, bad, pad_hint

    def _engine_check(self, module, qspec, rule, group, cutting, n, k) -> None:
        if qspec.format not in qshards.ENGINE_MULTIPLES or cutting.dim is None:
            return
        kernel, n_mult, k_mult = qshards.ENGINE_MULTIPLES[qspec.format]
        per = cutting.cuts[0].length + cutting.cuts[0].pad
        n_r, k_r = (per, k) if cutting.dim == 0 else (n, per)
        g = self.topology.group_size(group)
        for nk, size, mult in (("N", n_r, n_mult), ("K", k_r, k_mult)):
            if size % mult:
                self.engine[(qspec.format, kernel, nk, size, mult, rule.layer_class, group, g)].append(module)

    def kind(
        self, name: str, info: TensorInfo, module: str, suffix: str, qspec: QuantSpec, rule: Rule, layer: str,
        ep_slot: int | None = None, stages: tuple[int, ...] | None = None,
    ) -> _Kind:  # fmt: skip
        try:
            role = qspec.role(suffix)
        except KeyError:
            have = [r.suffix for r in qspec.roles()]
            raise PlanError(
                f"{name}: config.json quantizes {module} as {qspec.format} ({qspec.bits}-bit), whose tensors are"
                f" {', '.join(have)}; '{suffix}' is not one of them (is the module left unquantized? see docs/quantization.md)"
            ) from None
        cutting, cuts, n, k, group = self._layer(module, info, qspec, rule, layer, ep_slot)
        self.suffixes.setdefault(module, (qspec, set()))[1].add(suffix)
        if role.dtype is not None and info.dtype != role.dtype:
            raise PlanError(f"{name}: dtype {info.dtype} on disk; {qspec.format} stores {suffix} as {role.dtype}")
        want = _expected_physical_shape(qspec, role, info.shape, n, k)
        if want != info.shape:
            raise PlanError(
                f"{name}: shape {list(info.shape)} on disk, but a {qspec.format} {qspec.bits}-bit layer"
                f" [N={n}, K={k}] (group {qspec.group_size}) stores {suffix} as {list(want)}"
            )
        # Every expert and layer of one kind cuts alike (_Kind).
        key = (rule.layer_class, rule.role, rule.piece, n, k, qspec, suffix, info.dtype, info.shape, ep_slot, stages, bool(cuts))
        if key not in self.kinds:
            self.kinds[key] = _Kind(self._records(info, qspec, role, rule, cutting, cuts, n, k, group, ep_slot, stages), self.topology)
        return self.kinds[key]

    def _records(self, info, qspec, role, rule, cutting, cuts, n, k, group, ep_slot, stages) -> list[dict]:
        """The per-rank records of one kind of quantized tensor, without its names."""
        base = dict(
            layer_class=rule.layer_class, piece=rule.piece, dtype=info.dtype,
            source_shape=info.shape, quant=qspec.format, logical_dim=cutting.dim, logical_size=(n, k)[cutting.dim or 0],
            ep_slot=ep_slot,
        )  # fmt: skip

        def whole() -> dict:
            factor = self.topology.group_size(group)
            return dict(
                base, kind="replicated", shape=info.shape, dim=None, start=0, length=info.shape[0] if info.shape else 1,
                pad=0, group=group, factor=factor, group_rank=0, group_size=1,
                ranks=self.topology.ranks_of(group, 0, factor, ep_slot, stages),
            )  # fmt: skip

        if cutting.dim is None:
            return [whole()]
        if not cuts:
            return []
        out = []
        for c in cuts:
            per_rank = dict(
                base, kind=cutting.kind, group=group, factor=cutting.factor, group_rank=c.group_rank,
                group_size=cutting.group_size, ranks=self.topology.ranks_of(group, c.group_rank, cutting.factor, ep_slot, stages),
                logical_start=c.start, logical_length=c.length, logical_pad=c.pad,
            )  # fmt: skip
            if role.rewrite_shape:  # CT weight_shape: the rank's own [N_r, K] / [N, K_r]
                value = [n, k]
                value[cutting.dim] = c.length + c.pad
                out.append(dict(per_rank, shape=info.shape, dim=None, start=0, length=info.shape[0], pad=0, value=tuple(value)))
                continue
            phys = _physical_cut(qspec, role, cutting.dim, (n, k)[cutting.dim], c)
            if phys is None:
                return [dict(whole(), logical_dim=None)]
            dim, start, length, pad, ratio, atom, step = phys
            shape = list(info.shape)
            shape[dim] = length + pad
            out.append(dict(
                per_rank, shape=tuple(shape), dim=dim, start=start, length=length, pad=pad,
                step=step, ratio=(ratio.numerator, ratio.denominator), atom=atom,
            ))  # fmt: skip
        return out

    def builtins(self) -> dict[str, dict]:
        """Plan.quant_layers: each quantized module's spec as plain data, converted once per distinct spec."""
        plain: dict[QuantSpec, dict] = {}
        out = {}
        for module, (spec, _) in sorted(self.suffixes.items()):
            if spec not in plain:
                plain[spec] = msgspec.to_builtins(spec)
            out[module] = plain[spec]
        return out

    def finish(self) -> list[str]:
        """Refuse misaligned cuts (all of them, with numbers); otherwise the engine-kernel warnings."""
        missing = []
        needs: dict[QuantSpec, set[str]] = {}  # a few specs, ~46k modules in DeepSeek-V3
        for module, (qspec, have) in self.suffixes.items():
            if qspec not in needs:
                needs[qspec] = {r.suffix for r in qspec.roles()}
                if qspec.format in ("gptq", "gptq_v2") and not qspec.desc_act:
                    needs[qspec].discard("g_idx")  # optional without act order; engines regenerate it
            if not have >= needs[qspec]:
                missing += [f"{module}.{s}" for s in sorted(needs[qspec] - have)]
        if missing:
            raise PlanError(f"quantized tensors missing from the checkpoint: {', '.join(missing[:6])}" + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
        if self.errors:
            # One line per kind of tensor (layer and expert numbers masked): a MoE model repeats each
            # misalignment for every expert of every layer.
            kinds: dict[str, list[str]] = {}
            for name, message in self.errors:
                kinds.setdefault(_LAYER_OR_EXPERT.sub(".N.", name), []).append(message)
            lines = [m[0] + (f" (and {len(m) - 1} more like it in other layers/experts)" if len(m) > 1 else "") for m in kinds.values()]
            shown = "\n  ".join(lines[:12])
            more = f"\n  ... and {len(lines) - 12} more kinds" if len(lines) > 12 else ""
            raise PlanError(
                f"{len(self.errors)} quantized tensor cut(s) do not align at {self.topology.describe()}; nothing was written:\n  {shown}{more}"
            )
        return qshards.engine_warnings(self.engine)


# The same quantized cut recurs for every expert and layer; Fraction arithmetic is worth caching.
_expected_physical_shape = functools.lru_cache(maxsize=4096)(qshards.expected_physical_shape)
_physical_cut = functools.lru_cache(maxsize=16384)(qshards.physical_cut)


def file_header(tensors: list[tuple[str, str, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    """The header of an output file and its tensors' data offsets."""
    return build_header(tensors, FILE_METADATA)


def spec_layout(specs: list[ShardSpec]) -> tuple[bytes, list[int]]:
    """Header bytes and each tensor's absolute data offset in a file holding `specs` in order."""
    return file_header([(s.name, s.dtype, s.shape) for s in specs])


def _file_label(spec: dict, topology: Topology) -> str:
    """The file name part of a set of ranks: its group and group rank, after its pipeline stages
    when they are not all of them (pp-000-of-003-..., pp-000+002-of-003-...)."""
    stages = sorted({r // topology.tp for r in spec["ranks"]})
    if len(stages) == topology.pp:
        return _stage_label(spec, topology, len(stages))
    return f"pp-{'+'.join(f'{s:03d}' for s in stages)}-of-{topology.pp:03d}-" + _stage_label(spec, topology, len(stages))


def _stage_label(spec: dict, topology: Topology, stages: int) -> str:
    if len(spec["ranks"]) == topology.tp * stages:
        return "common"
    if spec.get("ep_slot") is not None:
        label = f"ep-{spec['ep_slot']:03d}-of-{topology.ep:03d}"
        return label + (f"-moe_tp-{spec['group_rank']:03d}-of-{spec['group_size']:03d}" if spec["group_size"] > 1 else "")
    # Without attention DP attn_tp is the tp group itself: name it so.
    group = "tp" if topology.span(spec["group"]) == topology.tp else spec["group"]
    label = group if spec["factor"] == 1 else f"{group}-x{spec['factor']}"
    return f"{label}-{spec['group_rank']:03d}-of-{spec['group_size']:03d}"


def _layout_files(
    entries: list[_Entry], options: Options, layouts: dict[str, tuple[int, array]], shards: list[FileShards]
) -> tuple[list[OutputFile], array, array]:
    """Group shards by the set of ranks holding them (one file set each), split into parts by size.

    Returns the files and the file index of each entry's cuts, back to back (entry e's at
    first[e] : first[e + 1]) as (first, file_of): a list per entry was 9 MB at 90k tensors. Sets each file's
    (header size, offsets) in `layouts` and appends its FileShards (tensors by their entry's
    index) to `shards`. Tensors keep source order inside a file."""
    # Each rank set's shards as (entry, cut, kind cut) indexes in three arrays: a tuple per shard
    # was 33 MB at 90k tensors and tp 8, and all of them were alive at once.
    by_ranks: dict[tuple[int, ...], tuple[array, array, array]] = {}
    kind_cuts: list[_KindCut] = []  # every kind's cuts, numbered
    # Each kind's cuts go to the same rank sets: found once per kind (the sets keep the order in
    # which the tensors first reach them).
    buckets_of: dict[int, list[tuple[int, int, tuple[array, array, array]]]] = {}
    for e, entry in enumerate(entries):
        buckets = buckets_of.get(id(entry.kind))
        if buckets is None:
            buckets = buckets_of[id(entry.kind)] = []
            for j, cut in enumerate(entry.kind.cuts):
                buckets.append((j, len(kind_cuts), by_ranks.setdefault(cut.ranks, (array("I"), array("I"), array("I")))))
                kind_cuts.append(cut)
        for j, k, (bucket_entries, bucket_cuts, bucket_kinds) in buckets:
            bucket_entries.append(e)
            bucket_cuts.append(j)
            bucket_kinds.append(k)
    files: list[OutputFile] = []
    first = array("I", itertools.accumulate((len(entry.kind.cuts) for entry in entries), initial=0))
    file_of = array("I", bytes(4 * first[-1]))
    # Names that JSON writes as they are, none twice (a repeated one is refused by _tensor_plans):
    # a file's header is sized from the lengths of its names and of its kinds' entry texts.
    names = [entry.name for entry in entries]
    plain = plain_names(names, FILE_METADATA)
    name_sizes = array("I", map(len, names))
    del names
    sizes_of, texts_of = [cut.nbytes for cut in kind_cuts], [cut.text for cut in kind_cuts]
    # The shards of a rank set are walked in C loops (map) over these arrays: a tuple per shard
    # cost 0.2 s at 90k tensors.
    for ranks, (held, cut_index, kind_index) in by_ranks.items():
        sizes = list(map(sizes_of.__getitem__, kind_index))
        bounds = _part_bounds(sizes, options.max_file_bytes)
        for p, (a, b) in enumerate(zip(bounds, bounds[1:])):
            suffix = f"-part-{p + 1:05d}-of-{len(bounds) - 1:05d}" if len(bounds) > 2 else ""
            name = f"model-{kind_cuts[kind_index[a]].label}{suffix}.safetensors"
            numbers = Numbering()  # kind cut -> its index in this file's shapes
            kinds = array("I", map(numbers.__getitem__, kind_index[a:b]))
            shard = FileShards(held[a:b], cut_index[a:b], kinds, [(kind_cuts[k].dtype, kind_cuts[k].shape) for k in numbers])
            if plain:  # what an entry adds up to is its name's length and its kind's
                text = sum(map(name_sizes.__getitem__, held[a:b])) + sum(map(texts_of.__getitem__, kind_index[a:b]))
                size, offsets = plain_layout(text, sizes[a:b], FILE_METADATA)
            else:
                tensors = list(map(attrgetter("name"), map(entries.__getitem__, held[a:b])))
                size, offsets = kinds_header_layout(tensors, shard.kinds, shard.shapes, FILE_METADATA)
            layouts[name] = size, array("Q", offsets)
            shards.append(shard)
            number = len(files)
            for at in map(add, map(first.__getitem__, held[a:b]), cut_index[a:b]):
                file_of[at] = number
            # the data ends with the last tensor
            files.append(OutputFile(name=name, ranks=ranks, size=offsets[-1] + sizes[b - 1]))
    return files, first, file_of


def _part_bounds(sizes: list[int], max_bytes: int) -> list[int]:
    """Where a rank set's shards are cut into files of at most `max_bytes` each (a larger shard
    alone): the index each file starts at, then len(sizes)."""
    if sum(sizes) <= max_bytes:
        return [0, len(sizes)]  # what the loop below gives when no part fills up
    bounds, size = [0], 0
    for k, nbytes in enumerate(sizes):
        if k > bounds[-1] and size + nbytes > max_bytes:
            bounds.append(k)
            size = 0
        size += nbytes
    return [*bounds, len(sizes)]


def _tensor_plans(entries: list[_Entry], first: array, file_of: array) -> tuple[TensorPlan, ...]:
    _refuse_repeated_names(entries)  # first: its set of every name is gone before the TensorPlans are made
    out = []
    # A TensorPlan per kind, copied with each tensor's own fields: six times faster than building
    # each from the kind's fifteen shared ones.
    templates: dict[int, TensorPlan] = {}
    replace = msgspec.structs.replace
    for entry, a, b in zip(entries, first, itertools.islice(first, 1, None)):
        kind = entry.kind
        if not kind.cuts:
            continue  # a misaligned quantized cut: refused by _QuantLayers.finish
        template = templates.get(id(kind))
        if template is None:
            template = templates[id(kind)] = TensorPlan(name="", layer="", cuts=(), **kind.shared)
        source = "" if entry.source == entry.name else entry.source  # recorded only where it differs
        out.append(replace(template, name=entry.name, source=source, layer=entry.layer, expert=entry.expert, cuts=kind.plan_cuts(tuple(file_of[a:b]))))
    return tuple(out)


def _refuse_repeated_names(entries: list[_Entry]) -> None:
    seen: set[str] = set()
    for entry in entries:
        if entry.kind.cuts:
            if entry.name in seen:
                raise PlanError(f"{entry.name}: two tensors of the checkpoint would be written under this name")
            seen.add(entry.name)
