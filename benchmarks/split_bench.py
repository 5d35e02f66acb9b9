"""Benchmark `tpshard split` / `check` / presharded loading against `cp -r` and a naive split.

    python benchmarks/split_bench.py [--layers 4] [--runs 3] [--workdir DIR] [--json out.json]
                                     [--reuse] [--keep] [--workers N] [--only CASES] [--check-growth] [--plain]

What it does, in one process:
1. writes a Llama-3-8B-shaped checkpoint (benchmarks/make_checkpoint.py) under --workdir
   (default /tmp/tpshard-bench), or reuses a complete one with --reuse;
2. reads the source once, untimed, so that every case starts from a warm page cache;
3. runs every case `--runs` times, round-robin (each round runs the cases in a rotated order),
   each as a fresh child process, with `sync` before every case and the output dropped after it;
4. prints medians: wall time including the `sync` that flushes the case's writes, peak RSS
   (the child's ru_maxrss from wait4, which covers reaped grandchildren as a max, not a sum) and a
   sampled peak of anonymous RSS over the child's process tree (file-backed mmap pages excluded),
   and the ratio of each case's time to `cp -r`. Load cases report the time of the load itself
   (measured inside the child, after imports) and the ratio to slicing from the source as engines do.

Cases: cp (the floor), naive (benchmarks/naive_split.py --tp 8), naive-load (rank 0 of the naive
output via safe_open), split (`tpshard split --tp 8`), check (`tpshard check` on that output),
load-presharded (tpshard.load_rank(out, 0) on an output split once up front), split-dp
(`tpshard split --tp 8 --attn-dp 2`), load-engine (rank 0 cut from the source at load time the
way vLLM's and SGLang's default loaders do: every full tensor, then narrow), load-slice (the best
case of slicing at load: safe_open get_slice reads only the rank's bytes). Cases whose tpshard
piece is missing are skipped with a note.

--check-growth also writes the --growth-layers (default 8) checkpoint and reports how peak memory
of `tpshard split --tp 8` (and of the naive split, for contrast) grows with the model: a streaming
split should stay flat.
"""

from __future__ import annotations

import argparse
import compileall
import functools
import json
import mmap
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import make_checkpoint  # noqa: E402

TP = 8
ATTN_DP = 2
READ_CHUNK = 16 * 1024 * 1024
SETTLE_S = 3.0  # idle time after deleting an output, before the next case (--settle)


# ---------------------------------------------------------------------------------------------
# Child programs (run as `python split_bench.py _child KIND ...` in a fresh process)
# ---------------------------------------------------------------------------------------------


