"""Measure verify's layer-level error at real shapes, per compute dtype: the data behind
LAYER_TOLERANCE (tpshard/verify/report.py) and docs/verify.md's tolerance table.

Not a test (minutes on a CPU, GBs of memory). It computes each layer as the tensor-parallel ranks
do in `verify` -- every rank's GEMM in the compute dtype on its slice (float32 accumulation, as
PyTorch's CPU kernels and cuBLAS with reduced-precision reductions off, which verify sets), a
row-parallel layer's partial sums rounded to the dtype and summed rank by rank in the dtype (the
all-reduce), the bias added once on group rank 0 -- and compares with the float64 reference of the
unsharded layer the way verify does: max |tp - ref| / max |ref|.

    python benchmarks/verify_tolerance.py                 # Llama-3-8B shapes, tp 8 and 16, 3 seeds
    python benchmarks/verify_tolerance.py --hidden 8192 --intermediate 28672 --tp 8 16 --seeds 1

Weights ~ N(0, 0.02) stored in bfloat16 (a checkpoint's dtype); inputs ~ N(0, 1) rounded to the
compute dtype, 16 tokens (verify's default --tokens); row biases ~ N(0, 0.1).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def layers(hidden: int, intermediate: int, heads_dim: int) -> dict[str, tuple[str, int, int]]:
    """name -> (column | row, N, K) of one Llama decoder layer's GEMMs (q/k/v and gate/up fused)."""
    return {
        "qkv_proj": ("column", heads_dim, hidden),
        "o_proj": ("row", hidden, hidden),
        "gate_up_proj": ("column", 2 * intermediate, hidden),
        "down_proj": ("row", hidden, intermediate),
    }


def measure(kind: str, n: int, k: int, tp: int, dtype: torch.dtype, seed: int, tokens: int, bias: bool) -> float:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)  # the checkpoint
    b = (torch.randn(n, generator=g) * 0.1).to(torch.bfloat16) if bias else None
    x = torch.randn(tokens, k, generator=g).to(dtype)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())  # [T, N]
    wd, bd = w.to(dtype), None if b is None else b.to(dtype)
    if kind == "column":
        # Each rank's output slice is an independent GEMM; concatenating changes nothing.
        step = -(-n // tp)
        out = torch.cat([F.linear(x, wd[i : i + step], None if bd is None else bd[i : i + step]) for i in range(0, n, step)], -1)
    else:
        step = -(-k // tp)
        partials = [
            F.linear(x[:, i : i + step], wd[:, i : i + step], bd if (bd is not None and i == 0) else None)
            for i in range(0, k, step)
        ]  # each rounded to dtype
        out = partials[0]
        for p in partials[1:]:
            out = out + p  # the all-reduce, in the dtype, one addition per rank
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--qkv", type=int, default=6144, help="q + k + v output features (Llama 3 8B: 4096 + 2 x 1024)")
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = []
    for name, (kind, n, k) in layers(args.hidden, args.intermediate, args.qkv).items():
        for tp in args.tp:
            for dname, dtype in DTYPES.items():
                errs = [measure(kind, n, k, tp, dtype, s, args.tokens, bias=kind == "row") for s in range(args.seeds)]
                rows.append(dict(layer=name, kind=kind, n=n, k=k, tp=tp, dtype=dname, max_rel=max(errs)))
                if not args.json:
                    print(f"{name:13s} {kind:6s} N={n:6d} K={k:6d} tp={tp:2d} {dname:8s} max_rel {max(errs):.3g}", flush=True)
    worst = {d: max(r["max_rel"] for r in rows if r["dtype"] == d) for d in DTYPES}
    if args.json:
        print(json.dumps({"rows": rows, "worst": worst}, indent=1))
    else:
        print("worst per dtype:", ", ".join(f"{d} {v:.3g}" for d, v in worst.items()))


if __name__ == "__main__":
    main()
