"""Engine start-up: vLLM's own loader, one rank, cold, from the HF folder against from the tpshard export.

    python benchmarks/engine_load.py [--cases llama-bf16,llama-fp8,dsv3-fp8] [--tp 8,4] [--rank 3]
        [--runs 3] [--export-runs 3] [--layers 8] [--experts 64] [--workdir DIR] [--json out.json]
        [--vllm-python /tmp/vllmvenv/bin/python] [--reuse] [--keep]

Issue 27's start-up figure. For each case it writes a checkpoint of random bytes (names, dtypes
and shapes of the real model: a split and a load never look at the values), splits it with
`tpshard split --tp N`, times `tpshard export OUT --format vllm` against `cp -r OUT` (alternated,
split_bench.alternate / against_cp; tp = the first of --tp only), keeps the export and removes the
split output. Then, per tp, it loads rank --rank with vLLM's own loader on this CPU
(examples/engine_load_vllm.py's `loader_for`: a one-process gloo world posing as that TP rank,
`get_model_loader(LoadConfig(...)).load_model` in full), each load in a fresh process of
--vllm-python, alternated round by round:

- `hf default`      load_format `auto` from the HF folder, safetensors_load_strategy None (vLLM's
                    default: mmap, lazy, on a local file system; it turns to `prefetch` by itself
                    only on nfs/nfs4/lustre when the checkpoint fits 90 % of available RAM);
- `export default`  load_format `sharded_state` from the export;
- `hf prefetch`     `auto` with safetensors_load_strategy="prefetch" (`--safetensors-load-strategy
                    prefetch`: vLLM reads its share of the files, files[rank::world_size] of the
                    torch.distributed world, into the page cache in background threads, while the
                    loader goes on reading every file; a node's ranks together read every file);
- `export prefetch` `sharded_state` with the same option. vLLM 0.33.0's ShardedStateLoader reads its
                    files with safe_open itself and never looks at the strategy: the row shows that.

Before each load, both folders leave the page cache: a sync, then posix_fadvise(POSIX_FADV_DONTNEED)
on every file; the pages still resident are counted with mincore(2) (0 expected, and reported).
The child times vLLM's own functions by wrapping them: `BaseModelLoader.load_model`, its
`create_model` (building the model) and the loader's `load_weights`; it reads /proc/self/io
(read_bytes: bytes the process made the kernel fetch from the disk, mmap faults and the prefetch
threads included; rchar: bytes of read() calls) around load_model, and again after vLLM's prefetch
thread has finished. The parent adds the child's wall time (interpreter and vLLM's imports
included), GNU time's peak RSS and the 1-minute load average (split_bench.measure).

Cases: `llama-bf16` / `llama-fp8` (Llama-3-8B's dims, --layers layers; FP8 block 128 x 128 with
F32 weight_scale_inv, as the tests' packer tests/quant_fixtures.py writes it, embedding, norms and
lm_head bf16), `dsv3-fp8` (DeepSeek-V3's real dims, two layers: one dense, one MoE with --experts of
its 256 routed experts; FP8 block as the release). The bytes per rank at the floor are the rank's
share: the size of its export files.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import make_checkpoint  # noqa: E402
import moe_bench  # noqa: E402
from quant_moe_bench import _fp8  # noqa: E402
from split_bench import against_cp, alternate, dir_bytes, measure, median, meminfo, warm  # noqa: E402

VLLM_PYTHON = "/tmp/vllmvenv/bin/python"
STRATEGIES = {"default": None, "prefetch": "prefetch"}  # label -> vLLM's safetensors_load_strategy
FP8_BLOCK = moe_bench.config(moe_bench.REAL)["quantization_config"]


# ---------------------------------------------------------------------------------------------
# The page cache and the process's I/O counters
# ---------------------------------------------------------------------------------------------


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


def drop_page_cache(folder: Path) -> None:
    """Evict every file under `folder` from the page cache: a sync (dirty pages are not dropped),
    then POSIX_FADV_DONTNEED on each file (no root needed, unlike /proc/sys/vm/drop_caches)."""
    os.sync()
    for p in files_of(folder):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def resident_bytes(path: Path) -> int:
    """Bytes of `path` (a file, or every file under a folder) in the page cache, by mincore(2) on a
    read-only mapping (what fincore(1) does; mapping and asking fault nothing in)."""
    path = Path(path)
    if path.is_dir():
        return sum(resident_bytes(p) for p in files_of(path))
    size = path.stat().st_size
    if size == 0:
        return 0
    page = mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap {path}")
        try:
            vec = (ctypes.c_ubyte * (-(-size // page)))()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore {path}")
            return sum(b & 1 for b in vec) * page
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/io as numbers (the whole process: every thread, live or ended)."""
    out = {}
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = int(value)
    return out


