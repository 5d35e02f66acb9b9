"""Benchmark `tpshard reshard` against `cp -r` of the output it reads and against a split from the source.

    python benchmarks/reshard_bench.py [--layers 2] [--runs 3] [--tp 8] [--to "--tp 4 --pp 2"]
                                       [--workdir DIR] [--reuse] [--json out.json]

A reshard reads every shard of the old output (twice: once to check it against its manifest, once
to reassemble each source tensor, the page cache serving the second) and writes the new output once.
`cp -r OUT` reads and writes the same volume once; a split reads the source once and writes the new
output: both are the references.

1. writes the Llama-3-8B-shaped checkpoint of split_bench.py (make_checkpoint.py) and splits it
   once at `--tp` (untimed): the old output;
2. reads the checkpoint and the old output once, untimed, so that every case starts from a warm
   page cache;
3. runs `cp -r OUT`, `tpshard reshard OUT --to...` and `tpshard split SOURCE --to...` `--runs` times,
   round-robin with the order rotated, each as a fresh child with a sync before and a timed sync
   after it (split_bench.measure), the result deleted after each; the first reshard's result is
   compared byte for byte with a split's before it is deleted;
4. prints medians of time, CPU time, ratio to cp and peak RSS (GNU time and sampled anonymous RSS),
   and the 1-minute load average (the machine may be shared: compare ratios of one run).
"""

from __future__ import annotations

import argparse
import filecmp
import json
import shlex
import shutil
import sys
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from split_bench import dir_bytes, drop, markdown_table, measure, prepare, summary, warm  # noqa: E402


def cases(ckpt: Path, out: Path, dest: Path, to: list[str]) -> dict[str, list[str]]:
    return {
        "cp": ["cp", "-r", str(out), str(dest)],
        "reshard": [sys.executable, "-m", "tpshard", "reshard", str(out), "-o", str(dest), *to],
        "split": [sys.executable, "-m", "tpshard", "split", str(ckpt), "-o", str(dest), *to],
    }


def identical(a: Path, b: Path) -> bool:
    for sub in [Path(".")] + sorted(p.relative_to(a) for p in a.iterdir() if p.is_dir()):
        names = sorted(p.name for p in (a / sub).iterdir() if p.is_file())
        if names != sorted(p.name for p in (b / sub).iterdir() if p.is_file()):
            return False
        _, mismatch, errors = filecmp.cmpfiles(a / sub, b / sub, names, shallow=False)
        if mismatch or errors:
            return False
    return True


def run(ckpt: Path, out: Path, work: Path, to: list[str], runs: int) -> tuple[dict[str, list], bool]:
    warm(ckpt)
    warm(out)
    dest, ref = work / "dest", work / "reference"
    drop(ref)
    sample = measure(cases(ckpt, out, ref, to)["split"])
    if not sample.ok:
        raise SystemExit(f"reference split failed: {sample.error}")
    same = None
    samples: dict[str, list] = {}
    names = list(cases(ckpt, out, dest, to))
    for r in range(runs):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            drop(dest)
            s = measure(cases(ckpt, out, dest, to)[name], dest)
            if not s.ok:
                raise SystemExit(f"{name} failed: {s.error}")
            if name == "reshard" and same is None:
                same = identical(ref, dest)
            samples.setdefault(name, []).append(s)
            print(f"  round {r + 1} {name}: {s.total_s:.2f} s, cpu {s.cpu_s:.2f} s, maxrss {s.maxrss_mib:.0f} MiB, load {s.loadavg:.1f}", file=sys.stderr)
    drop(dest)
    drop(ref)
    return samples, bool(same)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tp", type=int, default=8, help="topology of the old output")
    ap.add_argument("--to", default="--tp 4 --pp 2", help="topology of the new one (reshard / split options)")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tpshard-reshard-bench"))
    ap.add_argument("--reuse", action="store_true", help="keep and reuse the checkpoint and the old output")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    to = shlex.split(args.to)
    ckpt, out = prepare(args.workdir, args.layers, args.tp, args.reuse)
    print(f"{args.layers} layers: source {dir_bytes(ckpt) / 2**30:.2f} GiB, tp {args.tp} output {dir_bytes(out) / 2**30:.2f} GiB on disk", file=sys.stderr)
    samples, same = run(ckpt, out, args.workdir, to, args.runs)
    rows = summary(samples)
    print(f"\n{args.layers} layers, tp {args.tp} -> {args.to}, medians of {len(samples['cp'])}; reshard byte-identical to split: {same}")
    print(markdown_table(rows))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "identical": same, "samples": {k: [asdict(s) for s in v] for k, v in samples.items()}}, indent=1))
    if not args.reuse:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
