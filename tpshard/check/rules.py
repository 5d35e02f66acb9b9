"""check against the source, before any byte is compared: the manifest is what the rules give for
this checkpoint with its topology and options (check_rules), the source's weight files are the
size the split read (check_source_sizes), and the copied files equal the source's
(check_extras_against_source).

The rules themselves are tpshard.plan's; the byte-for-byte comparison is tpshard.check.reassembly's.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from tpshard.check.report import CheckReport, shard_text
from tpshard.digest import sha256_file
from tpshard.errors import TpshardError
from tpshard.manifest import Manifest, ManifestFrame, Options, Plan, manifest_with_tensors, plan_differences, read_manifest
from tpshard.topology import Topology

if TYPE_CHECKING:
    from tpshard.checkpoint import Checkpoint
    from tpshard.manifest.records import SourceFile


def manifest_and_rules(out: Path, frame: ManifestFrame, ckpt: Checkpoint) -> tuple[Manifest, Plan | TpshardError]:
    """The manifest at `out` (read as `frame`), and the plan the rules give for `ckpt` with its
    topology and options, or why not. When the rules' tensors are the manifest's, byte for byte,
    the manifest takes them instead of decoding its own (both held at once were a fifth of the
    peak of check --source at 90k tensors)."""
    expected = _rules_plan(ckpt, frame.text.topology, frame.text.options)
    manifest = None if isinstance(expected, TpshardError) else manifest_with_tensors(frame, expected)
    return (read_manifest(out) if manifest is None else manifest), expected


def check_extras_against_source(ckpt: Checkpoint, manifest: Manifest, report: CheckReport) -> None:
    """config.json, tokenizer and the other copied files equal the source's (the copies themselves
    were proven equal to the manifest's sha256); a file the source has and the output lacks is a finding."""
    check_copies_against_source(ckpt, manifest.extra_files, report)


def check_copies_against_source(ckpt: Checkpoint, copies: Iterable[SourceFile], report: CheckReport, into: str = "the output") -> None:
    """check_extras_against_source for the copies recorded as `copies` (a tpshard output's, an
    engine export's: tpshard.check.export), copied `into` the folder checked."""
    recorded = {e.name: e for e in copies}
    try:
        present = ckpt.extra_files()
    except TpshardError as e:
        report.add("extras", f"the source's non-weight files: {e}")
        return
    for name in sorted(set(present) | set(recorded)):
        if name not in recorded:
            report.add("extras", f"{name}: in the source, but not copied into {into}")
        elif name not in present:
            report.add("extras", f"{name}: copied into {into}, but the source has no such file")
        elif sha256_file(ckpt.path / name) != recorded[name].checksum:
            report.add("extras", f"{name}: differs from the source's")


def check_source_sizes(ckpt: Checkpoint, recorded, report: CheckReport, done: str) -> None:
    """Each weight file of `ckpt` has the size the manifest recorded when it was read."""
    sizes = {f.name: f.size for f in recorded}
    for name in ckpt.weight_files:
        actual = (ckpt.path / name).stat().st_size
        if sizes.get(name) != actual:
            report.add("rules", f"source {name}: {actual} bytes, the split read {sizes.get(name)}: not the checkpoint that was {done}")


def _rules_plan(ckpt: Checkpoint, topology: Topology, options: Options) -> Plan | TpshardError:
    """The plan the rules give for this source, topology and options, or why not."""
    from tpshard.plan import make_plan

    try:
        return make_plan(ckpt, topology, options)
    except TpshardError as e:
        return e


def check_rules(ckpt: Checkpoint, manifest: Manifest, report: CheckReport, expected: Plan | TpshardError | None = None) -> bool:
    """The manifest is what the rules give for this source (check 1, against the source);
    `expected`: the rules' plan or why not (manifest_and_rules gives it), when the caller has it
    already."""
    before = report.found
    check_source_sizes(ckpt, manifest.source.files, report, "split")
    expected = _rules_plan(ckpt, manifest.topology, manifest.options) if expected is None else expected
    if isinstance(expected, TpshardError):
        report.add("rules", f"the rules refuse this source: {expected}")
        return False
    differs = plan_differences(manifest, expected)
    if "files" in differs:
        report.add("rules", "the manifest's output files (names, ranks or sizes) are not the ones the rules lay out")
    for what in ("model", "warnings", "quant_layers"):  # what verify builds and dequantizes with
        if what in differs:
            report.add("rules", f"the manifest's {what} is not what the rules give for this source")
    if "tensors" not in differs:
        return report.found == before
    diffs = report.found
    got = {(s.name, s.group_rank): s for s in manifest.plan.shards}
    want = {(s.name, s.group_rank): s for s in expected.shards}
    for key in sorted(set(got) | set(want)):
        g, w = got.get(key), want.get(key)
        if g != w:
            if g is None or w is None:
                report.add("rules", f"{key[0]} group rank {key[1]}: {'missing from the manifest' if g is None else 'in the manifest, but no rule makes it'}")
            else:
                fields = [f for f in g.__struct_fields__ if getattr(g, f) != getattr(w, f)]
                report.add("rules", f"{shard_text(g)}: manifest differs from the rules in {', '.join(f'{f}={getattr(g, f)!r} (rules: {getattr(w, f)!r})' for f in fields)}")
    if report.found == diffs:  # same shards, another order
        report.add("rules", "the manifest lists the tensors or their cuts in another order than the rules")
    return False
