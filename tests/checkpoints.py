"""Tiny real Hugging Face checkpoints, made by transformers' own save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch

# Shapes chosen to exercise the contracts: 8 query heads over 2 kv heads (replicas at tp 8),
# a vocab that is not a multiple of 64, an intermediate size that tp 3/6 do not divide.
BASE = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=250,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)


def make_checkpoint(path: Path, arch: str = "llama", *, max_shard_size: str | None = None, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised `arch` model (llama, mistral, qwen2, qwen3) to `path`."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    config = config_cls(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.bfloat16 if overrides.get("dtype", "bf16") == "bf16" else torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make every byte matter
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path
