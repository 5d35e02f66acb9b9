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

Pipeline parallelism (reference/PIPELINE.md §1): `pp` stages of `tp` ranks each, world rank =
pp_rank * tp + tp_rank. Attention DP/CP and EP live inside each stage's TP group, so every group
above is the tp-sized layout of one stage, offset by pp_rank * tp; `ranks_of(..., stages=...)`
keeps the ranks of the stages holding a tensor. The partition (decoder layers per stage) is
`pp_layers`; pp is its length. It is UNSET (left out of the JSON) for one stage, so that an
output made without pipeline stages is byte for byte what it was before they existed. `engine`
names whose placement the stages follow (which stages hold the embedding, norm and lm_head,
tpshard.stages.placement): UNSET for SGLang, the default, and at one stage, where the engines place
every tensor alike; so only a vLLM pipeline output records it.
"""

from __future__ import annotations

import functools
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from tpshard.errors import TopologyError

GroupName = Literal["tp", "attn_tp", "moe_tp", "replicated"]
MAX_WORLD = 1 << 16  # ranks; beyond any deployment, and keeps a plan's size bounded
MAX_LAYERS = 1 << 16  # decoder layers of one pipeline stage


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    tp: int
    attn_dp: int = 1
    attn_cp: int = 1
    ep: int = 1  # expert parallel size (SGLang --ep-size); moe_tp = tp // ep
    moe_dense_tp: int | None = None  # SGLang --moe-dense-tp-size: None = tp, or 1 (dense MLPs whole)
    # Decoder layers of each pipeline stage, e.g. (26, 27, 27) (tpshard.stages); UNSET = one stage.
    pp_layers: tuple[int, ...] | UnsetType = UNSET
    # Whose pipeline placement the stages follow: "vllm", or UNSET = SGLang (and every one-stage output).
    engine: Literal["sglang", "vllm"] | UnsetType = UNSET

    def __post_init__(self) -> None:
        fields = (("tp", self.tp), ("attn_dp", self.attn_dp), ("attn_cp", self.attn_cp), ("ep", self.ep))
        if self.moe_dense_tp is not None:
            fields += (("moe_dense_tp", self.moe_dense_tp),)
        for field, value in fields:
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_WORLD:
                raise TopologyError(f"--{field.replace('_', '-')} must be an integer from 1 to {MAX_WORLD}, got {value!r}")
        if self.tp % (self.attn_dp * self.attn_cp):
            raise TopologyError(
                f"--tp {self.tp} is not divisible by --attn-dp {self.attn_dp} x --attn-cp {self.attn_cp}"
                f" = {self.attn_dp * self.attn_cp}; attention needs tp = attn_dp * attn_cp * attn_tp"
            )
        if self.tp % self.ep:
            raise TopologyError(
                f"--ep {self.ep} does not divide --tp {self.tp}; experts need tp = ep * moe_tp"
                " (SGLang: parallel topology is inconsistent)"
            )
        if self.moe_dense_tp not in (None, 1, self.tp):
            raise TopologyError(
                f"--moe-dense-tp {self.moe_dense_tp}: SGLang accepts only 1 (dense MLPs whole on every rank)"
                f" or the tp size {self.tp}"
            )
        if self.pp_layers is not UNSET:
            counts = self.pp_layers
            if isinstance(counts, list):
                counts = tuple(counts)
                msgspec.structs.force_setattr(self, "pp_layers", counts)
            if not isinstance(counts, tuple) or not 1 <= len(counts) <= MAX_WORLD or any(
                not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= MAX_LAYERS for c in counts
            ):
                raise TopologyError(
                    f"--pp-layers {counts!r}: give 1 to {MAX_WORLD} stages of 1 to {MAX_LAYERS} decoder layers each"
                )
            if len(counts) == 1:  # one stage is no pipeline: recorded as none, so pp 1 outputs stay as they were
                msgspec.structs.force_setattr(self, "pp_layers", UNSET)
        if self.engine is not UNSET:
            if self.engine not in ("sglang", "vllm"):
                raise TopologyError(f"--engine {self.engine!r}: choose sglang or vllm")
            if self.engine == "sglang" or self.pp_layers is UNSET:  # the default, or one stage: placed alike
                msgspec.structs.force_setattr(self, "engine", UNSET)
        if self.world_size > MAX_WORLD:
            raise TopologyError(f"--pp {self.pp} x --tp {self.tp} = {self.world_size} ranks; at most {MAX_WORLD}")

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
