"""Quantized on-disk formats: bit packing (`packing`) and per-format layouts + dequantize (`formats`).

This package knows how each format lays out one linear layer and how logical N/K offsets map onto
each tensor's physical dims. It does not parse configs per module, plan shards or touch files.
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
