"""The hand-written baseline: load every tensor, slice it per rank with torch, save_file per rank.

    python benchmarks/naive_split.py MODEL -o OUT --tp 8 [--attn-dp 2]

This is what people write before they have a tool: correct for Llama-style dense models, but it
reads the whole checkpoint into memory (safe_open get_tensor), keeps every rank's slices in
dicts until the end, and writes one model.safetensors per rank with save_file. Peak memory is
about the model size; nothing is shared between ranks that hold identical bytes.

Slicing rules (Llama, SGLang/vLLM load contract):
- q_proj by heads, k/v_proj by kv heads over attn_tp (one kv head per rank with replicas when
  attn_tp > kv heads, rank takes kv head rank // (attn_tp // kv heads)); o_proj by columns over attn_tp.
- gate/up_proj by rows, down_proj by columns, over tp.
- embed_tokens by rows of the vocab padded to a multiple of 64 (over attn_tp under attention DP),
  lm_head likewise over tp; padding rows are zero.
- norms whole on every rank.

`rank_slice` is also used by split_bench.py to slice one rank at load time with get_slice.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

VOCAB_PAD = 64


@dataclass(frozen=True)
class Slice:
    dim: int  # -1: whole tensor
    start: int = 0
    length: int = 0
    pad: int = 0  # zero rows appended after the slice (vocab padding)


@dataclass(frozen=True)
class Layout:
    tp: int
    attn_dp: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @property
    def attn_tp(self) -> int:
        return self.tp // self.attn_dp


def load_layout(model: Path, tp: int, attn_dp: int = 1) -> Layout:
    cfg = json.loads((Path(model) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    if tp % attn_dp:
        raise SystemExit(f"--tp {tp} is not divisible by --attn-dp {attn_dp}")
    return Layout(
        tp=tp,
        attn_dp=attn_dp,
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
    )


def rank_slice(name: str, shape: tuple[int, ...] | list[int], lay: Layout, rank: int) -> Slice:
    """Which part of source tensor `name` world rank `rank` holds."""
    a_size, a_rank = lay.attn_tp, rank % lay.attn_tp
    t_size, t_rank = lay.tp, rank
    if name.endswith("self_attn.q_proj.weight"):
        if lay.num_heads % a_size:
            raise SystemExit(f"{lay.num_heads} heads do not divide over attn_tp {a_size}")
        n = lay.num_heads // a_size * lay.head_dim
        return Slice(0, a_rank * n, n)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        k = lay.num_kv_heads
        if a_size >= k:
            if a_size % k:
                raise SystemExit(f"attn_tp {a_size} is not a multiple of {k} kv heads")
            head = a_rank // (a_size // k)
            return Slice(0, head * lay.head_dim, lay.head_dim)
        if k % a_size:
            raise SystemExit(f"{k} kv heads do not divide over attn_tp {a_size}")
        n = k // a_size * lay.head_dim
        return Slice(0, a_rank * n, n)
    if name.endswith("self_attn.o_proj.weight"):
        n = shape[1] // a_size
        return Slice(1, a_rank * n, n)
    if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
        if shape[0] % t_size:
            raise SystemExit(f"{name}: {shape[0]} rows do not divide over tp {t_size}")
        n = shape[0] // t_size
        return Slice(0, t_rank * n, n)
    if name.endswith("mlp.down_proj.weight"):
        if shape[1] % t_size:
            raise SystemExit(f"{name}: {shape[1]} columns do not divide over tp {t_size}")
        n = shape[1] // t_size
        return Slice(1, t_rank * n, n)
    if name.endswith("embed_tokens.weight") or name == "lm_head.weight":
        size, r = (a_size, a_rank) if name.endswith("embed_tokens.weight") and lay.attn_dp > 1 else (t_size, t_rank)
        vocab = shape[0]
        padded = -(-vocab // VOCAB_PAD) * VOCAB_PAD
        if padded % size:
            raise SystemExit(f"padded vocab {padded} does not divide over {size}")
        n = padded // size
        start = r * n
        real = max(0, min(n, vocab - start))
        return Slice(0, start, real, n - real)
    if name.endswith("norm.weight"):
        return Slice(-1)
    raise SystemExit(f"naive_split: no rule for {name}")


def apply_slice(t: torch.Tensor, s: Slice) -> torch.Tensor:
    if s.dim < 0:
        return t.clone()
    piece = t.narrow(s.dim, s.start, s.length)
    if s.pad:
        zeros = torch.zeros((s.pad,) + tuple(t.shape[1:]), dtype=t.dtype)
        return torch.cat([piece, zeros], dim=0)
    return piece.contiguous().clone()


def source_files(model: Path) -> list[Path]:
    index = model / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model / n for n in names]
    return [model / "model.safetensors"]


def naive_split(model: Path, out: Path, tp: int, attn_dp: int = 1) -> None:
    model, out = Path(model), Path(out)
    lay = load_layout(model, tp, attn_dp)
    per_rank: list[dict[str, torch.Tensor]] = [{} for _ in range(tp)]
    for path in source_files(model):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                for r in range(tp):
                    per_rank[r][name] = apply_slice(t, rank_slice(name, t.shape, lay, r))
                del t
    out.mkdir(parents=True, exist_ok=True)
    for r in range(tp):
        d = out / f"rank-{r:03d}"
        d.mkdir(exist_ok=True)
        save_file(per_rank[r], str(d / "model.safetensors"), metadata={"format": "pt"})
        for extra in model.iterdir():
            if extra.is_file() and extra.suffix == ".json" and not extra.name.endswith("index.json"):
                shutil.copy2(extra, d / extra.name)
        per_rank[r] = {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("-o", "--out", type=Path, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--attn-dp", type=int, default=1)
    args = ap.parse_args(argv)
    t = time.perf_counter()
    naive_split(args.model, args.out, args.tp, args.attn_dp)
    print(f"naive split: {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
