"""check for an engine export: prove on a CPU that the files are what the engine must load.

The engines check almost nothing when they load (a short tensor is copied into a corner with a
warning, a file of another TP size loads into wrong weights), so this is where it is checked.

Without the source: the folder holds exactly the manifest's files (a stray file matching the
engine's glob would be read too), parts numbered from 0 for every rank, one key set on every rank
(of a pipeline stage) with no key twice, each file's size, its header byte for byte, every tensor's
digest and constant; with pipeline stages, every key on the stage vLLM builds it on and every stage
complete (layout.stage_problems: its layers, the first stage's embedding, the last's norm and head).
With the source: also that the copied files (config.json, tokenizer, ...) are the source's (as for a
tpshard output, tpshard.check.rules), that the manifest is what the rules and the engine's name table give for this
checkpoint, and every byte of every rank's copy of every shard, placed by the rules (the manifest
does not say which shards make a tensor), bit-exact against the checkpoint
(tpshard.check.reassembly.reassemble, the same reassembly as for a tpshard output).

The export's layout and names are tpshard.export's; this only proves a folder holds them.
"""

from __future__ import annotations

import fnmatch
import json
import os
from array import array
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

from tpshard.check.pipeline import check_stages_request
from tpshard.check.report import CheckReport
from tpshard.check.rules import check_copies_against_source, check_source_sizes
from tpshard.digest import file_digest, range_digests, sha256_file
from tpshard.errors import TpshardError
from tpshard.export.layout import PART_GLOBS, EngineTensor, PartFile, config_tied, constant_bytes, parse_part_name, partition_env, rank_layouts, stage_problems
from tpshard.export.manifest import ExportFile, ExportManifest, ExportTensor, read_export_manifest
from tpshard.manifest import FILE_METADATA, Plan, differing
from tpshard.safetensors_format import build_header, header_layout, nbytes_of
from tpshard.workers import default_workers

if TYPE_CHECKING:
    from tpshard.check.reassembly import Place
    from tpshard.checkpoint import Checkpoint


def check_export(
    folder: str | Path, source: str | Path | None = None, *, workers: int | None = None, pp: int | None = None,
    pp_layers: str | None = None, from_output: str | Path | None = None,
) -> CheckReport:  # fmt: skip
    """Check the export at `folder` (and against the checkpoint at `source`, or against the tpshard
    output `from_output` read as the source, as tpshard.check.check does); never raises on a
    mismatch. `pp` / `pp_layers`: the stages the server will run (tpshard.check.pipeline)."""
    folder = Path(folder)
    m = read_export_manifest(folder)
    report = CheckReport(out_dir=str(folder), source=str(source) if source else None, from_output=str(from_output) if from_output else None)
    workers = workers or default_workers()
    if pp is not None or pp_layers is not None:
        layers = _num_layers(folder, m, report)
        if layers is not None:
            check_stages_request(m.from_.topology, layers, pp, pp_layers, report)
    _check_set(folder, m, report)
    env = dict(m.env) if m.env else {}
    if env != partition_env(m.from_.topology):
        report.add("stages", f"the manifest's launch environment {env} is not {partition_env(m.from_.topology)}, the stages' partition")
    _check_files(folder, m, report, workers)
    for extra in m.source.extra_files:
        path = folder / extra.name
        if path.is_symlink():
            report.add("files", _link_finding(path))
        elif not path.is_file():
            report.add("files", f"{extra.name} is missing (the engine builds the model from the source's config.json)")
        elif extra.name == "config.json" and m.config:  # the source's, with what vLLM needs added (ConfigEdit)
            if path.stat().st_size != m.config.size or sha256_file(path) != m.config.checksum:
                report.add("checksum", f"config.json: sha256 differs from the one the export wrote (the source's, {sorted(m.config.added)} added)")
        elif path.stat().st_size != extra.size or sha256_file(path) != extra.checksum:
            report.add("checksum", f"{extra.name}: sha256 differs from the source's copy")
    if source is not None:
        from tpshard.checkpoint import open_checkpoint

        _check_against_source(folder, m, open_checkpoint(Path(source)), report, workers)
    elif from_output is not None:
        _check_from_output(folder, m, Path(from_output), report, workers)
    return report


