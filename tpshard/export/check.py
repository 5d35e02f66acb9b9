"""check for an engine export: prove on a CPU that the files are what the engine must load.

The engines check almost nothing when they load (a short tensor is copied into a corner with a
warning, a file of another TP size loads into wrong weights), so this is where it is checked.

Without the source: the folder holds exactly the manifest's files (a stray file matching the
engine's glob would be read too), parts numbered from 0 for every rank, one key set on every rank
(of a pipeline stage) with no key twice, each file's size, its header byte for byte, every tensor's
digest and constant; with pipeline stages, every key on the stage vLLM builds it on and every stage
complete (layout.stage_problems: its layers, the first stage's embedding, the last's norm and head).
With the source: also that the manifest is what the rules and the engine's name table give for this
checkpoint, and every byte of every rank's copy of every shard, bit-exact against the checkpoint
(tpshard.check.reassemble, the same reassembly as for a tpshard output).
"""

from __future__ import annotations

import fnmatch
import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tpshard.check import CheckReport, check_source_sizes, range_digests, reassemble
from tpshard.checkpoint import open_checkpoint
from tpshard.digest import file_digest, sha256_file
from tpshard.errors import TpshardError
from tpshard.export.layout import PART_GLOBS, config_tied, export_layout, parse_part_name, partition_env, stage_problems
from tpshard.export.manifest import ExportFile, ExportManifest, read_export_manifest
from tpshard.export.writer import constant_bytes
from tpshard.manifest import shard_shape
from tpshard.plan import file_header, make_plan
from tpshard.safetensors_format import nbytes_of
from tpshard.workers import default_workers


def check_export(folder: str | Path, source: str | Path | None = None, *, workers: int | None = None) -> CheckReport:
    """Check the export at `folder` (and against the checkpoint at `source`); never raises on a mismatch."""
    folder = Path(folder)
    m = read_export_manifest(folder)
    report = CheckReport(out_dir=str(folder), source=str(source) if source else None)
    workers = workers or default_workers()
    _check_set(folder, m, report)
    env = dict(m.env) if m.env else {}
    if env != partition_env(m.from_.topology):
        report.add("stages", f"the manifest's launch environment {env} is not {partition_env(m.from_.topology)}, the stages' partition")
    _check_files(folder, m, report, workers)
    for extra in m.source.extra_files:
        path = folder / extra.name
        if not path.is_file():
            report.add("files", f"{extra.name} is missing (the engine builds the model from the source's config.json)")
        elif path.stat().st_size != extra.size or sha256_file(path) != extra.checksum:
            report.add("checksum", f"{extra.name}: sha256 differs from the source's copy")
    if source is not None:
        _check_against_source(folder, m, Path(source), report, workers)
    return report


def _check_set(folder: Path, m: ExportManifest, report: CheckReport) -> None:
    listed = {f.name for f in m.files}
    for name in sorted(os.listdir(folder)):
        if any(fnmatch.fnmatch(name, g) for g in PART_GLOBS) and name not in listed:
            report.add("files", f"{name}: not in the export manifest, but the engine's glob reads it (a stale file of another export?)")
    topo = m.from_.topology
    parts: dict[int, list[int]] = defaultdict(list)
    keys: dict[int, dict[str, tuple]] = defaultdict(dict)
    for f in m.files:
        parts[f.rank].append(parse_part_name(f.name, topo)[1])
        if not f.tensors:
            report.add("files", f"{f.name}: an empty part")
        for t in f.tensors:
            if t.name in keys[f.rank]:
                report.add("files", f"rank {f.rank}: {t.name} is in two parts (the engine raises KeyError on the second)")
            keys[f.rank][t.name] = (t.dtype, t.shape)
    for rank in range(topo.world_size):
        if sorted(parts[rank]) != list(range(len(parts[rank]))) or not parts[rank]:
            report.add("files", f"rank {rank}: parts {sorted(parts[rank])}, not 0..N-1")
    for rank in range(topo.world_size):
        first = topo.stage_ranks(topo.pp_rank(rank))[0]  # the ranks of one stage build one model
        if rank != first and keys[rank] != keys[first]:
            diff = sorted(set(keys[rank].items()) ^ set(keys[first].items()))[:3]
            report.add("files", f"rank {rank}: tensors differ from rank {first}'s in name, dtype or shape, e.g. {diff}")
    for problem in stage_problems({r: set(keys[r]) for r in range(topo.world_size)}, topo):
        report.add("stages", problem)


