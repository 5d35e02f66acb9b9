"""The steps of benchmarks/gpu_check.sh (see there): build, split, verify, plant faults, report.

Each step is a `python -m tpshard verify` command with the verdict it must give (exit code). The
backend is left to `--backend auto` (announced in the output) except where a step asks for NCCL
under torchrun. Steps that need more GPUs than the machine has are recorded as skipped, so the
same script runs on a CPU machine (`--cpu`) with every GPU step skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test helpers: quantized fixtures, fault planting

import torch  # noqa: E402

import tpshard  # noqa: E402
from tpshard.manifest import read_manifest  # noqa: E402
from tpshard.topology import Topology  # noqa: E402

# ~190M parameters in bf16 (~380 MB): every projection divides at tp 8 and FP8 128-blocks.
FULL = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=16,
            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=256)  # fmt: skip
SMALL = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=500, max_position_embeddings=256)  # fmt: skip


def build_dense(path: Path, shape: dict) -> Path:
    import transformers

    if (path / "config.json").is_file():
        return path
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # norms at 1 would hide a norm from the wrong place
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    model.save_pretrained(path, max_shard_size="200MB")
    return path


def build_fp8(path: Path, shape: dict) -> Path:
    from quant_fixtures import DEFAULT_SPECS, TinyLlama, write_quant_checkpoint

    if not (path / "config.json").is_file():
        heads = shape["hidden_size"] // 128  # head_dim 128: every per-rank N and K on the FP8 128-block grid
        tiny = TinyLlama(hidden=shape["hidden_size"], intermediate=shape["intermediate_size"], heads=heads,
                         kv_heads=max(1, heads // 4), head_dim=128, layers=2, vocab=shape["vocab_size"])  # fmt: skip
        write_quant_checkpoint(path, DEFAULT_SPECS["fp8_block"], shape=tiny)
    return path


def plant_faults(good: Path, root: Path) -> dict[str, Path]:
    """Two outputs that must fail: down_proj shards of ranks 0 and 1 swapped (consistent checksums),
    and a post-attention norm x 10 on the last rank only (its own copy of the shared file)."""
    from broken import overwrite_tensor, rewrite_checksums

    faults = {}
    swapped = root / "fault-swapped-down"
    shutil.copytree(good, swapped, symlinks=True, dirs_exist_ok=True)
    name = "model.layers.0.mlp.down_proj.weight"
    w0, w1 = (tpshard.open_rank(swapped, r)[name].clone() for r in (0, 1))
    overwrite_tensor(swapped, 0, name, w1)
    overwrite_tensor(swapped, 1, name, w0)
    rewrite_checksums(swapped)
    faults["swapped down_proj"] = swapped
    norm = root / "fault-norm-last-rank"
    shutil.copytree(good, norm, symlinks=True, dirs_exist_ok=True)
    last = read_manifest(norm).plan.topology.world_size - 1
    name = "model.layers.1.post_attention_layernorm.weight"
    overwrite_tensor(norm, last, name, tpshard.open_rank(norm, last)[name] * 10)  # copytree made private copies
    faults["norm x10 on the last rank"] = norm
    return faults


def moe_steps(out: Path, verify, *, small: bool) -> None:
    """The MoE and MLA layers and decoders (tpshard.runtime.moe, .mla) on the device: a Qwen3-MoE and
    a DeepSeek-V3 with its MTP layer at tp 4 / ep 2 / attn-dp 2 (every rank its own EP slot share and
    attention-DP replica), at tp 1 under torchrun with NCCL, and DeepSeek-V3's FP8 block release."""
    from moe_configs import add_mtp_layer, make_fp8_deepseek, make_moe_checkpoint

    models = {
        "qwen3-moe": out / "qwen3-moe" if (out / "qwen3-moe" / "config.json").is_file() else make_moe_checkpoint(out / "qwen3-moe", "qwen3_moe"),
        "deepseek-v3": out / "deepseek-v3" if (out / "deepseek-v3" / "config.json").is_file() else add_mtp_layer(make_moe_checkpoint(out / "deepseek-v3", "deepseek_v3")),
    }  # fmt: skip
    for name, src in models.items():
        for topo, label in ((Topology(tp=1), "tp 1"), (Topology(tp=2, ep=2), "tp 2 ep 2") if small else (Topology(tp=4, ep=2, attn_dp=2), "tp 4 ep 2 attn-dp 2")):
            dst = out / f"{name}-{label.replace(' ', '')}"
            if not (dst / "tpshard-manifest.json").is_file():
                tpshard.split(src, dst, topo)
            verify(f"{name} {label}, layers + model, auto backend", dst, src, 0, "--model")
            if topo.tp == 1:
                verify(f"{name} {label}, torchrun + NCCL", dst, src, 0, "--backend", "nccl", "--torchrun", "--standalone --nproc-per-node 1", "--model", needs_gpus=1)
    fp8 = out / "deepseek-v3-fp8"
    if not (fp8 / "config.json").is_file():
        make_fp8_deepseek(fp8)
    dst = out / "deepseek-v3-fp8-tp2"
    if not (dst / "tpshard-manifest.json").is_file():
        tpshard.split(fp8, dst, Topology(tp=2))
    verify("deepseek-v3 fp8 block tp 2, layers, auto backend", dst, fp8, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default="gpu-check")
    ap.add_argument("--cpu", action="store_true", help="no GPU: run every step on CPU ranks, skip the GPU-only steps")
    ap.add_argument("--small", action="store_true", help="a tiny model and tp 2 only (the CPU test)")
    ap.add_argument("--timeout", type=int, default=300, help="per verify command")
    ap.add_argument("--moe", action="store_true", help="also the MoE / MLA steps (tiny Qwen3-MoE, DeepSeek-V3 with MTP, its FP8 release)")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense Llama steps (a second run after they passed)")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    gpus = 0 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    shape = SMALL if args.small else FULL
    tps = [(2, 1)] if args.small else [(1, 1), (2, 1), (4, 1), (8, 1), (8, 2)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if args.cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the verify commands too must not see a GPU
    started = time.monotonic()
    steps: list[dict] = []

    def verify(name: str, output: Path, source: Path, expect: int, *extra: str, needs_gpus: int = 0) -> None:
        step = {"step": name, "output": output.name, "expect": expect, "args": list(extra)}
        if needs_gpus and gpus < needs_gpus:
            step.update(result="skipped", why=f"needs {needs_gpus} GPU(s), this machine has {gpus}")
            steps.append(step)
            print(f"SKIP {name}: {step['why']}", flush=True)
            return
        report = out / f"report-{len(steps):02d}.json"
        cmd = [sys.executable, "-m", "tpshard", "verify", str(output), "--source", str(source), "--report", str(report),
               "--timeout", str(args.timeout), *extra]  # fmt: skip
        if args.cpu:
            cmd += ["--device", "cpu"]
        t = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout + 120)
        step.update(exit=p.returncode, seconds=round(time.monotonic() - t, 1))
        step["announced"] = next((line for line in p.stderr.splitlines() if line.startswith("verify: ")), "")
        if report.is_file():
            data = json.loads(report.read_text())
            step.update(backend=data["backend"], device=data["device"], dtype=data["dtype"],
                        max_rel=max((x["max_rel"] for x in data["layers"]), default=0.0),
                        model=data["model"] and {k: data["model"][k] for k in ("max_rel", "top1", "kl")},
                        failures=[line for line in p.stderr.splitlines() if line.startswith("FAIL")][:4])  # fmt: skip
        step["result"] = "ok" if p.returncode == expect else "UNEXPECTED"
        if step["result"] != "ok":
            step["stderr"] = p.stderr[-2000:]
        steps.append(step)
        print(f"{step['result']:10s} {name}: exit {p.returncode} (want {expect}) in {step['seconds']} s; {step['announced']}", flush=True)

    t = time.monotonic()
    dense = build_dense(out / "llama", shape)
    fp8 = build_fp8(out / "llama-fp8", shape)
    build_s = round(time.monotonic() - t, 1)
    splits: dict[tuple[int, int, str], Path] = {}
    t = time.monotonic()
    for tp, dp in [] if args.no_dense else tps:
        for kind, src in (("dense", dense), ("fp8", fp8)):
            if kind == "fp8" and tp == 1:
                continue
            dst = out / f"{kind}-tp{tp}-dp{dp}"
            if not (dst / "tpshard-manifest.json").is_file():
                tpshard.split(src, dst, Topology(tp=tp, attn_dp=dp))
            splits[(tp, dp, kind)] = dst
    split_s = round(time.monotonic() - t, 1)

    for (tp, dp, kind), output in splits.items():
        src = dense if kind == "dense" else fp8
        label = f"{kind} tp {tp}" + (f" attn-dp {dp}" if dp > 1 else "")
        if kind == "dense":
            verify(f"{label}, layers + model, auto backend", output, src, 0, "--model")
        else:
            verify(f"{label}, layers, auto backend", output, src, 0)
        if kind == "dense" and tp == max(t for t, _ in tps):
            verify(f"{label}, layers in bfloat16", output, src, 0, "--dtype", "bfloat16")
        # The deployment path: one process per GPU under torchrun, NCCL.
        verify(
            f"{label}, torchrun + NCCL", output, src, 0, "--backend", "nccl",
            "--torchrun", f"--standalone --nproc-per-node {tp}", *(["--model"] if kind == "dense" else []),
            needs_gpus=tp,
        )  # fmt: skip
    if args.moe:
        moe_steps(out, verify, small=args.small)
    faulty = None if args.no_dense else splits[max((k for k in splits if k[2] == "dense"), key=lambda k: (k[0], k[1]))]
    for what, bad in plant_faults(faulty, out).items() if faulty else ():
        verify(f"fault: {what}", bad, dense, 1, "--model")
        verify(f"fault: {what}, torchrun + NCCL", bad, dense, 1, "--backend", "nccl", "--torchrun",
               f"--standalone --nproc-per-node {read_manifest(bad).plan.topology.world_size}",
               needs_gpus=read_manifest(bad).plan.topology.world_size)  # fmt: skip

    total = round(time.monotonic() - started, 1)
    ok = all(s["result"] in ("ok", "skipped") for s in steps)
    summary = {
        "ok": ok, "seconds": total, "build_seconds": build_s, "split_seconds": split_s, "gpus": gpus,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)], "torch": torch.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(), "steps": steps,
    }  # fmt: skip
    (out / "report.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"# tpshard verify GPU check: {'ok' if ok else 'FAILED'}",
        "",
        f"{gpus} GPU(s) {', '.join(summary['gpu_names']) or '(none: GPU steps skipped)'}; torch {torch.__version__},"
        f" CUDA {torch.version.cuda}; {total} s in all (build {build_s} s, split {split_s} s).",
        "",
        "| step | result | exit (want) | backend / device | max rel (layers) | model max rel / top-1 / KL | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in steps:
        m = s.get("model") or {}
        model = f"{m['max_rel']:.2g} / {m['top1']:.4g} / {m['kl']:.2g}" if m else "-"
        lines.append(
            f"| {s['step']} | {s['result']}{': ' + s['why'] if s.get('why') else ''} | {s.get('exit', '-')} ({s['expect']})"
            f" | {s.get('backend', '-')} / {s.get('device', '-')} | {s['max_rel']:.2g} | {model} | {s.get('seconds', '-')} |"
            if "max_rel" in s else
            f"| {s['step']} | {s['result']}{': ' + s['why'] if s.get('why') else ''} | {s.get('exit', '-')} ({s['expect']}) | - | - | - | {s.get('seconds', '-')} |"
        )  # fmt: skip
    (out / "report.md").write_text("\n".join(lines) + "\n")
    print(f"{'ok' if ok else 'FAILED'}: {len(steps)} steps in {total} s; report {out / 'report.md'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