def _num_layers(folder: Path, m: ExportManifest, report: CheckReport) -> int | None:
    """The model's decoder layers: its stages' at pp > 1, else its config.json's (the export's copy,
    checked against the manifest's sha256 as the export is); None, and a finding, without one."""
    topo = m.from_.topology
    if topo.pp > 1:
        return sum(topo.pp_layers)
    try:
        config = json.loads((folder / "config.json").read_bytes())
        layers = config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers")
        what = f"num_hidden_layers is {layers!r}"
    except (OSError, ValueError, AttributeError, RecursionError) as e:
        layers, what = None, f"unreadable ({e})"
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        report.add("stages", f"config.json: {what}; --pp and --pp-layers are checked against its num_hidden_layers")
        return None
    return layers


def _check_from_output(folder: Path, m: ExportManifest, old: Path, report: CheckReport, workers: int) -> None:
    """check --from on an export: `old` proven against its own manifest, then read as the source
    (tpshard.check.output_source), when it was split from the source this export records."""
    from tpshard.check.output_source import open_checked_source

    src = open_checked_source(old, report, workers, "the source given")
    if src is None:
        return
    with src.reader:
        if (m.source.path, m.source.files) != (src.manifest.source.path, src.manifest.source.files):
            report.add("rules", f"the export's source (path, file checksums) is not the one {old} records: not the checkpoint that was exported")
            return
        _check_against_source(folder, m, src.checkpoint, report, workers, src.reader)


def _check_set(folder: Path, m: ExportManifest, report: CheckReport) -> None:
    listed = {f.name for f in m.files}
    for name in sorted(os.listdir(folder)):
        if any(fnmatch.fnmatch(name, g) for g in PART_GLOBS) and name not in listed:
            report.add("files", f"{name}: not in the export manifest, but the engine's glob reads it (a stale file of another export?)")
    topo = m.from_.topology
    files: dict[int, list[tuple[int, ExportFile]]] = defaultdict(list)  # rank -> (part, file)
    for f in m.files:
        files[f.rank].append((parse_part_name(f.name, topo)[1], f))
        if not f.tensors:
            report.add("files", f"{f.name}: an empty part")
    # The ranks of a stage normally share their files' tensor tuples (read_export_manifest): their
    # keys are gathered once per distinct set of tuples.
    made: dict[tuple[int, ...], tuple[dict[str, tuple], list[str]]] = {}
    keys: dict[int, dict[str, tuple]] = {}
    for rank in range(topo.world_size):
        held = [f for _, f in sorted(files[rank], key=itemgetter(0))]
        parts = sorted(p for p, _ in files[rank])
        if parts != list(range(len(parts))) or not parts:
            report.add("files", f"rank {rank}: parts {parts}, not 0..N-1")
        ident = tuple(id(f.tensors) for f in held)
        if ident not in made:
            found: dict[str, tuple] = {}
            twice = []
            for f in held:
                for t in f.tensors:
                    if t.name in found:
                        twice.append(t.name)
                    found[t.name] = (t.dtype, t.shape)
            made[ident] = found, twice
        keys[rank], twice = made[ident]
        for name in twice:
            report.add("files", f"rank {rank}: {name} is in two parts (the engine raises KeyError on the second)")
    for rank in range(topo.world_size):
        first = topo.stage_ranks(topo.pp_rank(rank))[0]  # the ranks of one stage build one model
        if keys[rank] is not keys[first] and keys[rank] != keys[first]:
            diff = sorted(set(keys[rank].items()) ^ set(keys[first].items()))[:3]
            report.add("files", f"rank {rank}: tensors differ from rank {first}'s in name, dtype or shape, e.g. {diff}")
    if topo.pp > 1:
        for problem in stage_problems({r: set(keys[r]) for r in range(topo.world_size)}, topo):
            report.add("stages", problem)


