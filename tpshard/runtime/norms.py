"""RMSNorm over a projection cut by heads: MiniMax-M2's q_norm / k_norm (SGLang's MiniMaxM2RMSNormTP).

transformers normalises q [.., heads * head_dim] (and k [.., kv_heads * head_dim]) as one vector:
the RMS is over every head. Under attention TP a rank holds only its heads' slice of the projection
and of the norm's weight, so the mean of squares must be reduced over the group: SGLang's
MiniMaxM2RMSNormTP (sglang/srt/models/minimax_m2.py) all-reduces each rank's local mean over
attn_tp and divides by attn_tp. That is the global mean also when kv heads are replicated: each
kv head is held by the same number of consecutive ranks (group size / kv heads), so it is counted
that many times in the sum, like every other head.

The weight is the rank's slice, cut exactly as the projection's piece (QKVParallelLinear's q, or
its k with the kv heads' replicas): `shard_info` says which, `load_shard` copies it, never slices.
`reduce=False` computes the RMS over the local slice only: what a runtime that forgot the reduction
would do (verify must fail on it).
"""

from __future__ import annotations

import torch

from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.layers import _Piece, _ShardedModule, divide
from tpshard.runtime.linear_method import new_param


class RMSNormTP(_ShardedModule):
    """`weight * x / rms(x over all heads)`, x being this rank's heads' slice [..., heads_r * head_dim]."""

    def __init__(
        self, total_heads: int, head_dim: int, *, group: LogicalGroup, piece: str = "q", eps: float = 1e-6,
        dtype: torch.dtype | None = None, name: str = "", reduce: bool = True,
    ):  # fmt: skip
        super().__init__(group=group, quant_method=None, dtype=dtype, name=name)
        size = group.size
        if size >= total_heads:  # one head per rank, shared by size / heads consecutive ranks
            heads, replicas = 1, divide(size, total_heads, f"{self.name} group size over heads")
        else:
            heads, replicas = divide(total_heads, size, f"{self.name} heads over a group of {size}"), 1
        self.eps, self.reduce, self.replicas = eps, reduce, replicas
        self.width = heads * head_dim
        self._pieces = [_Piece(piece, 0, self.width, factor=replicas)]
        # zeros, as the linear layers' weights: a slice never loaded must not look plausible
        self.register_parameter("weight", new_param(torch.zeros(self.width, dtype=self.params_dtype), output_dim=0))

    @property
    def shard(self) -> int:
        """Which slice of the full width this rank's heads are (attn_tp_rank // num_head_replicas)."""
        return self.group.rank // self.replicas

    def local(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a full-width input [..., total_heads * head_dim]."""
        return full.narrow(-1, self.shard * self.width, self.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() if dtype != torch.float64 else x
        variance = x.pow(2).mean(-1, keepdim=True)  # over the local heads
        if self.reduce and self.group.size > 1:
            variance = self.group.all_reduce(variance) / self.group.size
        return (x * torch.rsqrt(variance + self.eps) * self.weight.to(x.dtype)).to(dtype)