def _child(argv: list[str]) -> int:
    """Load one rank and print {"load_s", "bytes", "tensors"} as JSON on the last stdout line.

    Every tensor is copied into a freshly allocated tensor, as an engine's weight_loader copies a
    loaded weight into its parameter; the same on every path, so the paths compare fairly."""
    kind = argv[0]
    # Imported before the clock starts: the load is timed, not the interpreter (after a dropped
    # page cache, importing would otherwise read modules from disk inside the timed region).
    import naive_split as ns
    import torch
    from safetensors import safe_open

    import tpshard

    params: dict[str, torch.Tensor] = {}

    def keep(name: str, t: torch.Tensor) -> None:
        p = torch.empty(t.shape, dtype=t.dtype)
        p.copy_(t)
        params[name] = p

    t0 = time.perf_counter()
    if kind == "load-presharded":
        out, rank = argv[1], int(argv[2])
        # load_rank copies every tensor into memory the process owns, as keep() does for the others.
        params.update(tpshard.load_rank(out, rank))
    elif kind == "load-naive":
        out, rank = Path(argv[1]), int(argv[2])
        with safe_open(str(out / f"rank-{rank:03d}" / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                keep(name, f.get_tensor(name))
    elif kind in ("load-slice", "load-engine"):
        model, rank, tp, attn_dp = Path(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
        lay = ns.load_layout(model, tp, attn_dp)
        for path in ns.source_files(model):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    # load-engine: what vLLM's and SGLang's default loaders do (every full tensor
                    # from the iterator, then narrow in weight_loader); load-slice: the best case
                    # of slicing at load, reading only the rank's bytes with get_slice.
                    sl = f.get_slice(name) if kind == "load-slice" else f.get_tensor(name)
                    shape = sl.get_shape() if kind == "load-slice" else list(sl.shape)
                    s = ns.rank_slice(name, shape, lay, rank)
                    if s.dim < 0:
                        t = sl[:]
                    elif s.dim == 0:
                        t = sl[s.start : s.start + s.length]
                    else:
                        t = sl[:, s.start : s.start + s.length]
                    if s.pad:
                        p = torch.zeros((s.length + s.pad,) + tuple(shape[1:]), dtype=t.dtype)
                        p[: s.length].copy_(t)
                        params[name] = p
                    else:
                        keep(name, t)
    else:
        raise SystemExit(f"unknown child kind {kind}")
    load_s = time.perf_counter() - t0
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    print(json.dumps({"load_s": load_s, "bytes": nbytes, "tensors": len(params)}))
    return 0


# ---------------------------------------------------------------------------------------------
# Measuring one child
# ---------------------------------------------------------------------------------------------


def _tree_pids(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return pids


def _rss_kib(pid: int) -> tuple[int, int]:
    anon = file = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    anon = int(line.split()[1])
                elif line.startswith("RssFile:"):
                    file = int(line.split()[1])
    except OSError:
        pass
    return anon, file


class _Sampler(threading.Thread):
    """Polls the child's process tree for RssAnon / RssFile sums; keeps the peaks (KiB)."""

    def __init__(self, pid: int, interval: float = 0.02):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak_anon = self.peak_file = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            anon = file = 0
            for p in _tree_pids(self.pid):
                a, f = _rss_kib(p)
                anon, file = anon + a, file + f
            self.peak_anon = max(self.peak_anon, anon)
            self.peak_file = max(self.peak_file, file)
            self.stop.wait(self.interval)


@dataclass
class Sample:
    ok: bool
    wall_s: float  # child start to exit
    sync_s: float  # the sync right after it: flushing what it wrote
    maxrss_mib: float
    anon_mib: float
    file_mib: float
    cpu_s: float = 0.0  # user + system time of the child and everything it waited for
    loadavg: float = 0.0  # 1-minute load average when the case started (other work on the box)
    load_s: float | None = None
    load_bytes: int | None = None
    out_gib: float | None = None
    error: str = ""
    info: dict = field(default_factory=dict)  # the JSON object the child printed last, if any

    @property
    def total_s(self) -> float:
        return self.wall_s + self.sync_s


@functools.cache
def compile_package(tree: Path = REPO) -> None:
    """Write the bytecode of `tree`'s tpshard (its __pycache__, git-ignored) before anything is
    timed, as a pip install leaves it: where PYTHONDONTWRITEBYTECODE is set (this project's VMs set
    it), every child would otherwise compile the package's ~90 modules from source, ~60 ms a run on
    this VM (5 % of a split of 9k tensors). Python reads existing bytecode whatever that variable says."""
    compileall.compile_dir(str(tree / "tpshard"), quiet=1)


def _env(tree: Path = REPO) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(HERE)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    return env


TIME = "/usr/bin/time"


def meminfo(field: str) -> int:
    """A field of /proc/meminfo in bytes (MemTotal, MemFree: memory no page cache holds,
    MemAvailable); 0 where there is none."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def prefault(nbytes: int) -> None:
    """Touch `nbytes` of new memory, a byte a page, and free it again.

    This project's VMs (Firecracker, free page reporting: `page_reporting` in dmesg) hand memory
    that stays free ~2 s back to their host, and a page touched again is faulted in from the host:
    a `cp -r` of 1 GiB took 0.4 s or 1.3-3.8 s of system time by whether its page cache found such
    pages (docs/performance.md). Touched and freed right before a case, the pages it allocates are
    the guest's own again, as on a machine of its own. At most the free memory less 512 MiB: never
    so much that the page cache (the warm source) is pushed out."""
    nbytes = min(nbytes, meminfo("MemFree") - (512 << 20))
    if nbytes > 0:
        with mmap.mmap(-1, nbytes) as m:
            for at in range(0, nbytes, mmap.PAGESIZE):
                m[at] = 1


def measure(cmd: list[str], out: Path | None = None, tree: Path = REPO, prefault_bytes: int = 0) -> Sample:
    """Run `cmd` as a fresh child after a sync, in `tree` (a checkout whose tpshard it imports:
    this one unless benchmarks/pairs.py times another); time it, its sync, and its memory; with
    `prefault_bytes`, that much memory is touched and freed just before (`prefault`).

    Peak RSS comes from GNU time (%M) when /usr/bin/time exists: a child forked straight from this
    Python process would inherit this process's RSS high-water mark in its ru_maxrss (Linux keeps
    the larger of the old and new mm's peaks across exec, and subprocess forks with vfork)."""
    compile_package(tree)
    os.sync()
    prefault(prefault_bytes)
    use_time = os.access(TIME, os.X_OK)
    with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se, tempfile.NamedTemporaryFile("r") as tf:
        full = [TIME, "-f", "%M", "-o", tf.name, *cmd] if use_time else cmd
        loadavg = os.getloadavg()[0]
        t0 = time.perf_counter()
        proc = subprocess.Popen(full, stdout=so, stderr=se, env=_env(tree), cwd=str(tree))
        sampler = _Sampler(proc.pid)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        sampler.stop.set()
        sampler.join()
        t1 = time.perf_counter()
        os.sync()
        sync_s = time.perf_counter() - t1
        so.seek(0)
        se.seek(0)
        stdout, stderr = so.read().decode(errors="replace"), se.read().decode(errors="replace")
        maxrss_kib = usage.ru_maxrss
        if use_time:
            lines = [ln for ln in tf.read().splitlines() if ln.strip()]
            if lines and lines[-1].strip().isdigit():
                maxrss_kib = int(lines[-1])
    s = Sample(
        ok=proc.returncode == 0,
        wall_s=wall,
        sync_s=sync_s,
        maxrss_mib=maxrss_kib / 1024,
        anon_mib=sampler.peak_anon / 1024,
        file_mib=sampler.peak_file / 1024,
        cpu_s=usage.ru_utime + usage.ru_stime,
        loadavg=loadavg,
    )
    if not s.ok:
        tail = (stderr.strip() or stdout.strip()).splitlines()[-6:]
        s.error = f"exit {proc.returncode}: " + " | ".join(tail)
        return s
    lines = stdout.strip().splitlines()
    if lines and lines[-1].startswith("{"):
        try:
            s.info = json.loads(lines[-1])
            s.load_s, s.load_bytes = s.info.get("load_s"), s.info.get("bytes")
        except ValueError:
            pass
    if out is not None and out.exists():
        s.out_gib = dir_bytes(out) / 2**30
    return s


def dir_bytes(path: Path) -> int:
    """Bytes on disk under `path`, hard-linked files counted once."""
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total


def drop(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)
    os.sync()
    # Freeing GBs of just-written pages goes on in the kernel after unlink returns; whatever ran
    # next paid for it (here: +40 % on the case after cp). Let it settle before the next case.
    time.sleep(SETTLE_S)


def drop_caches() -> None:
    """Empty the page cache (root only): the next read comes from the disk."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm(model: Path) -> float:
    """Read every file of `model` once (untimed for the benchmark), so the page cache is warm."""
    t = time.perf_counter()
    buf = bytearray(READ_CHUNK)
    for p in sorted(model.rglob("*")):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------
# tpshard availability
# ---------------------------------------------------------------------------------------------


@dataclass
class Tpshard:
    cmd: list[str] | None = None
    split: bool = False
    check: bool = False
    open_rank: bool = False
    notes: list[str] = field(default_factory=list)


def prepare(work: Path, layers: int, tp: int, reuse: bool) -> tuple[Path, Path]:
    """A Llama-shaped checkpoint of `layers` layers under `work` and its tpshard split for `tp`
    (kept with `reuse`): what export_bench and reshard_bench start from."""
    ckpt = work / f"ckpt-{layers}l"
    if not (reuse and make_checkpoint.is_complete(ckpt, layers)):
        shutil.rmtree(ckpt, ignore_errors=True)
        make_checkpoint.make_checkpoint(ckpt, layers=layers, quiet=True)
    out = work / f"out-{layers}l-tp{tp}"
    if not (reuse and (out / "tpshard-manifest.json").is_file()):
        shutil.rmtree(out, ignore_errors=True)
        sample = measure([sys.executable, "-m", "tpshard", "split", str(ckpt), "-o", str(out), "--tp", str(tp)])
        if not sample.ok:
            raise SystemExit(f"split failed: {sample.error}")
    return ckpt, out


def summary(samples: dict[str, list]) -> list[dict]:
    """Medians per case of measure() samples, x `cp` (the case named "cp"): export_bench, reshard_bench."""
    med = statistics.median
    cp = med([s.total_s for s in samples["cp"]])
    rows = []
    for name, ss in samples.items():
        t = med([s.total_s for s in ss])
        rows.append({
            "case": name, "time_s": round(t, 2), "cpu_s": round(med([s.cpu_s for s in ss]), 2), "x_cp": round(t / cp, 2),
            "maxrss_mib": round(med([s.maxrss_mib for s in ss])), "anon_mib": round(med([s.anon_mib for s in ss])),
            "out_gib": round(ss[0].out_gib or 0, 2), "loadavg": round(med([s.loadavg for s in ss]), 1),
        })  # fmt: skip
    return rows


def markdown_table(rows: list[dict]) -> str:
    """summary()'s rows as the table docs/performance.md quotes."""
    lines = ["| case | time s | cpu s | x cp | peak RSS MiB (anon) | written GiB | load avg |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['time_s']} | {r['cpu_s']} | {r['x_cp']} | {r['maxrss_mib']} ({r['anon_mib']}) | {r['out_gib']} | {r['loadavg']} |" for r in rows]
    return "\n".join(lines)


def _runs_ok(cmd: list[str]) -> tuple[bool, str]:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=str(REPO), timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    msg = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or [""]
    return r.returncode == 0, msg[0]


def find_tpshard(override: str | None) -> Tpshard:
    ts = Tpshard()
    candidates = []
    if override:
        candidates.append(shlex.split(override))
    else:
        candidates.append([sys.executable, "-m", "tpshard"])
        if shutil.which("tpshard"):
            candidates.append(["tpshard"])
    why = ""
    for cmd in candidates:
        ok_split, why_split = _runs_ok(cmd + ["split", "--help"])
        ok_check, why_check = _runs_ok(cmd + ["check", "--help"])
        if ok_split or ok_check:
            ts.cmd, ts.split, ts.check = cmd, ok_split, ok_check
            if not ok_split:
                ts.notes.append(f"`{shlex.join(cmd)} split` not available ({why_split}); split rows skipped")
            if not ok_check:
                ts.notes.append(f"`{shlex.join(cmd)} check` not available ({why_check}); check row skipped")
            break
        why = why_split
    else:
        ts.notes.append(f"tpshard CLI not available ({why}); split/check rows skipped")
    ok, why = _runs_ok([sys.executable, "-c", "from tpshard import load_rank"])
    ts.open_rank = ok
    if not ok:
        ts.notes.append(f"tpshard.load_rank not importable ({why}); load-presharded row skipped")
    return ts


# ---------------------------------------------------------------------------------------------
# Cases and rounds
# ---------------------------------------------------------------------------------------------

CASES = {
    # name: (label, kind) -- "copy" rows compare to cp, "load" rows to load-engine, "cold" to load-engine-cold
    "cp": ("cp -r checkpoint (floor)", "copy"),
    "naive": (f"naive split --tp {TP}", "copy"),
    "naive-load": ("load rank 0: naive per-rank file", "load"),
    "split": (f"tpshard split --tp {TP}", "copy"),
    "check": ("tpshard check (split output)", "copy"),
    "load-presharded": ("load rank 0: tpshard.load_rank", "load"),
    "split-dp": (f"tpshard split --tp {TP} --attn-dp {ATTN_DP}", "copy"),
    "load-slice": ("load rank 0: get_slice from source", "load"),
    "load-engine": ("load rank 0: full tensors + narrow (engines)", "load"),
    # the same two loads from a cold page cache (a node that just started), with --cold
    "load-presharded-cold": ("cold cache: tpshard.load_rank", "cold"),
    "load-engine-cold": ("cold cache: full tensors + narrow (engines)", "cold"),
}
# Blocks run together (later cases use the first one's output); rounds rotate the block order.
BLOCKS = [
    ["cp"], ["naive", "naive-load"], ["split", "check"], ["load-presharded"], ["split-dp"], ["load-slice"],
    ["load-engine"], ["load-presharded-cold"], ["load-engine-cold"],
]  # fmt: skip


class Bench:
    def __init__(self, model: Path, work: Path, ts: Tpshard, workers: int | None, only: set[str] | None, cold: bool = False):
        self.model, self.work, self.ts, self.workers, self.only = model, work, ts, workers, only
        self.cold = cold
        self.samples: dict[str, list[Sample]] = {name: [] for name in CASES}
        self.skipped: dict[str, str] = {}
        self.errors: list[str] = []

    def py(self, *args: str) -> list[str]:
        return [sys.executable, *args]

    def split_cmd(self, out: Path, attn_dp: int) -> list[str]:
        cmd = self.ts.cmd + ["split", str(self.model), "-o", str(out), "--tp", str(TP)]
        if attn_dp > 1:
            cmd += ["--attn-dp", str(attn_dp)]
        if self.workers:
            cmd += ["--workers", str(self.workers)]
        return cmd

    def wanted(self, name: str) -> bool:
        if CASES[name][1] == "cold" and not self.cold:
            return False
        return self.only is None or name in self.only

    def presharded(self) -> Path:
        out = self.work / "out-load"
        if not (out / "tpshard-manifest.json").exists():
            drop(out)
            subprocess.run(self.split_cmd(out, 1), check=True, capture_output=True, env=_env(), cwd=str(REPO))
            time.sleep(SETTLE_S)
        return out

    def load_cold(self, name: str, cmd: list[str]) -> None:
        """Measure a load from a cold page cache, then warm the source and the presharded output
        again (untimed): the warm cases after it must find them in memory."""
        drop_caches()
        self.record(name, measure(cmd))
        warm(self.model)
        warm(self.presharded())

    def skip(self, name: str, why: str) -> None:
        self.skipped.setdefault(name, why)

    def record(self, name: str, s: Sample) -> bool:
        self.samples[name].append(s)
        if not s.ok:
            self.errors.append(f"{name}: {s.error}")
        return s.ok

    def run_block(self, block: list[str]) -> None:
        w = self.work
        head = block[0]
        if not any(self.wanted(n) for n in block):
            return
        if head == "cp":
            out = w / "out-cp"
            self.record("cp", measure(["cp", "-r", str(self.model), str(out)], out))
            drop(out)
        elif head == "naive":
            out = w / "out-naive"
            ok = self.record("naive", measure(self.py(str(HERE / "naive_split.py"), str(self.model), "-o", str(out), "--tp", str(TP)), out))
            if ok and self.wanted("naive-load"):
                self.record("naive-load", measure(self.py(str(HERE / "split_bench.py"), "_child", "load-naive", str(out), "0")))
            drop(out)
        elif head == "split":
            if not self.ts.split:
                for n in block:
                    self.skip(n, "tpshard split not available")
                return
            out = w / "out-split"
            drop(out)
            ok = self.record("split", measure(self.split_cmd(out, 1), out))
            if ok and self.wanted("check"):
                if self.ts.check:
                    self.record("check", measure(self.ts.cmd + ["check", str(out), "--source", str(self.model)]))
                else:
                    self.skip("check", "tpshard check not available")
            drop(out)
        elif head == "split-dp":
            if not self.ts.split:
                self.skip("split-dp", "tpshard split not available")
                return
            out = w / "out-split-dp"
            drop(out)
            self.record("split-dp", measure(self.split_cmd(out, ATTN_DP), out))
            drop(out)
        elif head in ("load-presharded", "load-presharded-cold"):
            # From an output split once, untimed, at the start: a load right after a timed split
            # would pay for the kernel still settling the gigabytes just written.
            if not self.ts.open_rank:
                self.skip(head, "tpshard.load_rank not available")
                return
            cmd = self.py(str(HERE / "split_bench.py"), "_child", "load-presharded", str(self.presharded()), "0")
            if head == "load-presharded":
                self.record(head, measure(cmd))
            else:
                self.load_cold(head, cmd)
        elif head in ("load-slice", "load-engine"):
            self.record(head, measure(self.py(str(HERE / "split_bench.py"), "_child", head, str(self.model), "0", str(TP), "1")))
        elif head == "load-engine-cold":
            self.load_cold(head, self.py(str(HERE / "split_bench.py"), "_child", "load-engine", str(self.model), "0", str(TP), "1"))

    def run(self, runs: int, log) -> None:
        for r in range(runs):
            order = BLOCKS[r % len(BLOCKS):] + BLOCKS[: r % len(BLOCKS)]
            for block in order:
                self.run_block(block)
                for n in block:
                    if self.samples[n] and len(self.samples[n]) == r + 1:
                        s = self.samples[n][-1]
                        extra = f" load {s.load_s:.2f}s" if s.load_s is not None else ""
                        state = "ok" if s.ok else "FAILED"
                        log(f"  round {r + 1}/{runs} {n:16s} {state} {s.total_s:7.2f}s (sync {s.sync_s:.2f}s){extra} maxrss {s.maxrss_mib:8.0f} MiB anon {s.anon_mib:8.0f} MiB")


def alternate(cases: dict[str, list[str]], out: Path | None, runs: int, log, before=None) -> dict[str, list[Sample]]:
    """Each command of `cases` (label -> argv, writing `out`) once per round, in order, for `runs`
    rounds, `before(label)` called before each and `out` (if any) dropped after each; the samples
    by label. A failed run raises RuntimeError."""
    samples: dict[str, list[Sample]] = {k: [] for k in cases}
    for run in range(runs):
        for label, cmd in cases.items():
            if before is not None:
                before(label)
            s = measure(cmd, out)
            if out is not None:
                drop(out)
            if not s.ok:
                raise RuntimeError(f"{label}: {s.error}")
            samples[label].append(s)
        log(f"round {run + 1}/{runs} done")
    return samples


def against_cp(samples: dict[str, list[Sample]]) -> dict[str, dict]:
    """Per label the medians (time, CPU, load) and peaks (RSS) of its samples, the time over the
    median of label "cp -r" (times to the millisecond: a tiny case's cp takes a few)."""
    cp = median([s.total_s for s in samples["cp -r"]])
    rows = {}
    for label, ss in samples.items():
        t = median([s.total_s for s in ss])
        rows[label] = dict(
            time_s=round(t, 3), x_cp=round(t / cp, 2), cpu_s=round(median([s.cpu_s for s in ss]), 2),
            maxrss_mib=round(max(s.maxrss_mib for s in ss)), anon_mib=round(max(s.anon_mib for s in ss)),
            loadavg=round(median([s.loadavg for s in ss]), 1),
        )  # fmt: skip
    return rows


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(bench: Bench) -> dict:
    rows = {}
    for name, (label, kind) in CASES.items():
        ok = [s for s in bench.samples[name] if s.ok]
        if not ok:
            continue
        rows[name] = {
            "label": label,
            "kind": kind,
            "runs": len(ok),
            "failed_runs": len(bench.samples[name]) - len(ok),
            "total_s": median([s.total_s for s in ok]),
            "wall_s": median([s.wall_s for s in ok]),
            "sync_s": median([s.sync_s for s in ok]),
            "load_s": median([s.load_s for s in ok]),
            "load_bytes": median([s.load_bytes for s in ok]),
            "cpu_s": median([s.cpu_s for s in ok]),
            "loadavg": median([s.loadavg for s in ok]),
            "maxrss_mib": median([s.maxrss_mib for s in ok]),
            "anon_mib": median([s.anon_mib for s in ok]),
            "file_mib": median([s.file_mib for s in ok]),
            "out_gib": median([s.out_gib for s in ok]),
            "samples": [asdict(s) for s in bench.samples[name]],
        }
    cp = rows.get("cp", {}).get("total_s")
    ref_load = {kind: rows.get(name, {}).get("load_s") for kind, name in (("load", "load-engine"), ("cold", "load-engine-cold"))}
    for row in rows.values():
        row["ratio_to_cp"] = row["total_s"] / cp if cp and row["kind"] == "copy" else None
        ref = ref_load.get(row["kind"])
        row["ratio_to_engine_load"] = row["load_s"] / ref if ref and row["load_s"] is not None else None
    return rows


PLAIN = False


def print_table(rows: dict, title: str) -> None:
    headers = ["case", "what", "runs", "time s", "(sync s)", "cpu s", "load s", "x cp", "x engine-load", "maxrss MiB", "anon MiB", "out GiB"]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    body = [
        [
            name, r["label"], str(r["runs"]), f(r["total_s"], ".2f"), f(r["sync_s"], ".2f"), f(r["cpu_s"], ".2f"), f(r["load_s"], ".2f"),
            f(r["ratio_to_cp"], ".2f"), f(r["ratio_to_engine_load"], ".2f"), f(r["maxrss_mib"], ".0f"),
            f(r["anon_mib"], ".0f"), f(r["out_gib"], ".2f"),
        ]
        for name, r in rows.items()
    ]
    try:
        if PLAIN:
            raise ImportError("plain output asked for")
        from rich.console import Console
        from rich.table import Table

        t = Table(title=title)
        for i, h in enumerate(headers):
            t.add_column(h, justify="left" if i < 2 else "right", no_wrap=True)
        for line in body:
            t.add_row(*line)
        Console(width=None if sys.stdout.isatty() else 200).print(t)
    except ImportError:
        widths = [max(len(h), *(len(line[i]) for line in body)) if body else len(h) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.ljust(w) if i < 2 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
        for line in body:
            print("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))


def get_checkpoint(work: Path, layers: int, reuse: bool, log) -> tuple[Path, dict]:
    path = work / f"llama3-8b-shape-{layers}L"
    if reuse and make_checkpoint.is_complete(path, layers):
        log(f"reusing checkpoint {path}")
        return path, {"reused": True}
    log(f"writing checkpoint {path} ({layers} layers) ...")
    info = make_checkpoint.make_checkpoint(path, layers=layers, quiet=True)
    t = time.perf_counter()
    os.sync()
    info["sync_s"] = time.perf_counter() - t
    log(f"  {info['total_bytes'] / 2**30:.2f} GiB in {info['seconds']:.1f}s + sync {info['sync_s']:.1f}s")
    return path, info


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return _child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4, help="decoder layers in the checkpoint (default 4, ~3.6 GiB)")
    ap.add_argument("--runs", type=int, default=3, help="rounds; every case runs once per round (default 3)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "tpshard-bench")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--reuse", action="store_true", help="reuse a complete checkpoint in --workdir and keep it")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint(s) afterwards")
    ap.add_argument("--workers", type=int, help="passed to tpshard split as --workers")
    ap.add_argument("--tpshard-cmd", help="how to run the CLI (default: python -m tpshard, else tpshard on PATH)")
    ap.add_argument("--only", help="comma-separated cases to run: " + ",".join(CASES))
    ap.add_argument("--check-growth", action="store_true", help="also measure split memory at --growth-layers")
    ap.add_argument("--growth-layers", type=int, default=8)
    ap.add_argument("--plain", action="store_true", help="plain-text table instead of rich")
    ap.add_argument("--cold", action="store_true", help="also load from a cold page cache (root: drops caches)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds idle after deleting an output, before the next case")
    args = ap.parse_args(argv)
    global PLAIN, SETTLE_S
    SETTLE_S = args.settle
    PLAIN = args.plain
    only = set(args.only.split(",")) if args.only else None
    if only and only - set(CASES):
        ap.error(f"unknown cases: {', '.join(sorted(only - set(CASES)))}")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.glob("out-*"):
        drop(stale)
    result: dict = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30},
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "notes": [],
    }
    ts = find_tpshard(args.tpshard_cmd)
    result["tpshard_cmd"] = ts.cmd
    result["notes"] += ts.notes
    for n in ts.notes:
        log(f"note: {n}")
    generated: list[Path] = []
    try:
        model, info = get_checkpoint(work, args.layers, args.reuse, log)
        if not info.get("reused"):
            generated.append(model)
        result["checkpoint"] = {"path": str(model), "layers": args.layers, "bytes": dir_bytes(model), **info}
        log(f"warming page cache: {warm(model):.1f}s")
        measure([sys.executable, "-c", "import torch, safetensors"])  # warm the imports too
        bench = Bench(model, work, ts, args.workers, only, cold=args.cold)
        bench.run(args.runs, log)
        rows = summarize(bench)
        result["cases"] = rows
        result["skipped"] = bench.skipped
        result["errors"] = bench.errors
        print_table(rows, f"{args.layers}-layer Llama-3-8B-shaped checkpoint, {result['checkpoint']['bytes'] / 2**30:.2f} GiB, medians of {args.runs}")

        if args.check_growth:
            growth = check_growth(args, work, ts, rows, generated, log)
            result["growth"] = growth
        for name, why in bench.skipped.items():
            print(f"skipped {name}: {why}")
        for n in ts.notes:
            print(f"note: {n}")
        for e in bench.errors:
            print(f"error: {e}")
        notes = explain(rows)
        result["notes"] += notes
        for n in notes:
            print(n)
    finally:
        for stale in work.glob("out-*"):
            drop(stale)
        if not (args.keep or args.reuse):
            for g in generated:
                drop(g)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 1 if result.get("errors") else 0


def explain(rows: dict) -> list[str]:
    out = []
    busy = [r["loadavg"] for r in rows.values() if r["loadavg"] is not None]
    cpus = os.cpu_count() or 1
    if busy and max(busy) > 0.5 * cpus:
        out.append(f"warning: the machine was busy (1-min load average up to {max(busy):.1f} on {cpus} CPUs "
                   "at case starts); wall times are noisy, compare cpu s or rerun on a quiet machine")
    loaded = {n: r["load_bytes"] for n, r in rows.items() if r["kind"] == "load" and r["load_bytes"] is not None}
    if len(set(loaded.values())) > 1:
        out.append("warning: the load rows loaded different byte counts: "
                   + ", ".join(f"{n} {b}" for n, b in loaded.items()))
    for name in ("naive", "split", "split-dp", "check"):
        if name in rows and rows[name]["ratio_to_cp"] is not None:
            out.append(f"{CASES[name][0]}: {rows[name]['ratio_to_cp']:.2f}x the time of cp -r")
    if "load-presharded" in rows and rows["load-presharded"]["ratio_to_engine_load"] is not None:
        out.append(f"loading rank 0 presharded: {rows['load-presharded']['ratio_to_engine_load']:.2f}x "
                   "the time of slicing it from the source as engines do (full tensors, then narrow)")
    if rows.get("load-presharded-cold", {}).get("ratio_to_engine_load") is not None:
        out.append(f"cold cache: loading rank 0 presharded: {rows['load-presharded-cold']['ratio_to_engine_load']:.2f}x "
                   "the time of slicing it from the source as engines do")
    if "load-presharded" in rows and "load-slice" in rows:
        ratio = rows["load-presharded"]["load_s"] / rows["load-slice"]["load_s"]
        out.append(f"loading rank 0 presharded: {ratio:.2f}x the time of the best-case get_slice from the source")
    return out


def check_growth(args, work: Path, ts: Tpshard, rows: dict, generated: list[Path], log) -> dict:
    """Peak memory of the splits at --layers and --growth-layers; a streaming split stays flat."""
    big, info = get_checkpoint(work, args.growth_layers, args.reuse, log)
    if not info.get("reused"):
        generated.append(big)
    log(f"warming page cache: {warm(big):.1f}s")
    bench = Bench(big, work, ts, args.workers, {"naive", "split"})
    for r in range(args.runs):
        for block in (BLOCKS[1], BLOCKS[2]) if r % 2 == 0 else (BLOCKS[2], BLOCKS[1]):
            bench.run_block(block)
        log(f"  growth round {r + 1}/{args.runs} done")
    big_rows = summarize(bench)
    out: dict = {"layers": [args.layers, args.growth_layers], "cases": {}}
    gib = dir_bytes(big) / 2**30
    out["checkpoint_gib"] = gib
    print_table(big_rows, f"{args.growth_layers}-layer checkpoint, {gib:.2f} GiB, medians of {args.runs}")
    for name in ("split", "naive"):
        if name not in rows or name not in big_rows:
            if name == "split":
                out["note"] = "tpshard split not measured at both sizes; no growth figure"
                print(f"growth: {out['note']}")
            continue
        a, b = rows[name], big_rows[name]
        g = {
            "maxrss_mib": [a["maxrss_mib"], b["maxrss_mib"]],
            "anon_mib": [a["anon_mib"], b["anon_mib"]],
            "maxrss_growth_mib": b["maxrss_mib"] - a["maxrss_mib"],
            "anon_growth_mib": b["anon_mib"] - a["anon_mib"],
            "time_s": [a["total_s"], b["total_s"]],
        }
        out["cases"][name] = g
        print(f"{CASES[name][0]}: peak RSS {a['maxrss_mib']:.0f} -> {b['maxrss_mib']:.0f} MiB "
              f"({g['maxrss_growth_mib']:+.0f}), anon {a['anon_mib']:.0f} -> {b['anon_mib']:.0f} MiB "
              f"({g['anon_growth_mib']:+.0f}) from {args.layers} to {args.growth_layers} layers")
    return out


if __name__ == "__main__":
    sys.exit(main())
