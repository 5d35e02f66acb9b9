"""Mixture of experts over tensor parallelism: the router, the experts over EP x MoE-TP, the reduction.

Mirrors SGLang's default MoE path (`--moe-a2a-backend none`: sglang/srt/layers/moe/fused_moe_triton/layer.py, docs/contracts.md):

- the router (`mlp.gate`) is replicated: every rank computes the same top-k ids and weights for
  every token, as each transformers model computes them (`route`, with the family's RouterConfig:
  tpshard.arch.router_config);
- `FusedMoE` holds only the experts of this rank's EP slot, contiguous global ids
  `[ep_rank * E/ep, (ep_rank + 1) * E/ep)`, each cut over MoE-TP: gate/up rows and down columns
  `[m * I/moe_tp, (m + 1) * I/moe_tp)`. Inside the tp group, MoE-TP is the fastest index:
  `ep_rank = r // moe_tp`, `m = r % moe_tp`;
- every rank computes its experts' partial sums (an expert's down projection over its slice of I,
  zero for tokens that picked no local expert), and one all-reduce over the full tp group sums the
  EP slots and the MoE-TP slices together;
- shared experts (DeepSeek `shared_experts`, Qwen2-MoE `shared_expert`) are an MLP over tp whose
  partial sum joins the same all-reduce (Qwen2-MoE's `shared_expert_gate` scales it per token
  first: a per-token factor every rank computes alike commutes with the sum).

Loading is presharded, as for the dense layers: `load_expert(expert, piece, tensor)` copies a
tensor that is already this rank's slice of global expert `expert` and asserts its shape; an
expert outside the EP slot is refused, never placed somewhere else.

Not here: which tensors a rank holds (the plan), reading files, attention, which router a family has
(tpshard/arch/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from tpshard.arch.router import RouterConfig
from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.layers import MergedColumnParallelLinear, RowParallelLinear, divide

ExpertPiece = Literal["gate", "up", "down"]
EXPERT_PIECES: tuple[ExpertPiece, ...] = ("gate", "up", "down")


def route(
    cfg: RouterConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
    logit_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of tokens x [T, H] with router weight [E, H] -> (ids [T, k] int64, weights [T, k]).
    `bias`: the correction bias (the choice only); `logit_bias`: the router linear's own bias
    (gpt-oss's mlp.router.bias), part of the logits.

    Computed in float32 (float64 when x is), as transformers does; the weights come back in that
    dtype. Every rank holds the whole router and computes the same result.
    """
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    logits = F.linear(x.to(dt), weight.to(dt), None if logit_bias is None else logit_bias.to(dt))  # [T, E]
    scores = logits.sigmoid() if cfg.scoring == "sigmoid" else logits.softmax(dim=-1)
    choice = scores
    if cfg.correction_bias:
        if bias is None:
            raise ValueError("router: this model's router needs e_score_correction_bias")
        choice = scores + bias.to(dt)
    if cfg.n_group > 1:
        t, per = x.shape[0], cfg.num_experts // cfg.n_group
        grouped = choice.view(t, cfg.n_group, per)  # [T, groups, experts per group]
        if cfg.group_score == "top2_sum":
            group_scores = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, groups]
        else:
            group_scores = grouped.amax(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1], True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]  # [T, k]
    weights = scores.gather(1, ids)  # the bias picks, the unbiased score weighs
    if cfg.renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if cfg.scoring == "sigmoid" else 0.0))
    return ids, weights * cfg.routed_scaling_factor


