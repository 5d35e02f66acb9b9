"""Quantized on-disk formats, and the cut of quantized linears.

The package, in dependency order: `units` (code widths, Marlin's tile), `formats` (per-format
layouts, logical -> physical offsets, dequantize; torch only inside the functions that compute),
`packing` (bit packing, torch), `config` (a checkpoint's quantization_config resolved per module),
`shards` (one layer's logical cut converted per tensor, alignment checks) and `layers` (every
quantized tensor of a checkpoint cut per rank, for tpshard.plan). It does not decide the dense
rules (tpshard.plan.dense) or touch files. Its modules import each other by full path, never
through this file, which re-exports the names of `formats`.
"""

from tpshard.quant.formats import (
    LAYOUTS,
    Axis,
    FormatLayout,
    QuantSpec,
    TensorRole,
    alignment,
    dequantize,
    pack_layer,
    physical_range,
    random_layer,
    replicated_on,
    slice_tensors,
    step_ratio,
)

__all__ = [
    "LAYOUTS", "Axis", "FormatLayout", "QuantSpec", "TensorRole", "alignment", "dequantize", "pack_layer",
    "physical_range", "random_layer", "replicated_on", "slice_tensors", "step_ratio",
]  # fmt: skip
