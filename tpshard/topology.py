"""Rank topology: which group a weight is sharded over, and each rank's place in it.

The parallel contract of SGLang (dp_attention.py): world ranks are ordered (dp, cp, tp) with tp
fastest, attention runs over `attn_tp = tp // (attn_dp * attn_cp)`. Every group tpshard uses maps a
world rank to `(world_rank % span) // factor`: `span` is tp for the "tp" group, attn_tp for the
"attn_tp" group and moe_tp for the "moe_tp" group, `factor` merges consecutive ranks into replicas
(GQA kv heads). Rank and size are plain numbers here; only tpshard.runtime turns a group into a
process group.

Expert parallelism (SGLang runtime_context.derive_spawn_ranks): `moe_tp = tp // ep`, MoE-TP is
the fastest index, so ranks [k*moe_tp, (k+1)*moe_tp) form EP slot k; a routed expert is held only
by the ranks of its slot (`ranks_of(..., ep_slot=k)`), independent of the attention layout.

Pipeline parallelism (docs/pipeline.md): `pp` stages of `tp` ranks each, world rank =
pp_rank * tp + tp_rank. Attention DP/CP and EP live inside each stage's TP group, so every group
above is the tp-sized layout of one stage, offset by pp_rank * tp; `ranks_of(..., stages=...)`
keeps the ranks of the stages holding a tensor. The partition (decoder layers per stage) is
`pp_layers`; pp is its length. It is UNSET (left out of the JSON) for one stage, so that an
output made without pipeline stages is byte for byte what it was before they existed. `engine`
names whose placement the stages follow (which stages hold the embedding, norm and lm_head,
tpshard.stages.placement): UNSET for SGLang, the default, and at one stage, where the engines place
every tensor alike; so only a vLLM pipeline output records it. At one stage with --ep > 1 a vLLM
engine is kept until the plan, which drops it too unless the family's experts are placed otherwise
by vLLM (tpshard.plan.fused.engine_placed: bf16 gpt-oss, whose fused experts only vLLM slices by EP
rank), so that only such an output records it.

All-to-all MoE backends (`moe_a2a_backend`, SGLang --moe-a2a-backend): every one of A2A_BACKENDS
makes SGLang set ep to tp (sglang/srt/arg_groups/overrides.py, _a2a_ep_size), so a topology naming
one must have ep == tp; and the families that build their shared experts replicated under it
(Arch.a2a_shared) keep them whole on every rank. UNSET (left out of the JSON) is the default,
`none`, so that an output made without it is byte for byte what it was before.

Decode context parallelism (`dcp`, SGLang --dcp-size / --decode-context-parallel-size): SGLang
builds DCP groups of `dcp` consecutive ranks inside each TP group (sglang/srt/distributed/
parallel_state.py L2716-2727; dcp_rank = tp_rank % dcp, runtime_context.py L1592-1594), so
`dcp` must divide attn_tp: a group that crossed attention-DP replicas would gather queries of other
requests. What it changes in a rank's weights is the family's (Arch.dcp; tpshard.plan.dense):
Qwen3.5's K/V replicated over each DCP group. `dcp_replicate_q_proj` (--dcp-replicate-q-proj, only
with dcp > 1: arg_groups/parallel_hook.py L265-267) is recorded for the launch line; SGLang
gathers the replicated q projection after loading (model_executor/model_runner.py L1130-1160), so
the files hold the attn_tp cut. Both UNSET (left out of the JSON) at their defaults, 1 and off.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from tpshard.errors import TopologyError
from tpshard.public_struct import PublicStruct

GroupName = Literal["tp", "attn_tp", "moe_tp", "replicated"]
MAX_WORLD = 1 << 16  # ranks; beyond any deployment, and keeps a plan's size bounded
MAX_LAYERS = 1 << 16  # decoder layers of one pipeline stage
# SGLang 0.5.23's --moe-a2a-backend choices that force ep_size = tp_size: _A2A_EP_SPANNING_BACKENDS,
# sglang/srt/arg_groups/overrides.py L1578-1592 (the choices: arg_groups/fields/exec_.py L836-869).
# Left out: "none" (the default: UNSET here) and "ascend_tp", an Ascend NPU dispatcher that keeps
# ep as given and moves no weight (refused: split without it).
A2A_BACKENDS = (
    "deepep", "deepep_v2", "mooncake", "nixl", "mori", "pplx", "megamoe", "flashinfer", "flashinfer_megamoe", "ascend_fuseep",
)  # fmt: skip


def _flag(field: str, value: object = None) -> str:
    """A field as the CLI option that sets it: --attn-dp, or --attn-dp 3 with a value."""
    flag = "--" + field.replace("_", "-")
    return flag if value is None else f"{flag} {value}"


def _field(field: str, value: object = None) -> str:
    """A field as the Topology argument that sets it: attn_dp, or attn_dp=3 with a value."""
    if field == "pp":  # no field: the stage count is the length of pp_layers
        return f"len(pp_layers)={value}"
    return field if value is None else f"{field}={value}"


class Topology(PublicStruct, frozen=True, kw_only=True):
    """
    The parallel layout an output is split for: which ranks hold which shard (SGLang dp_attention.py).

    Args:
        tp (`int`):
            Tensor-parallel size of one pipeline stage (the world size without a pipeline).
        attn_dp (`int`, *optional*, defaults to 1):
            Attention data-parallel replicas (SGLang `--attn-dp-size`).
        attn_cp (`int`, *optional*, defaults to 1):
            Attention context-parallel size; attention is cut over attn_tp = tp // (attn_dp * attn_cp).
        ep (`int`, *optional*, defaults to 1):
            Expert-parallel size (SGLang `--ep-size`): routed experts in blocks, moe_tp = tp // ep.
        moe_dense_tp (`int`, *optional*, defaults to `None`):
            DeepSeek's dense-layer MLPs (SGLang `--moe-dense-tp-size`): None cuts them over tp, 1 keeps them whole.
        pp_layers (`tuple[int, ...]`, *optional*):
            Decoder layers of each pipeline stage, e.g. (26, 27, 27); left out: one stage (docs/pipeline.md).
        engine (`str`, *optional*):
            "vllm" to place a pipeline's stages as vLLM does; left out: as SGLang does.
        moe_a2a_backend (`str`, *optional*):
            SGLang `--moe-a2a-backend` (one of A2A_BACKENDS): needs ep == tp; left out: `none`.
        dcp (`int`, *optional*):
            SGLang `--dcp-size` (decode context parallelism): divides attn_tp; left out: 1.
        dcp_replicate_q_proj (`bool`, *optional*):
            SGLang `--dcp-replicate-q-proj` (needs dcp > 1); left out: off.

    Sizes that do not fit (tp not divisible by attn_dp * attn_cp, ep not dividing tp, ...) raise
    tpshard.errors.TopologyError naming the fields (attn_dp=3).

    Example:

    ```python
    from tpshard import Topology

    t = Topology(tp=8, attn_dp=2)
    t.attn_tp, t.world_size, t.ranks_of("attn_tp", 1)  # (4, 8, (1, 5))
    ```
    """

    tp: int
    attn_dp: int = 1
    attn_cp: int = 1
    ep: int = 1  # expert parallel size (SGLang --ep-size); moe_tp = tp // ep
    moe_dense_tp: int | None = None  # SGLang --moe-dense-tp-size: None = tp, or 1 (dense MLPs whole)
    # Decoder layers of each pipeline stage, e.g. (26, 27, 27) (tpshard.stages); UNSET = one stage.
    pp_layers: tuple[int, ...] | UnsetType = UNSET
    # Whose pipeline placement the stages follow: "vllm", or UNSET = SGLang (and every one-stage output).
    engine: Literal["sglang", "vllm"] | UnsetType = UNSET
    # SGLang --moe-a2a-backend (A2A_BACKENDS): ep is tp, shared experts as Arch.a2a_shared says; UNSET = none.
    moe_a2a_backend: str | UnsetType = UNSET
    # SGLang --dcp-size (module docstring): UNSET = 1; and --dcp-replicate-q-proj: UNSET = off.
    dcp: int | UnsetType = UNSET
    dcp_replicate_q_proj: bool | UnsetType = UNSET

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise TopologyError(problem(_field), flags=problem(_flag))

    def _problem(self) -> Callable[[Callable[..., str]], str] | None:
        """What is wrong with the sizes, as a message written with `name(field, value)`; None if nothing.
        Normalizes pp_layers and engine on the way (a list to a tuple, one stage and SGLang to UNSET)."""
        fields = (("tp", self.tp), ("attn_dp", self.attn_dp), ("attn_cp", self.attn_cp), ("ep", self.ep))
        if self.moe_dense_tp is not None:
            fields += (("moe_dense_tp", self.moe_dense_tp),)
        for field, value in fields:
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_WORLD:
                return lambda name: f"{name(field)} must be an integer from 1 to {MAX_WORLD}, got {value!r}"
        tp, dp, cp, ep, dense = self.tp, self.attn_dp, self.attn_cp, self.ep, self.moe_dense_tp
        if tp % (dp * cp):
            return lambda name: (
                f"{name('tp', tp)} is not divisible by {name('attn_dp', dp)} x {name('attn_cp', cp)}"
                f" = {dp * cp}; attention needs tp = attn_dp * attn_cp * attn_tp"
            )
        if tp % ep:
            return lambda name: (
                f"{name('ep', ep)} does not divide {name('tp', tp)}; experts need tp = ep * moe_tp"
                " (SGLang: parallel topology is inconsistent)"
            )
        if dense not in (None, 1, tp):
            return lambda name: (
                f"{name('moe_dense_tp', dense)}: SGLang accepts only 1 (dense MLPs whole on every rank)"
                f" or the tp size {tp}"
            )
        if self.pp_layers is not UNSET:
            counts = self.pp_layers
            if isinstance(counts, list):
                counts = tuple(counts)
                msgspec.structs.force_setattr(self, "pp_layers", counts)
            if not isinstance(counts, tuple) or not 1 <= len(counts) <= MAX_WORLD or any(
                not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= MAX_LAYERS for c in counts
            ):
                return lambda name: (
                    f"{name('pp_layers', repr(counts))}: give 1 to {MAX_WORLD} stages of 1 to {MAX_LAYERS} decoder layers each"
                )
            if len(counts) == 1:  # one stage is no pipeline: recorded as none, so pp 1 outputs stay as they were
                msgspec.structs.force_setattr(self, "pp_layers", UNSET)
        if self.engine is not UNSET:
            engine = self.engine
            if engine not in ("sglang", "vllm"):
                return lambda name: f"{name('engine', repr(engine))}: choose sglang or vllm"
            if engine == "sglang" or (self.pp_layers is UNSET and ep == 1):  # the default, or one stage without EP: placed alike
                msgspec.structs.force_setattr(self, "engine", UNSET)
        if self.moe_a2a_backend is not UNSET:
            backend = self.moe_a2a_backend
            if backend == "none":  # the default, recorded as none so that such outputs stay as they were
                msgspec.structs.force_setattr(self, "moe_a2a_backend", UNSET)
            elif backend not in A2A_BACKENDS:
                why = "; ascend_tp moves no weight: split without it" if backend == "ascend_tp" else ""
                return lambda name: f"{name('moe_a2a_backend', repr(backend))}: choose one of {', '.join(A2A_BACKENDS)}{why}"
            elif ep != tp:
                return lambda name: (
                    f"{name('ep', ep)} with {name('moe_a2a_backend', backend)}: SGLang sets the expert-parallel size"
                    f" to the tp size under every all-to-all backend (sglang/srt/arg_groups/overrides.py, _a2a_ep_size),"
                    f" so the engine would run {name('ep', tp)}; give that"
                )
        problem = self._dcp_problem()
        if problem is not None:
            return problem
        if self.world_size > MAX_WORLD:
            return lambda name: f"{name('pp', self.pp)} x {name('tp', tp)} = {self.world_size} ranks; at most {MAX_WORLD}"
        return None

    def _dcp_problem(self) -> Callable[[Callable[..., str]], str] | None:
        """What is wrong with dcp and dcp_replicate_q_proj (module docstring); normalizes their defaults to UNSET."""
        dcp, qrep = self.dcp, self.dcp_replicate_q_proj
        if dcp is not UNSET:
            if not isinstance(dcp, int) or isinstance(dcp, bool) or not 1 <= dcp <= MAX_WORLD:
                return lambda name: f"{name('dcp')} must be an integer from 1 to {MAX_WORLD}, got {dcp!r}"
            if dcp == 1:  # the default, recorded as nothing so that such outputs stay as they were
                msgspec.structs.force_setattr(self, "dcp", UNSET)
            elif self.attn_tp % dcp:
                return lambda name: (
                    f"{name('dcp', dcp)} does not divide attn_tp {self.attn_tp} = {name('tp', self.tp)} / ({name('attn_dp', self.attn_dp)}"
                    f" x {name('attn_cp', self.attn_cp)}):"
                    " SGLang's decode-context-parallel groups are dcp consecutive ranks of one attention group"
                    " (sglang/srt/distributed/parallel_state.py L2716-2727; Qwen3.5's K/V: layers/linear.py L95-100,"
                    " _ReplicatedGroup divides attn_tp by dcp)"
                )
        if qrep is not UNSET:
            if not isinstance(qrep, bool):
                return lambda name: f"{name('dcp_replicate_q_proj')} must be true or false, got {qrep!r}"
            if not qrep:
                msgspec.structs.force_setattr(self, "dcp_replicate_q_proj", UNSET)
            elif self.dcp_size == 1:
                return lambda name: (
                    f"{name('dcp_replicate_q_proj')} needs {name('dcp')} > 1: SGLang refuses it without decode context"
                    " parallelism (sglang/srt/arg_groups/parallel_hook.py L265-267)"
                )
        return None

    @property
    def dcp_size(self) -> int:
        """Decode-context-parallel size (1 without --dcp)."""
        return 1 if self.dcp is UNSET else self.dcp

    @property
    def pp(self) -> int:
        """Pipeline stages (1 without a pipeline)."""
        return 1 if self.pp_layers is UNSET else len(self.pp_layers)

    @property
    def placed_for(self) -> Literal["sglang", "vllm"]:
        """The engine whose pipeline placement the stages follow (SGLang unless recorded)."""
        return "sglang" if self.engine is UNSET else self.engine

    @property
    def world_size(self) -> int:
        return self.pp * self.tp

    def pp_rank(self, rank: int) -> int:
        """The pipeline stage of a world rank (TP fastest: world rank = pp_rank * tp + tp_rank)."""
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def stage_ranks(self, stage: int) -> range:
        """The world ranks of one pipeline stage: its TP group."""
        return range(stage * self.tp, (stage + 1) * self.tp)

    @property
    def attn_tp(self) -> int:
        return self.tp // (self.attn_dp * self.attn_cp)

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def attn_cp_rank(self, rank: int) -> int:
        return (rank // self.attn_tp) % self.attn_cp

    def attn_dp_rank(self, rank: int) -> int:
        return self.tp_rank(rank) // (self.attn_tp * self.attn_cp)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def dense_tp(self) -> int:
        """Size of the group DeepSeek's dense-layer MLPs are cut over (1 = whole on every rank)."""
        return self.moe_dense_tp or self.tp

    def ep_rank(self, rank: int) -> int:
        """EP slot of a world rank: the block of experts it holds (in its stage's TP group)."""
        return self.tp_rank(rank) // self.moe_tp

    def moe_tp_rank(self, rank: int) -> int:
        return rank % self.moe_tp

    def span(self, group: GroupName) -> int:
        """Number of consecutive world ranks one group instance covers before it repeats."""
        return {"tp": self.tp, "attn_tp": self.attn_tp, "moe_tp": self.moe_tp, "replicated": 1}[group]

    def group_size(self, group: GroupName, factor: int = 1) -> int:
        span = self.span(group)
        if factor < 1 or span % factor:
            raise TopologyError(f"replica factor {factor} does not divide the {group} group of size {span}")
        return span // factor

    def group_rank(self, group: GroupName, rank: int, factor: int = 1) -> int:
        """Rank of world rank `rank` in `group`, with `factor` consecutive ranks holding one replica."""
        self.group_size(group, factor)
        return (rank % self.span(group)) // factor

    def ranks_of(
        self, group: GroupName, group_rank: int, factor: int = 1, ep_slot: int | None = None,
        stages: tuple[int, ...] | None = None,
    ) -> tuple[int, ...]:  # fmt: skip
        """All world ranks whose rank in (group, factor) is `group_rank`: they hold identical bytes.

        `ep_slot` (routed experts) keeps only the ranks of that EP slot; `stages` only the ranks
        of those pipeline stages (None: every stage)."""
        return _ranks_of(self, group, group_rank, factor, ep_slot, stages)

    def describe(self) -> str:
        text = f"tp={self.tp} attn_dp={self.attn_dp} attn_cp={self.attn_cp} (attn_tp={self.attn_tp})"
        if self.ep != 1:
            text += f" ep={self.ep} (moe_tp={self.moe_tp})"
        if self.moe_dense_tp is not None:
            text += f" moe_dense_tp={self.moe_dense_tp}"
        if self.moe_a2a_backend is not UNSET:
            text += f" moe_a2a_backend={self.moe_a2a_backend}"
        if self.dcp is not UNSET:
            text += f" dcp={self.dcp}" + (" dcp_replicate_q_proj" if self.dcp_replicate_q_proj else "")
        if self.pp > 1:
            text += f" pp={self.pp} (layers {','.join(map(str, self.pp_layers))}"
            text += ", vLLM placement)" if self.placed_for == "vllm" else ")"
        return text


@functools.lru_cache(maxsize=65536)
def _ranks_of(
    topology: Topology, group: GroupName, group_rank: int, factor: int, ep_slot: int | None, stages: tuple[int, ...] | None
) -> tuple[int, ...]:  # fmt: skip
    size = topology.group_size(group, factor)
    if not 0 <= group_rank < size:
        return ()
    span = topology.span(group)
    first = group_rank * factor  # offsets inside each group instance holding this group rank
    # tp ranks of one stage; every stage repeats them, offset by pp_rank * tp
    ranks = [base + first + j for base in range(0, topology.tp, span) for j in range(factor)]
    if ep_slot is not None:
        ranks = [r for r in ranks if r // topology.moe_tp == ep_slot]
    if stages is None:
        stages = tuple(range(topology.pp))
    return tuple(s * topology.tp + r for s in stages if 0 <= s < topology.pp for r in ranks)
