"""The seeded inputs of the layer-level runs: the same numbers on every rank and in rank 0's reference.

Each input is a function of (seed, layer, batch) alone, so no rank sends its input to another and
rank 0 regenerates exactly what every rank ran. Not here: running or judging the layers.
"""

from __future__ import annotations

import zlib

import torch

from tpshard.verify.layer_specs import LayerSpecs


def generator(seed: int, what: str, batch: int) -> torch.Generator:
    """Same numbers on every rank and in every process: seeded from (seed, layer, batch) only."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{what}/{batch}".encode()))


def layer_input(lay: LayerSpecs, batch: int, *, seed: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """Token ids [n] for an embedding, else activations [tokens, in] rounded to the compute dtype."""
    g = generator(seed, lay.layer, batch)
    if lay.layer_class in ("FusedExperts", "AttentionSinks"):  # weightless: they make their own inputs
        return torch.randn(tokens, lay.hidden, generator=g).to(dtype)
    w = lay.main(lay.pieces()[0])
    if lay.layer_class == "VocabParallelEmbedding":
        vocab = w.source_shape[0]
        n = max(tokens, 2 * w.group_size)
        # Stratified over the vocab, so every rank's rows are looked up; both ends included.
        u = torch.rand(n, generator=g, dtype=torch.float64)
        ids = ((torch.arange(n, dtype=torch.float64) + u) * vocab / n).long().clamp(0, vocab - 1)
        ids[0], ids[-1] = 0, vocab - 1
        return ids
    k = input_size(lay) if lay.layer_class == "ReplicatedLinear" else lay.logical_shape(lay.pieces()[0])[1]
    return torch.randn(tokens, k, generator=g).to(dtype)


def input_size(lay) -> int:
    """K of a ReplicatedLinear: its weight's last dim (whole, so the source shape), also for FP8
    weights (one byte per value); packed formats are not sized here."""
    w = next((s for s in lay.specs if s.name.endswith(".weight")), None)
    if w is None or (w.quant and not w.dtype.startswith("F8")):
        raise ValueError(f"{lay.layer}: verify cannot size a {lay.quant or 'weightless'} ReplicatedLinear")
    return w.source_shape[-1]