def _check_files(folder: Path, m: ExportManifest, report: CheckReport, workers: int) -> None:
    algorithm = m.from_.options.checksum

    def verify(f: ExportFile) -> list[tuple[str, str]]:
        path = folder / f.name
        if not path.is_file():
            return [("files", f"{f.name} is missing")]
        size = path.stat().st_size
        header, offsets = file_header([(t.name, t.dtype, t.shape) for t in f.tensors])
        want = (offsets[-1] + nbytes_of(f.tensors[-1].dtype, f.tensors[-1].shape)) if f.tensors else len(header)
        if size != f.size or size != want:
            return [("files", f"{f.name}: {size} bytes, the manifest says {f.size} (its tensors need {want}); truncated or extended")]
        found: list[tuple[str, str]] = []
        with open(path, "rb") as fh:
            if fh.read(len(header)) != header:
                return [("files", f"{f.name}: safetensors header differs from the manifest's names, dtypes and shapes")]
            sizes = [nbytes_of(t.dtype, t.shape) for t in f.tensors]
            digests = list(range_digests(fh.fileno(), offsets, sizes, algorithm))
            for t, offset, n, d in zip(f.tensors, offsets, sizes, digests):
                if d.hex() != t.digest:
                    found.append(("checksum", f"{f.name}: tensor {t.name} does not match its {algorithm} in the manifest"))
                if t.value is not None:
                    fh.seek(offset)
                    if fh.read(n) != constant_bytes(t.dtype, t.value):
                        found.append(("checksum", f"{f.name}: {t.name} does not hold the constant {t.value}"))
        if file_digest(header, digests) != f.checksum:
            found.append(("checksum", f"{f.name}: file checksum differs from the manifest"))
        return found

    with ThreadPoolExecutor(workers) as pool:
        for f, found in zip(m.files, pool.map(verify, m.files)):
            report.files_checked += 1
            report.bytes_checked += f.size
            for c, msg in found:
                report.add(c, msg)


def _check_against_source(folder: Path, m: ExportManifest, source: Path, report: CheckReport, workers: int) -> None:
    ckpt = open_checkpoint(source)
    check_source_sizes(ckpt, m.source.files, report, "exported")
    try:
        plan = make_plan(ckpt, m.from_.topology, m.from_.options)
        expected = export_layout(plan, m.engine, config_tied(ckpt.config), m.max_part_bytes, ckpt.config)
    except TpshardError as e:
        report.add("rules", f"the rules refuse this source for --format {m.engine}: {e}")
        return
    got = {f.name: f for f in m.files}
    for f in expected:
        have = got.pop(f.name, None)
        want = [(t.name, t.dtype, t.shape, tuple((s.name, s.group_rank) for s in t.parts), t.value) for t in f.tensors]
        held = [(t.name, t.dtype, tuple(t.shape), tuple(tuple(p) for p in t.parts), t.value) for t in have.tensors] if have else None
        if held is None:
            report.add("rules", f"{f.name}: the rules give this file, the manifest has none")
        elif held != want:
            diff = [(h, w) for h, w in zip(held, want) if h != w][:2] or f"{len(held)} tensors, the rules give {len(want)}"
            report.add("rules", f"{f.name}: manifest differs from the {m.engine} name table and the rules: {diff}")
    for name in got:
        report.add("rules", f"{name}: in the manifest, but the rules give no such file")
    if any(p.check == "rules" for p in report.problems):
        return

    cut_of = {(t.name, c.group_rank): (t, c) for t in plan.tensors for c in t.cuts}
    located: dict[str, list] = defaultdict(list)
    for f in m.files:
        _, offsets = file_header([(t.name, t.dtype, t.shape) for t in f.tensors])
        for t, offset in zip(f.tensors, offsets):
            at = offset
            for name, group_rank in t.parts:
                tensor, cut = cut_of[(name, group_rank)]
                located[tensor.source or tensor.name].append((tensor, cut, folder / f.name, at, f" [{f.name}]"))
                at += nbytes_of(tensor.dtype, shard_shape(tensor, cut))
    names = list(located)
    reassemble(ckpt, plan, names, lambda p: located[names[p]], report, workers)
