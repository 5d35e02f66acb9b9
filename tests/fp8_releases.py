"""Tiny checkpoints of the newer families in their FP8 releases, quantized here with plain torch.

What this file is: `fp8_block(w)` quantizes one [N, K] weight to 128 x 128 blocks as the releases'
producers do (each block's amax / 448 the scale, zero padding to whole blocks, codes e4m3; written
from the format's definition, not with tpshard's quantizer), and `quantize_release(folder, release)`
rewrites a checkpoint saved by transformers so that the modules the release quantizes are stored
as `<module>.weight` (F8_E4M3) + `<module>.weight_scale_inv`, with the release's quantization_config.
Returns {module: the float32 weight the codes and scales stand for}.

Releases (config.json's quantization_config as published; which modules stay bf16):
- `minimax_m2` (MiniMaxAI/MiniMax-M2): fp8, weight_block_size [128, 128], float32 scales,
  modules_to_not_convert ["gate", "e_score_correction_bias", "lm_head"]: attention q/k/v/o and the
  experts' w1/w2/w3 FP8; the router, norms (q_norm / k_norm too), embedding and lm_head bf16.
- `qwen3_next` (Qwen/Qwen3-Next-80B-A3B-*-FP8): fp8 block, bf16 scales; modules_to_not_convert
  lists per layer the linear attention's in_proj_ba and conv1d, the router mlp.gate and
  mlp.shared_expert_gate, and lm_head: in_proj_qkvz, out_proj, the full attention, the shared
  expert and the routed experts FP8.
- `qwen3_5` (Qwen/Qwen3.5-*-FP8, Qwen3.6-35B-A3B-FP8): fp8 block, bf16 scales; in_proj_a,
  in_proj_b, conv1d, the routers, norms, embedding and lm_head bf16; in_proj_qkv, in_proj_z,
  out_proj, attention, shared and routed experts FP8.
- Llama-4 Maverick's FP8 (`quantize_llama4_fbgemm`): quant_method fbgemm_fp8, per-channel FP8 on the
  routed (fused) and shared experts, attention bf16; SGLang 0.5.23 cannot load it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def fp8_block(w: torch.Tensor, block: int = 128, scale_dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes e4m3 [N, K], scale_inv [ceil(N/b), ceil(K/b)], the float32 weight they stand for)."""
    n, k = w.shape
    rn, rk = -(-n // block), -(-k // block)
    padded = torch.zeros(rn * block, rk * block, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(rn, block, rk, block)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-8).to(scale_dtype)
    codes = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    dequant = (codes.float() * scale.float()[:, None, :, None]).reshape(rn * block, rk * block)[:n, :k]
    return codes.reshape(rn * block, rk * block)[:n, :k].contiguous(), scale, dequant


def _layers(n: int, *names: str, prefix: str = "model.") -> list[str]:
    return [f"{prefix}layers.{i}.{name}" for i in range(n) for name in names]


def release_config(release: str, num_layers: int, prefix: str = "model.") -> dict:
    base = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    if release == "minimax_m2":
        return {**base, "fmt": "float8_e4m3fn", "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    if release == "qwen3_next":
        skip = _layers(num_layers, "linear_attn.in_proj_ba", "linear_attn.conv1d", "mlp.gate", "mlp.shared_expert_gate")
        return {**base, "fmt": "e4m3", "modules_to_not_convert": ["lm_head", *skip]}
    if release == "qwen3_5":
        skip = _layers(num_layers, "linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.conv1d", "mlp.gate", "mlp.shared_expert_gate", prefix=prefix)
        wrapper = ["model.visual"] if prefix != "model." else []  # Qwen3_5MoeForConditionalGeneration: the vision tower bf16
        return {**base, "fmt": "e4m3", "modules_to_not_convert": ["lm_head", f"{prefix}embed_tokens", *skip, *wrapper]}
    raise ValueError(release)


# The modules each release stores in FP8 (every other tensor is saved as transformers wrote it).
QUANTIZED = {
    "minimax_m2": re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])"),
    "qwen3_next": re.compile(
        r"model\.layers\.\d+\.(linear_attn\.(in_proj_qkvz|out_proj)|self_attn\.[qkvo]_proj"
        r"|mlp\.shared_expert\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
    ),
    "qwen3_5": re.compile(  # the text class's names, or the multimodal wrapper's (model.language_model.)
        r"model\.(?:language_model\.)?layers\.\d+\.(linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|self_attn\.[qkvo]_proj"
        r"|mlp\.shared_expert\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)"
    ),
}
SCALE_DTYPE = {"minimax_m2": torch.float32, "qwen3_next": torch.bfloat16, "qwen3_5": torch.bfloat16}