@dataclass(frozen=True)
class ExpertShardInfo:
    """What FusedMoE expects of one presharded expert tensor: compare with the manifest's spec."""

    expert: int  # global expert id
    ep_rank: int
    ep_size: int
    moe_tp_rank: int
    moe_tp_size: int
    shape: tuple[int, int]


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer on one rank: its EP slot's experts, each cut over MoE-TP.

    `group` is the group the experts' partial sums are reduced over (the full tp group, as SGLang
    does without an all-to-all backend); `ep_size` splits it into EP slots of moe_tp = size / ep
    consecutive ranks. Parameters (SGLang's FusedMoE layout, gate before up):
      w13_weight [E/ep, 2 * I/moe_tp, H]: rows [0, I_p) gate, [I_p, 2 I_p) up, of local expert j;
      w2_weight  [E/ep, H, I/moe_tp]: down.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        group: LogicalGroup,
        ep_size: int = 1,
        reduce_results: bool = True,
        dtype: torch.dtype | None = None,
        name: str = "",
    ):
        super().__init__()
        self.name = name or "FusedMoE"
        self.group = group
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.ep_size = ep_size
        self.moe_tp_size = divide(group.size, ep_size, f"{self.name}: the {group.name} group over ep")
        self.ep_rank = group.rank // self.moe_tp_size
        self.moe_tp_rank = group.rank % self.moe_tp_size
        self.num_local_experts = divide(num_experts, ep_size, f"{self.name}: experts over ep")
        self.expert_start = self.ep_rank * self.num_local_experts
        self.intermediate_per_rank = divide(intermediate_size, self.moe_tp_size, f"{self.name}: expert intermediate size over MoE-TP")
        self.reduce_results = reduce_results
        dt = dtype if dtype is not None else torch.get_default_dtype()
        i_p = self.intermediate_per_rank
        # Zeros, not empty: an expert never loaded must not look like plausible weights.
        self.w13_weight = nn.Parameter(torch.zeros(self.num_local_experts, 2 * i_p, hidden_size, dtype=dt), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(self.num_local_experts, hidden_size, i_p, dtype=dt), requires_grad=False)
        self._loaded: set[tuple[int, str]] = set()

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds."""
        return range(self.expert_start, self.expert_start + self.num_local_experts)

    def describe(self) -> str:
        e = self.local_experts
        return (
            f"EP slot {self.ep_rank}/{self.ep_size} (experts [{e.start}, {e.stop})), MoE-TP rank "
            f"{self.moe_tp_rank}/{self.moe_tp_size} (world rank {self.group.world_rank})"
        )

    def shard_info(self, expert: int, piece: ExpertPiece) -> ExpertShardInfo:
        if piece not in EXPERT_PIECES:
            raise KeyError(f"{self.name}: unknown expert piece {piece!r}; experts have {list(EXPERT_PIECES)}")
        i_p, h = self.intermediate_per_rank, self.hidden_size
        shape = (h, i_p) if piece == "down" else (i_p, h)
        return ExpertShardInfo(expert, self.ep_rank, self.ep_size, self.moe_tp_rank, self.moe_tp_size, shape)

    def _dest(self, expert: int, piece: ExpertPiece) -> torch.Tensor:
        if expert not in self.local_experts:
            raise ValueError(
                f"{self.name}: expert {expert} is not on this rank's {self.describe()}; it belongs to EP slot "
                f"{expert // self.num_local_experts}" if 0 <= expert < self.num_experts else
                f"{self.name}: expert {expert} is outside 0..{self.num_experts - 1}"
            )  # fmt: skip
        j, i_p = expert - self.expert_start, self.intermediate_per_rank
        if piece == "gate":
            return self.w13_weight.data[j, :i_p]
        if piece == "up":
            return self.w13_weight.data[j, i_p:]
        if piece == "down":
            return self.w2_weight.data[j]
        raise KeyError(f"{self.name}: unknown expert piece {piece!r}; experts have {list(EXPERT_PIECES)}")

    def load_expert(self, expert: int, piece: ExpertPiece, tensor: torch.Tensor) -> None:
        """Copy this rank's presharded slice of global expert `expert`'s gate, up or down weight. Never slices."""
        dest = self._dest(expert, piece)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(
                f"{self.name}: expert {expert} {piece} has shape {tuple(tensor.shape)}, this rank ({self.describe()}) "
                f"expects {tuple(dest.shape)}"
            )
        if tensor.dtype.is_floating_point and tensor.dtype.itemsize > dest.dtype.itemsize:
            raise ValueError(f"{self.name}: expert {expert} {piece} dtype {tensor.dtype} cannot be loaded into {dest.dtype} without loss")
        dest.copy_(tensor)
        self._loaded.add((expert, piece))

    def missing_shards(self) -> list[str]:
        return [f"expert {e} {p}" for e in self.local_experts for p in EXPERT_PIECES if (e, p) not in self._loaded]

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], global ids [T, k], weights [T, k] -> [T, H]: sum over the k picks of w * expert(x).

        This rank adds only its local experts over its slice of I; the all-reduce over `group`
        (skipped with reduce_results=False) completes the sum.
        """
        out = torch.zeros_like(x)
        i_p = self.intermediate_per_rank
        local = topk_ids - self.expert_start  # [T, k]
        for j in range(self.num_local_experts):
            tok, pick = torch.where(local == j)  # tokens that chose local expert j, and in which slot
            if tok.numel() == 0:
                continue
            gate_up = F.linear(x[tok], self.w13_weight[j])  # [n, 2 I_p]
            h = F.silu(gate_up[:, :i_p]) * gate_up[:, i_p:]  # [n, I_p]
            y = F.linear(h, self.w2_weight[j])  # [n, H], partial over I
            out.index_add_(0, tok, y * topk_weights[tok, pick, None].to(y.dtype))
        if self.reduce_results:
            out = self.group.all_reduce(out)
        return out


