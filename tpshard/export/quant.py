"""Quantized vLLM exports: what each vLLM 0.33.0 quant method's `create_weights` builds for a rank.

vLLM's `sharded_state` loader copies the files into freshly created parameters and only then runs
`process_weights_after_loading` (model_loader/base_loader.py), so a quantized export holds, per
rank, the parameters of the layer's quant method as `create_weights` makes them (paths below are
under vllm/model_executor/layers/quantization/). That is tpshard's per-rank split, renamed and
fused per slot, with these differences (`Param`):

- fused along dim 1 where the method's tensors are [K, N]-major (AWQ `qweight`, `qzeros`, `scales`);
- a per-tensor scale becomes one slot of a vector with a slot per fused matrix (`weight_scale`
  [3] for qkv_proj, [2] for gate_up_proj, [1] elsewhere: `PerTensorScaleParameter`);
- a scale cast where vLLM creates it as float32 (compressed-tensors W8A8 FP8 channel scales);
- compressed-tensors `weight_shape`: the source's unsliced [N, K] of the last shard loaded
  (v_proj / up_proj; vLLM's loader overwrites the parameter with each shard's whole value);
- the attention layer's parameters the method adds (`ATTENTION`): FP8's `Fp8KVCacheMethod`
  (kv_cache.py `BaseKVCacheMethod.create_weights`: q/k/v/prob_scale, 0-d, -1.0, built under the
  model dtype), compressed-tensors' `CompressedTensorsKVCacheMethod` (compressed_tensors.py:
  k/v/q_scale [1] float32 1.0, k/v/q_zero_point [1] zeros in the model dtype).

What vLLM cannot load, or tpshard has not mapped, is refused here in one line (`refuse_method`).
Not here: which HF tensor is which slot (the architectures' name tables), the files (writer.py).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Param(NamedTuple):
    """What vLLM's parameter is made of a checkpoint tensor of one suffix."""

    name: str | None  # the parameter's suffix in vLLM; None: vLLM has no such parameter (dropped)
    axis: int = 0  # the dim along which the fused matrices' shards are concatenated
    dtype: str | None = None  # vLLM's dtype where it is not the checkpoint's (cast on export)
    slots: bool = False  # a per-tensor scale: one slot per fused matrix, shape [count]
    source_shape: bool = False  # CT weight_shape: the source's [N, K] of the last slot, as a constant


class AttnParam(NamedTuple):
    """A parameter the quant method adds to every attention layer (`{attn}.<name>`)."""

    name: str
    dtype: str | None  # None: the model dtype (torch's default dtype while vLLM builds the model)
    shape: tuple[int, ...]
    value: float


class Method(NamedTuple):
    vllm: str  # vLLM's linear method, for messages
    params: dict[str, Param]
    attention: tuple[AttnParam, ...] = ()


_FP8_ATTN = tuple(AttnParam(n, None, (), -1.0) for n in ("k_scale", "prob_scale", "q_scale", "v_scale"))
_CT_ATTN = tuple(AttnParam(n + "_scale", "F32", (1,), 1.0) for n in "kqv") + tuple(AttnParam(n + "_zero_point", None, (1,), 0.0) for n in "kqv")

