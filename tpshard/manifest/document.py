"""The Manifest: the plan as written, plus its source and checksums; and plan_differences.

What this file holds: `Manifest` (docs/format.md), the last file `split` writes and the first one
`check`, `verify` and `open_rank` read, with its Plan (`Manifest.plan`); rank_dir, a rank's folder
name; plan_differences, what check --source and reshard compare between the rules' plan and a
manifest.

What it is not: its JSON, written (tpshard.manifest.encode) or read and checked
(tpshard.manifest.decode, tpshard.manifest.validation); one rank's reader
(tpshard.manifest.rank_records).
"""

from __future__ import annotations

from functools import cached_property

import msgspec

from tpshard.manifest.plan import Plan
from tpshard.manifest.records import MANIFEST_FORMAT, ModelInfo, Options, OutputFile, Rank, Source, SourceFile, TensorPlan, manifest_version
from tpshard.topology import Topology


class Manifest(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    format: str = MANIFEST_FORMAT
    version: int = 3  # manifest_version: 4 where a cut has a leading-dim range (records.MANIFEST_VERSION)
    tool_version: str
    source: Source
    topology: Topology
    options: Options
    model: ModelInfo
    quant_layers: dict[str, dict] = {}
    warnings: tuple[str, ...] = ()
    written_ranks: tuple[Rank, ...]  # ranks whose folders this output holds (all, unless --ranks)
    tensors: tuple[TensorPlan, ...]
    files: tuple[OutputFile, ...]  # every file of the plan; checksums for those written

    @classmethod
    def of(cls, plan: Plan, *, tool_version: str, source: Source, written_ranks: tuple[int, ...], files: tuple[OutputFile, ...]) -> Manifest:
        return cls(
            version=manifest_version(plan.tensors), tool_version=tool_version, source=source, topology=plan.topology, options=plan.options, model=plan.model,
            quant_layers=plan.quant_layers, warnings=plan.warnings, written_ranks=written_ranks, tensors=plan.tensors, files=files,
        )  # fmt: skip

    @cached_property
    def plan(self) -> Plan:
        return Plan(
            topology=self.topology, options=self.options, model=self.model, tensors=self.tensors, files=self.files,
            warnings=self.warnings, quant_layers=self.quant_layers,
        )  # fmt: skip

    def with_plan(self, plan: Plan) -> Manifest:
        """This manifest recording `plan` instead (tests that break a manifest)."""
        return msgspec.structs.replace(
            self, version=manifest_version(plan.tensors), tensors=plan.tensors, files=plan.files, topology=plan.topology, options=plan.options
        )

    @property
    def source_path(self) -> str:
        return self.source.path

    @property
    def source_files(self) -> tuple[SourceFile, ...]:
        return self.source.files

    @property
    def extra_files(self) -> tuple[SourceFile, ...]:
        return self.source.extra_files

    @property
    def written_files(self) -> list[OutputFile]:
        """The files at least one written rank holds."""
        written = set(self.written_ranks)
        return [f for f in self.files if written.intersection(f.ranks)]


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


def plan_differences(a: Plan | Manifest, b: Plan | Manifest) -> list[str]:
    """Which of model, tensors, files (names, ranks, sizes), warnings and quant_layers differ
    between two plans or manifests: what make_plan gives against what a manifest records.
    quant_layers are compared as JSON: a plan made holds tuples where a decoded one holds lists."""
    parts = {
        "model": lambda p: p.model,
        "tensors": lambda p: p.tensors,
        "files": lambda p: [(f.name, f.ranks, f.size) for f in p.files],
        "warnings": lambda p: p.warnings,
        "quant_layers": lambda p: msgspec.json.encode(p.quant_layers, order="sorted"),
    }
    return [what for what, part in parts.items() if part(a) != part(b)]