class MoEBlock(nn.Module):
    """One MoE MLP on one rank: router, routed experts, optional shared expert(s), one all-reduce.

    `router_weight` [E, H] (and `correction_bias` [E]) and `shared_gate` [1, H] are replicated
    tensors, the same on every rank. The experts and the shared MLP leave their partial sums
    unreduced; they are added and reduced once over `experts.group` (SGLang's
    DeepseekV2MoE / Qwen2MoeSparseMoeBlock forward). Shared experts whole on every rank (an
    all-to-all backend builds them "replicated") give their full output, added after the reduction.
    """

    def __init__(
        self,
        cfg: RouterConfig,
        experts: FusedMoE,
        router_weight: torch.Tensor,
        *,
        correction_bias: torch.Tensor | None = None,
        shared_gate_up: MergedColumnParallelLinear | None = None,
        shared_down: RowParallelLinear | None = None,
        shared_gate: torch.Tensor | None = None,
    ):
        super().__init__()
        if cfg.num_experts != experts.num_experts or tuple(router_weight.shape) != (experts.num_experts, experts.hidden_size):
            raise ValueError(
                f"{experts.name}: router weight {list(router_weight.shape)} for {cfg.num_experts} experts, the layer has "
                f"{experts.num_experts} experts of hidden size {experts.hidden_size}"
            )
        if (shared_gate_up is None) != (shared_down is None):
            raise ValueError(f"{experts.name}: a shared expert needs both gate_up and down")
        self.shared_whole = shared_down is not None and shared_down.group.size == 1
        if shared_down is not None and not self.shared_whole and shared_down.group.members != experts.group.members:
            raise ValueError(
                f"{experts.name}: shared experts over {shared_down.group.describe()} cannot join the experts' "
                f"reduction over {experts.group.describe()}"
            )
        self.cfg, self.experts = cfg, experts
        self.router_weight, self.correction_bias = router_weight, correction_bias
        self.shared_gate_up, self.shared_down, self.shared_gate = shared_gate_up, shared_down, shared_gate
        experts.reduce_results = False
        if shared_down is not None:
            shared_down.reduce_results = False
            shared_down.input_is_parallel = not self.shared_whole

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H], the same tokens on every rank of the group -> [..., H], reduced."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, H]
        ids, weights = route(self.cfg, x, self.router_weight, self.correction_bias)
        out = self.experts(x, ids, weights)  # [T, H], partial
        if self.shared_down is None:
            return self.experts.group.all_reduce(out).reshape(shape)
        g, u = self.shared_gate_up.split(self.shared_gate_up(x))  # [T, S_r] each
        shared = self.shared_down(F.silu(g) * u)  # [T, H], partial over tp (whole when replicated)
        if self.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, self.shared_gate.to(x.dtype))) * shared  # [T, 1] per token
        if self.shared_whole:
            return (self.experts.group.all_reduce(out) + shared).reshape(shape)
        return self.experts.group.all_reduce(out + shared).reshape(shape)