def _link_finding(path: Path) -> str:
    """A symbolic link where the export has a file: tpshard writes none, and the bytes it points to
    may not travel with the folder (copied or mounted on the server), as in a tpshard output."""
    return f"{path.name} is a symbolic link to {os.readlink(path)}; an export holds plain files (the bytes a link points to may not travel with the folder)"


class _Layout(NamedTuple):
    """A file's header, each tensor's data offset and size: made once for the files that share
    one tuple of tensors (every TP rank of a stage)."""

    header: bytes
    offsets: list[int]
    sizes: list[int]


def _layout(tensors: tuple[ExportTensor, ...]) -> _Layout:
    header, offsets = build_header([(t.name, t.dtype, t.shape) for t in tensors], FILE_METADATA)  # tpshard.plan.file_header
    return _Layout(header, offsets, [nbytes_of(t.dtype, t.shape) for t in tensors])


def _check_files(folder: Path, m: ExportManifest, report: CheckReport, workers: int) -> None:
    algorithm = m.from_.options.checksum
    layouts: dict[int, _Layout] = {}
    for f in m.files:
        if id(f.tensors) not in layouts:
            layouts[id(f.tensors)] = _layout(f.tensors)

    def verify(f: ExportFile) -> list[tuple[str, str]]:
        path = folder / f.name
        if path.is_symlink():
            return [("files", _link_finding(path))]
        if not path.is_file():
            return [("files", f"{f.name} is missing")]
        size = path.stat().st_size
        header, offsets, sizes = layouts[id(f.tensors)]
        want = offsets[-1] + sizes[-1] if f.tensors else len(header)
        if size != f.size or size != want:
            return [("files", f"{f.name}: {size} bytes, the manifest says {f.size} (its tensors need {want}); truncated or extended")]
        found: list[tuple[str, str]] = []
        with open(path, "rb") as fh:
            if fh.read(len(header)) != header:
                return [("files", f"{f.name}: safetensors header differs from the manifest's names, dtypes and shapes")]
            digests = list(range_digests(fh.fileno(), offsets, sizes, algorithm))
            for k in differing(b"".join(digests), f.digests, algorithm):
                found.append(("checksum", f"{f.name}: tensor {f.tensors[k].name} does not match its {algorithm} in the manifest"))
            for t, offset, n in zip(f.tensors, offsets, sizes):
                if t.value is not None:
                    fh.seek(offset)
                    if fh.read(n) != constant_bytes(t.dtype, t.value, t.shape):
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


def _check_against_source(folder: Path, m: ExportManifest, ckpt: Checkpoint, report: CheckReport, workers: int, reader=None) -> None:
    """The copied files and the manifest's files against those the rules give for the source, rank
    by rank (the rules' engine tensors of one rank held at a time); then every byte against the
    checkpoint, placed by the rules' shards (the manifest does not store them). `reader`: where the
    source tensors are read (check --from: the old output's), else the checkpoint's files."""
    from tpshard.check.reassembly import reassemble
    from tpshard.plan import make_plan

    # The copies of config.json (what the engine builds the model from), tokenizer, ...: the
    # manifest's sha256 proves only that they are what was exported, not what the source holds.
    check_copies_against_source(ckpt, m.source.extra_files, report, "the export")
    before = report.found
    check_source_sizes(ckpt, m.source.files, report, "exported")
    got = {f.name: f for f in m.files}
    try:
        plan = make_plan(ckpt, m.from_.topology, m.from_.options)
        _check_config_edit(folder, m, ckpt, plan, report)
        located = _Located(plan, list(ckpt.tensors))
        for layout in rank_layouts(plan, m.engine, config_tied(ckpt.config), m.max_part_bytes, ckpt.config):
            for f in layout:
                have = got.pop(f.name, None)
                if have is None:
                    report.add("rules", f"{f.name}: the rules give this file, the manifest has none")
                    continue
                diff = [(h, w) for h, w in zip(have.tensors, f.tensors) if (h.name, h.dtype, h.shape, h.value) != (w.name, w.dtype, w.shape, w.value)]
                if diff or len(have.tensors) != len(f.tensors):
                    what = [((h.name, h.dtype, list(h.shape), h.value), (w.name, w.dtype, list(w.shape), w.value)) for h, w in diff[:2]]
                    what = what or f"{len(have.tensors)} tensors, the rules give {len(f.tensors)}"
                    report.add("rules", f"{f.name}: manifest differs from the {m.engine} name table and the rules: {what}")
                    continue
                located.add(f, folder / f.name)
            del layout  # or it would live on (every engine tensor of the rank) while the next is laid out
    except TpshardError as e:
        report.add("rules", f"the rules refuse this source for --format {m.engine}: {e}")
        return
    for name in got:
        report.add("rules", f"{name}: in the manifest, but the rules give no such file")
    if report.found != before:  # the rules refuse: nothing to reassemble
        return
    reassemble(ckpt, plan, located.names, located.places(), report, workers, reader)
    _check_transformed(ckpt, plan, located.transformed, report, reader)


