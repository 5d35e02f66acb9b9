"""Builders of tiny quantized Llama checkpoints in real on-disk formats, for planner/writer/check tests.

What this file is: `write_quant_checkpoint(path, spec)` writes config.json (a LlamaConfig with a real
`quantization_config` for the format) and safetensors weights where every q/k/v/o/gate/up/down
projection is packed with `tpshard.quant.formats.random_layer`; embeddings, norms and lm_head stay
unquantized. It returns the expected float32 weight [N, K] of every quantized linear, computed from
the logical codes, so a test can compare any rank's dequantized shard against it.

What it is not: a model that produces sensible text (codes are random), or a calibration tool.
The shape (hidden 256, intermediate 512, 4 heads x 64, 2 kv heads) keeps every projection's N and K
multiples of 128, which every format here needs for tp 2 (Marlin N % 64, FP8 block 128).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tpshard.quant.formats import QuantSpec, random_layer


@dataclass(frozen=True)
class TinyLlama:
    hidden: int = 256  # K of q/k/v/gate/up, N of o/down
    intermediate: int = 512  # N of gate/up, K of down
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    layers: int = 2
    vocab: int = 300  # not a multiple of 64: exercises vocab padding

    def linears(self, layer: int) -> dict[str, tuple[int, int]]:
        """HF prefix -> (N, K) of each quantized projection of one decoder layer."""
        p = f"model.layers.{layer}"
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {
            f"{p}.self_attn.q_proj": (q, h),
            f"{p}.self_attn.k_proj": (kv, h),
            f"{p}.self_attn.v_proj": (kv, h),
            f"{p}.self_attn.o_proj": (h, q),
            f"{p}.mlp.gate_proj": (i, h),
            f"{p}.mlp.up_proj": (i, h),
            f"{p}.mlp.down_proj": (h, i),
        }


TINY = TinyLlama()

# Specs a test can parametrize over: one per format family, as the tools write them by default.
DEFAULT_SPECS: dict[str, QuantSpec] = {
    "gptq": QuantSpec(format="gptq", bits=4, group_size=128, desc_act=False, sym=True),
    "gptq_act_order": QuantSpec(format="gptq", bits=4, group_size=64, desc_act=True, sym=False),
    "gptq_v2_3bit": QuantSpec(format="gptq_v2", bits=3, group_size=128, sym=False),
    "gptq_8bit_channel": QuantSpec(format="gptq", bits=8, group_size=-1),
    "awq": QuantSpec(format="awq", bits=4, group_size=128, sym=False),
    "marlin": QuantSpec(format="marlin", bits=4, group_size=128),
    "fp8_block": QuantSpec(format="fp8_block", bits=8, block=(128, 128)),
    "fp8_tensor": QuantSpec(format="fp8_tensor", bits=8, static_input=True),
    "ct_w4a16": QuantSpec(format="ct_int", bits=4, group_size=128),
    "ct_w4a16_asym_actorder": QuantSpec(format="ct_int", bits=4, group_size=64, sym=False, desc_act=True),
    "ct_w3a16": QuantSpec(format="ct_int", bits=3, group_size=128),
    "ct_w8a16_channel": QuantSpec(format="ct_int", bits=8, group_size=-1),
    "ct_fp8": QuantSpec(format="ct_fp8_tensor", bits=8, static_input=True),
    "ct_fp8_dynamic": QuantSpec(format="ct_fp8_channel", bits=8),
    "ct_fp8_block": QuantSpec(format="ct_fp8_block", bits=8),
    "ct_nvfp4": QuantSpec(format="ct_nvfp4", bits=4, group_size=16, static_input=True),
    "ct_w8a8_int8": QuantSpec(format="ct_int8_channel", bits=8),  # dynamic per-token activations
    "ct_w8a8_int8_static": QuantSpec(format="ct_int8_tensor", bits=8, static_input=True),
}


def _ct_args(num_bits: int, type_: str, strategy: str, **kw) -> dict:
    """One compressed-tensors QuantizationArgs as model_dump() writes it."""
    args = {
        "num_bits": num_bits, "type": type_, "symmetric": True, "group_size": None, "strategy": strategy,
        "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": None, "zp_dtype": None,
        "observer": "minmax", "observer_kwargs": {},
    }  # fmt: skip
    args.update(kw)
    return args


def _ct_config(fmt: str, weights: dict, input_activations: dict | None) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": input_activations,
                "output_activations": None,
                "format": fmt,
            }
        },
    }


def quantization_config(spec: QuantSpec) -> dict:
    """The `quantization_config` entry of config.json that the producing tool writes for `spec`."""
    f = spec.format
    if f in ("gptq", "gptq_v2", "marlin"):
        return {
            "quant_method": "gptq", "bits": spec.bits, "group_size": spec.group_size, "desc_act": spec.desc_act,
            "sym": spec.sym, "damp_percent": 0.01, "static_groups": False, "true_sequential": True,
            "checkpoint_format": {"gptq": "gptq", "gptq_v2": "gptq_v2", "marlin": "marlin"}[f],
            "format": {"gptq": "gptq", "gptq_v2": "gptq_v2", "marlin": "marlin"}[f],
            "lm_head": False,
        }  # fmt: skip
    if f == "awq":
        return {"quant_method": "awq", "zero_point": not spec.sym, "group_size": spec.group_size, "bits": 4,
                "version": "gemm", "modules_to_not_convert": None}  # fmt: skip
    if f == "fp8_block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(spec.block)}  # fmt: skip
    if f == "fp8_tensor":
        return {"quant_method": "fp8", "fmt": "e4m3",
                "activation_scheme": "static" if spec.static_input else "dynamic"}  # fmt: skip
    if f == "ct_int":
        channel = spec.group_size == -1
        weights = _ct_args(
            spec.bits, "int", "channel" if channel else "group", symmetric=spec.sym,
            group_size=None if channel else spec.group_size, actorder="group" if spec.desc_act else None,
        )  # fmt: skip
        return _ct_config("pack-quantized", weights, None)
    if f.startswith("ct_fp8_"):
        strategy = f.removeprefix("ct_fp8_")
        weights = _ct_args(8, "float", strategy,
                           block_structure=list(spec.block) if strategy == "block" else None)  # fmt: skip
        acts = _ct_args(8, "float", "tensor") if spec.static_input else \
            _ct_args(8, "float", "token", dynamic=True, observer=None)  # fmt: skip
        return _ct_config("float-quantized", weights, acts)
    if f.startswith("ct_int8_"):
        weights = _ct_args(8, "int", f.removeprefix("ct_int8_"))
        acts = _ct_args(8, "int", "tensor") if spec.static_input else _ct_args(8, "int", "token", dynamic=True, observer=None)
        return _ct_config("int-quantized", weights, acts)
    if f == "ct_nvfp4":
        weights = _ct_args(4, "float", "tensor_group", group_size=16, scale_dtype="torch.float8_e4m3fn",
                           zp_dtype="torch.float8_e4m3fn")  # fmt: skip
        acts = _ct_args(4, "float", "tensor_group", group_size=16, dynamic="local", observer="static_minmax",
                        scale_dtype="torch.float8_e4m3fn", zp_dtype="torch.float8_e4m3fn") \
            if spec.static_input else None  # fmt: skip
        return _ct_config("nvfp4-pack-quantized", weights, acts)
    raise ValueError(f"no quantization_config for {f!r}")


def _model_dtype(spec: QuantSpec) -> torch.dtype:
    """GPTQ/AWQ/Marlin tools export fp16; FP8 and compressed-tensors checkpoints are bf16."""
    return torch.float16 if spec.format in ("gptq", "gptq_v2", "awq", "marlin") else torch.bfloat16


def config_dict(spec: QuantSpec, shape: TinyLlama = TINY) -> dict:
    """A Llama config.json with the format's quantization_config."""
    dtype = _model_dtype(spec)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "num_hidden_layers": shape.layers,
        "vocab_size": shape.vocab,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "quantization_config": quantization_config(spec),
    }


