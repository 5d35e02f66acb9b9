"""Rank topology: which group a weight is sharded over, and each rank's place in it.

The parallel contract of SGLang (dp_attention.py): world ranks are ordered (dp, cp, tp) with tp
fastest, attention runs over `attn_tp = tp // (attn_dp * attn_cp)`. Every group tpshard uses maps a
world rank to `(world_rank % span) // factor`: `span` is tp for the "tp" group and attn_tp for the
"attn_tp" group, `factor` merges consecutive ranks into replicas (GQA kv heads). Rank and size are
plain numbers here; only tpshard.runtime turns a group into a process group.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from tpshard.errors import TopologyError

GroupName = Literal["tp", "attn_tp", "replicated"]
MAX_WORLD = 1 << 16  # ranks; beyond any deployment, and keeps a plan's size bounded


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    tp: int
    attn_dp: int = 1
    attn_cp: int = 1

    def __post_init__(self) -> None:
        for field, value in (("tp", self.tp), ("attn_dp", self.attn_dp), ("attn_cp", self.attn_cp)):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_WORLD:
                raise TopologyError(f"--{field.replace('_', '-')} must be an integer from 1 to {MAX_WORLD}, got {value!r}")
        if self.tp % (self.attn_dp * self.attn_cp):
            raise TopologyError(
                f"--tp {self.tp} is not divisible by --attn-dp {self.attn_dp} x --attn-cp {self.attn_cp}"
                f" = {self.attn_dp * self.attn_cp}; attention needs tp = attn_dp * attn_cp * attn_tp"
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

    def span(self, group: GroupName) -> int:
        """Number of consecutive world ranks one group instance covers before it repeats."""
        return {"tp": self.tp, "attn_tp": self.attn_tp, "replicated": 1}[group]

    def group_size(self, group: GroupName, factor: int = 1) -> int:
        span = self.span(group)
        if factor < 1 or span % factor:
            raise TopologyError(f"replica factor {factor} does not divide the {group} group of size {span}")
        return span // factor

    def group_rank(self, group: GroupName, rank: int, factor: int = 1) -> int:
        """Rank of world rank `rank` in `group`, with `factor` consecutive ranks holding one replica."""
        self.group_size(group, factor)
        return (rank % self.span(group)) // factor

    def ranks_of(self, group: GroupName, group_rank: int, factor: int = 1) -> tuple[int, ...]:
        """All world ranks whose rank in (group, factor) is `group_rank`: they hold identical bytes."""
        return tuple(r for r in range(self.world_size) if self.group_rank(group, r, factor) == group_rank)

    def describe(self) -> str:
        return f"tp={self.tp} attn_dp={self.attn_dp} attn_cp={self.attn_cp} (attn_tp={self.attn_tp})"
