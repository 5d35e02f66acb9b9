"""The dequantized source that `verify --model` runs transformers' forward on, for quantized outputs.

The ranks run the TP decoder on their own quantized shards, dequantized per rank by tpshard's
`tpshard.quant.formats.dequantize` (the code under test). The reference must not be that code: rank
0 dequantizes the *source* checkpoint's tensors with dequantizers of other projects, in float32,
and hands transformers a dense float32 state dict (`from_pretrained(None, config=..., state_dict=...)`,
so transformers' own weight conversions fuse the experts as they do for a dense checkpoint):

- FP8 block (`weight` + `weight_scale_inv`): transformers' `Fp8Dequantize` (the op its FP8 loader
  runs with `dequantize=True`), in float32;
- compressed-tensors (`pack-quantized`, `int-quantized`, `float-quantized`, `nvfp4-pack-quantized`):
  compressed-tensors' own compressors' `decompress`, with the scheme compressed-tensors matches to
  the module (`is_match` against the config groups' targets and ignore), scales promoted to float32
  first (its decompress computes in the scale's dtype; the ranks dequantize in float32);
- MXFP4 experts (gpt-oss `*_blocks` / `*_scales`): transformers' `convert_moe_packed_tensors`, in float32.

Which tensors are quantized is read from the tensors themselves (a module with codes and a scale),
not from tpshard's plan. Other formats (GPTQ, AWQ, Marlin, AutoFP8 per-tensor, DeepSeek-V4's) have
no such dequantizer here and stay refused at model level (`unsupported_reason`); layer level covers them.
"""

from __future__ import annotations

import torch

from tpshard.errors import TpshardError

# tpshard's format -> the dequantizer of the source for transformers' forward (docs/verify.md).
INDEPENDENT = {
    "fp8_block": "transformers' Fp8Dequantize",
    "ct_int": "compressed-tensors' PackedQuantizationCompressor",
    "ct_int8_channel": "compressed-tensors' IntQuantizationCompressor",
    "ct_int8_tensor": "compressed-tensors' IntQuantizationCompressor",
    "ct_fp8_tensor": "compressed-tensors' FloatQuantizationCompressor",
    "ct_fp8_channel": "compressed-tensors' FloatQuantizationCompressor",
    "ct_fp8_block": "compressed-tensors' FloatQuantizationCompressor",
    "ct_nvfp4": "compressed-tensors' NVFP4PackedCompressor",
}
MXFP4 = "transformers' convert_moe_packed_tensors"
_CT_TENSORS = ("weight_packed", "weight", "weight_scale", "weight_zero_point", "weight_global_scale", "weight_shape", "weight_g_idx")


def unsupported_reason(plan, config: dict) -> str | None:
    """Why --model cannot build an independent dequantized reference for this quantized output, or None."""
    formats = sorted({str(q.get("format")) for q in plan.quant_layers.values()})
    missing = [f for f in formats if f not in INDEPENDENT]
    if missing:
        return (
            f"model-level verify runs transformers on the source dequantized by another project's code, and has no"
            f" such dequantizer for {', '.join(missing)} checkpoints; layer-level verify covers them"
        )
    try:
        if any(f.startswith("ct_") for f in formats):
            _ct_config(config)
        if "fp8_block" in formats:
            _fp8_dequantizer()
        if plan.model.expert_block:
            _mxfp4_dequantizer()
    except ImportError as e:
        return f"model-level verify of a quantized output needs {e}"
    except ValueError as e:
        return f"model-level verify cannot read this checkpoint's quantization_config with compressed-tensors: {e}"
    return None


def dense_state_dict(ckpt, read) -> dict[str, torch.Tensor]:
    """{name: float32 tensor} of the source `ckpt` (tpshard.checkpoint.Checkpoint) with every quantized
    module dequantized; `read(name)` gives a tensor as the file holds it. Activation scales are dropped
    (transformers' dense forward has no activation quantization; layer level checks them)."""
    names = set(ckpt.tensors)
    quant = ckpt.config.get("quantization_config") or {}
    ct = _ct_config(ckpt.config) if quant.get("quant_method") == "compressed-tensors" else None
    out: dict[str, torch.Tensor] = {}
    done: set[str] = set()
    for name in sorted(names):
        if name in done:
            continue
        module, _, suffix = name.rpartition(".")
        if suffix == "weight_scale_inv" or (suffix == "weight" and f"{module}.weight_scale_inv" in names):
            pair = (f"{module}.weight", f"{module}.weight_scale_inv")
            out[f"{module}.weight"] = fp8_dequantize(read(pair[0]), read(pair[1]), quant.get("weight_block_size") or (128, 128))
            done.update(pair)
        elif ct is not None and suffix in _CT_TENSORS and f"{module}.weight_scale" in names:
            own = {f"{module}.{s}" for s in _CT_TENSORS} & names
            out[f"{module}.weight"] = _ct_decompress(ct, module, {n.rpartition(".")[2]: read(n) for n in own})
            done.update(own)
        elif suffix.endswith("_blocks") and f"{name[: -len('_blocks')]}_scales" in names:
            base = name[: -len("_blocks")]
            out[base] = _mxfp4_dequantizer()(read(name), read(f"{base}_scales"), dtype=torch.float32)
            done.update((name, f"{base}_scales"))
        elif suffix in ("input_scale", "input_global_scale") or (suffix.endswith("_scales") and f"{name[:-7]}_blocks" in names):
            continue  # activation scales; an MXFP4 scale is taken with its blocks
        else:
            t = read(name)
            out[name] = t.to(torch.float32) if t.is_floating_point() else t
    return out


