"""Where a split's time goes on a checkpoint of many tensors, phase by phase, in one process.

    python benchmarks/split_phases.py CHECKPOINT --tp 8 [--attn-dp 2 --ep 8] [--workdir /tmp]

Times (wall and CPU seconds of this process, threads included) opening the checkpoint, make_plan,
the whole write (tpshard.writer.write_plan into a staging folder, fsync included) and, again on
their own afterwards, the pieces of the write that do not move tensor bytes: every output file's
header, every rank's model.safetensors.index.json and the manifest's encoding. The copy itself is
the write less those. Peak RSS is the process's, at the end.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's tpshard

from tpshard.checkpoint import open_checkpoint
from tpshard.manifest import encode_manifest, rank_index_pieces
from tpshard.plan import make_plan
from tpshard.topology import Topology
from tpshard.workers import default_workers
from tpshard.writer import write_plan


def timed(label: str, rows: list, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    rows.append((label, time.perf_counter() - wall, time.process_time() - cpu))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--attn-dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args(argv)
    topology = Topology(tp=args.tp, attn_dp=args.attn_dp, ep=args.ep)
    rows: list = []
    ckpt = timed("open the checkpoint (headers)", rows, lambda: open_checkpoint(args.checkpoint))
    plan = timed("make_plan", rows, lambda: make_plan(ckpt, topology))
    staging = Path(tempfile.mkdtemp(dir=args.workdir, prefix="tpshard-phases-"))
    try:
        ranks = list(range(topology.world_size))
        manifest = timed("write_plan (all of the write)", rows, lambda: write_plan(ckpt, plan, staging, ranks, default_workers(), None))
    finally:
        shutil.rmtree(staging)
    fresh = make_plan(ckpt, topology)
    timed("  of which: file headers", rows, lambda: [fresh.header(f.name) for f in fresh.files])
    timed("  of which: rank index files", rows, lambda: [b"".join(rank_index_pieces(fresh, r)) for r in ranks])
    timed("  of which: manifest encoding", rows, lambda: encode_manifest(manifest))
    shards = sum(len(t.cuts) for t in plan.tensors)
    print(f"{args.checkpoint}: {len(ckpt.tensors)} tensors, {shards} shards, {topology.describe()}")
    print(f"{'phase':40} {'wall s':>8} {'cpu s':>8} {'us/shard':>9}")
    for label, wall, cpu in rows:
        print(f"{label:40} {wall:8.2f} {cpu:8.2f} {wall / shards * 1e6:9.1f}")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
