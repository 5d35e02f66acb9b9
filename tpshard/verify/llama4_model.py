"""Llama-4's text decoder for `verify --model` (tpshard.verify.decoder's TPDecoder with Llama-4's
layers), compared with transformers' Llama4ForCausalLM on the same weights (AutoModelForCausalLM
loads the `language_model.*` tensors of a Llama4ForConditionalGeneration checkpoint into it).

What transformers' modeling_llama4 computes, each on the rank's heads or slices:
- attention: q/k/v over the attention group; on RoPE layers (config.json no_rope_layers[i] = 1)
  rotary embedding on adjacent pairs (apply_rotary_emb: each (x_2j, x_2j+1) a complex number times
  exp(i pos theta_j)), then with use_qk_norm an L2 norm of each head over head_dim without weight
  (Llama4TextL2Norm, eps rms_norm_eps); on the no-RoPE layers with attn_temperature_tuning, q
  scaled by log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1. Causal attention, chunked on
  RoPE layers (attention_chunk_size: a query sees its own chunk only), scaled head_dim^-0.5; o_proj
  reduced over the attention group.
- MoE layers (Llama4TextMoe): router logits, the top-k experts each weighted by sigmoid(logit),
  the weight applied to the expert's *input* (routed_in = x * score), silu(gate) * up of the
  [gate | up] halves, plus the shared expert on x; every rank runs all attention-DP replicas'
  tokens through its EP block's experts over its slice of I, one all-reduce over tp.
- dense layers: silu(gate) * up, down, over tp.

Not here: the embedding, norms, head and replica bookkeeping (tpshard.verify.decoder), what
--model supports (tpshard.verify.model).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpshard.arch.tensors import config_value
from tpshard.verify.decoder import INPUT_NORM, POST_NORM, TPDecoder, rms_norm, rope_config
from tpshard.verify.layer_specs import run_row

ROPE_TYPES = ("default", "llama3")


def text_config(config: dict) -> dict:
    return config.get("text_config") or config


def rope_layers(config: dict, n: int) -> list[int]:
    """no_rope_layers as transformers' Llama4TextConfig derives it when absent (1: RoPE, 0: NoPE)."""
    every = config_value(config, "no_rope_layer_interval", 4)
    return list(config_value(config, "no_rope_layers") or [int((i + 1) % every != 0) for i in range(n)])


def unsupported_reason(config: dict) -> str | None:
    kind = rope_config(text_config(config)).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        return f"the Llama-4 decoder implements RoPE types {', '.join(ROPE_TYPES)}, not rope_type {kind!r}"
    return None


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, heads, hd] with each adjacent pair (x_2j, x_2j+1) rotated by the angle of cos/sin [S, hd/2]."""
    a, b = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2)


class Llama4Decoder(TPDecoder):
    prefix = "language_model."

    def __init__(self, plan, rank, layers, norms, device, config: dict):
        text = text_config(config)
        super().__init__(plan, rank, layers, norms, device, rope=rope_config(text))
        self.text = text
        self.uses_rope = rope_layers(config, plan.model.num_layers)
        # transformers' layer_types: chunked_attention on the RoPE layers unless config.json says otherwise
        types = config_value(config, "layer_types") or ["chunked_attention" if r else "full_attention" for r in self.uses_rope]
        self.chunked = [t == "chunked_attention" for t in types]
        self.k = int(config_value(config, "num_experts_per_tok", 1))

    def _rope(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(s, device=self.device, dtype=torch.float32), self.inv_freq)  # [S, hd/2]
        return freqs.cos(), freqs.sin()

    def _layer(self, p: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int) -> torch.Tensor:
        x = rms_norm(h, self.norms[f"{p}.{INPUT_NORM}"], self.eps)
        h = h + self._llama4_attention(p, x, cos, sin)
        x = rms_norm(h, self.norms[f"{p}.{POST_NORM}"], self.eps)
        return h + self._feed_forward(p, x, b)

    def _llama4_attention(self, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv, o = self.layers[f"{p}.self_attn.qkv_proj"], self.layers[f"{p}.self_attn.o_proj"]
        s, hd = x.shape[1], self.head_dim
        q, k, v = (t.unflatten(-1, (-1, hd)) for t in qkv.module.split(qkv.module(x)))  # [B, S, heads, hd]
        pos = torch.arange(s, device=x.device)
        rope = bool(self.uses_rope[int(p.rsplit(".", 1)[1])])
        if rope:
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
            if self.text.get("use_qk_norm", True):
                q, k = (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + self.eps) for t in (q, k))
        elif self.text.get("attn_temperature_tuning", True):
            floor, scale = float(self.text.get("floor_scale", 8192)), float(self.text.get("attn_scale", 0.1))
            q = q * (torch.log1p(torch.floor((pos.float() + 1.0) / floor)) * scale + 1.0)[None, :, None, None]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, hd]
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        allowed = pos[None, :] <= pos[:, None]
        chunk = self.text.get("attention_chunk_size")
        if self.chunked[int(p.rsplit(".", 1)[1])] and chunk:  # a query sees the keys of its own chunk only
            allowed &= (pos[None, :] // chunk) == (pos[:, None] // chunk)
        scores = (q @ k.transpose(-1, -2)) * hd**-0.5
        out = F.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1) @ v
        o.module.input_is_parallel = True
        return run_row(o, out.transpose(1, 2).flatten(2))  # [B, S, H], reduced over the attention group

    def _feed_forward(self, p: str, x: torch.Tensor, b: int) -> torch.Tensor:
        ff = f"{p}.feed_forward"
        attn_group = self.layers[f"{p}.self_attn.qkv_proj"].group
        mlp = f"{ff}.shared_expert" if f"{ff}.experts" in self.layers else ff
        gate_up, down = self.layers[f"{mlp}.gate_up_proj"], self.layers[f"{mlp}.down_proj"]
        xs = self._gather(x, attn_group, gate_up.group)  # every replica's tokens, over tp
        g, u = gate_up.module.split(gate_up.module(xs))
        down.module.input_is_parallel = True
        y = run_row(down, F.silu(g) * u)  # [n*B, S, H], reduced over tp
        if mlp != ff:
            y = y + self._routed(ff, xs)
        return self._scatter(y, attn_group, gate_up.group, b)

    def _routed(self, ff: str, xs: torch.Tensor) -> torch.Tensor:
        """The routed experts on xs [n*B, S, H]: top-k by logit, sigmoid weight on each expert's input."""
        router, experts = self.layers[f"{ff}.router"].module, self.layers[f"{ff}.experts"]
        flat = xs.reshape(-1, xs.shape[-1])
        logits = flat @ router.weight.T  # [T, E]
        top, ids = logits.topk(self.k, dim=-1)
        w = torch.sigmoid(top)
        out, m = torch.zeros_like(flat), experts.module
        for j in range(m.num_local_experts):  # this rank's EP block: global ids expert_start + j
            tok, pick = torch.where(ids == m.expert_start + j)
            if tok.numel():
                out.index_add_(0, tok, m.expert(j, flat[tok] * w[tok, pick, None]))
        return experts.group.all_reduce(out).reshape(xs.shape)