def _fp8_dequantizer():
    """transformers' FP8 block dequantization (what `from_pretrained` runs with FineGrainedFP8Config(dequantize=True))."""
    try:
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize
    except ImportError:
        raise ImportError("transformers with integrations.finegrained_fp8.Fp8Dequantize (5.x)") from None
    return Fp8Dequantize(None)._dequantize_one


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block=None) -> torch.Tensor:
    """transformers' Fp8Dequantize of one weight with its block scales, float32.

    Without `block`, Fp8Dequantize reads the block size off the grid (N / scale rows), as it does for
    DeepSeek-V4's release (FP8 128 x 128, FP4 e2m1 pairs 1 x 32, every dim whole blocks). That is the
    checkpoint's block only where N and K are whole blocks: DeepSeek-V3's kv_a_proj_with_mqa (N 576 =
    4.5 blocks) raises, and a tiny N 192 over 2 scale rows would be read as 96-row blocks. So with
    `block` (bn, bk), one [N, K] weight with [ceil(N/bn), ceil(K/bk)] scales is zero-padded to whole
    blocks first (the padding is cut off after), which pins the block to the config's."""
    if block is None:
        return _fp8_dequantizer()(weight, scale, output_dtype=torch.float32)
    bn, bk = int(block[0]), int(block[1])
    n, k = weight.shape
    if tuple(scale.shape) != (-(-n // bn), -(-k // bk)):
        raise ValueError(f"an FP8 weight {list(weight.shape)} has scales {list(scale.shape)}, not one per {bn}x{bk} block")
    padded = torch.zeros(scale.shape[0] * bn, scale.shape[1] * bk, dtype=torch.float32)
    padded[:n, :k] = weight.to(torch.float32)  # e4m3 -> float32 is exact
    return _fp8_dequantizer()(padded, scale, output_dtype=torch.float32)[:n, :k].contiguous()


def _mxfp4_dequantizer():
    try:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    except ImportError:
        raise ImportError("transformers with integrations.mxfp4.convert_moe_packed_tensors") from None
    return convert_moe_packed_tensors


def _ct_config(config: dict):
    """compressed-tensors' own reading of the checkpoint's quantization_config (ValueError if it refuses it)."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise ImportError("compressed-tensors (pip install compressed-tensors)") from None
    try:
        return QuantizationConfig.model_validate(config.get("quantization_config") or {})
    except Exception as e:  # noqa: BLE001 - pydantic's ValidationError: its first "Value error" line
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        raise ValueError(next((x for x in lines if x.startswith("Value error")), lines[0] if lines else type(e).__name__)) from None


def _ct_decompress(ct, module: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One module's weight, float32, by the compressor compressed-tensors registers for its scheme's format."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.utils.match import is_match

    probe = torch.nn.Linear(1, 1, device="meta")  # the modules a checkpoint's linear tensors come from
    groups = [g for g in ct.config_groups.values() if is_match(module, probe, g.targets, ct.ignore or ())]
    if len(groups) != 1:
        raise ValueError(f"{module}: compressed-tensors matches {len(groups)} config groups to it")
    scheme = groups[0]
    fmt = scheme.format or ct.format
    state = {k: (v.to(torch.float32) if k in ("weight_scale", "weight_global_scale") else v) for k, v in tensors.items()}
    if fmt == "nvfp4-pack-quantized":  # its decompress unpacks to bf16 and rounds to it: the same steps in float32
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
        from compressed_tensors.quantization.lifecycle.forward import dequantize

        packed = state["weight_packed"]
        values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
        return dequantize(
            x_q=values, scale=state["weight_scale"], args=scheme.weights, global_scale=state.get("weight_global_scale"),
            dtype=torch.float32,
        )  # fmt: skip
    compressor = BaseCompressor.get_value_from_registry(fmt)
    return compressor.decompress(state, scheme)["weight"].to(torch.float32)


def dense_model(source: str, **kw):
    """transformers' model of the quantized checkpoint at `source`, built dense in float32 from
    `dense_state_dict` (its config without quantization_config, so no quantizer of transformers runs)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from tpshard.verify.layers_check import SourceTensors

    src = SourceTensors(source)
    config = AutoConfig.from_pretrained(source)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = dense_state_dict(src.ckpt, src.raw)
    # The class AutoModelForCausalLM picks for the config (the Auto class needs a folder to load from).
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    model, info = cls.from_pretrained(None, config=config, state_dict=state, output_loading_info=True, **kw)
    # A weight transformers did not get from the dense state dict would be random: never a reference.
    lost = sorted(info.get("missing_keys") or []) + sorted(str(k) for k in info.get("mismatched_keys") or [])
    if lost:
        raise TpshardError(f"{source}: transformers did not load {len(lost)} dequantized weights, first {lost[0]}")
    return model


def weights_only(layers: dict) -> None:
    """Turn off static activation quantization in the ranks' built layers (layer -> Built): transformers'
    dense forward of the dequantized source has none, so --model compares the weights; the input
    scales are checked at layer level (docs/verify.md, "Every byte")."""
    for built in layers.values():
        for m in built.module.modules():
            if getattr(m, "input_scales", None):
                m.input_scales = {}
