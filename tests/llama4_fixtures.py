"""Tiny Llama-4 checkpoints saved by transformers' own Llama4ForConditionalGeneration (bf16).

Text: 8 heads of 16 over 2 kv heads, hidden 64, 4 layers with experts in layers 1 and 3
(interleave_moe_layer_step 2), 4 experts (top 1) of intermediate 32 (divisible by moe_tp 2, 4, 8),
a shared expert of 32, dense layers of intermediate_size_mlp 48, vocab 250 (not a multiple of 64);
layer 3 is a NoPE layer (no_rope_layer_interval 4), the others RoPE with chunked attention.
Every parameter random (norms would start at 1). transformers 5.24 saves the release's names:
`language_model.model.layers.N.feed_forward.experts.gate_up_proj` [E, H, 2I] ([gate | up] halves),
`...experts.down_proj` [E, I, H], `language_model.lm_head.weight`, and the vision tower under
`vision_model.*` / `multi_modal_projector.*`. `text_only` drops the vision tensors, as ModelOpt's
text-only exports are (the same config, architectures Llama4ForConditionalGeneration).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moe_configs import randomize

TEXT = dict(
    vocab_size=250, hidden_size=64, intermediate_size=32, intermediate_size_mlp=48, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, max_position_embeddings=256, rms_norm_eps=1e-5,
    # shorter than verify's 16 tokens, so that chunked attention and the NoPE layer's temperature
    # tuning both act (the release's 8192 would leave them identities)
    attention_chunk_size=4, floor_scale=4,
)  # fmt: skip
VISION = dict(
    hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=28, patch_size=14,
    vision_output_dim=32, projector_input_dim=32, projector_output_dim=32,
)  # fmt: skip


def make_llama4(path: Path, *, seed: int = 0, text_only: bool = True, **overrides) -> Path:
    from safetensors.torch import load_file, save_file
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    torch.manual_seed(seed)
    model = Llama4ForConditionalGeneration(Llama4Config(text_config={**TEXT, **overrides}, vision_config=VISION))
    randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="60KB")
    if text_only:  # rewrite each file without the vision tensors, and the index
        index_path = path / "model.safetensors.index.json"
        index = json.loads(index_path.read_text())
        for f in sorted(path.glob("model*.safetensors")):
            kept = {k: v for k, v in load_file(f).items() if k.startswith("language_model.")}
            if kept:
                save_file(kept, f, metadata={"format": "pt"})
            else:
                f.unlink()
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k.startswith("language_model.")}
        index_path.write_text(json.dumps(index, indent=1))
    return path
