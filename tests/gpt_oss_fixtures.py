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


MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def make_gpt_oss_mxfp4(path: Path, bf16: Path, *, seed: int = 1) -> Path:
    """The released MXFP4 layout of `bf16`'s model: each layer's gate_up_proj / down_proj replaced by
    random `*_blocks` [E, out, in / 32, 16] (two FP4 codes a byte, low nibble first) and E8M0
    `*_scales` [E, out, in / 32] (stored transposed: gate/up rows on dim 1), biases and everything
    else as saved in bf16; config.json with quantization_config quant_method mxfp4."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    path.mkdir(parents=True)
    tensors = {}
    for f in sorted(bf16.glob("*.safetensors")):
        tensors |= load_file(f)
    g = torch.Generator().manual_seed(seed)
    config = json.loads((bf16 / "config.json").read_text())
    e, h, i = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        del tensors[name]
        out, k = (2 * i, h) if name.endswith("gate_up_proj") else (h, i)
        tensors[name + "_blocks"] = torch.randint(0, 256, (e, out, k // 32, 16), generator=g, dtype=torch.uint8)
        tensors[name + "_scales"] = torch.randint(121, 126, (e, out, k // 32), generator=g, dtype=torch.uint8)
    names = sorted(tensors)
    files = {n: f"model-0000{1 + j % 2}-of-00002.safetensors" for j, n in enumerate(names)}
    for f in sorted(set(files.values())):
        save_file({n: tensors[n].contiguous() for n in names if files[n] == f}, str(path / f), metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    config["quantization_config"] = MXFP4_CONFIG
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(bf16 / "generation_config.json", path / "generation_config.json")
    return path
