"""A tiny gpt-oss checkpoint saved by transformers' own GptOssForCausalLM (bf16).

8 heads of 16 over 2 kv heads, 8 experts (top 2), hidden 64, expert intermediate 96 (3 MXFP4
blocks of 32, and divisible by moe_tp 2, 4 and 8), vocab 250 (not a multiple of 64), two layers:
layer 0 sliding (window 4, shorter than verify's 16 tokens), layer 1 full. Every parameter random
(transformers starts the expert biases at zero, which would hide a wrong down bias), in several files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moe_configs import randomize

CONFIG = dict(
    vocab_size=250, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=4,
    max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5,
    rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0, truncate=False),
)  # fmt: skip


def make_gpt_oss(path: Path, *, seed: int = 0, **overrides) -> Path:
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**{**CONFIG, **overrides}))
    randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="100KB")
    return path
