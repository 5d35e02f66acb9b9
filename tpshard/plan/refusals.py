"""Topologies and pipelines the engine refuses, refused before any tensor is cut.

What this file is: `refuse_topology` (attention DP, --dp-lm-head, --moe-dense-tp, --dcp against the
architecture and config.json: a one-line PlanError each, else warnings), `refuse_experts` (expert
parallelism, --moe-a2a-backend, the experts' sizes) and `refuse_pipeline` (at pp > 1: the stages holding each tensor and the engine's placement).

What it is not: no per-tensor cut (tpshard.plan.dense), no check of the experts a checkpoint holds
(tpshard.plan.experts).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from msgspec import UNSET

from tpshard.errors import PlanError
from tpshard.plan.dense import Layout
from tpshard.safetensors_format import TensorInfo
from tpshard.stages import Placement, layer_of, placement, refuse_engine_layout, tensor_stages


def refuse_topology(ctx: Layout, config: dict) -> list[str]:
    """Topologies the engine refuses or would not build as asked (one line each); else warnings."""
    t, m, a, o = ctx.topology, ctx.model, ctx.arch, ctx.options
    engine = f"SGLang {a.engine}"
    if a.check:
        a.check(config, m)
    if a.check_topology:
        a.check_topology(t, m)
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
    if t.moe_dense_tp is not None and not any(r.role == "dense_mlp" for r in a.rules):
        raise PlanError(f"--moe-dense-tp applies to DeepSeek's dense MLP layers; {m.architecture} has none")
    refuse_dcp(ctx)
    return warnings


def refuse_experts(ctx: Layout) -> None:
    """--moe-a2a-backend, --ep and the experts' sizes against the routed experts. After the head
    counts (tpshard.plan.make.refuse_attention): SGLang builds a layer's attention before its MoE, and
    `--tp 3` on 8 heads and 32-wide experts is about the heads first."""
    t, m, a = ctx.topology, ctx.model, ctx.arch
    engine = f"SGLang {a.engine}"
    refuse_a2a(ctx)  # before --ep: the CLI set ep to tp for the backend
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


def refuse_a2a(ctx: Layout) -> None:
    """--moe-a2a-backend: only for a model with routed experts, and for a family with shared experts
    only where tpshard knows which backends SGLang's class replicates them under (Arch.a2a_shared)."""
    t, m, a = ctx.topology, ctx.model, ctx.arch
    if t.moe_a2a_backend is UNSET:
        return
    flag = f"--moe-a2a-backend {t.moe_a2a_backend}"
    if not m.num_experts or a.sparse is None:
        raise PlanError(f"{flag}: {m.architecture} has no routed experts; an all-to-all MoE backend needs a MoE model")
    if a.a2a_shared is None and any(r.role == "shared_expert" for r in a.table(m)):
        raise PlanError(
            f"{flag}: where SGLang {a.engine} keeps the {m.architecture} shared experts under an all-to-all backend"
            " is not established in tpshard; split without it"
        )


def refuse_dcp(ctx: Layout) -> None:
    """--dcp only for a family whose SGLang class reads it (Arch.dcp); --dcp-replicate-q-proj only for
    DeepSeek's MLA, the one attention model_runner.py's _prepare_replicated_q_proj touches (L1143-1145)."""
    t, m, a = ctx.topology, ctx.model, ctx.arch
    if t.dcp is UNSET:
        return
    if a.dcp is None:
        raise PlanError(
            f"--dcp {t.dcp}: SGLang's {a.engine} never reads the decode-context-parallel size for {m.architecture}, so"
            " tpshard has no dcp layout on record for it (its class loads the layout of a split without --dcp)"
        )
    if t.dcp_replicate_q_proj and not any(r.shape in ("mla_q_b", "mla_q") for r in a.rules):
        raise PlanError(
            f"--dcp-replicate-q-proj: SGLang replicates only DeepSeek MLA's q projection (model_executor/model_runner.py"
            f" _prepare_replicated_q_proj); {m.architecture} has none, so the flag would do nothing; split without it"
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
