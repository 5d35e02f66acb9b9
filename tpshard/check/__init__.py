"""check: prove an output right on any CPU machine, from the manifest alone or against the source.

Without the source: the plan's alignment checks (group, global vs per-rank size, one piece per rank,
bias once per reduction group), each rank's index, and every file's size, header and per-tensor
checksums, for every rank folder (a copy that replaced a hard link is checked on its own).
With the source: also that the manifest is what the rules give for this checkpoint, and the bit-exact
reassembly of every source tensor from the shards, padding required to be zero. A mismatch names
the tensor, the ranks and what differs; a piece that equals another rank's slice says so.

The modules, each below the ones that use it:
  report         what a check found (CheckReport, Problem)
  pipeline       the pipeline stages' checks (check_stages, check_pipeline_request)
  alignment      the plan's checks, which read no byte (check_plan)
  files          the folder, each rank's index, every file's checksums (check_output, check_rank_files)
  rules          against the source: the manifest is what the rules give (check_rules)
  reassembly     against the source: every byte (reassemble); imported only where a source is read
  output_source  a tpshard output read as the checkpoint it was split from (check --from, reshard)
  export         an engine export's checks (check_export)
  run            check(): which of these run on a folder, in what order they report
The package imports the first five and run; the others are imported where they are used:
reassembly and output_source bring in numpy and the checkpoint reader, which check without a source
does not need, and export is for an engine export only.
"""

from __future__ import annotations

from tpshard.check.report import CheckReport, Problem
from tpshard.check.pipeline import check_pipeline_request, check_stages
from tpshard.check.alignment import check_plan
from tpshard.check.files import check_index, check_layout, check_output, check_rank_files, distinct_copies
from tpshard.check.rules import check_extras_against_source, check_rules, check_source_sizes
from tpshard.check.run import check

__all__ = [
    "CheckReport", "Problem", "check", "check_extras_against_source", "check_index", "check_layout", "check_output",
    "check_pipeline_request", "check_plan", "check_rank_files", "check_rules", "check_source_sizes", "check_stages",
    "distinct_copies",
]  # fmt: skip