METHODS: dict[str, Method] = {
    # fp8.py Fp8LinearMethod.create_weights: weight [N_r, K_r] F8, weight_scale_inv [ceil(N_r/bn), ceil(K_r/bk)] F32
    "fp8_block": Method("Fp8LinearMethod (block)", {"weight": Param("weight"), "weight_scale_inv": Param("weight_scale_inv", dtype="F32")}, _FP8_ATTN),
    # the same, per tensor: weight_scale / input_scale are PerTensorScaleParameter [len(output_partition_sizes)] F32
    "fp8_tensor": Method("Fp8LinearMethod (per-tensor)", {
        "weight": Param("weight"), "weight_scale": Param("weight_scale", dtype="F32", slots=True),
        "input_scale": Param("input_scale", dtype="F32", slots=True),
    }, _FP8_ATTN),  # fmt: skip
    # schemes/compressed_tensors_wNa16.py CompressedTensorsWNA16: weight_packed [N_r, K_r/pack], weight_scale
    # [N_r, K_r/G] (model dtype), weight_zero_point [N_r/pack, K_r/G], weight_shape I64 [2]
    "ct_int": Method("CompressedTensorsWNA16", {
        "weight_packed": Param("weight_packed"), "weight_scale": Param("weight_scale"),
        "weight_zero_point": Param("weight_zero_point"), "weight_shape": Param("weight_shape", source_shape=True),
    }, _CT_ATTN),  # fmt: skip
    # schemes/compressed_tensors_w8a8_fp8.py CompressedTensorsW8A8Fp8 (create_fp8_scale_parameter: float32):
    # weight F8, weight_scale F32 [N_r, 1]
    "ct_fp8_channel": Method("CompressedTensorsW8A8Fp8 (channel)", {"weight": Param("weight"), "weight_scale": Param("weight_scale", dtype="F32")}, _CT_ATTN),
    # the same scheme per tensor (PerTensorScaleParameter [slots], F32) and per 128-block (F32 block rows)
    "ct_fp8_tensor": Method("CompressedTensorsW8A8Fp8 (tensor)", {
        "weight": Param("weight"), "weight_scale": Param("weight_scale", dtype="F32", slots=True),
        "input_scale": Param("input_scale", dtype="F32", slots=True),
    }, _CT_ATTN),  # fmt: skip
    "ct_fp8_block": Method("CompressedTensorsW8A8Fp8 (block)", {"weight": Param("weight"), "weight_scale": Param("weight_scale", dtype="F32")}, _CT_ATTN),
    # schemes/compressed_tensors_w4a4_nvfp4.py CompressedTensorsW4A4Fp4: weight_packed U8 [N_r, K_r/2], weight_scale
    # F8 [N_r, K_r/16], weight_global_scale / input_global_scale F32 [slots]
    "ct_nvfp4": Method("CompressedTensorsW4A4Fp4", {
        "weight_packed": Param("weight_packed"), "weight_scale": Param("weight_scale"),
        "weight_global_scale": Param("weight_global_scale", dtype="F32", slots=True),
        "input_global_scale": Param("input_global_scale", dtype="F32", slots=True),
    }, _CT_ATTN),  # fmt: skip
    # auto_gptq.py AutoGPTQLinearMethod.create_weights: qweight [K_r/pack, N_r], scales [K_r/G, N_r], qzeros
    # [K_r/G, N_r/pack]; no g_idx (vLLM regenerates none without act-order: the checkpoint's is dropped)
    "gptq": Method("AutoGPTQLinearMethod", {
        "qweight": Param("qweight", 1), "scales": Param("scales", 1), "qzeros": Param("qzeros", 1), "g_idx": Param(None),
    }),  # fmt: skip
    # auto_awq.py AutoAWQMarlinLinearMethod.create_weights: qweight [K_r, N_r/8], qzeros [K_r/G, N_r/8],
    # scales [K_r/G, N_r]: output dim last, so fused matrices sit side by side
    "awq": Method("AutoAWQMarlinLinearMethod", {"qweight": Param("qweight", 1), "qzeros": Param("qzeros", 1), "scales": Param("scales", 1)}),
}


def refuse_method(fmt: str, specs: list[dict]) -> str | None:
    """Why vLLM 0.33.0 cannot load an export of quantized format `fmt` (specs: its layers' QuantSpecs
    as plain data), in one line; None when it can."""
    if fmt == "gptq":
        if any(s.get("desc_act") and s.get("group_size") != -1 for s in specs):
            return (
                "GPTQ with act-order (desc_act=true): vLLM 0.33.0 refuses it"
                ' (quantization/utils/gptq_utils.py: "desc_act=True is no longer supported"); serve a checkpoint without act-order'
            )
        odd = sorted({(s.get("bits"), s.get("sym")) for s in specs} - {(4, True), (8, True)})
        if odd:
            return f"GPTQ bits/sym {odd}: vLLM 0.33.0's AutoGPTQConfig has kernels for 4- and 8-bit symmetric only (auto_gptq.py TYPE_MAP)"
    if fmt == "gptq_v2":
        return "GPTQ checkpoint_format gptq_v2: vLLM 0.33.0's AutoGPTQ reads qzeros as v1 (z - 1); not mapped; serve the HF checkpoint"
    if fmt == "marlin":
        return (
            "legacy Marlin (B, s): vLLM 0.33.0 has no parameter for it (its own load fails: models/utils.py"
            ' "no parameter named ...B"); re-quantize to GPTQ or AWQ'
        )
    if fmt == "ct_int" and any(s.get("desc_act") for s in specs):
        return "compressed-tensors with act-order (weight_g_idx): not mapped for a vLLM export yet; serve the HF checkpoint"
    if fmt not in METHODS:
        return f"{fmt}: no vLLM 0.33.0 parameter layout mapped for it; serve the HF checkpoint with vLLM's own loader"
    return None


