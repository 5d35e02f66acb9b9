"""Per-tensor cost: plan, split, check, check --source and one rank's load on many small tensors.

    python benchmarks/many_tensors.py                      # both cases, 3 rounds, tp 8
    python benchmarks/many_tensors.py --case layers1000 --runs 5
    python benchmarks/many_tensors.py --case tiny90k --runs 1 --json out.json

Cases (Llama-shaped checkpoints of random bf16 bits, written straight to safetensors):
- `layers1000`: 1,000 layers, hidden 256, intermediate 512, 8 heads of 32 (2 kv heads), vocab 4096:
  9,003 tensors, about 1.1 GiB, in 4 files (issue 12's checkpoint).
- `tiny90k`: 10,000 layers, hidden 32, intermediate 64, 8 heads of 4 (2 kv heads), vocab 256:
  90,003 tensors (DeepSeek-V3's count), about 170 MiB, in 4 files.

Each command runs in a fresh child process, every case once per round, round-robin; `sync` before
each, and the `sync` after it is timed and counted (dirty pages the command left behind). The source
is read once first, so every case starts from a warm page cache. `x cp` divides by the `cp -r` of
the checkpoint in the same run; `peak RSS` is the child's maxrss as GNU time reports it (wait4 of
a child forked from this process would count this process's own peak). `load` is
`tpshard.open_rank` + reading every tensor, then `tpshard.load_rank`, of rank 0, both verifying
(the default), timed inside the child after imports. Outputs and checkpoints go under --workdir.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from split_bench import compile_package  # benchmarks/ is this script's folder, first on sys.path

CASES = {
    "layers1000": dict(layers=1000, hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=32, vocab=4096),
    "tiny90k": dict(layers=10000, hidden=32, intermediate=64, heads=8, kv_heads=2, head_dim=4, vocab=256),
}
FILES = 4
REPO = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"


def tensors(c: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, q, kv, i = c["hidden"], c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["intermediate"]
    out = [("model.embed_tokens.weight", (c["vocab"], h))]
    for n in range(c["layers"]):
        p = f"model.layers.{n}."
        out += [
            (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
            (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]  # fmt: skip
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (c["vocab"], h))]


def make_checkpoint(out: Path, c: dict) -> None:
    """Random finite bf16, FILES files of about equal size, an index and config.json."""
    if (out / ".done").is_file():
        return
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    ts = tensors(c)
    total = sum(2 * int(np.prod(s)) for _, s in ts)
    rng = np.random.default_rng(0)
    weight_map, group, size, k = {}, [], 0, 1

    def flush(group: list, k: int) -> None:
        name = f"model-{k:05d}-of-{FILES:05d}.safetensors"
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for t, s in group:
            n = 2 * int(np.prod(s))
            header[t] = {"dtype": "BF16", "shape": list(s), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[t] = name
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-(len(raw) + 8) % 8)
        with open(out / name, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = offset
            while left:
                n = min(left, 64 << 20)
                bits = rng.integers(0, 2**16, n // 2, dtype=np.uint16) & 0xBFFF  # finite bf16
                f.write(bits.tobytes())
                left -= n

    for t, s in ts:
        group.append((t, s))
        size += 2 * int(np.prod(s))
        if size >= total / FILES and k < FILES:
            flush(group, k)
            group, size, k = [], 0, k + 1
    flush(group, k)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": c["hidden"],
        "intermediate_size": c["intermediate"], "num_hidden_layers": c["layers"], "num_attention_heads": c["heads"],
        "num_key_value_heads": c["kv_heads"], "head_dim": c["head_dim"], "vocab_size": c["vocab"],
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
        "hidden_act": "silu", "max_position_embeddings": 2048,
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / ".done").write_text(str(len(ts)))


LOAD = """
import sys, time, tpshard
t = time.perf_counter()
m = tpshard.open_rank(sys.argv[1], 0)
n = sum(v.numel() for v in m.values())
t1 = time.perf_counter()
d = tpshard.load_rank(sys.argv[1], 0)
t2 = time.perf_counter()
print(f"{t1 - t:.3f} {t2 - t1:.3f} {len(d)}")
"""


def run(cmd: list[str], env: dict) -> tuple[float, float, str, float]:
    """(seconds incl. the sync after, peak RSS MiB, stdout, CPU seconds) of one child. CPU time
    (user + system) is the figure to compare when other jobs share the machine."""
    subprocess.run(["sync"], check=True)
    use_time = os.access(TIME, os.X_OK)
    t = time.perf_counter()
    # files: a full pipe would block the child
    with tempfile.TemporaryFile() as fo, tempfile.TemporaryFile() as fe, tempfile.NamedTemporaryFile("r") as tf:
        p = subprocess.Popen([TIME, "-f", "%M", "-o", tf.name, *cmd] if use_time else cmd, env=env, stdout=fo, stderr=fe)
        _, status, usage = os.wait4(p.pid, 0)
        p.returncode = os.waitstatus_to_exitcode(status)
        subprocess.run(["sync"], check=True)
        seconds = time.perf_counter() - t
        fo.seek(0), fe.seek(0)
        out, err = fo.read().decode(), fe.read().decode()
        maxrss_kib = int(tf.read().split()[-1]) if use_time else usage.ru_maxrss
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{err[-2000:]}")
    return seconds, maxrss_kib / 1024, out, usage.ru_utime + usage.ru_stime


def bench_case(name: str, work: Path, runs: int, tp: int, log) -> dict:
    c = CASES[name]
    model = work / f"ckpt-{name}"
    t = time.perf_counter()
    make_checkpoint(model, c)
    log(f"{name}: checkpoint {model} ({len(tensors(c))} tensors) ready in {time.perf_counter() - t:.1f} s")
    for f in model.iterdir():  # warm the page cache (not through this process: a child inherits its peak RSS)
        subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    compile_package()  # as a pip install leaves it
    py = [sys.executable, "-m", "tpshard"]
    out = work / f"out-{name}"
    ref = work / f"ref-{name}"  # the output check and load read; split writes `out` each round
    shutil.rmtree(ref, ignore_errors=True)
    run(py + ["split", str(model), "--tp", str(tp), "-o", str(ref)], env)
    manifest = ref / "tpshard-manifest.json"
    cmds = {
        "cp -r": ["cp", "-r", str(model), str(out)],
        "plan": py + ["plan", str(model), "--tp", str(tp), "--json"],
        "split": py + ["split", str(model), "--tp", str(tp), "-o", str(out)],
        "check": py + ["check", str(ref)],
        "check --source": py + ["check", str(ref), "--source", str(model)],
        "load rank 0": [sys.executable, "-c", LOAD, str(ref)],
    }
    samples: dict[str, list] = {k: [] for k in cmds}
    for r in range(runs):
        for case, cmd in cmds.items():
            shutil.rmtree(out, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            seconds, rss, stdout, cpu = run(cmd, env)
            extra = stdout.split() if case == "load rank 0" else None
            samples[case].append((seconds, rss, extra, cpu))
            log(f"  round {r + 1} {case}: {seconds:.2f} s, {rss:.0f} MiB" + (f" (open+read {extra[0]} s, load_rank {extra[1]} s)" if extra else ""))
    shutil.rmtree(out, ignore_errors=True)
    cp = statistics.median(s[0] for s in samples["cp -r"])
    rows = {}
    for case, ss in samples.items():
        secs = statistics.median(s[0] for s in ss)
        rows[case] = {
            "seconds": round(secs, 3), "x_cp": round(secs / cp, 2), "peak_rss_mib": round(max(s[1] for s in ss)),
            "cpu_s": round(statistics.median(s[3] for s in ss), 2),
        }  # fmt: skip
        if case == "load rank 0":
            rows[case]["open_read_s"] = statistics.median(float(s[2][0]) for s in ss)
            rows[case]["load_rank_s"] = statistics.median(float(s[2][1]) for s in ss)
    n = len(tensors(c))
    size = manifest.stat().st_size
    result = {
        "case": name, "tensors": n, "tp": tp, "runs": runs, "rows": rows,
        "manifest_bytes": size, "manifest_bytes_per_tensor": round(size / n),
        "loadavg": os.getloadavg(), "cpus": os.cpu_count(),
    }  # fmt: skip
    shutil.rmtree(ref, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", choices=[*CASES, "all"], default="all")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tpshard-many")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    results = []
    for name in CASES if args.case == "all" else [args.case]:
        res = bench_case(name, args.workdir, args.runs, args.tp, log)
        results.append(res)
        print(f"\n{name}: {res['tensors']} tensors, tp {res['tp']}, medians of {res['runs']}, load average {res['loadavg'][0]:.1f} on {res['cpus']} CPUs")
        print(f"{'command':<16} {'time s':>8} {'x cp -r':>8} {'cpu s':>7} {'peak RSS MiB':>13}")
        for case, row in res["rows"].items():
            print(f"{case:<16} {row['seconds']:>8.2f} {row['x_cp']:>8.2f} {row['cpu_s']:>7.2f} {row['peak_rss_mib']:>13}")
        lr = res["rows"]["load rank 0"]
        print(f"load rank 0 inside the child: open_rank + read all {lr['open_read_s']:.2f} s, load_rank {lr['load_rank_s']:.2f} s")
        print(f"manifest: {res['manifest_bytes'] / 1e6:.1f} MB, {res['manifest_bytes_per_tensor']} B per source tensor")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
