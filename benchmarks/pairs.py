"""Time `tpshard split` (and `check --source`) against `cp -r` and against another revision, pair by pair.

    python benchmarks/pairs.py CHECKPOINT [--start REV] [--check] [--runs 10] [--json out.json] [-- SPLIT ARGS]

Every round runs, each as a fresh child with split_bench's `measure` (sync before, the sync after
timed into the figure, peak RSS): `cp -r CHECKPOINT`, this checkout's `split CHECKPOINT SPLIT ARGS`
(default `--tp 8`) and, with `--start REV`, the same split from a worktree of REV (made under
--workdir, removed at the end); the order turns by one each round. `--check` adds
`check OUT --source CHECKPOINT` of each tree, on an output that tree split once up front. Before
each case `--prefault` GiB of memory is touched and freed (split_bench.prefault: on this project's
VMs a page left free is given back to the host, and the case that touches it next pays for that).

What it prints is a ratio per pair of one round (split over cp, this checkout over REV), as the
median and range over the rounds: two runs far apart in time see different states of the page
cache and of a VM's disk, one round's neighbours see the same. docs/performance.md quotes these
tables with the command line that printed them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import split_bench  # benchmarks/ is this script's folder, first on sys.path
from split_bench import REPO, dir_bytes, drop, measure, warm


def tree_of(rev: str, work: Path) -> Path:
    """A worktree of `rev` under `work` (detached: no branch is made)."""
    tree = work / f"tree-{rev.replace('/', '_')}"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(tree), rev], check=True)
    return tree


def tpshard(*args: str) -> list[str]:
    """The CLI of the tree a command runs in (measure's cwd and PYTHONPATH say which)."""
    return [sys.executable, "-m", "tpshard", *args]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def cases(model: Path, work: Path, trees: dict[str, Path], split_args: list[str], check: bool) -> dict[str, tuple[list[str], Path | None, Path]]:
    """label -> (argv, the output it writes or None, the tree it runs in)."""
    out = work / "out"
    found = {"cp -r": (["cp", "-r", str(model), str(out)], out, REPO)}
    for name, tree in trees.items():
        found[f"split {name}"] = (tpshard("split", str(model), "-o", str(out), *split_args), out, tree)
    if check:
        for name, tree in trees.items():
            kept = work / f"checked-{name}"
            subprocess.run(tpshard("split", str(model), "-o", str(kept), *split_args), check=True, capture_output=True, cwd=tree, env=split_bench._env(tree))
            found[f"check {name}"] = (tpshard("check", str(kept), "--source", str(model)), None, tree)
    return found


def rounds(found: dict, runs: int, log, prefault_bytes: int) -> dict[str, list]:
    samples: dict[str, list] = {label: [] for label in found}
    labels = list(found)
    for r in range(runs):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:
            argv, out, tree = found[label]
            if out is not None and out.exists():
                drop(out)  # the case before wrote it
            s = measure(argv, out, tree, prefault_bytes)
            if not s.ok:
                raise RuntimeError(f"{label}: {s.error}")
            samples[label].append(s)
        log(f"round {r + 1}/{runs} done (load {os.getloadavg()[0]:.1f})")
    return samples


def ratios(samples: dict[str, list], a: str, b: str) -> dict:
    """a over b, round by round: median, min, max."""
    xs = [sa.total_s / sb.total_s for sa, sb in zip(samples[a], samples[b])]
    return {"of": a, "over": b, "median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}


def report(samples: dict[str, list], trees: dict[str, Path]) -> dict:
    rows = {
        label: {
            "time_s": round(statistics.median(s.total_s for s in ss), 3),
            "cpu_s": round(statistics.median(s.cpu_s for s in ss), 2),
            "maxrss_mib": round(max(s.maxrss_mib for s in ss)),
            "loadavg": round(statistics.median(s.loadavg for s in ss), 1),
            "each": [[round(s.wall_s, 6), round(s.sync_s, 6), round(s.cpu_s, 3)] for s in ss],  # wall, sync, cpu by round
        }
        for label, ss in samples.items()
    }
    pairs = []
    for kind in ("split", "check"):
        if f"{kind} now" not in samples:
            continue
        pairs.append(ratios(samples, f"{kind} now", "cp -r"))
        if "start" in trees:
            pairs.append(ratios(samples, f"{kind} now", f"{kind} start"))
    return {"rows": rows, "pairs": pairs}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split_args = ["--tp", "8"]
    if "--" in argv:
        at = argv.index("--")
        argv, split_args = argv[:at], argv[at + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--start", metavar="REV", help="also time the split (and check) of this git revision")
    ap.add_argument("--check", action="store_true", help="also time check --source of each tree's output")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--settle", type=float, default=0.0, help="seconds idle after each deletion (split_bench's --settle)")
    ap.add_argument("--prefault", type=float, metavar="GIB", help="memory touched and freed before each case (split_bench.prefault; default: twice the checkpoint, at most the free memory less 512 MiB; 0: none)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="a new folder in it holds the outputs and the worktree, removed at the end")
    ap.add_argument("--json", type=Path, help="write the figures here too")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    if not (args.checkpoint / "config.json").is_file():
        ap.error(f"{args.checkpoint}: not a checkpoint folder (no config.json)")
    split_bench.SETTLE_S = args.settle
    args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="tpshard-pairs-", dir=args.workdir))
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    trees = {"now": REPO}
    try:
        if args.start:
            trees["start"] = tree_of(args.start, work)
        found = cases(args.checkpoint.resolve(), work, trees, split_args, args.check)
        log(f"source read in {warm(args.checkpoint):.2f} s (untimed: every case starts from a warm page cache)")
        prefault_bytes = int(args.prefault * 2**30) if args.prefault is not None else 2 * dir_bytes(args.checkpoint)
        result = report(rounds(found, args.runs, log, prefault_bytes), trees)
    finally:
        if "start" in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["start"])], check=False)
        shutil.rmtree(work)
    result |= {"checkpoint": str(args.checkpoint), "split_args": split_args, "start": args.start, "runs": args.runs, "prefault_bytes": prefault_bytes,
               "cpu": cpu_model(), "cpus": os.cpu_count()}  # fmt: skip
    for label, row in result["rows"].items():
        print(f"{label:<12} {row['time_s']:8.3f} s  cpu {row['cpu_s']:6.2f} s  {row['maxrss_mib']:5d} MiB  load {row['loadavg']}")
    for p in result["pairs"]:
        print(f"{p['of']} / {p['over']}: {p['median']:.2f} x ({p['min']:.2f}-{p['max']:.2f}), {args.runs} pairs")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
