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


# MoE / MLA families: 8 experts of intermediate 32 (MoE-TP 1, 2, 4 and 8 all divide it), 3 layers.
# DeepSeek: layer 0 dense (first_k_dense_replace 1), MLA with q_lora_rank (V3) or q_proj (V2),
# 8 heads of nope 16 + rope 8, v 16; 1 (V3) or 2 (V2) shared experts.
MOE = dict(num_hidden_layers=3, num_experts_per_tok=2)
ARCH_DEFAULTS = {
    "qwen3_moe": dict(MOE, num_experts=8, moe_intermediate_size=32, head_dim=16),
    "qwen2_moe": dict(MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    "mixtral": dict(MOE, num_local_experts=8),
    "deepseek_v3": dict(
        MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=2, topk_group=1,
        num_nextn_predict_layers=0,
    ),
    "deepseek_v2": dict(
        MOE, n_routed_experts=8, n_shared_experts=2, moe_intermediate_size=32, q_lora_rank=None, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
    ),
    # GLM-4.5: 8 heads of 16 over 2 kv heads (kv replicated at attn_tp 4 and 8), q/k/v biases, q/k
    # norms, layer 0 dense, one shared expert, grouped sigmoid routing.
    "glm4_moe": dict(
        MOE, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32, head_dim=16, first_k_dense_replace=1,
        n_group=2, topk_group=1, use_qk_norm=True, attention_bias=True, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    # Hybrid decoders: layers 0-2 gated DeltaNet (8 key heads of 4, 16 value heads of 4: K 32, V 64),
    # layer 3 gated full attention (8 heads of 8 over 2 kv heads); 8 experts + a shared expert.
    "qwen3_5_moe": dict(
        MOE, num_hidden_layers=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=8,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=4, linear_value_head_dim=4,
    ),
    "qwen3_next": dict(
        MOE, num_hidden_layers=4, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48, head_dim=8,
        linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=4, linear_value_head_dim=4,
    ),
}  # fmt: skip


def make_checkpoint(
    path: Path, arch: str = "llama", *, max_shard_size: str | None = None, seed: int = 0, mtp: bool = False, **overrides
) -> Path:  # fmt: skip
    """Save a randomly initialised `arch` model (llama, mistral, qwen2, qwen3, qwen3_moe, qwen2_moe,
    mixtral, deepseek_v3, deepseek_v2, glm4_moe, qwen3_5_moe, qwen3_next) to `path`. `mtp` (deepseek_v3, glm4_moe) adds the MTP layer as
    layer num_hidden_layers in a file of its own, as the real checkpoints ship it."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "deepseek_v2": (transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM),
        "glm4_moe": (transformers.Glm4MoeConfig, transformers.Glm4MoeForCausalLM),
        "qwen3_5_moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3_next": (transformers.Qwen3NextConfig, transformers.Qwen3NextForCausalLM),
    }[arch]
    fields = {**BASE, **ARCH_DEFAULTS.get(arch, {}), **overrides}
    if arch == "qwen3_5_moe":  # every layer MoE: Qwen3.5-MoE's config.json has no intermediate_size
        fields.pop("intermediate_size")
    config = config_cls(**fields)
    torch.manual_seed(seed)
    dtype = torch.bfloat16 if overrides.get("dtype", "bf16") == "bf16" else torch.float32
    if arch == "glm4_moe":  # from_config keeps the router and its correction bias fp32, as GLM ships them; .to() would cast them
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = model_cls(config).to(dtype)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make every byte matter
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    if mtp:
        add_mtp_layer(path, config)
    return path


def add_mtp_layer(path: Path, config) -> None:
    """DeepSeek-V3's (and GLM-4.5's) MTP module as the checkpoint stores it: decoder layer n = num_hidden_layers (a
    MoE layer) plus enorm, hnorm, eh_proj [H, 2H], shared_head.norm, embed_tokens, shared_head.head."""
    import json

    from safetensors.torch import load_file, save_file

    n, h = config.num_hidden_layers, config.hidden_size
    files = sorted(path.glob("model*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors |= load_file(f)
    last = f"model.layers.{n - 1}."
    dtype = tensors["model.norm.weight"].dtype
    # each in its source's dtype: GLM's router and correction bias are fp32
    mtp = {f"model.layers.{n}." + k[len(last):]: torch.randn_like(v.float()).to(v.dtype) * 0.05 for k, v in tensors.items() if k.startswith(last)}
    mtp |= {
        f"model.layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(h).to(dtype),
        f"model.layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(h).to(dtype),
        f"model.layers.{n}.eh_proj.weight": 0.05 * torch.randn(h, 2 * h).to(dtype),
        f"model.layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h).to(dtype),
        f"model.layers.{n}.embed_tokens.weight": 0.05 * torch.randn(config.vocab_size, h).to(dtype),
        f"model.layers.{n}.shared_head.head.weight": 0.05 * torch.randn(config.vocab_size, h).to(dtype),
    }
    mtp = {k: v.contiguous() for k, v in mtp.items()}
    save_file(mtp, path / "model-mtp.safetensors", metadata={"format": "pt"})
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # one file: write the index that now names two
        index = {"metadata": {}, "weight_map": {k: files[0].name for k in tensors}}
    index["weight_map"] |= {k: "model-mtp.safetensors" for k in mtp}
    index_path.write_text(json.dumps(index, indent=1))
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


# FP8 block DeepSeek-V3 at the smallest sizes whose cuts stay on 128-blocks at tp 4 / ep 2 and at
# tp 8 / attn-dp 2 / ep 8: 8 heads of nope 64 + rope 64, v 64 (q_b / kv_b 1024 rows, o_proj 512
# columns: attn_tp 4 gives 256 / 256 / 128), experts of 256, 4 shared experts (1024), dense 1024.
FP8_DEEPSEEK = dict(
    hidden_size=128, intermediate_size=1024, moe_intermediate_size=256, n_shared_experts=4, q_lora_rank=128,
    kv_lora_rank=64, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, num_hidden_layers=2,
)  # fmt: skip
FP8_SKIP = ("embed_tokens", "lm_head", "shared_head.head", "eh_proj", ".mlp.gate.", "norm")


def make_fp8_deepseek(path: Path, **overrides) -> Path:
    """A DeepSeek-V3 checkpoint (with its MTP layer) in DeepSeek's FP8 block format: every linear
    but the router, embeddings, heads and eh_proj stored as F8_E4M3 codes plus a weight_scale_inv
    per 128x128 block (random codes: split and check compare bytes, not numbers)."""
    import json

    from safetensors.torch import load_file, save_file

    from tpshard.quant.formats import QuantSpec, random_layer

    make_checkpoint(path, "deepseek_v3", mtp=True, **{**FP8_DEEPSEEK, **overrides})
    spec = QuantSpec(format="fp8_block", bits=8, block=(128, 128))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    for i, f in enumerate(sorted({*index["weight_map"].values()})):
        tensors = load_file(path / f)
        out = {}
        for name, t in tensors.items():
            if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in FP8_SKIP):
                packed, _ = random_layer(spec, t.shape[0], t.shape[1], seed=hash(name) % (1 << 31))
                prefix = name.removesuffix(".weight")
                out |= {f"{prefix}.{suffix}": v for suffix, v in packed.items()}
                index["weight_map"] |= {f"{prefix}.{suffix}": f for suffix in packed}
            else:
                out[name] = t
        save_file({k: v.contiguous() for k, v in out.items()}, path / f, metadata={"format": "pt"})
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


# A one-block vision tower for Qwen3_5MoeForConditionalGeneration (tiny; tpshard does not write it).
QWEN3_5_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, num_position_embeddings=16,
)  # fmt: skip


def make_qwen3_5_wrapper(path: Path, text: Path, **overrides) -> tuple[Path, Path]:
    """Qwen3_5MoeForConditionalGeneration at `path` (the published checkpoints' class: the text model under
    model.language_model., a vision tower under model.visual.) and Qwen3_5MoeForCausalLM at `text`, holding
    the same text weights: the text checkpoint is made first and the wrapper's language model loaded from it."""
    import transformers

    make_checkpoint(text, "qwen3_5_moe", **overrides)
    lm = transformers.Qwen3_5MoeForCausalLM.from_pretrained(text, dtype=torch.bfloat16)
    config = transformers.Qwen3_5MoeConfig(text_config=lm.config.to_dict(), vision_config=QWEN3_5_VISION)
    torch.manual_seed(1)
    model = transformers.Qwen3_5MoeForConditionalGeneration(config).to(torch.bfloat16)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.load_state_dict(lm.lm_head.state_dict())
    model.save_pretrained(path, max_shard_size="200KB")
    return path, text
