"""reshard: a new output for another topology, from an existing output, without the source.

The old output is read as the checkpoint it was split from (tpshard.check.output_source: proven
against its own manifest first, each source tensor reassembled from its shards), and the new
topology's plan is written by the same writer as split, so the result is byte for byte what `split
SOURCE` would write: every rank file, index, copied file and the manifest (whose source section is the old
output's). Memory: one reassembled tensor at a time, or a few small ones (output_source's budget),
plus the writer's chunks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

from tpshard.manifest import Manifest, Options
from tpshard.check.output_source import OutputSource, open_output_source
from tpshard.plan import make_plan
from tpshard.publish import check_output_path, staged_output
from tpshard.topology import Topology
from tpshard.workers import check_workers
from tpshard.writer import select_ranks, write_plan


def reshard(
    old: str | Path | OutputSource,
    out: str | Path,
    topology: Topology,
    options: Options | None = None,
    *,
    workers: int | None = None,
    force: bool = False,
    ranks: Iterable[int] | None = None,
    on_tensor: Callable[[int], None] | None = None,
) -> Manifest:
    """Write at `out` the split of `old`'s source for `topology`; return its manifest.

    `old` is a tpshard output folder or an OutputSource already opened (the CLI opens it to read
    the layer count for --pp). Everything that cannot be rebuilt exactly is refused before a byte
    is written; a shard of the old output that differs from its manifest stops the reshard and leaves
    nothing behind: each is hashed as it is read, those no new tensor needs at the end."""
    workers = check_workers(workers)
    selected = select_ranks(topology, ranks)
    check_output_path(Path(out), [old.out if isinstance(old, OutputSource) else Path(old)])  # before reading it all
    src = old if isinstance(old, OutputSource) else open_output_source(old, workers=workers)
    plan = make_plan(src.checkpoint, topology, options)
    with staged_output(out, force=force, inputs=[src.out]) as staging:
        manifest = write_plan(src.checkpoint, plan, staging, selected, workers, on_tensor, reader=src.reader)
        src.reader.verify_rest(workers)  # the old output's bytes no new tensor needed: compared too
    return manifest
