"""gpt-oss's layers in the `verify --model` decoder (tpshard.verify.moe_model's MoEDecoder calls them
when the manifest has them): attention with sinks and sliding windows, and the fused experts' MoE.

- attention: q/k/v (+bias) of the rank's heads, RoPE from transformers' tables (yarn with its
  attention factor: tpshard.verify.moe_model.rope_tables), causal attention whose softmax has one
  extra column per head, the rank's sinks (tpshard.runtime.fused_moe.sinks_attention); a layer
  config.json's layer_types calls sliding_attention sees only its `sliding_window` latest
  positions; o_proj all-reduced over the attention group, its bias added once;
- MoE: the router (replicated, with its bias: top-k of the logits, softmax over the k), then every
  rank runs every expert over its slice of I on the tokens of all its attention-DP replicas, and
  one all-reduce over tp (the down bias added by MoE-TP rank 0).

Not here: the decoder's embedding, norms, head and replica bookkeeping (tpshard.verify.decoder).
"""

from __future__ import annotations

import torch

from tpshard.runtime.fused_moe import sinks_attention
from tpshard.runtime.moe import route
from tpshard.verify.decoder import rotate
from tpshard.verify.layer_specs import run_row


def has_sinks(layers: dict, p: str) -> bool:
    return f"{p}.self_attn.sinks" in layers


def window_of(config: dict, p: str) -> int | None:
    """The sliding window of decoder layer `p` (model.layers.i) by config.json's layer_types, or None."""
    types = config.get("layer_types") or []
    i = int(p.rsplit(".", 1)[1])
    return config.get("sliding_window") if i < len(types) and types[i] == "sliding_attention" else None


def attention(dec, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H] -> [B, S, H], reduced over the attention group."""
    qkv, o = dec.layers[f"{p}.self_attn.qkv_proj"], dec.layers[f"{p}.self_attn.o_proj"]
    sinks = dec.layers[f"{p}.self_attn.sinks"].module.sinks  # [this rank's heads]
    hd = dec.head_dim
    q, k, v = (t.unflatten(-1, (-1, hd)).transpose(1, 2) for t in qkv.module.split(qkv.module(x)))  # [B, heads, S, hd]
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    out = sinks_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), sinks.to(q.dtype), window_of(dec.config, p))
    o.module.input_is_parallel = True
    return run_row(o, out.transpose(1, 2).flatten(2))


def moe(dec, prefix: str, x: torch.Tensor, attn_group, b: int) -> torch.Tensor:
    """The router and the fused experts of `prefix` (model.layers.i.mlp) on x [B, S, H] -> [B, S, H]."""
    router, experts = dec.layers[f"{prefix}.router"].module, dec.layers[f"{prefix}.experts"]
    big = experts.group  # tp: every rank runs every replica's tokens
    xs = dec._gather(x, attn_group, big)
    flat = xs.reshape(-1, xs.shape[-1])
    ids, w = route(dec.router, flat, router.weight, None, router.bias)
    experts.module.reduce_results = True
    out = experts.module(flat, ids, w.to(flat.dtype)).reshape(xs.shape)
    return dec._scatter(out, attn_group, big, b)
