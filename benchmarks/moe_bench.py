"""Split a checkpoint with DeepSeek-V3's tensor count (dims scaled down) against `cp -r`.

    python benchmarks/moe_bench.py [--runs 3] [--workdir /tmp/tpshard-moe-bench] [--json out.json]

DeepSeek-V3 has 61 decoder layers (3 dense, 58 MoE) plus the MTP layer, 256 routed experts of
3 projections, each an FP8 block weight with its weight_scale_inv: 91,991 tensors, ~1,500 per MoE
layer. The checkpoint written here has exactly those names, dtypes and that count, with every dim
scaled down so the cuts stay on 128-blocks at tp 8 / attn-dp 2 / ep 8 (the deployment of
docs/contracts.md): hidden 256, 16 heads of nope 64 + rope 64 and v 64, q_lora 256, kv_lora 128,
experts of 128, 8 shared experts (1024), dense MLP 1024, vocab 129,280 -- about 2.3 GiB. What it
measures is the per-tensor cost of tpshard: plan, file layout, one read and many small writes.

Cases, each in a fresh child after a sync (split_bench.measure: wall time plus the sync after it,
GNU time's peak RSS, sampled anonymous RSS): `cp -r` of the checkpoint, `tpshard plan --json`
(headers only), `tpshard split --tp 8 --attn-dp 2 --ep 8`, and `tpshard check` of that output.

`--real-dims --layers 2` writes DeepSeek-V3's own dims instead (hidden 7168, 128 heads, experts of
2048, dense MLP 18432, one shared expert) for the first `--layers` layers (one dense, the rest MoE;
no MTP layer): ~16 GiB for 2 layers in 4 files, tensors of up to 1.8 GiB. Per-tensor cost is then
hidden behind the bytes, as in the real model; it needs twice that much free disk.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from split_bench import against_cp, drop, measure, warm  # noqa: E402

class Dims(NamedTuple):
    H: int  # hidden
    NH: int  # heads
    NOPE: int
    ROPE: int
    V_HD: int
    Q_LORA: int
    KV_LORA: int
    E: int  # routed experts
    I_E: int  # expert intermediate
    N_SHARED: int  # shared experts
    I_D: int  # dense MLP intermediate
    VOCAB: int
    LAYERS: int
    DENSE: int  # first_k_dense_replace
    MTP: int  # num_nextn_predict_layers


SCALED = Dims(256, 16, 64, 64, 64, 256, 128, 256, 128, 8, 1024, 129280, 61, 3, 1)
REAL = Dims(7168, 128, 128, 64, 128, 1536, 512, 256, 2048, 1, 18432, 129280, 61, 3, 1)  # DeepSeek-V3's config.json
SIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "I64": 8, "U8": 1, "I8": 1}
CHUNK = 64 << 20


def config(d: Dims = SCALED) -> dict:
    H, NH, NOPE, ROPE, V_HD, Q_LORA, KV_LORA, E, I_E, N_SHARED, I_D, VOCAB, LAYERS, DENSE, MTP = d
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": H,
        "num_attention_heads": NH, "num_key_value_heads": NH, "q_lora_rank": Q_LORA, "kv_lora_rank": KV_LORA,
        "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "v_head_dim": V_HD, "n_routed_experts": E,
        "moe_intermediate_size": I_E, "n_shared_experts": N_SHARED, "first_k_dense_replace": DENSE,
        "intermediate_size": I_D, "vocab_size": VOCAB, "num_hidden_layers": LAYERS, "num_nextn_predict_layers": MTP,
        "moe_layer_freq": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16", "tie_word_embeddings": False,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }  # fmt: skip


def tensors(d: Dims = SCALED) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor, layer by layer as DeepSeek-V3's files hold them."""
    H, NH, NOPE, ROPE, V_HD, Q_LORA, KV_LORA, E, I_E, N_SHARED, I_D, VOCAB, LAYERS, DENSE, MTP = d
    out: list[tuple[str, str, tuple[int, ...]]] = []

    def fp8(name: str, n: int, k: int) -> None:
        out.append((f"{name}.weight", "F8_E4M3", (n, k)))
        out.append((f"{name}.weight_scale_inv", "F32", (-(-n // 128), -(-k // 128))))

    out.append(("model.embed_tokens.weight", "BF16", (VOCAB, H)))
    for i in range(LAYERS + MTP):
        p = f"model.layers.{i}"
        out.append((f"{p}.input_layernorm.weight", "BF16", (H,)))
        fp8(f"{p}.self_attn.q_a_proj", Q_LORA, H)
        out.append((f"{p}.self_attn.q_a_layernorm.weight", "BF16", (Q_LORA,)))
        fp8(f"{p}.self_attn.q_b_proj", NH * (NOPE + ROPE), Q_LORA)
        fp8(f"{p}.self_attn.kv_a_proj_with_mqa", KV_LORA + ROPE, H)
        out.append((f"{p}.self_attn.kv_a_layernorm.weight", "BF16", (KV_LORA,)))
        fp8(f"{p}.self_attn.kv_b_proj", NH * (NOPE + V_HD), KV_LORA)
        fp8(f"{p}.self_attn.o_proj", H, NH * V_HD)
        out.append((f"{p}.post_attention_layernorm.weight", "BF16", (H,)))
        if i < DENSE:
            fp8(f"{p}.mlp.gate_proj", I_D, H)
            fp8(f"{p}.mlp.up_proj", I_D, H)
            fp8(f"{p}.mlp.down_proj", H, I_D)
            continue
        out.append((f"{p}.mlp.gate.weight", "BF16", (E, H)))
        out.append((f"{p}.mlp.gate.e_score_correction_bias", "F32", (E,)))
        for e in range(E):
            fp8(f"{p}.mlp.experts.{e}.gate_proj", I_E, H)
            fp8(f"{p}.mlp.experts.{e}.up_proj", I_E, H)
            fp8(f"{p}.mlp.experts.{e}.down_proj", H, I_E)
        fp8(f"{p}.mlp.shared_experts.gate_proj", N_SHARED * I_E, H)
        fp8(f"{p}.mlp.shared_experts.up_proj", N_SHARED * I_E, H)
        fp8(f"{p}.mlp.shared_experts.down_proj", H, N_SHARED * I_E)
        if i >= LAYERS:  # MTP
            out += [
                (f"{p}.enorm.weight", "BF16", (H,)), (f"{p}.hnorm.weight", "BF16", (H,)),
                (f"{p}.eh_proj.weight", "BF16", (H, 2 * H)), (f"{p}.shared_head.norm.weight", "BF16", (H,)),
                (f"{p}.embed_tokens.weight", "BF16", (VOCAB, H)), (f"{p}.shared_head.head.weight", "BF16", (VOCAB, H)),
            ]  # fmt: skip
    out += [("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (VOCAB, H))]
    return out


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return SIZE[dtype] * int(np.prod(shape, dtype=np.int64))


def write_checkpoint(out: Path, files: int = 163, dims: Dims = SCALED) -> int:
    """DeepSeek-V3 ships 163 files; random bytes (finite bf16 / fp32 scales do not matter to a split)."""
    items = tensors(dims)
    write_random_checkpoint(out, items, config(dims), files)
    return len(items)


def write_random_checkpoint(
    out: Path, items: list[tuple[str, str, tuple[int, ...]]], config: dict, files: int, ints: dict[str, int] | None = None,
    sparse: bool = False,
) -> int:  # fmt: skip
    """`items` (name, dtype, shape) in that order over `files` safetensors files with their index and
    config.json, written as `out.partial` and renamed. Every byte is random in [0, 0x3F] (finite
    small bf16 / fp32 / fp8), streamed in 64 MiB chunks so memory stays flat; an I32 tensor named in
    `ints` holds values in [0, ints[name]) instead (ids the split reads, such as an expert map).
    `sparse`: headers and holes only (zeros, no disk written), enough for `tpshard plan`.
    Returns the bytes of tensor data."""
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    per = -(-len(items) // files)
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0
    for k in range(files):
        group = items[k * per : (k + 1) * per]
        if not group:
            break
        name = f"model-{k + 1:05d}-of-{files:06d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t, dtype, shape in group:
            n = nbytes(dtype, shape)
            header[t] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        with open(tmp / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            if sparse:
                f.truncate(8 + len(raw) + offset)
            for t, dtype, shape in () if sparse else group:
                n = nbytes(dtype, shape)
                if ints and t in ints:
                    f.write(rng.integers(0, ints[t], n // 4, dtype=np.int32).tobytes())
                    continue
                for at in range(0, n, CHUNK):  # small positive values, in chunks: memory stays flat
                    f.write(rng.integers(0, 0x3F, min(CHUNK, n - at), dtype=np.uint8).tobytes())
        weight_map |= {t: name for t, _, _ in group}
        total += offset
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tpshard-moe-bench")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--real-dims", action="store_true", help="DeepSeek-V3's own dims, for --layers layers")
    ap.add_argument("--layers", type=int, default=2, help="with --real-dims: decoder layers (the first dense)")
    args = ap.parse_args(argv)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    if args.real_dims:
        model = work / f"deepseek-v3-real-dims-{args.layers}-layers"
        count = write_checkpoint(model, files=4, dims=REAL._replace(LAYERS=args.layers, DENSE=1, MTP=0))
    else:
        model = work / "deepseek-v3-shaped"
        count = write_checkpoint(model)
    size = sum(f.stat().st_size for f in model.iterdir())
    print(f"checkpoint: {count} tensors, {size / 2**30:.2f} GiB in {model}", file=sys.stderr)
    warm(model)
    py = [sys.executable, "-m", "tpshard"]
    topo = ["--tp", "8", "--attn-dp", "2", "--ep", "8"]
    workers = ["--workers", str(args.workers)] if args.workers else []
    out = work / "out"
    cases = {
        "cp -r": (["cp", "-r", str(model), str(out)], out),
        "plan": ([*py, "plan", str(model), *topo, "--json"], None),
        "split": ([*py, "split", str(model), "-o", str(out), *topo, *workers], out),
    }
    samples: dict[str, list] = {k: [] for k in [*cases, "check"]}
    for run in range(args.runs):
        for name, (cmd, target) in cases.items():
            s = measure(cmd, target)
            if not s.ok:
                print(f"{name}: {s.error}", file=sys.stderr)
                return 1
            samples[name].append(s)
            if name == "split":
                c = measure([*py, "check", str(out)])
                samples["check"].append(c)
            if target is not None:
                drop(target)
        print(f"round {run + 1}/{args.runs} done", file=sys.stderr)
    rows = against_cp(samples)
    print(f"{'case':8} {'time s':>8} {'x cp':>6} {'cpu s':>7} {'maxrss MiB':>11} {'anon MiB':>9} {'load':>5}")
    for name, r in rows.items():
        print(f"{name:8} {r['time_s']:8.2f} {r['x_cp']:6.2f} {r['cpu_s']:7.2f} {r['maxrss_mib']:11d} {r['anon_mib']:9d} {r['loadavg']:5.1f}")
    if args.json:
        args.json.write_text(json.dumps({"tensors": count, "bytes": size, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    shutil.rmtree(model, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
