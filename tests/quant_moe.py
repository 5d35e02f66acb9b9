"""Tiny MoE checkpoints whose routed experts are quantized as the producing tools write them.

What this file is: `quantize_linears(folder, scheme)` rewrites a checkpoint saved by transformers
(tests/moe_configs.py, tests/checkpoints.py) so that every routed expert (or, with `experts_only`
False, every linear but the router, embeddings and lm_head) is stored in `scheme`, and writes the
`quantization_config` the tool writes. compressed-tensors schemes are packed by compressed-tensors'
own compressors (`PackedQuantizationCompressor`, `IntQuantizationCompressor`,
`FloatQuantizationCompressor`, `NVFP4PackedCompressor`), an implementation independent of tpshard's packers, and the expected float
weights come from its `decompress`; DeepSeek-style FP8 block (quant_method fp8, which no
compressed-tensors compressor writes) is packed by `tpshard.quant.formats.random_layer`. Returns
{module: expected float32 weight [N, K]}.

Schemes: `w4a16_g32` (Kimi-K2's release: pack-quantized INT4, group 32, symmetric, experts only; `w4a16_g128` the same with groups of 128),
`w4a16_g32_actorder` (the same with actorder "group": weight_g_idx, packed by tpshard), `w8a8_int8` (int-quantized, channel scales, dynamic per-token int8
activations), `w8a8_fp8` (float-quantized, FP8 channel scales, dynamic per-token FP8 activations:
llm-compressor's FP8_DYNAMIC), `nvfp4` (nvfp4-pack-quantized with input_global_scale), `fp8_block` (DeepSeek-V3 /
GLM-4.5-FP8 / Qwen3-FP8: quant_method fp8, weight_block_size [128, 128]); `gptq` and `awq` (4-bit,
group 32, the layouts auto-round's auto_gptq / auto_awq packing formats write; no config written).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# Kimi-K2's ignore list (experts only): attention, shared experts and dense MLPs stay bf16.
EXPERTS_ONLY_IGNORE = [
    "lm_head", "re:.*self_attn.*", "re:.*shared_expert.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
    "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$",
]  # fmt: skip
_EXPERT = re.compile(r".*\.experts\.\d+\.[^.]+\.weight$")
_NEVER = ("embed_tokens", "lm_head", "shared_head.head", "eh_proj", "norm")
_ROUTER = re.compile(r".*\.(mlp|block_sparse_moe)\.gate\.weight$|.*shared_expert_gate\.weight$")


def _args(**kw) -> dict:
    base = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32, dynamic=False, actorder=None)
    return {**base, **kw}


SCHEMES: dict[str, tuple[str, dict, dict | None]] = {
    # name: (compressed-tensors format, weights args, input_activations args)
    "w4a16_g32": ("pack-quantized", _args(), None),
    "w4a16_g128": ("pack-quantized", _args(group_size=128), None),  # dense Llama at tp 8 (docs/deploy.md)
    "w4a16_g32_actorder": ("pack-quantized", _args(actorder="group"), None),  # packed by tpshard (TPSHARD_PACKED)
    "w8a8_int8": (
        "int-quantized", _args(num_bits=8, strategy="channel", group_size=None),
        _args(num_bits=8, strategy="token", group_size=None, dynamic=True),
    ),
    # llm-compressor's FP8_DYNAMIC: float-quantized, channel scales, dynamic per-token FP8 activations
    "w8a8_fp8": (
        "float-quantized", _args(num_bits=8, type="float", strategy="channel", group_size=None),
        _args(num_bits=8, type="float", strategy="token", group_size=None, dynamic=True),
    ),
    "nvfp4": (
        "nvfp4-pack-quantized", _args(type="float", strategy="tensor_group", group_size=16),
        _args(type="float", strategy="tensor_group", group_size=16, dynamic="local"),
    ),
}  # fmt: skip


def _tpshard_packed() -> dict:
    from tpshard.quant.formats import QuantSpec

    return {
        "fp8_block": QuantSpec(format="fp8_block", bits=8),
        # compressed-tensors' compressor does not write act order's g_idx; tpshard's ct_int packer does
        "w4a16_g32_actorder": QuantSpec(format="ct_int", bits=4, group_size=32, desc_act=True),
        "gptq": QuantSpec(format="gptq", bits=4, group_size=32, sym=True),  # auto-round's auto_gptq layout
        "awq": QuantSpec(format="awq", bits=4, group_size=32, sym=False),  # auto-round's auto_awq layout
    }


# Packed by tpshard.quant.formats.random_layer (its packers are checked against compressed-tensors
# and the published loops in tests/test_quant_packing.py).
TPSHARD_PACKED = _tpshard_packed()


def _scheme(name: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    _, weights, acts = SCHEMES[name]
    return QuantizationScheme(
        targets=["Linear"], weights=QuantizationArgs(**weights), input_activations=QuantizationArgs(**acts) if acts else None
    )


def _compress(name: str, w: torch.Tensor, gen: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear through compressed-tensors' compressor: (on-disk tensors, expected float32 weight)."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor, IntQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor

    scheme = _scheme(name)
    w = w.float()
    n, k = w.shape
    if name in ("w4a16_g32", "w4a16_g128"):
        g = SCHEMES[name][1]["group_size"]
        scale = (w.reshape(n, k // g, g).abs().amax(-1) / 7 + 1e-4).to(torch.bfloat16)
        out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)
        ref = PackedQuantizationCompressor.decompress({**out, "weight_scale": out["weight_scale"].float()}, scheme)["weight"]
        return out, ref.float()
    if name == "w8a8_int8":
        scale = w.abs().amax(1, keepdim=True) / 127 + 1e-6
        out = IntQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme)
        return out, out["weight"].float() * out["weight_scale"].float()
    if name == "w8a8_fp8":
        scale = w.abs().amax(1, keepdim=True) / 448 + 1e-6
        out = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.bfloat16)}, scheme)
        return out, out["weight"].float() * out["weight_scale"].float()
    if name == "nvfp4":
        global_scale = torch.tensor([448.0 * 6.0]) / w.abs().amax()
        block = (w.reshape(n, k // 16, 16).abs().amax(-1) / 6 * global_scale).to(torch.float8_e4m3fn).float()
        state = {"weight": w, "weight_scale": block, "weight_global_scale": global_scale,
                 "input_global_scale": torch.rand(1, generator=gen) * 100 + 10}  # fmt: skip
        out = NVFP4PackedCompressor.compress(state, scheme)
        # compressed-tensors' unpacker, scaled in float32 (its decompress rounds to the model dtype)
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

        values = unpack_fp4_from_uint8(out["weight_packed"], n, k, dtype=torch.float32)
        scale = out["weight_scale"].float() / out["weight_global_scale"].float()
        return out, values * scale.repeat_interleave(16, 1)
    raise ValueError(name)


def ct_config(name: str, experts_only: bool) -> dict:
    fmt, weights, acts = SCHEMES[name]
    return {
        "quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
        "ignore": EXPERTS_ONLY_IGNORE if experts_only else ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                      "output_activations": None, "format": fmt}},
    }  # fmt: skip


def quantize_linears(path: Path, scheme: str, *, experts_only: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rewrite the checkpoint at `path` with its experts (or every linear) in `scheme`; see the module docstring."""
    gen = torch.Generator().manual_seed(seed)
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else None
    files = sorted(set(index["weight_map"].values())) if index else ["model.safetensors"]
    expected: dict[str, torch.Tensor] = {}
    for i, f in enumerate(files):
        out: dict[str, torch.Tensor] = {}
        for name, t in load_file(path / f).items():
            chosen = _EXPERT.fullmatch(name) if experts_only else (
                t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in _NEVER) and not _ROUTER.fullmatch(name)
            )  # fmt: skip
            if not chosen:
                out[name] = t
                continue
            module = name.removesuffix(".weight")
            if scheme in TPSHARD_PACKED:
                from tpshard.quant.formats import random_layer

                packed, ref = random_layer(TPSHARD_PACKED[scheme], *t.shape, seed=seed * 100003 + len(expected))
            else:
                packed, ref = _compress(scheme, t, gen)
            expected[module] = ref
            if index:
                del index["weight_map"][name]  # int8 and FP8 keep the name for their codes
            for suffix, v in packed.items():
                out[f"{module}.{suffix}"] = v.contiguous()
                if index:
                    index["weight_map"][f"{module}.{suffix}"] = f
        save_file(out, path / f, metadata={"format": "pt"})
    if index:
        index_path.write_text(json.dumps(index, indent=1))
    config = json.loads((path / "config.json").read_text())
    if scheme in ("gptq", "awq"):
        return expected  # the caller writes the config (auto-round's, which packs in these layouts)
    if scheme == "fp8_block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}  # fmt: skip
        if experts_only:
            config["quantization_config"]["modules_to_not_convert"] = ["self_attn", "shared_expert", "mlp.gate_proj",
                                                                        "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    else:
        config["quantization_config"] = ct_config(scheme, experts_only)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return expected
