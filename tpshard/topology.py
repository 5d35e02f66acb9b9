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
"""

from __future__ import annotations

import functools
from typing import Literal

import msgspec

from tpshard.errors import TopologyError

GroupName = Literal["tp", "attn_tp", "moe_tp", "replicated"]
MAX_WORLD = 1 << 16  # ranks; beyond any deployment, and keeps a plan's size bounded


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    tp: int
    attn_dp: int = 1
    attn_cp: int = 1
    ep: int = 1  # expert parallel size (SGLang --ep-size); moe_tp = tp // ep
    moe_dense_tp: int | None = None  # SGLang --moe-dense-tp-size: None = tp, or 1 (dense MLPs whole)

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

    @property
    def world_size(self) -> int:
        return self.tp

    @property
    def attn_tp(self) -> int:
        return self.tp // (self.attn_dp * self.attn_cp)

    def attn_tp_rank(self, rank: int) -> int:
        return rank % self.attn_tp

    def attn_cp_rank(self, rank: int) -> int:
        return (rank // self.attn_tp) % self.attn_cp

    def attn_dp_rank(self, rank: int) -> int:
        return rank // (self.attn_tp * self.attn_cp)

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def dense_tp(self) -> int:
        """Size of the group DeepSeek's dense-layer MLPs are cut over (1 = whole on every rank)."""
        return self.moe_dense_tp or self.tp

    def ep_rank(self, rank: int) -> int:
        """EP slot of a world rank: the block of experts it holds."""
        return rank // self.moe_tp

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

    def ranks_of(self, group: GroupName, group_rank: int, factor: int = 1, ep_slot: int | None = None) -> tuple[int, ...]:
        """All world ranks whose rank in (group, factor) is `group_rank`: they hold identical bytes.

        `ep_slot` (routed experts) keeps only the ranks of that EP slot."""
        return _ranks_of(self, group, group_rank, factor, ep_slot)

    def describe(self) -> str:
        text = f"tp={self.tp} attn_dp={self.attn_dp} attn_cp={self.attn_cp} (attn_tp={self.attn_tp})"
        if self.ep != 1:
            text += f" ep={self.ep} (moe_tp={self.moe_tp})"
        if self.moe_dense_tp is not None:
            text += f" moe_dense_tp={self.moe_dense_tp}"
        return text


@functools.lru_cache(maxsize=65536)
def _ranks_of(topology: Topology, group: GroupName, group_rank: int, factor: int, ep_slot: int | None) -> tuple[int, ...]:
    size = topology.group_size(group, factor)
    if not 0 <= group_rank < size:
        return ()
    span = topology.span(group)
    first = group_rank * factor  # offsets inside each group instance holding this group rank
    ranks = (base + first + j for base in range(0, topology.world_size, span) for j in range(factor))
    if ep_slot is None:
        return tuple(ranks)
    return tuple(r for r in ranks if r // topology.moe_tp == ep_slot)