def write_quant_checkpoint(
    path: str | Path, spec: QuantSpec, *, shape: TinyLlama = TINY, seed: int = 0, num_files: int = 1
) -> dict[str, torch.Tensor]:
    """Write a tiny quantized Llama checkpoint to `path`; return {linear prefix: expected weight [N, K]}.

    Args:
        path: output folder (created).
        spec: the format of every projection (lm_head, embeddings and norms stay unquantized).
        shape: model sizes.
        seed: codes/scales seed; each linear gets its own derived seed.
        num_files: > 1 writes model-0000i-of-0000n.safetensors plus model.safetensors.index.json.

    Example:
        >>> expected = write_quant_checkpoint(tmp_path / "gptq", DEFAULT_SPECS["gptq"])
        >>> expected["model.layers.0.self_attn.q_proj"].shape
        torch.Size([256, 256])
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    dtype = _model_dtype(spec)
    scale_dtype = torch.float16 if dtype == torch.float16 else torch.bfloat16
    h = shape.hidden
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": (torch.randn(shape.vocab, h, generator=gen) * 0.02).to(dtype),
        "model.norm.weight": torch.ones(h, dtype=dtype),
        "lm_head.weight": (torch.randn(shape.vocab, h, generator=gen) * 0.02).to(dtype),
    }
    expected: dict[str, torch.Tensor] = {}
    linear_seed = seed * 1000
    for layer in range(shape.layers):
        tensors[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(h, dtype=dtype)
        tensors[f"model.layers.{layer}.post_attention_layernorm.weight"] = torch.ones(h, dtype=dtype)
        for prefix, (n, k) in shape.linears(layer).items():
            linear_seed += 1
            packed, weight = random_layer(spec, n, k, seed=linear_seed, scale_dtype=scale_dtype)
            tensors.update({f"{prefix}.{suffix}": t for suffix, t in packed.items()})
            expected[prefix] = weight
    names = sorted(tensors)
    if num_files == 1:
        save_file({n: tensors[n] for n in names}, out / "model.safetensors", metadata={"format": "pt"})
    else:
        chunks = [names[i::num_files] for i in range(num_files)]
        weight_map, total = {}, 0
        for i, chunk in enumerate(chunks):
            fname = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
            save_file({n: tensors[n] for n in chunk}, out / fname, metadata={"format": "pt"})
            weight_map.update({n: fname for n in chunk})
            total += sum(tensors[n].numel() * tensors[n].element_size() for n in chunk)
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(config_dict(spec, shape), indent=2) + "\n")
    return expected