# ---------------------------------------------------------------------------------------------
# Checkpoints: (config.json, [(name, dtype, shape)]) written by moe_bench.write_random_checkpoint
# ---------------------------------------------------------------------------------------------


def llama(layers: int, fp8: bool) -> tuple[dict, list]:
    """Llama-3-8B's dims with `layers` layers; fp8: every linear of a layer in FP8 block."""
    config = make_checkpoint.llama_config(layers)
    items: list = []
    for name, shape in make_checkpoint.tensor_shapes(layers):
        if fp8 and name.endswith("_proj.weight"):
            _fp8(items, name.removesuffix(".weight"), *shape)
        else:
            items.append((name, "BF16", shape))
    if fp8:
        config["quantization_config"] = dict(FP8_BLOCK)
    return config, items


def dsv3(experts: int) -> tuple[dict, list]:
    """DeepSeek-V3's real dims, FP8 block: layer 0 dense, layer 1 MoE with `experts` routed experts."""
    dims = moe_bench.REAL._replace(LAYERS=2, DENSE=1, MTP=0, E=experts)
    return moe_bench.config(dims), moe_bench.tensors(dims)


CASES = {
    "llama-bf16": lambda a: llama(a.layers, fp8=False),
    "llama-fp8": lambda a: llama(a.layers, fp8=True),
    "dsv3-fp8": lambda a: dsv3(a.experts),
}


