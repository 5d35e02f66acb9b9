"""A tiny DeepSeek-V4 checkpoint in the release's native names and config (what SGLang's
deepseek_v4.py reads), built from transformers' own random-init DeepseekV4ForCausalLM.

transformers keeps V4 under its own names (model.layers.N.self_attn.q_a_proj, fused expert tensors
[E, 2I, H]) and maps the release's names to them on load (conversion_mapping.py "deepseek_v4");
`NATIVE` is that mapping written backwards, tensor by tensor, and `save_native` splits the fused
experts back into the release's experts.E.w1/w3/w2. The config carries what SGLang reads and
transformers' save drops: compress_ratios and num_hash_layers.

Layers: 0 sliding window (hash-routed), 1 ratio 4 (compressor + indexer), 2 ratio 128, 3 ratio 4;
8 heads of 32, o_groups 4, 8 experts (top 2) + 1 shared, hc_mult 2; an MTP layer mtp.0 unless
mtp=False. bf16 weights; fp32 sinks, mHC tensors, compressor ape, router and its bias (as the
release keeps them); tid2eid int32 global expert ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

RATIOS = [0, 4, 128, 4]
TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
HASHED = 1

CONFIG = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, o_groups=4, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=4,
    sliding_window=8, hc_mult=2, partial_rotary_factor=0.25, num_nextn_predict_layers=1,
    swiglu_limit=0.5,  # the release's 10 never clamps random tiny weights: 0.5 makes verify --model see the clamp
)  # fmt: skip

# transformers' name -> the release's (applied in order, on the name without its "model." prefix)
NATIVE = (
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"),
    (r"\.self_attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.self_attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.self_attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.self_attn\.kv_proj\.", ".attn.wkv."),
    (r"\.self_attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.self_attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.self_attn\.", ".attn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.mlp\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.mlp\.shared_experts\.gate_proj\.", ".ffn.shared_experts.w1."),
    (r"\.mlp\.shared_experts\.up_proj\.", ".ffn.shared_experts.w3."),
    (r"\.mlp\.shared_experts\.down_proj\.", ".ffn.shared_experts.w2."),
    (r"\.mlp\.", ".ffn."),
)
FP32 = re.compile(r"attn_sink$|(^|\.)hc_|\.ape$|\.gate\.(weight|bias)$")


def native_name(name: str) -> str:
    name = name.removeprefix("model.")
    for pattern, repl in NATIVE:
        name = re.sub(pattern, repl, name)
    return name


def transformers_model(**overrides):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = {**CONFIG, **overrides}
    n = cfg["num_hidden_layers"]
    ratios = (RATIOS * n)[:n]
    config = DeepseekV4Config(
        **cfg, layer_types=[TYPES[r] for r in ratios], mlp_layer_types=["hash_moe"] * HASHED + ["moe"] * (n - HASHED)
    )
    torch.manual_seed(0)
    return DeepseekV4ForCausalLM(config).eval(), cfg, ratios


def native_tensors(model, cfg: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach()
        if t.dtype.is_floating_point:  # random init leaves some zeros / ones: give every tensor content
            t = torch.randn(t.shape, generator=g) * 0.05 + t
        new = native_name(name)
        if new.endswith(".ffn.experts.gate_up_proj"):  # [E, 2I, H]: w1 the first I rows, w3 the next
            i = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[new.replace("gate_up_proj", f"{e}.w1.weight")] = t[e, :i].clone()
                out[new.replace("gate_up_proj", f"{e}.w3.weight")] = t[e, i:].clone()
        elif new.endswith(".ffn.experts.down_proj"):
            for e in range(t.shape[0]):
                out[new.replace("down_proj", f"{e}.w2.weight")] = t[e].clone()
        elif new.endswith(".gate.tid2eid"):
            out[new] = torch.randint(0, cfg["n_routed_experts"], t.shape, generator=g, dtype=torch.int32)
        else:
            out[new] = t.clone()
    return {k: v if not v.dtype.is_floating_point else v.to(torch.float32 if FP32.search(k) else torch.bfloat16) for k, v in out.items()}


def mtp_tensors(tensors: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """mtp.0: a sliding-window decoder (layer 0's attention, layer 1's routed MoE with its bias), its
    e_proj / h_proj / enorm / hnorm / norm / hc_head (deepseek_v4_nextn.py DeepseekV4ModelNextN)."""
    g = torch.Generator().manual_seed(2)
    out = {}
    for name, t in tensors.items():
        if (name.startswith("layers.0.") and ".ffn." not in name) or name.startswith("layers.1.ffn."):
            out["mtp.0." + name.split(".", 2)[2]] = (t.float() * 1.5).to(t.dtype) if t.dtype.is_floating_point else t
    h = cfg["hidden_size"]
    for p in ("e_proj", "h_proj"):
        out[f"mtp.0.{p}.weight"] = (torch.randn(h, h, generator=g) * 0.05).bfloat16()
    for p in ("enorm", "hnorm", "norm"):
        out[f"mtp.0.{p}.weight"] = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    for p in ("fn", "base", "scale"):
        out[f"mtp.0.hc_head_{p}"] = torch.randn(tensors[f"hc_head_{p}"].shape, generator=g)
    return out


def save_native(path: Path, tensors: dict[str, torch.Tensor], config: dict, files: int = 3) -> Path:
    """Tensors over `files` safetensors files with an index, and config.json."""
    path.mkdir(parents=True, exist_ok=True)
    names = list(tensors)
    weight_map = {}
    for f in range(files):
        part = names[f::files]
        fname = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, str(path / fname))
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def make_v4(path: Path, *, mtp: bool = True, **overrides) -> Path:
    """The tiny V4 checkpoint in native names (see the module docstring)."""
    model, cfg, ratios = transformers_model(**overrides)
    tensors = native_tensors(model, cfg)
    if mtp:
        tensors |= mtp_tensors(tensors, cfg)
    config = {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **cfg,
        "compress_ratios": ratios, "num_hash_layers": HASHED, "qk_rope_head_dim": int(cfg["head_dim"] * cfg["partial_rotary_factor"]),
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    if not mtp:
        config["num_nextn_predict_layers"] = 0
    return save_native(path, tensors, config)


def save_transformers(path: Path) -> Path:
    """The same model as transformers' own save_pretrained writes it (its spelling, its config)."""
    model, _, _ = transformers_model()
    model.to(torch.bfloat16).save_pretrained(path)
    return path
