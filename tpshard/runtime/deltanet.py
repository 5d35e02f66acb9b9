"""The gated DeltaNet linear attention of Qwen3-Next and Qwen3.5 over attention TP: one rank's heads.

What a rank runs is SGLang's Qwen3GatedDeltaNet (sglang/srt/models/qwen3_next.py) and
Qwen3_5GatedDeltaNet (models/qwen3_5.py) on its own shards; the math is transformers' torch
fallback (models/qwen3_next/modeling_qwen3_next.py: causal_conv1d_fn, torch_recurrent_gated_delta_rule,
Qwen3NextRMSNormGated), over the rank's heads only:

- the input projections' local outputs are unpacked into the rank's q, k, v, z, b, a. Qwen3-Next's
  in_proj_qkvz / in_proj_ba are packed per key-head group ([q_g | k_g | v_g | z_g], [b_g | a_g]) and
  a rank holds whole groups: its output is viewed as [key heads_r, group width] and split inside
  each group (SGLang's fix_query_key_value_ordering). Qwen3.5's split projections load as the
  pieces of one fused layer: qkv_r = [q_r | k_r | v_r] (each segment's slice) and z_r, b_r, a_r,
  split by their per-rank sizes (qwen3_5.py's fix_query_key_value_ordering).
- the causal depthwise conv1d over the rank's channels [q_r | k_r | v_r] (its conv1d rows, cut as
  mamba's sharded loader cuts them: each segment's slice), then SiLU;
- q, k L2-normalised per head, q scaled by key_dim^-0.5; every key head serves value_heads /
  key_heads consecutive value heads, so a rank's value heads use its own key heads;
- decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), with the rank's A_log and
  dt_bias (cut by value heads); the delta rule per value head, token by token (the recurrent form);
- the gated RMSNorm per value head (weight whole: it is one head's width), times silu(z);
- out_proj row-parallel over the attention group, all-reduced there.

Loading is presharded, as tpshard.runtime.layers: `load_shard(param, tensor)` copies the rank's
conv1d / A_log / dt_bias slice and asserts its shape; nothing here slices a checkpoint tensor.

Not here: which tensors a rank holds (the plan), the full-attention layers and the decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.layers import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, ShardInfo, divide

# FLA's (and transformers') epsilon of the q / k L2 norm.
L2_EPS = 1e-6


@dataclass(frozen=True)
class DeltaNetConfig:
    key_heads: int
    value_heads: int
    key_dim: int  # per head
    value_dim: int  # per head
    conv_kernel: int
    eps: float = 1e-6  # the gated norm's (config.json rms_norm_eps)

    @classmethod
    def from_hf(cls, config: dict) -> DeltaNetConfig:
        return cls(
            key_heads=int(config["linear_num_key_heads"]), value_heads=int(config["linear_num_value_heads"]),
            key_dim=int(config["linear_key_head_dim"]), value_dim=int(config["linear_value_head_dim"]),
            conv_kernel=int(config.get("linear_conv_kernel_dim", 4)), eps=float(config.get("rms_norm_eps", 1e-6)),
        )  # fmt: skip


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, S, C], weight [C, 1, k] (one filter per channel) -> silu(causal conv) [B, S, C]."""
    s = x.shape[1]
    out = F.conv1d(x.transpose(1, 2), weight, padding=weight.shape[-1] - 1, groups=x.shape[-1])[..., :s]
    return F.silu(out).transpose(1, 2)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """The gated delta rule, one token at a time. q, k [B, S, h, dk] (one per value head), v [B, S, h, dv],
    g (log decay) and beta [B, S, h] -> [B, S, h, dv]. The state S [B, h, dk, dv] starts at zero; per
    token S = exp(g) S, then S += k (beta (v - S^T k))^T, and the output is S^T q."""
    q = l2norm(q) * q.shape[-1] ** -0.5
    k = l2norm(k)
    b, s, h, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = torch.empty_like(v)
    for t in range(s):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over each head's last dim, then times silu(z) (norm before gate, Qwen3NextRMSNormGated)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * F.silu(z)


def _heads(t: torch.Tensor, dim: int) -> torch.Tensor:
    """[B, S, heads * dim] (or grouped [B, S, groups, k * dim]) -> [B, S, heads, dim]."""
    return t.reshape(*t.shape[:2], -1, dim)


