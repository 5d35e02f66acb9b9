"""How a MoE model turns router logits into top-k experts: `RouterConfig`, the fact a family's
module declares (per config.json `model_type`) and tpshard.runtime.moe.route computes with.

Torch-free, so the architecture tables stay importable without the runtime. Not here: the routing
itself (tpshard.runtime.moe), which family has which rule (the family modules; tpshard.arch's
`router_config` finds one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RouterConfig:
    """How a model turns router logits into top-k expert ids and weights.

    scoring: softmax over the experts (Qwen, Mixtral, DeepSeek-V2) or an independent sigmoid per
    expert (DeepSeek-V3). Grouped selection (n_group > 1): experts are split into n_group
    contiguous groups, a group scores the sum of its top-2 scores (V3) or its max (V2), only the
    best topk_group groups compete. correction_bias (V3 `e_score_correction_bias`) shifts the
    choice only, never the weights. renormalize divides the k weights by their sum; then the
    weights are multiplied by routed_scaling_factor.
    """

    num_experts: int
    top_k: int
    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    correction_bias: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"router: top-k {self.top_k} of {self.num_experts} experts")
        if self.num_experts % self.n_group:  # the runtime's `divide` message: experts split into whole groups
            raise ValueError(f"router: experts over n_group: {self.num_experts} is not divisible by {self.n_group}")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"router: topk_group {self.topk_group} of n_group {self.n_group}")


# (config.json, routed experts E, experts per token k) -> the model's RouterConfig.
RouterRule = Callable[[dict, int, int], RouterConfig]
