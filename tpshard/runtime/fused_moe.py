"""gpt-oss's routed experts over tensor parallelism, loaded from fused [E, ...] shards
(tpshard.arch.fused), and its attention with sinks.

`InterleavedExperts` mirrors SGLang's FusedMoE as models/gpt_oss.py builds it: every rank holds
its EP slot's experts (all of them at ep 1; the contiguous block [slot * E/ep, +E/ep) under the
MXFP4 loader's EP) over its moe_tp slice of the intermediate size, as the checkpoint stores them
(transformers GptOssExperts: gate_up_proj [E, H, 2 I_r] with gate and up interleaved, its bias
[E, 2 I_r], down_proj [E, I_r, H]) and the down bias [E, H] whole. The clamped SwiGLU is
elementwise over the intermediate axis, so each rank's slice gives its partial sum exactly; the
down bias is added by MoE-TP rank 0 only (SGLang zeroes it on the other ranks), and one
all-reduce over the group sums the slices.

`SegmentedExperts` is the same for Llama-4 (models/mllama4.py, transformers Llama4TextExperts): no
biases, gate_up_proj [E, H, 2 I_r] holding the rank's slice of the gate half then of the up half,
silu(gate) * up.

`sinks_attention` is transformers' eager_attention_forward of gpt-oss on a rank's heads: the
sink of each head an extra logit column of the softmax, dropped after it; a sliding window keeps
the `window` most recent positions (the query's own included).

Not here: which shards a rank holds (the plan), the router (tpshard.runtime.moe.route).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.layers import divide

# checkpoint parameter -> the runtime's (SGLang's w13 / w2 and their biases)
PARAMS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class InterleavedExperts(nn.Module):
    params = PARAMS  # the checkpoint's fused tensors of the layer

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, group: LogicalGroup,
        alpha: float, limit: float, dtype: torch.dtype, name: str = "", per_rank: int | None = None, ep_size: int = 1,
    ):  # fmt: skip
        """per_rank: the intermediate elements a rank holds, padding included (MXFP4's whole
        32-blocks, ceil(blocks / moe_tp) a rank); default I / moe_tp. `group` (tp) is split into
        ep_size EP slots of moe_tp consecutive ranks."""
        super().__init__()
        self.name, self.group = name or "InterleavedExperts", group
        self.num_experts, self.hidden_size, self.alpha, self.limit = num_experts, hidden_size, alpha, limit
        self.moe_tp_size = divide(group.size, ep_size, f"{self.name}: the {group.name} group over ep")
        self.ep_rank, self.moe_tp_rank = group.rank // self.moe_tp_size, group.rank % self.moe_tp_size
        self.num_local_experts = divide(num_experts, ep_size, f"{self.name}: experts over ep")
        self.expert_start = self.ep_rank * self.num_local_experts
        i_p = per_rank or divide(intermediate_size, self.moe_tp_size, f"{self.name}: expert intermediate size over MoE-TP")
        self.intermediate_per_rank = i_p
        e, h = self.num_local_experts, hidden_size
        shapes = {"gate_up_proj": (e, h, 2 * i_p), "gate_up_proj_bias": (e, 2 * i_p), "down_proj": (e, i_p, h), "down_proj_bias": (e, h)}
        self.shapes = {p: shapes[p] for p in self.params}
        # Zeros, not empty: a parameter never loaded must not look like plausible weights.
        self.weights = {p: torch.zeros(s, dtype=dtype) for p, s in self.shapes.items()}
        self.reduce_results = True
        self._loaded: set[str] = set()

    def to(self, device):  # the tensors are plain attributes
        self.weights = {p: w.to(device) for p, w in self.weights.items()}
        return self

    def load(self, param: str, tensor: torch.Tensor) -> None:
        """Copy this rank's presharded tensor of `param`; never slices."""
        if param not in self.shapes:
            raise KeyError(f"{self.name}: no parameter {param!r}; the fused experts have {list(self.params)}")
        if tuple(tensor.shape) != self.shapes[param]:
            raise ValueError(
                f"{self.name}: {param} has shape {tuple(tensor.shape)}, MoE-TP rank {self.moe_tp_rank}/{self.moe_tp_size}"
                f" expects {self.shapes[param]}"
            )
        self.weights[param].copy_(tensor)
        self._loaded.add(param)

    def missing_shards(self) -> list[str]:
        return [p for p in self.params if p not in self._loaded]

    def expert(self, e: int, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
        """Local expert e (global id expert_start + e) on tokens x [n, H] over this rank's slice
        of I -> [n, H], partial; the down bias with `bias` on MoE-TP rank 0."""
        w = self.weights
        gu = x @ w["gate_up_proj"][e] + w["gate_up_proj_bias"][e]  # [n, 2 I_r], gate/up interleaved
        y = swiglu(gu, self.alpha, self.limit) @ w["down_proj"][e]
        return y + w["down_proj_bias"][e] if bias and self.moe_tp_rank == 0 else y

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k], weights [T, k] -> [T, H]: sum over the k picks of w * expert(x)."""
        out = torch.zeros_like(x)
        for e in range(self.num_local_experts):
            tok, pick = torch.where(topk_ids == self.expert_start + e)
            if tok.numel():
                out.index_add_(0, tok, self.expert(e, x[tok]) * topk_weights[tok, pick, None].to(x.dtype))
        return self.group.all_reduce(out) if self.reduce_results else out


# The E2M1 values of the 16 FP4 codes (OCP MX spec), sign in bit 3.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 blocks [..., G, 16] uint8 (two codes a byte, the low nibble the even element) and E8M0
    scales [..., G] (2^(s - 127)) -> float32 [..., G * 32]: the checkpoint's [E, out, in] layout."""
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [..., G, 32]
    return torch.ldexp(vals, (scales.to(torch.int32) - 127).unsqueeze(-1)).flatten(-2)


class SegmentedExperts(InterleavedExperts):
    params = ("gate_up_proj", "down_proj")

    def expert(self, e: int, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
        """Expert e on tokens x [n, H] over this rank's slice of I -> [n, H], partial (no biases)."""
        gu = x @ self.weights["gate_up_proj"][e]  # [n, 2 I_r]: the rank's gate slice, then its up slice
        return silu_halves(gu) @ self.weights["down_proj"][e]


def silu_halves(gu: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of [gate | up] halves [..., 2n] -> [..., n] (transformers Llama4TextExperts)."""
    g, u = gu.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu(gu: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of interleaved gate/up [..., 2n] -> [..., n] (GptOssExperts._apply_gate)."""
    g, u = gu[..., ::2].clamp(max=limit), gu[..., 1::2].clamp(min=-limit, max=limit)
    return (u + 1) * (g * torch.sigmoid(g * alpha))


def sinks_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [B, nh, S, hd], k / v [B, nh, S, hd] (kv heads repeated), sinks [nh] -> [B, nh, S, hd]."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # [B, nh, S, S]
    i, j = torch.arange(s, device=q.device)[:, None], torch.arange(s, device=q.device)[None, :]
    allowed = (j <= i) if window is None else (j <= i) & (i - j < window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    logits = torch.cat((scores, sink), -1)
    probs = F.softmax(logits - logits.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return probs @ v