class GatedDeltaNet(nn.Module):
    """One rank's gated DeltaNet: key heads key_heads / size, value heads value_heads / size of the group.

    in_proj_qkvz / in_proj_ba are the rank's loaded projection layers: a ColumnParallelLinear holding
    whole key-head groups (Qwen3-Next's packed checkpoint), or a MergedColumnParallelLinear with pieces
    qkv, z and b, a (Qwen3.5's split one). conv1d, A_log, dt_bias are this module's, loaded with
    `load_shard`; the gated norm's weight is passed whole (replicated)."""

    PARAMS = ("conv1d", "A_log", "dt_bias")

    def __init__(
        self, cfg: DeltaNetConfig, *, group: LogicalGroup, in_proj_qkvz: ColumnParallelLinear | MergedColumnParallelLinear,
        in_proj_ba: ColumnParallelLinear | MergedColumnParallelLinear, out_proj: RowParallelLinear, norm: torch.Tensor,
        dtype: torch.dtype = torch.float32, name: str = "",
    ):  # fmt: skip
        super().__init__()
        self.cfg, self.group, self.name = cfg, group, name or "GatedDeltaNet"
        self.key_heads = divide(cfg.key_heads, group.size, f"{self.name} key heads over a group of {group.size}")
        self.value_heads = divide(cfg.value_heads, group.size, f"{self.name} value heads over a group of {group.size}")
        self.in_proj_qkvz, self.in_proj_ba, self.out_proj, self.norm = in_proj_qkvz, in_proj_ba, out_proj, norm
        channels = self.key_heads * cfg.key_dim * 2 + self.value_heads * cfg.value_dim
        # zeros, as the linear layers' weights: a slice never loaded must not look plausible
        self.conv1d = nn.Parameter(torch.zeros(channels, 1, cfg.conv_kernel, dtype=dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.value_heads, dtype=dtype), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.value_heads, dtype=dtype), requires_grad=False)
        self._loaded: set[str] = set()

    def shard_info(self, param: str) -> ShardInfo:
        """What this rank must hold of conv1d (its channels of each of q, k, v), A_log or dt_bias (its value heads)."""
        g = self.group
        return ShardInfo(group=g.name, factor=1, group_rank=g.rank, group_size=g.size, shape=tuple(self._param(param).shape))

    def _param(self, param: str) -> nn.Parameter:
        if param not in self.PARAMS:
            raise KeyError(f"{self.name}: no parameter {param!r}; it has {list(self.PARAMS)}")
        return getattr(self, param)

    def load_shard(self, param: str, tensor: torch.Tensor) -> None:
        target = self._param(param)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{self.name}.{param}: got shape {list(tensor.shape)}, this rank's slice is {list(target.shape)}")
        target.data.copy_(tensor.to(target.dtype))
        self._loaded.add(param)

    def missing_shards(self) -> list[str]:
        return [p for p in self.PARAMS if p not in self._loaded]

    def unpack(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The projections' local outputs [B, S, .] -> q, k [B, S, key heads_r, dk], v, z [B, S, value heads_r, dv],
        b, a [B, S, value heads_r]."""
        c, nk, nv = self.cfg, self.key_heads, self.value_heads
        per = nv // nk  # value heads per key head
        if isinstance(self.in_proj_qkvz, MergedColumnParallelLinear):  # Qwen3.5: pieces by name
            pieces = dict(zip(self.in_proj_qkvz.piece_names, self.in_proj_qkvz.split(qkvz)))
            q, k, v = pieces["qkv"].split([nk * c.key_dim, nk * c.key_dim, nv * c.value_dim], -1)
            z = pieces["z"]
            b, a = (dict(zip(self.in_proj_ba.piece_names, self.in_proj_ba.split(ba)))[n] for n in ("b", "a"))
        else:  # Qwen3-Next: whole key-head groups [q_g | k_g | v_g | z_g], [b_g | a_g]
            groups = qkvz.unflatten(-1, (nk, -1))
            q, k, v, z = groups.split([c.key_dim, c.key_dim, per * c.value_dim, per * c.value_dim], -1)
            b, a = ba.unflatten(-1, (nk, -1)).split([per, per], -1)
        return (
            _heads(q, c.key_dim), _heads(k, c.key_dim), _heads(v, c.value_dim), _heads(z, c.value_dim),
            b.reshape(*b.shape[:2], nv), a.reshape(*a.shape[:2], nv),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (this replica's tokens) -> [B, S, H], reduced over the group."""
        c = self.cfg
        q, k, v, z, b, a = self.unpack(self.in_proj_qkvz(x), self.in_proj_ba(x))
        mixed = causal_conv1d(torch.cat([t.flatten(2) for t in (q, k, v)], -1), self.conv1d)
        q, k, v = mixed.split([q.shape[2] * c.key_dim, k.shape[2] * c.key_dim, v.shape[2] * c.value_dim], -1)
        per = self.value_heads // self.key_heads
        q, k = (t.unflatten(-1, (-1, c.key_dim)).repeat_interleave(per, 2) for t in (q, k))
        v = v.unflatten(-1, (-1, c.value_dim))
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        out = gated_delta_rule(q, k, v, g, torch.sigmoid(b))  # [B, S, value heads_r, dv]
        out = gated_rms_norm(out, z, self.norm.to(out.dtype), c.eps)
        self.out_proj.input_is_parallel = True
        return self.out_proj(out.flatten(2))  # [B, S, H], reduced over the group
