"""Split gpt-oss-120b's own dims (1 layer by default, bf16 or MXFP4) against `cp -r`.

    python benchmarks/gpt_oss_bench.py [--mxfp4] [--layers 1] [--runs 3] [--tp 8] [--json out.json]

gpt-oss-120b: hidden 2880, 64 heads of 64 over 8 kv heads, 128 experts of intermediate 2880 stored
fused per layer (gate_up_proj [128, 2880, 5760], 4.0 GiB in bf16; down_proj [128, 2880, 2880]), vocab
201,088, q/k/v/o and router biases, sinks. With --mxfp4 the experts are the released layout
(`*_blocks` [E, out, in/32, 16] and `*_scales` uint8, stored transposed) and config.json says
quant_method mxfp4. Random bytes (small positive values: a split does not read them).

What it measures: the fused experts' cut. In bf16 gate_up_proj is cut on its LAST dim (each rank
keeps a contiguous 2I / tp of every [expert, hidden] row): tpshard.pieces reads the tensor once,
in 4 MiB chunks of whole rows, and copies each rank's strided slab out of each chunk (one numpy
copy per chunk and rank) into that rank's file. MXFP4's blocks are cut on dim 1 (gate/up rows) and
dim 2 (down's blocks). Cases run as in moe_bench.py (split_bench.measure: a fresh child after a
sync, the sync after it timed, GNU time's peak RSS, sampled anonymous RSS), alternated round by
round with `cp -r` of the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from moe_bench import write_random_checkpoint  # noqa: E402
from split_bench import against_cp, alternate, warm  # noqa: E402

H, NH, KV, HD, E, I, VOCAB, K = 2880, 64, 8, 64, 128, 2880, 201088, 4


def config(layers: int, mxfp4: bool) -> dict:
    c = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H, "intermediate_size": I,
        "num_hidden_layers": layers, "num_attention_heads": NH, "num_key_value_heads": KV, "head_dim": HD,
        "num_local_experts": E, "num_experts_per_tok": K, "vocab_size": VOCAB, "attention_bias": True,
        "tie_word_embeddings": False, "sliding_window": 128, "rms_norm_eps": 1e-5, "dtype": "bfloat16",
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "swiglu_limit": 7.0, "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False},
        "max_position_embeddings": 131072,
    }  # fmt: skip
    if mxfp4:
        c["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    return c


def tensors(layers: int, mxfp4: bool) -> list[tuple[str, str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", "BF16", (VOCAB, H)), ("model.norm.weight", "BF16", (H,)), ("lm_head.weight", "BF16", (VOCAB, H))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", "BF16", (H,)), (f"{p}.post_attention_layernorm.weight", "BF16", (H,))]
        for proj, rows in (("q_proj", NH * HD), ("k_proj", KV * HD), ("v_proj", KV * HD)):
            out += [(f"{p}.self_attn.{proj}.weight", "BF16", (rows, H)), (f"{p}.self_attn.{proj}.bias", "BF16", (rows,))]
        out += [(f"{p}.self_attn.o_proj.weight", "BF16", (H, NH * HD)), (f"{p}.self_attn.o_proj.bias", "BF16", (H,))]
        out += [(f"{p}.self_attn.sinks", "BF16", (NH,)), (f"{p}.mlp.router.weight", "BF16", (E, H)), (f"{p}.mlp.router.bias", "BF16", (E,))]
        x = f"{p}.mlp.experts"
        if mxfp4:
            out += [
                (f"{x}.gate_up_proj_blocks", "U8", (E, 2 * I, H // 32, 16)), (f"{x}.gate_up_proj_scales", "U8", (E, 2 * I, H // 32)),
                (f"{x}.down_proj_blocks", "U8", (E, H, I // 32, 16)), (f"{x}.down_proj_scales", "U8", (E, H, I // 32)),
            ]  # fmt: skip
        else:
            out += [(f"{x}.gate_up_proj", "BF16", (E, H, 2 * I)), (f"{x}.down_proj", "BF16", (E, I, H))]
        out += [(f"{x}.gate_up_proj_bias", "BF16", (E, 2 * I)), (f"{x}.down_proj_bias", "BF16", (E, H))]
    return out


def write_checkpoint(out: Path, layers: int, mxfp4: bool, files: int = 3) -> int:
    return write_random_checkpoint(out, tensors(layers, mxfp4), config(layers, mxfp4), files)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mxfp4", action="store_true")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tpshard-gpt-oss-bench")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = work / f"gpt-oss-120b-{'mxfp4' if args.mxfp4 else 'bf16'}-{args.layers}-layers"
    size = write_checkpoint(model, args.layers, args.mxfp4)
    print(f"checkpoint: {size / 2**30:.2f} GiB in {model}", file=sys.stderr)
    warm(model)
    out = work / "out"
    cases = {
        "cp -r": ["cp", "-r", str(model), str(out)],
        f"split --tp {args.tp}": [sys.executable, "-m", "tpshard", "split", str(model), "-o", str(out), "--tp", str(args.tp)],
    }
    try:
        rows = against_cp(alternate(cases, out, args.runs, lambda line: print(line, file=sys.stderr)))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    for r in rows.values():
        r["gib_s"] = round(size / 2**30 / r["time_s"], 2)
    print(f"{'case':14} {'time s':>8} {'x cp':>6} {'GiB/s':>6} {'cpu s':>7} {'maxrss MiB':>11} {'anon MiB':>9} {'load':>5}")
    for name, r in rows.items():
        print(f"{name:14} {r['time_s']:8.2f} {r['x_cp']:6.2f} {r['gib_s']:6.2f} {r['cpu_s']:7.2f} {r['maxrss_mib']:11d} {r['anon_mib']:9d} {r['loadavg']:5.1f}")
    if args.json:
        args.json.write_text(json.dumps({"bytes": size, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    shutil.rmtree(model, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