def _check_transformed(ckpt: Checkpoint, plan: Plan, tensors: list, report: CheckReport, reader) -> None:
    """The quantized parameters that are not their shards' bytes back to back (fused along dim 1,
    cast: tpshard.export.quant), each slot cut from its source tensor as the rules place it and
    compared with the slot as read back out of the file; a slot holding another rank's shard, or
    another slot's, is named as such. Each source tensor proven in every place is counted."""
    import numpy as np

    from tpshard.export.quant import split_back
    from tpshard.pieces import read_into, shard_bytes

    cache: dict[str, np.ndarray] = {}

    def source_bytes(name: str) -> np.ndarray:
        if name not in cache:
            info = ckpt.tensors[name]
            if reader is not None:
                with reader.tensor(name, info) as (_, _, data):
                    cache[name] = np.array(data, np.uint8)
            else:
                fd = os.open(ckpt.path / info.file, os.O_RDONLY)
                try:
                    cache[name] = read_into(fd, np.empty(info.nbytes, np.uint8), info.begin, info.nbytes).copy()
                finally:
                    os.close(fd)
        return cache[name]

    def cut_of(part, cut) -> np.ndarray:
        name = part.tensor.source or part.tensor.name
        return shard_bytes(source_bytes(name), ckpt.tensors[name].shape, part.tensor.dim, cut, part.tensor.segments)

    seen, bad = set(), set()
    for file_name, path, t, at in tensors:
        with open(path, "rb") as fh:
            fh.seek(at)
            data = np.frombuffer(fh.read(t.nbytes), np.uint8)
        names = [p.tensor.source or p.tensor.name for p in t.parts]
        seen.update(names)
        if len(data) != t.nbytes:
            report.add("files", f"{file_name}: {t.name} ends early")
            bad.update(names)
            continue
        held = split_back(data, [p.shape for p in t.parts], [p.nbytes for p in t.parts], t.parts[0].dtype, t.dtype, t.axis, t.shape[0] if t.axis == 2 else 1, t.rotary)
        want = [cut_of(p, p.cut) for p in t.parts]
        for i, (part, h, w) in enumerate(zip(t.parts, held, want)):
            if np.array_equal(h, w):
                continue
            bad.add(names[i])
            what = f"{file_name}: {t.name} slot {i} ({part.name}, group rank {part.group_rank}) differs from the source"
            other = [c for c in part.tensor.cuts if c is not part.cut and np.array_equal(h, cut_of(part, c))]
            slot = [j for j, w2 in enumerate(want) if j != i and np.array_equal(h, w2)]
            if other:
                what += f": it holds the shard of rank(s) {list(plan.files[other[0].file].ranks)} (group rank {other[0].group_rank})"
            elif slot:
                what += f": it holds slot {slot[0]} ({t.parts[slot[0]].name}): slots out of order"
            report.add("reassembly", what)
    report.tensors_reassembled += len(seen - bad)


