"""q/k rows reordered for vLLM's rotary kernel (Llama-4, vLLM 0.33.0 models/llama4.py L805-844).

`Llama4ForCausalLM.load_weights` passes every `q_proj` / `k_proj` weight through
`permute_qk_weight_for_rotary` before its weight loader slices it: `view(n_heads, head_dim // 2, 2,
in).transpose(1, 2)`, i.e. within each head the even rows (the first of each rotary pair) then
the odd rows. The permutation never crosses a head, and the cut is by whole heads, so the rank's
slice of the permuted tensor is its shard of the checkpoint with each head's rows so reordered:
"rotary", an EngineTable.fused rule on the fused `qkv_proj` [q; k; v], whose q and k pieces
(the first two of three) are permuted and v is not. The export's EngineTensor then carries the
head dim (`rotary`); the writer permutes the shard bytes in memory (assemble) and check permutes
them back (split_back) to compare them with the source.
"""

from __future__ import annotations

import numpy as np

PERMUTED_PIECES = 2  # q and k of [q; k; v]


def permute(data: np.ndarray, shape: tuple[int, ...], head_dim: int) -> np.ndarray:
    """The bytes of a [heads * head_dim, in] piece with each head's rows even first, then odd."""
    rows = shape[0]
    view = data.reshape(rows // head_dim, head_dim // 2, 2, -1)  # [heads, pairs, 2, in * itemsize]
    return np.ascontiguousarray(view.transpose(0, 2, 1, 3)).reshape(-1)


def unpermute(data: np.ndarray, shape: tuple[int, ...], head_dim: int) -> np.ndarray:
    """The inverse of `permute`: the checkpoint's row order back."""
    rows = shape[0]
    view = data.reshape(rows // head_dim, 2, head_dim // 2, -1)  # [heads, 2, pairs, in * itemsize]
    return np.ascontiguousarray(view.transpose(0, 2, 1, 3)).reshape(-1)
