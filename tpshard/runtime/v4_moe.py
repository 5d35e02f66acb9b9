"""DeepSeek-V4's MoE on one rank: its routers, its clamped SwiGLU experts and shared expert, one all-reduce.

The cut is SGLang 0.5.23's (sglang/srt/models/deepseek_v4.py, layers/moe/hash_topk.py): the router
weight, its fp32 correction bias and the hash layers' `tid2eid` are whole on every rank (global
expert ids, under EP too); FusedMoE holds this rank's EP slot of experts over MoE-TP
(tpshard.runtime.moe.FusedMoE, its w13 / w2 layout); the shared expert is a MergedColumnParallel
gate/up and a RowParallel down over the full tp. Partial sums of both are reduced once over tp.

The math is transformers' DeepseekV4SparseMoeBlock:
- scores = sqrtsoftplus(x W^T) (sqrt(softplus); `sigmoid` also read); a top-k router picks the
  top-k of scores + bias, a hash router the experts tid2eid[token id]; the picked scores are
  renormalised (sum + 1e-20) and times routed_scaling_factor;
- each expert (and the shared expert): down(silu(min(gate, limit)) * clamp(up, -limit, limit)),
  limit = swiglu_limit; elementwise, so a rank's slice of the intermediate dim clamps alike.

Not here: which tokens reach the MoE under attention DP (the caller gathers them), attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpshard.runtime.moe import FusedMoE

SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class V4MoEConfig:
    top_k: int
    routed_scaling_factor: float
    swiglu_limit: float
    scoring: str

    @classmethod
    def from_hf(cls, c) -> V4MoEConfig:
        return cls(c.num_experts_per_tok, float(c.routed_scaling_factor), float(c.swiglu_limit), c.scoring_func)


def route_v4(
    cfg: V4MoEConfig, x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
    tid2eid: torch.Tensor | None = None, ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [T, H] -> (global expert ids [T, k], weights [T, k]). A hash layer passes tid2eid [V, k] and
    the tokens' ids [T]; a top-k layer its correction bias [E]."""
    scores = SCORING[cfg.scoring](F.linear(x, weight.to(x.dtype)))  # [T, E]
    if tid2eid is not None:
        picked = tid2eid[ids.reshape(-1).long()].long()
    else:
        picked = torch.topk(scores + bias.to(scores.dtype), cfg.top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, picked)
    return picked, w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts_partial(cfg: V4MoEConfig, experts: FusedMoE, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """This rank's experts (its EP slot, its MoE-TP slice of I) on x [T, H]: the unreduced partial sum."""
    out = torch.zeros_like(x)
    i_p = experts.intermediate_per_rank
    local = ids - experts.expert_start
    for j in range(experts.num_local_experts):
        tok, pick = torch.where(local == j)
        if tok.numel():
            gate_up = F.linear(x[tok], experts.w13_weight[j])
            y = F.linear(swiglu(gate_up[:, :i_p], gate_up[:, i_p:], cfg.swiglu_limit), experts.w2_weight[j])
            out.index_add_(0, tok, y * w[tok, pick, None].to(y.dtype))
    return out


def shared_partial(cfg: V4MoEConfig, gate_up, down, x: torch.Tensor) -> torch.Tensor:
    """The shared expert over tp on x [T, H]: this rank's slice of I, unreduced."""
    g, u = gate_up.split(gate_up(x))
    down.reduce_results, down.input_is_parallel = False, True
    return down(swiglu(g, u, cfg.swiglu_limit))


def v4_moe(
    cfg: V4MoEConfig, x: torch.Tensor, experts: FusedMoE, router_weight: torch.Tensor, shared: tuple | None, **route
) -> torch.Tensor:  # fmt: skip
    """x [T, H], the same tokens on every rank of the experts' group -> [T, H], reduced over it."""
    ids, w = route_v4(cfg, x, router_weight, **route)
    out = experts_partial(cfg, experts, x, ids, w)
    if shared is not None:
        out = out + shared_partial(cfg, *shared, x)
    return experts.group.all_reduce(out)
