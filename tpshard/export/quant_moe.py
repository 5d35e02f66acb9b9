"""Quantized routed experts in vLLM exports: what each vLLM 0.33.0 FusedMoE quant method's
`create_weights` builds for a rank (paths under vllm/model_executor/layers/quantization/).

Every method stacks the rank's local experts in ascending id on dim 0 and fuses each expert's gate
and up matrices into `w13_<param>` ([gate; up]: FusedMoE's weight loader, fused_moe/routed_experts.py
`_load_w13`, narrows w1 into the first half of the expert's rows and w3 into the second), down into
`w2_<param>`; scales, zero points and global scales are stacked alike. What differs per method
(`EXPERTS`, checkpoint suffix -> Param, tpshard.export.quant):

- N-major methods (fp8.py Fp8MoEMethod, compressed_tensors_moe_wna16.py, _w8a8_fp8.py, _w4a4_nvfp4.py):
  each expert's [gate; up] along its dim 0, the rank's slices as tpshard cuts them;
- K-major methods (auto_gptq.py AutoGPTQMoEMethod, auto_awq.py AutoAWQMoEMethod: `is_transposed`):
  each expert's gate and up side by side along its last dim (`axis` 2 of the stacked tensor);
- a per-tensor scale (NVFP4's weight/input global scales) is one value per slot: w13 [E, 2], w2 [E]
  (`_load_per_tensor_weight_scale`);
- a cast where the method creates float32 (W8A8-FP8 channel and block scales);
- compressed-tensors `w13/w2_weight_shape` [E, 2] in the model dtype (`torch.empty` under it): per
  expert the source's unsliced [N, K] of the last shard loaded (up_proj; `_load_single_value`), a
  constant;
- AutoGPTQMoEMethod's `w13_bias` [E, 2 I_r] / `w2_bias` [E, H], zeros in the model dtype, which it
  creates whether or not the checkpoint has biases (`ZERO_COMPANIONS`).

What vLLM builds with another method, or cannot load, is refused in one line (`refuse_experts`).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple

from tpshard.export.quant import Param, source_shape


class ExpertMethod(NamedTuple):
    vllm: str  # vLLM's FusedMoE method, for messages
    params: dict[str, Param]


_FP8 = {"weight": Param("weight"), "weight_scale": Param("weight_scale", dtype="F32")}
EXPERTS: dict[str, ExpertMethod] = {
    # fp8.py Fp8MoEMethod.create_weights: w13_weight F8 [E, 2 I_r, H], w13_weight_scale_inv F32 [E, 2 I_r/128, H/128]
    "fp8_block": ExpertMethod("Fp8MoEMethod", {"weight": Param("weight"), "weight_scale_inv": Param("weight_scale_inv", dtype="F32")}),
    # compressed_tensors_moe_wna16.py CompressedTensorsWNA16MoEMethod: w13_weight_packed I32 [E, 2 I_r, H/pack],
    # w13_weight_scale [E, 2 I_r, H/G] (model dtype), w13_weight_zero_point [E, 2 I_r/pack, H/G], w13_weight_shape [E, 2]
    "ct_int": ExpertMethod("CompressedTensorsWNA16MoEMethod", {
        "weight_packed": Param("weight_packed"), "weight_scale": Param("weight_scale"),
        "weight_zero_point": Param("weight_zero_point"), "weight_shape": Param("weight_shape", source_shape=True),
    }),  # fmt: skip
    # compressed_tensors_moe_w8a8_fp8.py CompressedTensorsW8A8Fp8MoEMethod: w13_weight F8 [E, 2 I_r, H],
    # channel: w13_weight_scale F32 [E, 2 I_r, 1], w2_weight_scale F32 [E, H, 1]; block: F32 [E, 2 I_r/bn, H/bk]
    "ct_fp8_channel": ExpertMethod("CompressedTensorsW8A8Fp8MoEMethod (channel)", _FP8),
    "ct_fp8_block": ExpertMethod("CompressedTensorsW8A8Fp8MoEMethod (block)", _FP8),
    # compressed_tensors_moe_w4a4_nvfp4.py CompressedTensorsW4A4Nvfp4MoEMethod: w13_weight_packed U8 [E, 2 I_r, H/2],
    # w13_weight_scale F8 [E, 2 I_r, H/16], w13_weight_global_scale / w13_input_global_scale F32 [E, 2], w2_*: [E]
    "ct_nvfp4": ExpertMethod("CompressedTensorsW4A4Nvfp4MoEMethod", {
        "weight_packed": Param("weight_packed"), "weight_scale": Param("weight_scale"),
        "weight_global_scale": Param("weight_global_scale", dtype="F32", slots=True),
        "input_global_scale": Param("input_global_scale", dtype="F32", slots=True),
    }),  # fmt: skip
    # auto_gptq.py AutoGPTQMoEMethod: w13_qweight [E, H/pack, 2 I_r], w13_scales [E, H/G, 2 I_r], w13_qzeros
    # [E, H/G, 2 I_r/pack], w2_* [E, I_r/.., H]; no g_idx without act-order (the checkpoint's is dropped)
    "gptq": ExpertMethod("AutoGPTQMoEMethod", {
        "qweight": Param("qweight", 1), "scales": Param("scales", 1), "qzeros": Param("qzeros", 1), "g_idx": Param(None),
    }),  # fmt: skip
    # auto_awq.py AutoAWQMoEMethod: w13_qweight [E, H, 2 I_r/8], w13_scales [E, H/G, 2 I_r], w13_qzeros [E, H/G, 2 I_r/8]
    "awq": ExpertMethod("AutoAWQMoEMethod", {"qweight": Param("qweight", 1), "qzeros": Param("qzeros", 1), "scales": Param("scales", 1)}),
}

# fmt -> (the parameter they ride with, the suffix of the zeros vLLM creates beside it)
ZERO_COMPANIONS = {"gptq": ("qweight", "bias")}

_MLA = re.compile(r".*\.self_attn\..*")


def expert_param(piece_engine: str, suffix: str, fmt: str) -> tuple[str, Param] | None:
    """(vLLM key, Param) of a routed expert's checkpoint tensor `<module>.<suffix>` whose `.weight`
    stacks into `piece_engine` (`…w13_weight` / `…w2_weight`); None when the method has no such
    tensor; ("", Param(None)) for a tensor vLLM has no parameter for (dropped)."""
    method = EXPERTS.get(fmt)
    param = method.params.get(suffix) if method else None
    if param is None or not piece_engine.endswith("_weight"):
        return None
    if not param.name:
        return "", param
    return piece_engine.removesuffix("weight") + param.name, param


def refuse_experts(plan, table) -> str | None:
    """Why vLLM 0.33.0 cannot load this MoE / MLA checkpoint's quantized tensors as an export, in one
    line; None when it can. Routed experts: a method of `EXPERTS`, the one vLLM picks for the
    config; MLA attention: FP8 block only (its fused_qkv_a_proj / mla_attn names); the rest are
    dense linears (tpshard.export.quant.METHODS, refused there)."""
    from tpshard.export.names import NameMap

    names = NameMap(table, plan.model.q_lora_rank)
    mla = bool(table.q_lora or table.drop_mtp)
    experts: dict[str, dict] = {}
    for module, spec in plan.quant_layers.items():
        piece = names.piece(module + ".weight")
        fmt = spec.get("format", "?")
        if piece is not None and piece.stacked:
            experts.setdefault(fmt, spec)
        elif mla and _MLA.fullmatch(module) and fmt != "fp8_block":
            return f"{module} is {fmt}: tpshard maps MLA attention for vLLM in FP8 block format only; serve the HF checkpoint with vLLM's own loader"
    for fmt, spec in sorted(experts.items()):
        why = _refuse_expert_format(plan, fmt, spec)
        if why:
            return why
    return None


def _refuse_expert_format(plan, fmt: str, spec: dict) -> str | None:
    if fmt == "ct_fp8_tensor":
        return (
            "compressed-tensors W8A8-FP8 per-tensor experts: vLLM's CompressedTensorsW8A8Fp8MoEMethod keeps one input"
            " scale for gate and up (w13_input_scale [E]); not mapped for a vLLM export; serve the HF checkpoint"
        )
    if fmt not in EXPERTS:
        return f"routed experts in {fmt}: no vLLM 0.33.0 FusedMoE parameter layout mapped for it; serve the HF checkpoint with vLLM's own loader"
    bits, group = spec.get("bits", 4), spec.get("group_size", -1)
    if fmt == "ct_int" and bits not in (4, 8):
        return (
            f"compressed-tensors {bits}-bit experts: their CompressedTensorsWNA16MoEMethod layout (a pack word not a"
            " multiple of the bits) is not mapped for a vLLM export (4- and 8-bit are); serve the HF checkpoint"
        )
    if fmt == "awq" and bits != 4:
        return f'AWQ {bits}-bit experts: vLLM 0.33.0 refuses them (auto_awq.py AutoAWQMoEMethod: "only supports 4bit now")'
    if fmt in ("gptq", "awq"):
        hidden, inter = plan.model.hidden_size, plan.model.moe_intermediate_size // plan.topology.moe_tp
        if not (hidden % 128 == 0 and group in (-1, 32, 64, 128) and (group <= 0 or inter % group == 0)):
            return (
                f"{fmt.upper()} experts of hidden {hidden}, {inter} intermediate per rank, group {group}: vLLM 0.33.0 builds"
                " them with MoeWNA16Method (utils/marlin_utils.py check_moe_marlin_supports_config fails), whose weight"
                " loader repacks the codes (moe_wna16.py); not mapped for a vLLM export; serve the HF checkpoint"
            )
    return None


def stacked_tensors(engine: str, param: Param, by_expert: dict, model_dtype: str) -> list[tuple]:
    """The engine tensors of one stacked quantized expert parameter, as tpshard.export.layout's
    EngineTensor fields (name, dtype, shape, parts, value, axis): `by_expert` maps each local expert
    to its slot Parts ([gate, up] or [down]); the parameter, plus the zeros vLLM creates beside it
    (ZERO_COMPANIONS). ValueError: pieces that do not stack."""
    groups = [by_expert[e] for e in sorted(by_expert)]
    fmt = groups[0][0].tensor.quant
    count, first = len(groups[0]), groups[0][0]
    parts = tuple(p for g in groups for p in g)
    if param.source_shape:  # per expert the source's [N, K] of its last slot, in the model dtype
        values = [v for g in groups for v in source_shape(g[-1])]
        _exact(engine, values, model_dtype)
        return [(engine, model_dtype, (len(groups), len(values) // len(groups)), (), tuple(values), 0)]
    if any(p.dtype != first.dtype for p in parts):
        raise ValueError(f"{engine}: pieces of dtypes {sorted({p.dtype for p in parts})} do not stack")
    dtype = param.dtype or first.dtype
    if param.slots:  # one value per slot: [E, 2] for w13, [E] for w2
        if any(math.prod(p.shape) != 1 for p in parts):
            raise ValueError(f"{engine}: per-tensor scales of shapes {sorted({p.shape for p in parts})}, not one value each")
        return [(engine, dtype, (len(groups), count) if count > 1 else (len(groups),), parts, None, 0)]
    if any(len(p.shape) != 2 or p.shape[1 - param.axis] != first.shape[1 - param.axis] for p in parts):
        raise ValueError(f"{engine}: pieces {[(p.name, list(p.shape)) for p in parts[:4]]} do not stack")
    if param.axis == 1:  # K-major: each expert's slots side by side along its last dim
        shape = (len(groups), first.shape[0], sum(p.shape[1] for p in groups[0]))
        widths = {sum(p.shape[1] for p in g) for g in groups}
        out = (engine, dtype, shape, parts, None, 2 if count > 1 else 0)
    else:
        shape = (len(groups), sum(p.shape[0] for p in groups[0]), first.shape[1])
        widths = {sum(p.shape[0] for p in g) for g in groups}
        out = (engine, dtype, shape, parts, None, 0)
    if len(widths) != 1:
        raise ValueError(f"{engine}: experts of {sorted(widths)} rows or columns do not stack")
    tensors = [out]
    rides, zeros = ZERO_COMPANIONS.get(fmt, (None, None))
    if rides and engine.endswith("_" + rides):
        tensors.append((engine.removesuffix(rides) + zeros, model_dtype, (shape[0], shape[-1]), (), 0.0, 0))
    return tensors


def _exact(engine: str, values: list[float], dtype: str) -> None:
    """vLLM stores weight_shape in the model dtype: refuse a size that dtype rounds (the export writes exact constants)."""
    from tpshard.export.quant import constant_array

    try:
        constant_array(dtype, tuple(values), (len(values),))
    except ValueError:
        raise ValueError(f"{engine}: the expert sizes {sorted(set(values))} are not exact in {dtype}, in which vLLM stores weight_shape") from None