def write_case(name: str, args, path: Path) -> int:
    """The case's checkpoint at `path` (kept with --reuse when complete); its bytes of tensors."""
    config, items = CASES[name](args)
    total = sum(moe_bench.nbytes(d, s) for _, d, s in items)
    if not (args.reuse and (path / "config.json").is_file()):
        moe_bench.write_random_checkpoint(path, items, config, files=max(1, -(-total // (2 << 30))))
    return total


# ---------------------------------------------------------------------------------------------
# The child: one load with vLLM's loader, in the vLLM interpreter
# ---------------------------------------------------------------------------------------------


def _timed(cls, name: str, into: dict) -> None:
    """Wrap cls.name to add its seconds and read_bytes / rchar to into[name] (summed over calls)."""
    fn = getattr(cls, name)

    def wrapper(*a, **k):
        io, t = proc_io(), time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            end = proc_io()
            r = into.setdefault(name, {"s": 0.0, "read_bytes": 0, "rchar": 0})
            r["s"] += time.perf_counter() - t
            r["read_bytes"] += end["read_bytes"] - io["read_bytes"]
            r["rchar"] += end["rchar"] - io["rchar"]

    setattr(cls, name, wrapper)


def child(path: str, load_format: str, strategy: str, rank: int, tp: int) -> int:
    sys.path.insert(0, str(REPO / "examples"))
    from engine_load_vllm import loader_for

    options = {} if STRATEGIES[strategy] is None else {"safetensors_load_strategy": STRATEGIES[strategy]}
    build = loader_for(path, **options)
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.model_loader.sharded_state_loader import ShardedStateLoader

    times: dict = {}
    for cls, name in [(BaseModelLoader, "load_model"), (BaseModelLoader, "create_model"),
                      (DefaultModelLoader, "load_weights"), (ShardedStateLoader, "load_weights")]:  # fmt: skip
        _timed(cls, name, times)
    io0, t0 = proc_io(), time.perf_counter()
    model = build(rank, tp, path, load_format)
    io1, prefetch_end = proc_io(), None
    for t in threading.enumerate():  # vLLM's prefetch runs on in a daemon thread after load_model returns
        if "_run_prefetch" in t.name:
            t.join()
            prefetch_end = time.perf_counter() - t0
    io2 = proc_io()
    params = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    print(json.dumps({
        "times": times, "params_bytes": params,
        "read_bytes": io1["read_bytes"] - io0["read_bytes"], "rchar": io1["rchar"] - io0["rchar"],
        "read_bytes_with_prefetch": io2["read_bytes"] - io0["read_bytes"], "prefetch_end_s": prefetch_end,
    }))  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------------------
# The parent
# ---------------------------------------------------------------------------------------------


def rank_share(deploy: Path, rank: int) -> int:
    """Bytes of the export's files for `rank`: what that rank must read at the least."""
    return sum(p.stat().st_size for p in deploy.glob(f"model-rank-{rank}-part-*.safetensors"))


def load_cases(source: Path, deploy: Path, rank: int, tp: int, strategies: list[str], python: str) -> dict[str, tuple[Path, list[str]]]:
    """label -> (the folder it reads, the child's argv), the two sides alternating per strategy."""
    me = [python, str(Path(__file__).resolve()), "_child"]
    cases = {}
    for strategy in strategies:
        cases[f"hf {strategy}"] = (source, [*me, str(source), "auto", strategy, str(rank), str(tp)])
        cases[f"export {strategy}"] = (deploy, [*me, str(deploy), "sharded_state", strategy, str(rank), str(tp)])
    return cases


def cold_loads(source: Path, deploy: Path, rank: int, tp: int, args, log) -> dict:
    """Every load case --runs rounds, alternated, each after both folders left the page cache."""
    cases = load_cases(source, deploy, rank, tp, args.strategies, args.vllm_python)
    left: dict[str, list[int]] = {label: [] for label in cases}

    def before(label: str) -> None:
        for folder in (source, deploy):
            drop_page_cache(folder)
        left[label].append(resident_bytes(cases[label][0]))

    first = next(iter(cases))
    warmup = measure(cases[first][1])  # vLLM's own files into the page cache, untimed
    if not warmup.ok:
        raise RuntimeError(f"{first}: {warmup.error}")
    samples = alternate({k: argv for k, (_, argv) in cases.items()}, None, args.runs, log, before)
    return {"share": rank_share(deploy, rank), "samples": samples, "resident_before": left}


def _seconds(samples: list, name: str) -> float | None:
    """The median time of vLLM's function `name` over the samples (the child's "times")."""
    return _round(median([s.info["times"].get(name, {}).get("s") for s in samples]))


def load_rows(result: dict) -> dict[str, dict]:
    """Medians per label; bytes against the rank's share; load_weights against the hf side's."""
    share, rows = result["share"], {}
    for label, ss in result["samples"].items():
        read = median([s.info["read_bytes_with_prefetch"] for s in ss])
        rows[label] = dict(
            load_model_s=_seconds(ss, "load_model"), create_model_s=_seconds(ss, "create_model"),
            load_weights_s=_seconds(ss, "load_weights"), wall_s=round(median([s.wall_s for s in ss]), 2),
            read_mb=round(read / 1e6), rchar_mb=round(median([s.info["rchar"] for s in ss]) / 1e6),
            x_share=round(read / share, 2), resident_before=max(result["resident_before"][label]),
            prefetch_end_s=_round(median([s.info.get("prefetch_end_s") for s in ss])),
            maxrss_mib=round(max(s.maxrss_mib for s in ss)), loadavg=round(median([s.loadavg for s in ss]), 1),
            runs=len(ss),
        )  # fmt: skip
    for label, r in rows.items():
        hf = rows.get(label.replace("export", "hf"))
        if label.startswith("export") and hf and r["load_weights_s"]:
            r["hf_over_export_load_weights"] = round(hf["load_weights_s"] / r["load_weights_s"], 2)
            r["hf_over_export_load_model"] = round(hf["load_model_s"] / r["load_model_s"], 2)
    return rows


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


def tpshard(*args: str) -> None:
    s = measure([sys.executable, "-m", "tpshard", *args])
    if not s.ok:
        raise RuntimeError(f"tpshard {args[0]}: {s.error}")


def prepare_exports(name: str, source: Path, args, log) -> tuple[dict[int, Path], dict | None]:
    """Split and export for every tp (kept with --reuse); `export` against `cp -r` at the first."""
    deploys, vs_cp = {}, None
    for tp in args.tp:
        out, deploy = args.workdir / f"{name}-out-tp{tp}", args.workdir / f"{name}-vllm-tp{tp}"
        deploys[tp] = deploy
        if args.reuse and (deploy / "tpshard-export.json").is_file():
            continue
        shutil.rmtree(deploy, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
        tpshard("split", str(source), "-o", str(out), "--tp", str(tp))
        if tp == args.tp[0] and args.export_runs:
            warm(out)
            dest = args.workdir / "dest"
            cmds = {"cp -r": ["cp", "-r", str(out), str(dest)],
                    "export": [sys.executable, "-m", "tpshard", "export", str(out), "-o", str(dest), "--format", "vllm"]}  # fmt: skip
            vs_cp = against_cp(alternate(cmds, dest, args.export_runs, lambda m: log(f"{name} export vs cp: {m}")))
            vs_cp["out_gib"] = round(dir_bytes(out) / 2**30, 2)
        tpshard("export", str(out), "-o", str(deploy), "--format", "vllm")
        shutil.rmtree(out)
    return deploys, vs_cp


def machine() -> dict:
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "loadavg": os.getloadavg(),
            "mem_total_gib": round(meminfo("MemTotal") / 2**30, 1), "mem_available_gib": round(meminfo("MemAvailable") / 2**30, 1),
            "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip


def print_case(name: str, result: dict) -> None:
    print(f"\n{name}: checkpoint {result['bytes'] / 1e9:.2f} GB")
    if result.get("export_vs_cp"):
        print(f"export vs cp -r of the tp {result['tp'][0]} output ({result['export_vs_cp']['out_gib']} GiB):")
        for label in ("cp -r", "export"):
            r = result["export_vs_cp"][label]
            print(f"  {label:7} {r['time_s']:7.2f} s  x cp {r['x_cp']:.2f}  cpu {r['cpu_s']:.2f} s  load {r['loadavg']}")
    print("| tp, rank (share MB) | load | load_model s | create_model s | load_weights s | prefetch ends s | wall s | read MB | x share | rchar MB | hf/export load_weights | resident before | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for tp, per in result["loads"].items():
        for label, r in per["rows"].items():
            print(f"| {tp}, {per['rank']} ({per['share'] / 1e6:.0f}) | {label} | {r['load_model_s']} | {r['create_model_s']} | {r['load_weights_s']} | "
                  f"{r['prefetch_end_s'] or ''} | {r['wall_s']} | {r['read_mb']} | {r['x_share']} | {r['rchar_mb']} | {r.get('hf_over_export_load_weights', '')} | {r['resident_before']} | {r['loadavg']} |")  # fmt: skip


def run_case(name: str, args, log) -> dict:
    source = args.workdir / f"{name}-hf"
    total = write_case(name, args, source)
    log(f"{name}: {total / 1e9:.2f} GB of tensors in {source}")
    try:
        deploys, vs_cp = prepare_exports(name, source, args, log)
        loads = {}
        for tp, deploy in deploys.items():
            r = cold_loads(source, deploy, args.rank, tp, args, lambda m: log(f"{name} tp {tp}: {m}"))
            loads[tp] = {"rank": args.rank, "share": r["share"], "rows": load_rows(r),
                         "samples": {k: [asdict(s) for s in ss] for k, ss in r["samples"].items()}}  # fmt: skip
    finally:
        if not args.keep:
            for tp in args.tp:
                shutil.rmtree(args.workdir / f"{name}-vllm-tp{tp}", ignore_errors=True)
            shutil.rmtree(source, ignore_errors=True)
    return {"bytes": total, "tp": args.tp, "export_vs_cp": vs_cp, "loads": loads}


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="llama-bf16,llama-fp8,dsv3-fp8", help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--tp", default="8,4", help="comma-separated TP sizes; export vs cp -r runs at the first")
    ap.add_argument("--rank", type=int, default=3, help="the TP rank loaded (of every --tp)")
    ap.add_argument("--runs", type=int, default=3, help="rounds of cold loads")
    ap.add_argument("--export-runs", type=int, default=3, help="rounds of export against cp -r (0: none)")
    ap.add_argument("--strategies", default="default,prefetch", help=f"comma-separated, of {', '.join(STRATEGIES)}")
    ap.add_argument("--layers", type=int, default=8, help="Llama cases: decoder layers")
    ap.add_argument("--experts", type=int, default=64, help="dsv3-fp8: routed experts kept of 256")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/tpshard-engine-load"))
    ap.add_argument("--vllm-python", default=VLLM_PYTHON, help="an interpreter that imports vLLM 0.33.0 (CPU)")
    ap.add_argument("--reuse", action="store_true", help="keep using complete checkpoints and exports found in --workdir")
    ap.add_argument("--keep", action="store_true", help="leave the checkpoints and exports in --workdir")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:
        args.cases = [c for c in args.cases.split(",") if c]
        args.tp = [int(t) for t in args.tp.split(",") if t]
        args.strategies = [s for s in args.strategies.split(",") if s]
    except ValueError:
        ap.error(f"--tp {args.tp}: comma-separated integers")
    for opt, given, known in [("--cases", args.cases, CASES), ("--strategies", args.strategies, STRATEGIES)]:
        if not given or set(given) - set(known):
            ap.error(f"{opt}: choose from {', '.join(known)}")
    if not args.tp or any(t < 1 for t in args.tp) or not all(0 <= args.rank < t for t in args.tp):
        ap.error(f"--rank {args.rank} must be a rank of every --tp {args.tp}")
    if args.runs < 1 or args.export_runs < 0 or args.layers < 1 or args.experts < 1:
        ap.error("--runs, --layers and --experts must be at least 1, --export-runs at least 0")
    if not os.access(args.vllm_python, os.X_OK):
        ap.error(f"--vllm-python {args.vllm_python}: not an executable (see docs/deploy.md for the CPU vLLM recipe)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] load {os.getloadavg()[0]:.1f} {msg}", file=sys.stderr, flush=True)

    result = {"machine": machine(), "argv": sys.argv, "cases": {}}
    for name in args.cases:
        result["cases"][name] = run_case(name, args, log)
        print_case(name, result["cases"][name])
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
    result["machine"]["finished_loadavg"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_child"]:
        path, load_format, strategy, rank, tp = sys.argv[2:7]
        raise SystemExit(child(path, load_format, strategy, int(rank), int(tp)))
    raise SystemExit(main())