def quantize_release(path: Path, release: str) -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint at `path` as `release` ships; see the module docstring."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    expected: dict[str, torch.Tensor] = {}
    for f in files:
        out: dict[str, torch.Tensor] = {}
        for name, t in load_file(path / f).items():
            module = name.removesuffix(".weight")
            if not (name.endswith(".weight") and QUANTIZED[release].fullmatch(module)):
                out[name] = t
                continue
            codes, scale, expected[module] = fp8_block(t, scale_dtype=SCALE_DTYPE[release])
            out[name], out[f"{module}.weight_scale_inv"] = codes, scale
            if index:
                index["weight_map"][f"{module}.weight_scale_inv"] = f
        save_file(out, path / f, metadata={"format": "pt"})
    if index:
        index_path.write_text(json.dumps(index, indent=1))
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)
    prefix = "model.language_model." if "text_config" in config else "model."
    config["quantization_config"] = release_config(release, text["num_hidden_layers"], prefix)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return expected


def fp8_rows(w: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel FP8 (fbgemm's quantize_fp8_per_row): one float32 scale per row, the amax over `dim` / 448."""
    scale = (w.float().abs().amax(dim=dim, keepdim=True) / FP8_MAX).clamp(min=1e-8)
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_llama4_fbgemm(path: Path) -> None:
    """Rewrite a Llama-4 checkpoint (tests/llama4_fixtures.py) as Meta's Maverick FP8 release ships it
    (quant_method fbgemm_fp8): the fused routed experts per-channel FP8 with `experts.gate_up_proj_scale`
    [E, 1, 2I] and `experts.down_proj_scale` [E, H, 1] (transformers' FbgemmFp8Llama4TextExperts), the
    shared expert's and dense MLPs' linears FP8 with `weight_scale` [N, 1]; attention, router, norms,
    embedding and lm_head bf16 (modules_to_not_convert)."""
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for f in sorted(set(index["weight_map"].values())):
        out: dict[str, torch.Tensor] = {}
        for name, t in load_file(path / f).items():
            if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                out[name], out[f"{name}_scale"] = fp8_rows(t, dim=1)  # a scale per output channel of each expert
                out[f"{name}_scale"] = out[f"{name}_scale"] if name.endswith("gate_up_proj") else out[f"{name}_scale"].transpose(1, 2).contiguous()
                index["weight_map"][f"{name}_scale"] = f
            elif re.search(r"\.feed_forward\.(shared_expert\.)?(gate|up|down)_proj\.weight$", name):
                module = name.removesuffix(".weight")
                out[name], out[f"{module}.weight_scale"] = fp8_rows(t)
                index["weight_map"][f"{module}.weight_scale"] = f
            else:
                out[name] = t
        save_file({k: v.contiguous() for k, v in out.items()}, path / f, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=1))
    config = json.loads((path / "config.json").read_text())
    n = config["text_config"]["num_hidden_layers"]
    skip = [f"language_model.model.layers.{i}.self_attn" for i in range(n)] + [f"language_model.model.layers.{i}.feed_forward.router" for i in range(n)]
    config["quantization_config"] = {
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
        "modules_to_not_convert": [*skip, "language_model.lm_head", "vision_model", "multi_modal_projector"],
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config, indent=1))
