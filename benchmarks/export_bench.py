"""Benchmark `tpshard export` against `cp -r` of the tpshard output it reads, and its memory.

    python benchmarks/export_bench.py [--layers 4] [--runs 3] [--tp 8] [--format vllm] [--workdir DIR]
                                      [--reuse] [--check-growth] [--json out.json]

An export reads every shard of a tpshard output once and writes it once, concatenated (plus the
per-layer attention buffers): what `cp -r OUT` does, which also writes every rank's hard-linked
files as separate copies. So `cp -r` of the output is the floor, and the target is <= 1.2x it.

1. writes the Llama-3-8B-shaped checkpoint of split_bench.py (make_checkpoint.py) and splits it
   once (`--tp`, untimed);
2. reads the output once, untimed, so that both cases start from a warm page cache;
3. runs `cp -r OUT` and `tpshard export OUT --format F` `--runs` times, round-robin with the order
   rotated, each as a fresh child with a sync before and a timed sync after it (split_bench.measure),
   the copy or export deleted after each;
4. prints medians of time, CPU time, ratio to cp and peak RSS (GNU time and sampled anonymous RSS).

--check-growth repeats the export on a checkpoint with twice the layers: streaming memory stays flat.
The 1-minute load average is recorded with every sample: on a shared machine compare ratios of
one run, not times across runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from split_bench import dir_bytes, drop, markdown_table, measure, prepare, summary, warm  # noqa: E402


def cases(out: Path, dest: Path, fmt: str) -> dict[str, list[str]]:
    return {
        "cp": ["cp", "-r", str(out), str(dest)],
        "export": [sys.executable, "-m", "tpshard", "export", str(out), "-o", str(dest), "--format", fmt],
    }


def run(out: Path, work: Path, fmt: str, runs: int) -> dict[str, list]:
    warm(out)
    dest = work / "dest"
    samples: dict[str, list] = {}
    names = list(cases(out, dest, fmt))
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            drop(dest)
            s = measure(cases(out, dest, fmt)[name], dest)
            if not s.ok:
                raise SystemExit(f"{name} failed: {s.error}")
            samples.setdefault(name, []).append(s)
            print(f"  round {r + 1} {name}: {s.total_s:.2f} s, cpu {s.cpu_s:.2f} s, maxrss {s.maxrss_mib:.0f} MiB, load {s.loadavg:.1f}", file=sys.stderr)
    drop(dest)
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--format", default="vllm", choices=["vllm", "sglang"])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tpshard-export-bench"))
    ap.add_argument("--reuse", action="store_true", help="keep and reuse the checkpoints and split outputs")
    ap.add_argument("--check-growth", action="store_true", help="also export a checkpoint with twice the layers")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    result = {}
    for layers in [args.layers] + ([2 * args.layers] if args.check_growth else []):
        _, out = prepare(args.workdir, layers, args.tp, args.reuse)
        print(f"{layers} layers, tp {args.tp}: tpshard output {dir_bytes(out) / 2**30:.2f} GiB on disk", file=sys.stderr)
        samples = run(out, args.workdir, args.format, args.runs if layers == args.layers else 1)
        rows = summary(samples)
        result[f"{layers}l"] = {"rows": rows, "samples": {k: [asdict(s) for s in v] for k, v in samples.items()}}
        print(f"\n{layers} layers, tp {args.tp}, --format {args.format}, medians of {len(samples['cp'])}:")
        print(markdown_table(rows))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if not args.reuse:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
