"""DeepSeek-V4's attention and hyper-connections on one rank, as SGLang 0.5.23 cuts them
(sglang/srt/models/deepseek_v4.py MqaAttentionBase / MQALayer), with the math of transformers'
modeling_deepseek_v4.py (its eager path, without a cache: one prefill of the whole sequence).

The cut:
- replicated (every rank computes the same): wq_a and q_norm (the query latent), wkv and kv_norm
  (the one shared kv head, read as key and value), each compressor (`wkv_gate`: wkv and wgate
  fused, its fp32 `ape` and its norm) and the ratio-4 layers' indexer (its wq_b, weights_proj and
  its own compressor);
- wq_b by heads over attn_tp (rank a: heads [a nh/attn_tp, (a + 1) nh/attn_tp)); the fp32 sinks
  held whole and sliced to the same heads in the forward (`_local_attn_sink`);
- wo_a by whole output groups over attn_tp (rank a: groups [a g/attn_tp, (a + 1) g/attn_tp), the
  groups of its own heads); wo_b row-parallel over attn_tp, all-reduced there.

The math (transformers' DeepseekV4Attention.forward): q = rms(wq_b(q_norm(wq_a x))) per head
without weight, kv = kv_norm(wkv x), both with interleaved RoPE on the trailing rope dims ("main"
rope on sliding-window layers, "compress" rope on compressed ones). Keys = values = the sliding
window of kv, plus the compressor's entries (one per `ratio` tokens: a softmax-gated sum of the
window with `ape` added to the gate, normed, roped at the window's first position; ratio 4
overlaps each window with the previous one's first half of channels), which a query sees once
its window is closed, and on ratio-4 layers only the indexer's top-k of them (scores
sum_h w_h relu(q_h . k)). Softmax with one sink logit per head, the conjugate rope on the output,
wo_a per group, wo_b.

mHC (DeepseekV4HyperConnection, HyperHead): hc_mult residual streams; before each block a
projection of the normed streams gives pre (collapse), post (expand) and comb (a Sinkhorn-
normalised mixing matrix); all whole, computed alike on every rank.

Not here: the MoE (tpshard.runtime.v4_moe), the embedding and head (tpshard.runtime.layers), which
shards a rank holds (the plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpshard.runtime.layers import divide


@dataclass(frozen=True)
class V4AttentionConfig:
    """What the attention and mHC read of a DeepseekV4Config (transformers' names)."""

    num_heads: int
    head_dim: int
    o_groups: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    eps: float

    @classmethod
    def from_hf(cls, c) -> V4AttentionConfig:
        return cls(
            c.num_attention_heads, c.head_dim, c.o_groups, c.sliding_window, c.index_n_heads, c.index_head_dim,
            c.index_topk, c.hc_mult, c.hc_sinkhorn_iters, float(c.hc_eps), float(c.rms_norm_eps),
        )  # fmt: skip


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; no weight: DeepseekV4UnweightedRMSNorm."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if weight is None else weight * y


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on the trailing 2 * cos.shape[-1] channels of x [B, S, (heads,) D]; cos/sin
    [B or 1, S, d/2]: each pair (a, b) -> (a cos - b sin, b cos + a sin); the leading channels pass."""
    d = 2 * cos.shape[-1]
    if x.dim() == 4:
        cos, sin = cos[:, :, None], sin[:, :, None]
    c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    keep, r = x[..., :-d], x[..., -d:]
    swapped = torch.stack((-r[..., 1::2], r[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([keep, r * c + swapped * s], dim=-1)


# ---------------------------------------------------------------- mHC


def hyper_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: V4AttentionConfig):
    """h [B, S, n, H] -> (post [B, S, n], comb [B, S, n, n], collapsed [B, S, H])."""
    n = cfg.hc_mult
    mixes = F.linear(rms(h.flatten(2), None, cfg.eps), fn)  # [B, S, (2 + n) n]
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + cfg.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + cfg.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)  # Sinkhorn-Knopp: columns, then rows and columns
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + cfg.hc_eps)
    return post, comb, (pre.unsqueeze(-1) * h).sum(2)


def hyper_post(h: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The block's output [B, S, H] expanded into the streams, plus the streams mixed by comb^T."""
    return post.unsqueeze(-1) * out.unsqueeze(-2) + comb.transpose(-1, -2) @ h


def hyper_head(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg: V4AttentionConfig) -> torch.Tensor:
    """The final collapse of the streams h [B, S, n, H] -> [B, S, H] (DeepseekV4HyperHead)."""
    pre = torch.sigmoid(F.linear(rms(h.flatten(2), None, cfg.eps), fn) * scale + base) + cfg.hc_eps
    return (pre.unsqueeze(-1) * h).sum(2)


# ---------------------------------------------------------------- compressors and indexer


@dataclass
class Compressor:
    """One compressor's replicated parts: `wkv_gate` (the engine's fused ReplicatedLinear; its
    pieces "wkv" and "wgate"), `ape` [ratio, c], `norm` [d]. c = 2d at ratio 4 (two overlapping
    series), d at ratio 128."""

    wkv_gate: torch.nn.Module
    ape: torch.Tensor
    norm: torch.Tensor
    ratio: int

    def __call__(self, x: torch.Tensor, cos_at, eps: float) -> torch.Tensor:
        """x [B, S, H] -> the entries of every closed window [B, S // ratio, d], roped at the windows'
        first positions (cos_at(positions) -> cos, sin)."""
        out = dict(zip(self.wkv_gate.piece_names, self.wkv_gate.split(self.wkv_gate(x))))
        kv, gate = out["wkv"], out["wgate"]
        b, r = x.shape[0], self.ratio
        w = x.shape[1] // r
        d = self.norm.shape[0]
        if w == 0:
            return x.new_zeros(b, 0, d)
        kv = kv[:, : w * r].unflatten(1, (w, r))  # [B, W, r, c]
        gate = gate[:, : w * r].unflatten(1, (w, r)) + self.ape
        if kv.shape[-1] == 2 * d:  # Ca of window w-1 (first d channels) beside Cb of window w (the last d)
            prev_kv, prev_gate = kv.new_zeros(b, w, r, d), gate.new_full((b, w, r, d), float("-inf"))
            prev_kv[:, 1:], prev_gate[:, 1:] = kv[:, :-1, :, :d], gate[:, :-1, :, :d]
            kv, gate = torch.cat([prev_kv, kv[..., d:]], 2), torch.cat([prev_gate, gate[..., d:]], 2)  # [B, W, 2r, d]
        entries = rms((kv * gate.softmax(dim=2)).sum(2), self.norm, eps)  # [B, W, d]
        cos, sin = cos_at(torch.arange(w, device=x.device) * r)
        return rope(entries, cos, sin)


def visible(s: int, entries: int, ratio: int, device) -> torch.Tensor:
    """[S, T] bool: query t sees entry w once its window is closed, w < (t + 1) // ratio."""
    return torch.arange(entries, device=device)[None, :] < ((torch.arange(s, device=device) + 1) // ratio)[:, None]


def indexer_pick(
    x: torch.Tensor, q_latent: torch.Tensor, keys: torch.Tensor, wq_b, weights_proj, cos: torch.Tensor, sin: torch.Tensor,
    cfg: V4AttentionConfig, ratio: int,
) -> torch.Tensor:  # fmt: skip
    """[B, S, T] bool: the indexer's top-k of the compressed entries `keys` [B, T, d_i] a query may see
    (transformers' DeepseekV4Indexer: scores sum_h w_h relu(q_h . k) d_i^-1/2, w = weights_proj(x) nh_i^-1/2)."""
    b, s, _ = x.shape
    t = keys.shape[1]
    q = rope(wq_b(q_latent).unflatten(-1, (-1, cfg.index_head_dim)), cos, sin)  # [B, S, nh_i, d_i]
    scores = F.relu(torch.einsum("bshd,btd->bsht", q, keys)) * cfg.index_head_dim**-0.5
    weights = weights_proj(x) * cfg.index_n_heads**-0.5  # [B, S, nh_i]
    scores = (scores * weights.unsqueeze(-1)).sum(2)  # [B, S, T]
    seen = visible(s, t, ratio, x.device)
    top = scores.masked_fill(~seen, float("-inf")).topk(min(cfg.index_topk, t), dim=-1).indices  # [B, S, k]
    picked = torch.zeros(b, s, t, dtype=torch.bool, device=x.device).scatter_(-1, top, True)
    return picked & seen  # a pick past a query's closed windows (too few of them) is no pick


# ---------------------------------------------------------------- attention


@dataclass
class V4Attention:
    """One rank's attention of one layer. Linear modules are the runtime's (tpshard.runtime.layers):
    wq_a, wkv replicated; wq_b, wo_a column-parallel over attn_tp; wo_b row-parallel (reduces)."""

    cfg: V4AttentionConfig
    wq_a: torch.nn.Module
    q_norm: torch.Tensor
    wq_b: torch.nn.Module
    wkv: torch.nn.Module
    kv_norm: torch.Tensor
    wo_a: torch.nn.Module
    wo_b: torch.nn.Module
    sinks: torch.Tensor  # [num_heads], whole: this rank slices its heads
    attn_rank: int  # this rank's place in attn_tp
    attn_size: int
    compressor: Compressor | None = None
    indexer: tuple | None = None  # (wq_b, weights_proj, Compressor) of a ratio-4 layer

    def local_sinks(self, heads: int) -> torch.Tensor:
        """SGLang's _local_attn_sink: the sinks of this rank's heads."""
        return self.sinks[self.attn_rank * heads : (self.attn_rank + 1) * heads]

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cos_at) -> torch.Tensor:
        """x [B, S, H] (one attention-DP replica's tokens) -> [B, S, H], reduced over attn_tp. cos/sin
        [1, S, d/2] of the layer's rope; cos_at(positions) the compress rope at other positions."""
        cfg, (b, s, _) = self.cfg, x.shape
        q_latent = rms(self.wq_a(x), self.q_norm, cfg.eps)
        q = rope(rms(self.wq_b(q_latent).unflatten(-1, (-1, cfg.head_dim)), None, cfg.eps), cos, sin)  # [B, S, h, D]
        kv = rope(rms(self.wkv(x), self.kv_norm, cfg.eps), cos, sin)  # [B, S, D]
        i, j = torch.arange(s, device=x.device)[:, None], torch.arange(s, device=x.device)[None, :]
        allowed = ((j <= i) & (i - j < cfg.sliding_window)).expand(b, s, s)  # the sliding window
        if self.compressor is not None:
            entries = self.compressor(x, cos_at, cfg.eps)  # [B, T, D]
            if self.indexer is not None:
                iq, iw, icomp = self.indexer
                seen = indexer_pick(x, q_latent, icomp(x, cos_at, cfg.eps), iq, iw, cos, sin, cfg, self.compressor.ratio)
            else:
                seen = visible(s, entries.shape[1], self.compressor.ratio, x.device).expand(b, s, -1)
            kv, allowed = torch.cat([kv, entries], 1), torch.cat([allowed, seen], -1)
        heads = q.shape[2]
        scores = torch.einsum("bshd,btd->bhst", q, kv) * cfg.head_dim**-0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        sink = self.local_sinks(heads).to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, s, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]  # the sink takes its share, then goes
        out = rope(torch.einsum("bhst,btd->bshd", probs, kv), cos, -sin)  # the rope on V undone
        return self.wo_b(self._wo_a(out))

    def _wo_a(self, out: torch.Tensor) -> torch.Tensor:
        """out [B, S, h, D] -> [B, S, g * o_lora] of this rank's g output groups: group k reads its
        heads' channels with its o_lora rows of wo_a (block-diagonal)."""
        groups = divide(self.cfg.o_groups, self.attn_size, "o_groups over attn_tp")
        grouped = out.flatten(2).unflatten(-1, (groups, -1))  # [B, S, g, h D / g]
        every = self.wo_a(grouped).unflatten(-1, (groups, -1))  # [B, S, g, g, o_lora]: each group by every group's rows
        return torch.diagonal(every, dim1=2, dim2=3).transpose(-1, -2).flatten(2)
