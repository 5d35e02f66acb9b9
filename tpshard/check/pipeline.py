"""check's pipeline-stage checks: at pp > 1 every stage's ranks hold what the engine builds on that
stage (check_stages, also run by verify), and `check --pp/--pp-layers`: the output was split for the
stages the server will run (check_pipeline_request).

Where the engines place layers and modules is tpshard.stages; this only compares an output's
manifest with it.
"""

from __future__ import annotations

from tpshard.check.report import CheckReport, some_of
from tpshard.errors import TpshardError
from tpshard.manifest import Plan
from tpshard.stages import (
    ENGINE_NAME,
    PARTITION_ENV,
    Placement,
    default_partition,
    layer_of,
    partition_value,
    placement,
    refuse_engine_layout,
    resolve_partition,
    stage_ranges,
    tensor_stages,
)


def check_stages(plan: Plan, report: CheckReport) -> dict[str, tuple[int, ...]]:
    """At pp > 1: each stage's ranks hold exactly that stage's layers (global indices), and the
    embedding, final norm and lm_head where the engine places them (tpshard.stages.tensor_stages).
    Returns each tensor's stages, for the group and replica checks; {} at pp 1."""
    topo, model = plan.topology, plan.model
    if topo.pp == 1:
        return {}
    from tpshard.arch import arch_for

    try:
        arch = arch_for(model)
    except TpshardError as e:
        report.add("stages", f"pipeline stages: {e}")
        return {}
    engine = ENGINE_NAME[topo.placed_for]
    try:
        where_built = placement(arch, topo.placed_for, tied=model.tie_word_embeddings, pp=topo.pp)
        refuse_engine_layout(topo.placed_for, topo, plan.options.dp_lm_head)
    except TpshardError as e:
        report.add("stages", f"pipeline stages: {engine} cannot serve this output: {e}")
        if arch.pp_head is None:
            return {}
        where_built = Placement(topo.placed_for, arch.pp_head, False, model.tie_word_embeddings)
    counts, last = topo.pp_layers, topo.pp - 1
    ranges = stage_ranges(counts)
    mtp = any((i := layer_of(t.name)) is not None and i >= model.num_layers for t in plan.tensors)

    def where(stages) -> str:
        return ", ".join(f"stage {st} (ranks {topo.stage_ranks(st)[0]}-{topo.stage_ranks(st)[-1]})" for st in stages)

    want: dict[str, tuple[int, ...]] = {}
    layers_held: list[set[int]] = [set() for _ in counts]
    modules_held: list[set[str]] = [set() for _ in counts]
    for t in plan.tensors:
        held = sorted({r // topo.tp for c in t.cuts for r in plan.files[c.file].ranks})
        layer = layer_of(t.name)
        for st in held:
            if layer is not None:
                layers_held[st].add(layer)
            else:
                modules_held[st].add(t.name.rpartition(".")[0])
        stages = tensor_stages(t.name, counts, head=where_built.head, mtp=mtp, embed_last=where_built.embed_last)
        if stages is None:
            report.add("stages", f"{t.name}: held by {where(held)}, but no pipeline stage holds such a tensor")
            continue
        want[t.name] = stages
        if held != list(stages):
            if layer is not None and layer < model.num_layers:
                first, end = ranges[stages[0]]
                why = f"layer {layer} is one of layers {first}-{end - 1}"
            elif layer is not None:
                why = "the MTP layer runs on the last stage"
            else:
                why = "this is where the engine builds it"
            report.add("stages", f"{t.name}: held by {where(held) or 'no rank'}, but belongs to {where(stages)}: {why}")
    for st, (first, end) in enumerate(ranges):
        missing = sorted(set(range(first, end)) - layers_held[st])
        if missing:
            report.add("stages", f"{where([st])} holds no tensor of layers {some_of(missing)}; its layers are {first}-{end - 1}")
        needed = {"model.embed_tokens"} if st == 0 or (st == last and (mtp or where_built.embed_last)) else set()
        if st == last:
            needed.add("model.norm")
        has_head = not model.tie_word_embeddings or where_built.head_copy
        if has_head and (st == last or where_built.head == "every"):
            needed.add("lm_head")
        for module in sorted(needed - modules_held[st]):
            report.add("stages", f"{where([st])} lacks {module}, which {engine} builds on that stage")
    return want


def check_pipeline_request(plan: Plan, pp: int | None, pp_layers: str | None, report: CheckReport) -> None:
    """`check --pp N [--pp-layers ...]`: the output was split for the stages the server will run."""
    have = plan.topology.pp_layers if plan.topology.pp > 1 else (plan.model.num_layers,)
    split_for = f"pp {len(have)}" + (f" (layers {partition_value(have)})" if len(have) > 1 else "")
    engine = plan.topology.placed_for
    if pp_layers is None:
        if pp != len(have):
            report.add("stages", f"the output was split for {split_for}, not --pp {pp}")
            return
        # No partition given: the server builds its engine's default one.
        if len(have) > 1 and default_partition(plan.model.num_layers, pp, engine) != tuple(have):
            report.add(
                "stages",
                f"the output was split for {split_for}, but {ENGINE_NAME[engine]} at --pp {pp} builds layers"
                f" {partition_value(default_partition(plan.model.num_layers, pp, engine))} unless started with"
                f" {PARTITION_ENV[engine]}={partition_value(have)} (then check with --pp-layers {partition_value(have)})",
            )
        return
    want = resolve_partition(plan.model.num_layers, pp, pp_layers, engine)
    if want != tuple(have):
        report.add("stages", f"the output was split for {split_for}, not --pp-layers {partition_value(want)}")
