"""What examples/engine_load_vllm.py and engine_load_sglang.py share: the command line, and the
per-rank bit-for-bit comparison of an engine's own load of the HF source with its load of an export.

Needs torch only; each script brings its engine's model building as `load(rank, path, load_format)`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

Load = Callable[[int, str, str], dict[str, torch.Tensor]]  # (rank, folder, load format) -> state dict


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (a NaN compares equal to itself here)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def compare_ranks(engine: str, model: str, export: str, tp: int, ranks: list[int], load: Load) -> int:
    """Load every rank both ways and print the verdict per rank; 1 if any rank differs or is refused."""
    failed = 0
    for r in ranks:
        ref = load(r, model, "auto")
        try:
            got = load(r, export, "sharded_state")
        except Exception as e:  # what the engine says about a broken export is the result here
            print(f"tp {tp} rank {r}: {engine} refused the export: {type(e).__name__}: {str(e)[:200]}")
            failed += 1
            continue
        diff = sorted(k for k in ref.keys() | got.keys() if k not in ref or k not in got or not same(ref[k], got[k]))
        print(f"tp {tp} rank {r}: {len(ref)} state_dict entries, " + ("bit-equal" if not diff else f"DIFFER: {diff[:4]}"))
        failed += bool(diff)
    return 1 if failed else 0


def args() -> tuple[str, str, int, list[int]]:
    """MODEL EXPORT TP [RANKS] from the command line (RANKS: comma separated, default all)."""
    model, export, tp = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ranks = [int(r) for r in sys.argv[4].split(",")] if len(sys.argv) > 4 else list(range(tp))
    return model, export, tp, ranks
