"""`split --format`: a checkpoint straight to an engine export, through a tpshard output nobody sees.

    split_and_export(model, "dest/", Topology(tp=8), "vllm")   # the engine's sharded_state files

The export's refusals come first, from the plan alone (every rank laid out, none kept), so a
checkpoint the engine cannot load is refused before a byte is written; then the tpshard output is
split into a fresh hidden folder beside `dest`, exported, and removed whatever happens (tpshard.publish.scratch_folder: a killed run's is removed
by the next run for `dest`).

Not here: the split (tpshard.writer), the export (tpshard.export.writer), the options' parsing (the CLI).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import msgspec

from tpshard.checkpoint import Checkpoint, open_checkpoint
from tpshard.errors import TpshardError
from tpshard.export.layout import DEFAULT_MAX_PART_BYTES, config_tied, rank_layouts
from tpshard.export.manifest import ExportManifest
from tpshard.export.writer import export, export_bytes
from tpshard.manifest import Options
from tpshard.plan import make_plan
from tpshard.publish import check_output_path, scratch_folder
from tpshard.topology import Topology
from tpshard.writer import split


def split_and_export(
    source: str | Path | Checkpoint,
    dest: str | Path,
    topology: Topology,
    engine: str,
    options: Options | None = None,
    *,
    max_part_bytes: int = DEFAULT_MAX_PART_BYTES,
    workers: int | None = None,
    force: bool = False,
    checksum: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> ExportManifest:
    """Split the checkpoint at `source` for `topology` and write the `engine` ("vllm" or "sglang")
    export of it into `dest`; return the export's manifest.

    `source` is a checkpoint folder or an already opened Checkpoint; `options` are the split's
    (default Options()); `checksum` ("crc32" or "sha256"), when given, replaces options.checksum for
    the intermediate output, checked as that split starts. `on_total(n)` hears once, before the split,
    how many bytes `on_bytes` will hear of in all: the source's as the split reads them, then the
    export's as it writes them (the command's progress). Raises what `export` would refuse before
    anything is written, and OutputError / TpshardError for a `dest` that is an input or exists
    without `force`.
    """
    ckpt = source if isinstance(source, Checkpoint) else open_checkpoint(source)
    dest = Path(dest)
    options = options if options is not None else Options()
    plan = make_plan(ckpt, topology, options)
    for _ in rank_layouts(plan, engine, config_tied(ckpt.config), max_part_bytes, ckpt.config):
        pass  # refuse before writing: every rank laid out, none kept
    check_output_path(dest, [ckpt.path])
    if os.path.lexists(dest) and not force:
        raise TpshardError(f"{dest} already exists; pass --force to replace it")
    # The intermediate tpshard output lives in a fresh folder of our own beside dest, removed after
    # (and by the next run for dest, where a kill left it).
    if on_total is not None:
        on_total(sum(t.nbytes for t in ckpt.tensors.values()) + export_bytes(plan))
    with scratch_folder(dest) as scratch:
        options = options if checksum is None else msgspec.structs.replace(options, checksum=checksum)
        split(ckpt, scratch / "out", topology, options, workers=workers, on_tensor=on_bytes)
        return export(scratch / "out", dest, engine, max_part_bytes=max_part_bytes, workers=workers, force=force, on_bytes=on_bytes)
