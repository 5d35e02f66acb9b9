"""check(): which of the checks run on a folder, and in what order its findings are reported.

A tpshard output: the checks without a source (tpshard.check.files, .alignment, .pipeline); with
`source`, also the rules (tpshard.check.rules) and the reassembly (tpshard.check.reassembly); with
`from_output`, the same against another tpshard output read as the source
(tpshard.check.output_source). An engine export: tpshard.check.export's checks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

# numpy, the checkpoint reader, the planner and the writer are imported where the source is read:
# check without a source needs none of them (their imports were a sixth of it at 9k tensors).
from tpshard.check.files import Hashed, check_output, unread_findings
from tpshard.check.pipeline import check_pipeline_request
from tpshard.check.report import CheckReport
from tpshard.check.rules import check_extras_against_source, check_rules, manifest_and_rules
from tpshard.collector import paused
from tpshard.errors import TpshardError, UsageError
from tpshard.manifest import Manifest, Plan, read_manifest, read_manifest_frame
from tpshard.workers import check_workers

if TYPE_CHECKING:
    from tpshard.checkpoint import Checkpoint


@paused()
def check(
    out_dir: str | Path, source: str | Path | None = None, *, workers: int | None = None, pp: int | None = None,
    pp_layers: str | None = None, from_output: str | Path | None = None, on_bytes: Callable[[int], None] | None = None,
) -> CheckReport:  # fmt: skip
    """Check the output at `out_dir` (and against the checkpoint at `source`); never raises on a mismatch.

    `from_output`: the tpshard output it was resharded from (tpshard reshard), in place of the
    source: that output is checked against its own manifest, then every source tensor reassembled
    from it is compared with every shard here, as with `source`.

    `pp` / `pp_layers` (text such as "26,27,27"): the pipeline stages the server will run; the
    output must have been split for them. An engine export (a folder with tpshard-export.json)
    gets tpshard.check.export's checks.

    `on_bytes(n)`, for progress: called with the bytes of each source tensor compared (with a
    source) or of each file checked (without one; with `from_output`, the files of `out_dir`)."""
    out = Path(out_dir)
    workers = check_workers(workers)
    from tpshard.export.manifest import EXPORT_MANIFEST_NAME

    if source is not None and from_output is not None:
        raise UsageError("--source and --from: give one (--from when the source is gone)")
    if (out / EXPORT_MANIFEST_NAME).is_file():  # an engine export (tpshard export) has its own checks
        from tpshard.check.export import check_export

        return check_export(out, source, workers=workers, pp=pp, pp_layers=pp_layers, from_output=from_output)
    if source is not None:
        from tpshard.checkpoint import open_checkpoint

        from tpshard.source_identity import check_source_identity

        frame = read_manifest_frame(out)
        ckpt = open_checkpoint(source)
        # Another checkpoint is one line, exit 2. Its names and sizes now; its checksums from the
        # reassembly's read of it (one read of the source, not two), or here if the plan fails.
        recorded = frame.text.source.files
        check_source_identity(ckpt, recorded, out, listing_only=True)
        try:
            manifest, expected = manifest_and_rules(out, frame, ckpt)
        except TpshardError:
            check_source_identity(ckpt, recorded, out, workers=workers)
            raise
    else:
        manifest = read_manifest(out)
    report = CheckReport(out_dir=str(out), source=str(source) if source else None, from_output=str(from_output) if from_output else None)
    if pp is not None or pp_layers is not None:
        check_pipeline_request(manifest.plan, pp, pp_layers, report)
    if source is not None:
        _check_against_source(out, ckpt, manifest, report, workers, expected, on_bytes, recorded)
        return report
    check_output(out, manifest, report, workers, on_bytes=on_bytes)
    if from_output is not None:
        _check_from_output(out, Path(from_output), manifest, report, workers)
    return report


def _check_against_source(
    out: Path, ckpt: Checkpoint, manifest: Manifest, report: CheckReport, workers: int, expected: Plan | TpshardError,
    on_bytes: Callable[[int], None] | None = None, recorded=(),
) -> None:  # fmt: skip
    """check_output, the copied files and the rules against the source, then the reassembly.
    `recorded`: the manifest's source files, whose checksums prove this is the checkpoint split
    (WrongSource otherwise, whatever else was found), from the tensors the reassembly read.

    The output's files are read once: the reassembly hashes each tensor it compares, and
    check_output takes those digests instead of reading the files again (half the bytes read).
    The findings are reported in the order above: those against the source are made first, held,
    and added after check_output's. When the rules refuse the manifest, nothing is reassembled."""
    held = CheckReport(out_dir=report.out_dir, source=report.source)
    check_extras_against_source(ckpt, manifest, held)
    from tpshard.source_identity import check_source_identity

    if not check_rules(ckpt, manifest, held, expected):
        check_source_identity(ckpt, recorded, out, workers=workers)
        check_output(out, manifest, report, workers)
        report.extend(held)
        return
    from tpshard.check.reassembly import reassemble_output

    hashed = Hashed(manifest.plan)
    reassembled = CheckReport(out_dir=report.out_dir, source=report.source)
    crcs: dict[str, bytes] = {}
    unread = []  # check_output's findings that need no file's bytes, made while the reassembly reads
    reassemble_output(
        out, ckpt, manifest, reassembled, workers, hashed=hashed, on_bytes=on_bytes, source_crcs=crcs,
        meanwhile=lambda: unread.append(unread_findings(out, manifest)),
    )  # fmt: skip
    check_source_identity(ckpt, recorded, out, workers=workers, crcs=crcs)
    check_output(out, manifest, report, workers, hashed=hashed, unread=unread[0])
    report.extend(held)
    report.extend(reassembled)
    report.tensors_reassembled = reassembled.tensors_reassembled


def _check_from_output(out: Path, old: Path, manifest: Manifest, report: CheckReport, workers: int) -> None:
    """check --from: `old` proven against its own manifest, then read as the source (tpshard.check.output_source)."""
    from tpshard.check.output_source import open_checked_source
    from tpshard.check.reassembly import reassemble_output

    src = open_checked_source(old, report, workers)
    if src is None:
        return
    with src.reader:
        same_source = (manifest.source.path, manifest.source.files) == (src.manifest.source.path, src.manifest.source.files)
        if not same_source:
            report.add("rules", f"the manifest's source (path, file checksums) is not the one {old} records")
        check_extras_against_source(src.checkpoint, manifest, report)
        if check_rules(src.checkpoint, manifest, report) and same_source:
            reassemble_output(out, src.checkpoint, manifest, report, workers, reader=src.reader)
