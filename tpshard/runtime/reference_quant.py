"""The quant method for quantized shards: dequantize with torch, then matmul (a reference, not a kernel).

The protocol it implements, and the unquantized method, are tpshard.runtime.linear_method's.

`ReferenceQuantMethod(spec)` implements the QuantMethod protocol for every format of
`tpshard.quant.formats.LAYOUTS`. It is a correctness reference, not a kernel: each piece of the
layer (q / k / v, gate / up, or the one matrix) keeps its on-disk tensors exactly as the rank's
files hold them (`load_quant(layer, piece, suffix, tensor)`), and `process_weights_after_loading`
dequantizes each piece with `tpshard.quant.formats.dequantize` into a float32 `weight` placed by
the layer's own `load_shard` (so shapes are checked against what the layer expects). `apply` is
`F.linear` in float32. Per piece, because q, k and v keep their own scalars (FP8 per-tensor scales,
NVFP4 global scales) and their own act-order g_idx.

The reference for a layer is the dequantized source tensor: a rank's weight must equal its logical
slice of `dequantize(spec, source tensors)` (zero in padding), so a wrong packed offset shows up as
a wrong number.

Integration (verify): `spec = quant_spec_of(plan, hf_module)` (recorded in Plan.quant_layers);
build the layer with `quant_method=ReferenceQuantMethod(spec)` and per-rank
sizes from the manifest (`logical_length + logical_pad` of the layer's specs, which --pad-blocks may
make larger than ceil(n / size)); for each quantized ShardSpec of the rank call
`method.load_quant(layer, spec.piece or None, suffix, tensor)`, bias through `layer.load_shard`;
then `layer.process_weights_after_loading()`.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from tpshard.quant.formats import QuantSpec, dequantize
from tpshard.runtime.linear_method import new_param

# Static activation scales, by suffix: the input of the layer is quantized with them.
INPUT_SCALES = ("input_scale", "input_global_scale")
_FP8_MAX = 448.0  # largest e4m3 value
_FP4_MAX = 6.0  # largest e2m1 value


def quantize_input(spec: QuantSpec, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as the layer's static activation quantization leaves it (float32 in, float32 out).

    FP8 with `input_scale` s: e4m3(clamp(x / s)) * s, one scale for the tensor; int8 (W8A8):
    clamp(round(x / s), -128, 127) * s. NVFP4 with
    `input_global_scale` g (compressed-tensors' convention, a multiplier): per 16 values along K a
    block scale e4m3(amax / 6 * g), values rounded to e2m1 at block scale / g. Elementwise or per
    16-block along K, so a rank's K-slice (aligned to 16) quantizes as the whole input would.
    """
    x = x.to(torch.float32)
    s = scale.to(torch.float32).reshape(())
    if spec.format == "ct_nvfp4":
        blocks = x.unflatten(-1, (-1, 16))  # [..., K/16, 16]
        amax = blocks.abs().amax(-1, keepdim=True)
        block_scale = (amax / _FP4_MAX * s).clamp(max=_FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) / s
        safe = torch.where(block_scale > 0, block_scale, torch.ones_like(block_scale))
        values = _round_fp4((blocks / safe).clamp(-_FP4_MAX, _FP4_MAX))
        return (values * block_scale).flatten(-2)
    if spec.format.startswith("ct_int8_"):  # W8A8 int8, static per-tensor: round(x / s) in [-128, 127]
        return (x / s).round().clamp(-128, 127) * s
    return (x / s).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s


def _round_fp4(v: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value (ties to the smaller magnitude)."""
    from tpshard.quant.packing import E2M1_VALUES

    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    idx = (v.abs().unsqueeze(-1) - mags).abs().argmin(-1)
    return mags[idx] * v.sign()


def quant_spec_of(plan, module: str) -> QuantSpec | None:
    """The QuantSpec the plan recorded for HF module `module` (e.g. model.layers.0.mlp.down_proj), or None."""
    raw = plan.quant_layers.get(module)
    return None if raw is None else msgspec.convert(raw, QuantSpec)


class ReferenceQuantMethod:
    """Dequantize-then-matmul for one QuantSpec (all pieces of a layer share the format)."""

    def __init__(self, spec: QuantSpec):
        self.spec = spec

    def create_weights(
        self,
        layer: nn.Module,
        in_per_rank: int,
        out_per_rank: int,
        dtype: torch.dtype,
        *,
        out_pieces: Sequence[int] | None = None,
    ) -> None:
        # The dequantized weight, filled by process_weights_after_loading; float32 whatever `dtype`.
        layer.register_parameter("weight", new_param(torch.zeros(out_per_rank, in_per_rank), output_dim=0))
        layer.quant_tensors = {}  # (piece id, suffix) -> on-disk tensor of this rank

    def load_quant(self, layer: nn.Module, shard_id, suffix: str, tensor: torch.Tensor) -> None:
        """Keep one on-disk tensor of piece `shard_id` (None for a single-matrix layer) as it is."""
        self.spec.role(suffix)  # KeyError for a tensor the format does not have
        layer.quant_tensors[(shard_id, suffix)] = tensor

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        by_piece: dict[object, dict[str, torch.Tensor]] = {}
        for (sid, suffix), t in layer.quant_tensors.items():
            by_piece.setdefault(sid, {})[suffix] = t
        # Each piece quantizes its input with its own static scale (q, k, v keep theirs).
        layer.input_scales = {}
        for sid, tensors in by_piece.items():
            scale = next((tensors[n] for n in INPUT_SCALES if n in tensors), None)
            if self.spec.static_input and scale is not None:
                layer.input_scales[sid] = scale.to(layer.weight.device)
        for sid, tensors in by_piece.items():
            w = dequantize(self.spec, tensors, k=layer.in_per_rank)  # [N piece per rank, K per rank], float32
            layer.load_shard(sid, w, "weight")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b = bias.to(torch.float32) if bias is not None else None
        scales = getattr(layer, "input_scales", None)
        if not scales:
            return F.linear(x.to(torch.float32), layer.weight, b).to(x.dtype)
        outs = []
        for piece in layer._pieces:  # the pieces along the output dim, each with its input scale
            rows = slice(piece.offset, piece.offset + piece.size)
            xq = quantize_input(self.spec, x, scales[piece.shard_id]) if piece.shard_id in scales else x.to(torch.float32)
            outs.append(F.linear(xq, layer.weight[rows], None if b is None else b[rows]))
        return torch.cat(outs, dim=-1).to(x.dtype)
