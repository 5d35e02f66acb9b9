"""How a linear layer holds and applies its weight: the QuantMethod protocol (the compute
contract), `new_param`, and the unquantized method every dense layer uses.

A quant method owns a linear layer's weight parameters and its GEMM.

Layers only pass per-rank shapes; what parameters exist (a plain `weight`, or packed codes plus
scales) and how `x @ W^T` is computed is the quant method's business, as in vLLM/SGLang. Each
parameter a method registers carries its sharding metadata as attributes, which is all a layer
needs to place a presharded piece (q, k, v, gate, up) without knowing the format:

- `output_dim`: the dim that follows the layer's output features (None: not split by output,
  the tensor is copied whole);
- `packed_factor` (default 1): how many logical output features one element along `output_dim`
  holds (int4 codes packed 8 per int32 along the output dim: 8).

Not here: the method for quantized shards (tpshard.runtime.reference_quant implements the same
protocol), and any collective (layers do those).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn


@runtime_checkable
class QuantMethod(Protocol):
    def create_weights(
        self,
        layer: nn.Module,
        in_per_rank: int,
        out_per_rank: int,
        dtype: torch.dtype,
        *,
        out_pieces: Sequence[int] | None = None,
    ) -> None:
        """Register this rank's parameters on `layer` for a [out_per_rank, in_per_rank] matrix.

        `out_pieces` are the per-rank sizes of the logical matrices fused along the output dim
        (q/k/v, gate/up); their sum is `out_per_rank`. Methods with one scale per logical matrix
        need them; others ignore them.
        """
        ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """`x @ W_r^T (+ bias)` for this rank's weight: [..., in_per_rank] -> [..., out_per_rank]."""
        ...

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded parameters into the compute layout (a no-op for unquantized weights)."""
        ...


def new_param(data: torch.Tensor, *, output_dim: int | None, packed_factor: int = 1) -> nn.Parameter:
    """A frozen parameter tagged with the sharding metadata layers read (see module docstring)."""
    param = nn.Parameter(data, requires_grad=False)  # inference only: no autograd through collectives
    param.output_dim = output_dim
    param.packed_factor = packed_factor
    return param


class UnquantizedLinearMethod:
    """A dense `weight [out_per_rank, in_per_rank]` and `F.linear`; also the embedding lookup."""

    def create_weights(
        self,
        layer: nn.Module,
        in_per_rank: int,
        out_per_rank: int,
        dtype: torch.dtype,
        *,
        out_pieces: Sequence[int] | None = None,
    ) -> None:
        # Zeros, not empty: a piece that is never loaded must not look like plausible weights.
        weight = torch.zeros(out_per_rank, in_per_rank, dtype=dtype)
        layer.register_parameter("weight", new_param(weight, output_dim=0))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pass

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Rows of the local table: [...] local ids -> [..., embedding_dim]. Used by embeddings only."""
        return F.embedding(ids, layer.weight)
