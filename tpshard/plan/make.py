"""make_plan: a checkpoint's tensors matched to their rules and cut, then laid out in files.

What this file is: the walk over a checkpoint's tensors in source order, each matched to its rule,
placed (EP slot, pipeline stages) and cut once per kind (tpshard.plan.dense, or
tpshard.quant.layers for a tensor of a quantized linear); then the refusals of what is missing,
and the Plan, its files laid out.

What it is not: no slicing rule (tpshard.plan.dense, tpshard.quant.layers), no file layout
(tpshard.plan.files).
"""

from __future__ import annotations

import re
from array import array

from tpshard.arch import Matcher, Rule, arch_for
from tpshard.arch.base import DROPPED, VOCAB
from tpshard.plan.fused import engine_placed
from tpshard.checkpoint import Checkpoint, model_info
from tpshard.collector import paused
from tpshard.completeness import check_complete
from tpshard.errors import PlanError
from tpshard.manifest import FileShards, Options, Plan
from tpshard.plan.dense import Layout, dense_kind, group_of, logical_layers, refuse_heads
from tpshard.plan.experts import Experts
from tpshard.plan.files import layout_files, tensor_plans
from tpshard.plan.kinds import Entry, TensorKind
from tpshard.plan.refusals import refuse_experts, refuse_pipeline, refuse_topology
from tpshard.quant.config import read_quant_config
from tpshard.stages import layer_of
from tpshard.quant.layers import QuantLayers
from tpshard.topology import Topology


@paused()
def make_plan(ckpt: Checkpoint, topology: Topology, options: Options | None = None) -> Plan:
    """Every distinct per-rank tensor of the split, and the files that will hold them."""
    options = options or Options()
    model = model_info(ckpt)
    arch = arch_for(model)
    topology = engine_placed(topology, arch, model)
    ctx = Layout(topology, model, options, arch)
    warnings = refuse_topology(ctx, ckpt.config)
    stages_of, where = refuse_pipeline(ctx, ckpt.tensors) or (None, None)  # None: one stage
    head_copy = where is not None and where.head_copy  # tied: SGLang's last stage has its own lm_head.weight
    if arch.refuse_tensors:
        arch.refuse_tensors(ckpt.tensors)
    matcher = Matcher(arch.table(model))
    refuse_attention(ctx, matcher, ckpt.tensors)
    refuse_experts(ctx)
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

    entries: list[Entry] = []
    unknown: list[str] = []
    kinds: dict[tuple, TensorKind] = {}  # unquantized tensors (dense_kind)
    quant = read_quant_config(ckpt.path, ckpt.config)
    qlayers = QuantLayers(topology, options.pad_blocks, logical_layers(ctx), lambda records: TensorKind(records, topology))
    experts = Experts(ctx)
    names = re.compile(arch.names) if arch.names else None
    dropped = re.compile(arch.dropped[0]) if arch.dropped else None
    if arch.dropped:
        warnings.append(arch.dropped[1])
    # Source order by (file, offset): the writer then reads each file front to back.
    for name, info in sorted(ckpt.tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
        if name.endswith("inv_freq") and DROPPED.fullmatch(name):  # the test alone: a regex a tensor costs 5 % of a plan
            warnings.append(f"{name}: dropped (engines recompute it)")
            continue
        if dropped is not None and dropped.fullmatch(name):
            continue
        module, _, param = name.rpartition(".")
        found = matcher.match(module)
        if found is None or (names is not None and not names.fullmatch(name)):
            unknown.append(name)
            continue
        rule, layer, expert = found
        ep_slot = experts.place(name, rule, expert)
        stages = stages_of(name) if stages_of else None
        qspec = quant.spec_for(module, rule.layer_class in _LINEAR and rule.quantized) if quant else None
        if qspec is not None and rule.layer_class in ("ReplicatedLinear", "ParallelLMHead"):
            # Quantized only if the checkpoint stores it so: DeepSeek-V3's FP8 checkpoint keeps the MTP
            # layer's eh_proj and shared_head.head in bf16 though its config names no exception.
            if not any(f"{module}.{r.suffix}" in ckpt.tensors for r in qspec.roles() if r.suffix not in ("weight", "bias")):
                qspec = None
        if qspec is not None and param != "bias":
            if head_copy and name == "model.embed_tokens.weight":
                raise PlanError(f"{name}: quantized ({qspec.format}) and tied to lm_head; a pipeline's lm_head copy of it is not built")
            entries.append(Entry(name, name, layer, expert, qlayers.kind(name, info, module, param, qspec, rule, ep_slot, stages)))
            continue
        targets = [(name, rule, layer, stages)]
        if head_copy and name == "model.embed_tokens.weight":
            # Tied at pp > 1: the last stage's own lm_head, filled from the embedding (docs/pipeline.md).
            targets.append(("lm_head.weight", VOCAB[1], VOCAB[1].layer, stages_of("lm_head.weight")))
        for target, rule, layer, stages in targets:
            entries.append(Entry(target, name, layer, expert, dense_kind(target, info, rule, param, ep_slot, stages, ctx, kinds)))
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
    files, first, file_of = layout_files(entries, options, layouts, shards)
    plan = Plan(
        topology=topology,
        options=options,
        model=model,
        tensors=tensor_plans(entries, first, file_of),
        files=tuple(files),
        warnings=tuple(warnings),
        quant_layers=qlayers.builtins(),
    )
    # The files laid out above, so that Plan.offsets and Plan.header need not redo it. Their shards
    # name tensors by entry: the same index in plan.tensors when no entry was left out (every entry
    # has cuts once QuantLayers.finish has passed).
    plan.take_layout(layouts, shards if len(plan.tensors) == len(entries) else None)
    return plan


def refuse_attention(ctx: Layout, matcher: Matcher, tensors) -> None:
    """The head counts against the attention group, before the walk: the embedding comes first on
    disk, and `--tp 3` on 8 heads is about the heads, not the vocab that tp 3 does not divide either.
    The first decoder layer's attention tensors, q's heads before k's and v's kv heads (a mismatch
    there is refused again, by the same refuse_heads, as each tensor is cut)."""
    found: list[tuple[str, Rule]] = []
    first = None
    for name in tensors:
        if ".self_attn." not in name or (first is not None and layer_of(name) != first):
            continue
        hit = matcher.match(name.rpartition(".")[0])
        if hit is not None:
            first = layer_of(name)
            found.append((name, hit[0]))
    for name, rule in sorted(found, key=lambda nr: nr[1].layer_class == "QKVParallelLinear" and nr[1].piece != "q"):
        refuse_heads(name, rule, ctx)


_LINEAR = (
    "QKVParallelLinear", "MergedColumnParallelLinear", "ColumnParallelLinear", "RowParallelLinear", "ParallelLMHead",
    "FusedMoE", "ReplicatedLinear",
)  # fmt: skip
