"""Tiny configs of the MoE and MLA architectures, and real checkpoints of them saved by transformers.

Shapes chosen so that every topology of the tests cuts something: 8 routed experts (EP 1, 2, 4, 8),
expert intermediate 32 (MoE-TP 1, 2, 4), 8 attention heads, DeepSeek grouped routing (4 groups,
2 chosen) and one dense first layer, a Qwen2-MoE shared expert with its gate.
"""

from __future__ import annotations

from pathlib import Path

import torch

COMMON = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, vocab_size=250, max_position_embeddings=128, rms_norm_eps=1e-6)

CONFIGS: dict[str, dict] = {
    "deepseek_v3": dict(
        COMMON, num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=8,
        n_shared_experts=1, n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, routed_scaling_factor=2.5, norm_topk_prob=True,
    ),
    "qwen3_moe": dict(
        COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
    ),
    "mixtral": dict(COMMON, intermediate_size=32, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2),
}  # fmt: skip

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)


def hf_classes(kind: str):
    import transformers

    return {
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[kind]


def hf_config(kind: str, **overrides):
    config_cls, _ = hf_classes(kind)
    return config_cls(**{**CONFIGS[kind], **overrides})


def randomize(module: torch.nn.Module, seed: int) -> None:
    """Random init leaves norms at 1, biases and the correction bias at 0: make every number matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            r = torch.randn(p.shape, generator=g, dtype=torch.float64)
            if p.dim() == 1:
                p.copy_(r * 0.1 + (1.0 if "norm" in name else 0.0))
            else:
                p.copy_(r / p.shape[-1] ** 0.5)


def make_moe_checkpoint(path: Path, kind: str, *, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a randomly initialised tiny `kind` model (deepseek_v3, qwen3_moe, qwen2_moe, mixtral)."""
    _, model_cls = hf_classes(kind)
    torch.manual_seed(seed)
    model = model_cls(hf_config(kind, **overrides))
    randomize(model, seed)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(torch.bfloat16).save_pretrained(path, **kwargs)
    return path


# DeepSeek-V3 as it ships (FP8 block 128 x 128), scaled down so that every cut of tp 2 is whole
# blocks: q_b rows 4 heads x 192 / 2, kv_b rows 4 x 256 / 2, o_proj columns 4 x 128 / 2, dense
# intermediate 512 / 2, expert intermediate 256 / moe_tp 2, shared expert 256 / 2.
FP8_DEEPSEEK = dict(
    hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=250,
    intermediate_size=512, moe_intermediate_size=256, n_shared_experts=1, n_routed_experts=4, n_group=2,
    topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128,
    qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=128,
)  # fmt: skip
FP8_BLOCK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


# Qwen3-MoE and Mixtral as their FP8 releases ship (Qwen3-30B-A3B-FP8: block 128 x 128), scaled
# down so that every cut of tp 2 (and ep 2) is whole blocks.
FP8_MOE = {
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_experts=4),
    "mixtral": dict(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=128, num_local_experts=4),
}  # fmt: skip


def make_fp8_deepseek(path: Path, *, seed: int = 0) -> Path:
    """A tiny DeepSeek-V3 checkpoint with every linear but the router and lm_head in FP8 block format
    (random codes and scales, tpshard.quant.formats.random_layer), as DeepSeek-V3 ships."""
    return make_fp8_moe(path, "deepseek_v3", seed=seed, **FP8_DEEPSEEK)


def make_fp8_moe(path: Path, kind: str, *, seed: int = 0, **overrides) -> Path:
    """A tiny MoE checkpoint of `kind` with every linear but the router, embeddings and lm_head in FP8
    block format (random codes and scales, tpshard.quant.formats.random_layer)."""
    import json

    from safetensors.torch import load_file, save_file

    from tpshard.quant.formats import QuantSpec, random_layer

    make_moe_checkpoint(path, kind, seed=seed, **(overrides or FP8_MOE[kind]))
    spec = QuantSpec(format="fp8_block", bits=8, block=(128, 128))
    tensors = load_file(path / "model.safetensors")
    out = {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        module = name.rsplit(".", 1)[0]
        router = module.endswith("mlp.gate") or module.endswith("block_sparse_moe.gate")
        linear = t.dim() == 2 and "embed_tokens" not in name and not name.startswith("lm_head") and not router
        if not linear:
            out[name] = t
            continue
        packed, _ = random_layer(spec, t.shape[0], t.shape[1], seed=seed * 10000 + i, scale_dtype=torch.float32)
        out.update({f"{module}.{suffix}": v for suffix, v in packed.items()})
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(FP8_BLOCK)
    routers = sorted({n.rsplit(".", 1)[0] for n in out if n.endswith(".gate.weight") and ".experts." not in n})
    if kind != "deepseek_v3":  # vLLM builds these routers with the quant config: an unquantized one is listed, as the releases do
        config["quantization_config"]["modules_to_not_convert"] = routers
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def add_mtp_layer(path: Path, *, seed: int = 7) -> Path:
    """Append DeepSeek-V3's MTP module as layer num_hidden_layers, as the released checkpoints carry it
    (transformers neither saves nor runs it): a MoE decoder layer (a copy of the last layer's tensors
    with new values) plus enorm, hnorm, eh_proj [H, 2H], shared_head.norm, and its own embed_tokens
    and shared_head.head. Written to its own file and added to the index."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((path / "config.json").read_text())
    n, h, v = config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]
    index_path = path / "model.safetensors.index.json"
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:
        with safe_open(path / "model.safetensors", "pt") as f:
            index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in f.keys()}}
    g = torch.Generator().manual_seed(seed)
    last, mtp = f"model.layers.{n - 1}.", f"model.layers.{n}."
    tensors = {}
    for name, file in index["weight_map"].items():
        if name.startswith(last):
            with safe_open(path / file, "pt") as f:
                t = f.get_tensor(name)
            tensors[mtp + name[len(last):]] = (torch.randn(t.shape, generator=g) * t.float().std() + t.float().mean()).to(t.dtype)
    dt = next(iter(tensors.values())).dtype
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{mtp}{norm}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).to(dt)
    tensors[f"{mtp}eh_proj.weight"] = (torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5).to(dt)
    tensors[f"{mtp}embed_tokens.weight"] = torch.randn(v, h, generator=g).to(dt)
    tensors[f"{mtp}shared_head.head.weight"] = (torch.randn(v, h, generator=g) / h**0.5).to(dt)
    save_file(tensors, path / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"].update({k: "model-mtp.safetensors" for k in tensors})
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