def config_additions(plan, config: dict) -> dict[str, list[str]]:
    """What the export adds to config.json's quantization_config so that vLLM loads it quantized.

    GPTQ: without `modules_in_block_to_quantize`, vLLM lists the quantized modules from the folder's
    safetensors dtypes (auto_gptq.py maybe_update_config), i.e. from the export's fused names
    (qkv_proj), and then matches each fused layer's HF shards (q_proj) against them
    (utils/gptq_utils.py is_layer_gptq_quantized): no match, so every linear would be built
    unquantized and the load would fail. The HF modules quantized, as full prefixes, match."""
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "gptq" or q.get("modules_in_block_to_quantize"):
        return {}
    return {"modules_in_block_to_quantize": sorted(m for m, spec in plan.quant_layers.items() if spec.get("format") == "gptq")}


def config_bytes(config: dict) -> bytes:
    """config.json as an export writes it when it adds to it (config_additions)."""
    import json

    return (json.dumps(config, indent=2) + "\n").encode()


def engine_param(piece_engine: str, suffix: str, fmt: str) -> tuple[str, Param] | None:
    """(vLLM key, Param) of the checkpoint tensor `<module>.<suffix>` whose module's `.weight` maps
    to `piece_engine`; None when vLLM's method has no such tensor. Routed experts: quant_moe.expert_param."""
    param = METHODS[fmt].params.get(suffix)
    if param is None:
        return None
    if not param.name:
        return "", param
    return piece_engine.removesuffix(".weight") + "." + param.name, param


def fused_tensor(engine: str, param: Param, parts: list) -> tuple:
    """A quantized parameter of vLLM's create_weights layout from its slots (tpshard.export.layout
    Parts), as EngineTensor's fields (name, dtype, shape, parts, value, axis). ValueError: slots
    that do not fuse."""
    first = parts[0]
    dtype = param.dtype or first.dtype
    if param.source_shape:  # the source's [N, K] of the last slot: vLLM's loader keeps the last shard's value
        return engine, "I64", (2,), (), tuple(source_shape(parts[-1])), 0
    if any(s.dtype != first.dtype for s in parts):
        raise ValueError(f"{engine}: pieces of dtypes {sorted({s.dtype for s in parts})} do not fuse")
    if param.slots:  # one slot per fused matrix: PerTensorScaleParameter [len(output_partition_sizes)]
        if any(int(np.prod(s.shape)) != 1 for s in parts):
            raise ValueError(f"{engine}: per-tensor scales of shapes {[list(s.shape) for s in parts]}, not one value each")
        return engine, dtype, (len(parts),), tuple(parts), None, 0
    if param.axis == 1:
        if any(len(s.shape) != 2 or s.shape[0] != first.shape[0] for s in parts):
            raise ValueError(f"{engine}: pieces {[(s.name, list(s.shape)) for s in parts]} do not fuse along dim 1")
        return engine, dtype, (first.shape[0], sum(s.shape[1] for s in parts)), tuple(parts), None, 1
    if len(parts) > 1 and any(len(s.shape) < 1 or s.shape[1:] != first.shape[1:] for s in parts):
        raise ValueError(f"{engine}: pieces {[(s.name, list(s.shape)) for s in parts]} do not concatenate along dim 0")
    shape = (sum(s.shape[0] for s in parts), *first.shape[1:]) if len(parts) > 1 else first.shape
    return engine, dtype, shape, tuple(parts), None, 0


def source_shape(part) -> list[float]:
    """The source's unsliced [N, K] of a compressed-tensors `weight_shape` shard (its per-rank value
    with the cut dim put back to the whole)."""
    if part.cut.value is None or part.tensor.logical_dim is None:
        raise ValueError(f"{part.name}: no per-rank [N, K] value in the tpshard output")
    full = list(part.cut.value)
    full[part.tensor.logical_dim] = part.tensor.logical_size
    return [float(v) for v in full]


# ---- bytes ------------------------------------------------------------------------------------

_NUMPY = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "u1"}


