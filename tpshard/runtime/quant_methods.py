"""Reference quant methods for quantized shards: dequantize with torch, then matmul.

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
from tpshard.runtime.quant_method import new_param


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
        for sid, tensors in by_piece.items():
            w = dequantize(self.spec, tensors, k=layer.in_per_rank)  # [N piece per rank, K per rank], float32
            layer.load_shard(sid, w, "weight")

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        b = bias.to(torch.float32) if bias is not None else None
        return F.linear(x.to(torch.float32), layer.weight, b).to(x.dtype)
