"""Write a Llama-3-8B-shaped Hugging Face checkpoint folder filled with random bf16 values.

    python benchmarks/make_checkpoint.py OUT [--layers 4] [--shard-size-gb 2] [--seed 0]

The shapes are Llama-3-8B's (hidden 4096, intermediate 14336, 32 heads, 8 kv heads, head_dim 128,
vocab 128256, untied lm_head); only the layer count changes. 4 layers is about 3.6 GiB.

The safetensors files are written directly (8-byte little-endian header length, JSON header padded
with spaces to a multiple of 8, then the data), streaming random bits in chunks, so memory stays at
one chunk whatever the model size. Values are finite: the top exponent bit of every bf16 is cleared,
so |x| < 2 and no inf/nan can appear. The folder is written under a temporary name and renamed
into place, so a folder named OUT is always complete (see `is_complete`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import time
from pathlib import Path

import numpy as np

HIDDEN = 4096
INTERMEDIATE = 14336
NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
VOCAB = 128256
DTYPE = "BF16"
ITEMSIZE = 2
CHUNK_BYTES = 64 * 1024 * 1024
# Clear bit 14 of each bf16 (the exponent's top bit): the exponent stays <= 127, value finite.
FINITE_MASK = np.uint64(0xBFFF_BFFF_BFFF_BFFF)
DONE_MARKER = ".make_checkpoint.json"


def llama_config(layers: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": 8192,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": NUM_HEADS,
        "num_hidden_layers": layers,
        "num_key_value_heads": NUM_KV_HEADS,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": None,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.40.0",
        "use_cache": True,
        "vocab_size": VOCAB,
    }


def tensor_shapes(layers: int) -> list[tuple[str, tuple[int, ...]]]:
    """HF names and shapes, in the order HF's sharded save walks the state dict."""
    kv = NUM_KV_HEADS * HEAD_DIM
    q = NUM_HEADS * HEAD_DIM
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (q, HIDDEN)),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN)),
            (p + "self_attn.o_proj.weight", (HIDDEN, q)),
            (p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
            (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
            (p + "input_layernorm.weight", (HIDDEN,)),
            (p + "post_attention_layernorm.weight", (HIDDEN,)),
        ]
    out += [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]
    return out


def nbytes(shape: tuple[int, ...]) -> int:
    n = ITEMSIZE
    for d in shape:
        n *= d
    return n


def group_into_files(tensors, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy, like transformers' shard_checkpoint: start a new file when the next tensor would
    push the current one past `shard_bytes` (a tensor larger than that gets a file to itself)."""
    files: list[list] = [[]]
    size = 0
    for name, shape in tensors:
        b = nbytes(shape)
        if files[-1] and size + b > shard_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += b
    return files


def safetensors_header(entries) -> tuple[bytes, list[tuple[str, tuple[int, ...]]]]:
    """Header bytes (length prefix included) and the tensors in data order.

    Data order is by name, as the safetensors library writes it for tensors of one dtype."""
    ordered = sorted(entries, key=lambda e: e[0])
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in ordered:
        b = nbytes(shape)
        header[name] = {"dtype": DTYPE, "shape": list(shape), "data_offsets": [offset, offset + b]}
        offset += b
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, ordered


def write_random(f, nbytes_total: int, seed: tuple[int, ...], buf: np.ndarray) -> None:
    """Stream `nbytes_total` random finite bf16 bytes into `f`, one chunk at a time."""
    bitgen = np.random.SFC64(list(seed))
    left = nbytes_total
    while left:
        n = min(left, CHUNK_BYTES)
        words = (n + 7) // 8
        view = buf[:words]
        view[:] = bitgen.random_raw(words)
        np.bitwise_and(view, FINITE_MASK, out=view)
        f.write(memoryview(view).cast("B")[:n])
        left -= n


def is_complete(out: Path, layers: int | None = None) -> bool:
    """True when `out` was fully written by this script (with `layers` layers, if given)."""
    marker = out / DONE_MARKER
    if not marker.is_file():
        return False
    try:
        info = json.loads(marker.read_text())
    except ValueError:
        return False
    if layers is not None and info.get("layers") != layers:
        return False
    return all((out / name).is_file() and (out / name).stat().st_size == size for name, size in info["files"].items())


def make_checkpoint(out: Path, layers: int = 4, shard_size_gb: float = 2.0, seed: int = 0, quiet: bool = False) -> dict:
    """Write the checkpoint to `out` (replacing it). Returns a summary dict."""
    out = Path(out)
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    tensors = tensor_shapes(layers)
    groups = group_into_files(tensors, int(shard_size_gb * 1e9))
    n = len(groups)
    weight_map: dict[str, str] = {}
    sizes: dict[str, int] = {}
    total = 0
    buf = np.empty(CHUNK_BYTES // 8, dtype=np.uint64)
    index_of = {name: i for i, (name, _) in enumerate(tensors)}
    for k, group in enumerate(groups, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        header, ordered = safetensors_header(group)
        with open(tmp / fname, "wb") as f:
            f.write(header)
            for name, shape in ordered:
                write_random(f, nbytes(shape), (seed, index_of[name]), buf)
                weight_map[name] = fname
                total += nbytes(shape)
        sizes[fname] = (tmp / fname).stat().st_size
        if not quiet:
            print(f"  wrote {fname} ({sizes[fname] / 2**30:.2f} GiB)", file=sys.stderr)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (tmp / "config.json").write_text(json.dumps(llama_config(layers), indent=2) + "\n")
    gen = {"bos_token_id": 128000, "eos_token_id": 128001, "do_sample": True, "temperature": 0.6,
           "top_p": 0.9, "transformers_version": "4.40.0"}
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    info = {"layers": layers, "seed": seed, "total_bytes": total, "files": sizes}
    (tmp / DONE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    info["seconds"] = time.perf_counter() - t0
    if not quiet:
        print(f"checkpoint: {out} ({total / 2**30:.2f} GiB of weights, {n} files, {layers} layers) "
              f"in {info['seconds']:.1f}s (not synced)", file=sys.stderr)
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--shard-size-gb", type=float, default=2.0, help="max bytes per file, in 1e9 (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sync", action="store_true", help="flush to disk before returning")
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error("--layers must be >= 1")
    make_checkpoint(args.out, args.layers, args.shard_size_gb, args.seed)
    if args.sync:
        t = time.perf_counter()
        os.sync()
        print(f"sync: {time.perf_counter() - t:.1f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