def constant_array(dtype: str, value: float | tuple, shape: tuple[int, ...]) -> np.ndarray:
    """The bytes of a constant engine tensor: `value` filled over `shape`, or the values given."""
    n = int(np.prod(shape)) if shape else 1
    values = np.full(n, value, np.float64) if not isinstance(value, tuple) else np.asarray(value, np.float64)
    if len(values) != n:
        raise ValueError(f"a constant of shape {list(shape)} given {len(values)} values")
    if dtype == "BF16":  # the top half of the float32: exact for the constants used (0, ±1, small ints)
        f = values.astype("<f4")
        if not np.array_equal(f.astype(np.float64), values) or (f.view("<u4") & 0xFFFF).any():
            raise ValueError(f"{value} is not exact in BF16")
        return (f.view("<u4") >> 16).astype("<u2").view(np.uint8)
    out = values.astype(_NUMPY[dtype])
    if not np.array_equal(out.astype(np.float64), values):
        raise ValueError(f"{value} is not exact in {dtype}")
    return out.view(np.uint8)


def to_f32(dtype: str, data: np.ndarray) -> np.ndarray:
    """Bytes of a BF16 / F16 / F32 tensor as float32 bytes (exact)."""
    if dtype == "BF16":
        return (data.view("<u2").astype("<u4") << 16).view(np.uint8)
    return data.view(_NUMPY[dtype]).astype("<f4").view(np.uint8)


def assemble(
    pieces: list[tuple[np.ndarray, tuple[int, ...]]], src_dtype: str, dtype: str, axis: int, experts: int = 1, rotary: int = 0
) -> np.ndarray:  # fmt: skip
    """An engine tensor's bytes from its pieces' (bytes, shape): concatenated along `axis` (each
    piece 2-D for axis 1; axis 2: `experts` stacked experts, each its own pieces along dim 1; fused
    experts' TRANSPOSED: tpshard.export.fused), cast from `src_dtype` to `dtype` where they differ;
    `rotary`: the head dim of the q and k pieces whose rows are permuted first (tpshard.export.rotary)."""
    if rotary:
        from tpshard.export.rotary import PERMUTED_PIECES, permute

        pieces = [(permute(b, s, rotary), s) if i < PERMUTED_PIECES else (b, s) for i, (b, s) in enumerate(pieces)]
    if axis < 0:
        from tpshard.export.fused import transpose

        return transpose(pieces[0][0], pieces[0][1])
    if axis == 2:
        per = len(pieces) // experts
        data = np.concatenate([assemble(pieces[i : i + per], src_dtype, src_dtype, 1) for i in range(0, len(pieces), per)])
    elif axis == 1:
        rows = pieces[0][1][0]
        data = np.concatenate([b.reshape(rows, -1) for b, _ in pieces], axis=1).reshape(-1)
    else:
        data = np.concatenate([b for b, _ in pieces]) if len(pieces) > 1 else pieces[0][0]
    return to_f32(src_dtype, data) if dtype != src_dtype else data


def split_back(
    data: np.ndarray, shapes: list[tuple[int, ...]], nbytes: list[int], src_dtype: str, dtype: str, axis: int, experts: int = 1,
    rotary: int = 0,
) -> list[np.ndarray]:  # fmt: skip
    """The inverse of `assemble`: each piece's bytes as the checkpoint holds them, from the engine
    tensor's (for check: which slot differs). A cast back is exact for what `to_f32` made."""
    if rotary:
        from tpshard.export.rotary import PERMUTED_PIECES, unpermute

        out = split_back(data, shapes, nbytes, src_dtype, dtype, axis, experts)
        return [unpermute(b, shapes[i], rotary) if i < PERMUTED_PIECES else b for i, b in enumerate(out)]
    if dtype != src_dtype:
        f = data.view("<f4")
        data = (f.view("<u4") >> 16).astype("<u2").view(np.uint8) if src_dtype == "BF16" else f.astype(_NUMPY[src_dtype]).view(np.uint8)
    if axis < 0:
        from tpshard.export.fused import transpose_back

        return [transpose_back(data, shapes[0])]
    if axis == 2:
        per, out, at = len(shapes) // experts, [], 0
        for i in range(0, len(shapes), per):
            n = sum(nbytes[i : i + per])
            out += split_back(data[at : at + n], shapes[i : i + per], nbytes[i : i + per], src_dtype, src_dtype, 1)
            at += n
        return out
    if axis == 1:
        rows = shapes[0][0]
        view = data.reshape(rows, -1)
        out, at = [], 0
        for n in nbytes:
            w = n // rows
            out.append(np.ascontiguousarray(view[:, at : at + w]).reshape(-1))
            at += w
        return out
    out, at = [], 0
    for n in nbytes:
        out.append(data[at : at + n])
        at += n
    return out