def _check_config_edit(folder: Path, m: ExportManifest, ckpt: Checkpoint, plan: Plan, report: CheckReport) -> None:
    """config.json: the source's with exactly what the rules add for vLLM (tpshard.export.quant.config_additions),
    and nothing else; without an addition it is a byte-identical copy (checked with the other copies)."""
    from tpshard.export.quant import config_additions, config_bytes

    source = ckpt.config  # the source's config.json as read (check --from: the output's copy of it)
    want = config_additions(plan, source) if m.engine == "vllm" else {}
    have = dict(m.config.added) if m.config else {}
    if have != want:
        report.add("rules", f"config.json: the export adds {sorted(have) or 'nothing'} to quantization_config, the rules add {sorted(want) or 'nothing'}")
        return
    if have:
        edited = dict(source, quantization_config={**source["quantization_config"], **have})
        try:
            held = (folder / "config.json").read_bytes()
        except OSError:
            return  # reported as missing with the copies
        if held != config_bytes(edited):
            report.add("rules", f"config.json: not the source's with exactly {sorted(have)} added to quantization_config")


class _Located:
    """Where the rules put every shard in the export's files, as reassemble asks for them (the
    places of one source tensor, made when it is compared): each place as numbers in flat arrays,
    24 bytes (a tuple per place, all held, was ~85 MB at tiny90k and tp 8). A shard is named by
    its place in the tpshard output (its file and index there, Part.index): Plan.member gives its
    tensor and cut back from the plan's own arrays."""

    def __init__(self, plan: Plan, names: list[str]):
        self.plan, self.names = plan, names
        self.position = {name: p for p, name in enumerate(names)}
        self.files: list[tuple[Path, str]] = []  # export file: (path, what a finding appends)
        # per place, in the order added: its source tensor, the shard's tpshard file and its index
        # there, the export file, the data offset
        self.source, self.held, self.index, self.file, self.offset = array("I"), array("I"), array("I"), array("I"), array("Q")
        self.transformed: list[tuple[str, Path, EngineTensor, int]] = []  # (file name, path, tensor, data offset)

    def add(self, f: PartFile, path: Path) -> None:
        """The places of the shards of the rules' file `f`, written at `path`."""
        _, offsets = header_layout([(t.name, t.dtype, t.shape) for t in f.tensors], FILE_METADATA)  # counted, not built
        k = len(self.files)
        self.files.append((path, f" [{f.name}]"))
        for t, at in zip(f.tensors, offsets):
            if t.transformed:  # not the shards' bytes back to back: compared by _check_transformed
                self.transformed.append((f.name, path, t, at))
                continue
            for part in t.parts:
                self.source.append(self.position[part.tensor.source or part.tensor.name])
                self.held.append(part.cut.file)
                self.index.append(part.index)
                self.file.append(k)
                self.offset.append(at)
                at += part.nbytes

    def places(self) -> Callable[[int], list[Place]]:
        """reassemble's `places`: the places of names[p], from the arrays grouped by source tensor
        (a counting sort; the arrays of source positions go)."""
        start = array("I", bytes(4 * (len(self.names) + 1)))
        for p in self.source:
            start[p + 1] += 1
        for p in range(len(self.names)):
            start[p + 1] += start[p]
        order, fill = array("I", bytes(4 * len(self.source))), array("I", start)
        for j, p in enumerate(self.source):
            order[fill[p]] = j
            fill[p] += 1
        del self.source
        member = self.plan.member

        def places(p: int) -> list[Place]:
            found = []
            for j in order[start[p] : start[p + 1]]:
                path, where = self.files[self.file[j]]
                found.append((*member(self.held[j], self.index[j]), path, self.offset[j], where))
            return found

        return places
