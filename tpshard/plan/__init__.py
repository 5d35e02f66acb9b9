"""make_plan: the one pure function that decides what every rank holds.

Inputs are headers and config only (no tensor data, no torch.distributed). Every cut is one
narrow of one source tensor along one dim plus zero padding at its end; this covers column, row,
QKV with GQA replicas, merged gate/up, vocab padding and padding of non-divisible MLP dims.
`split` executes the result, `check` inverts it; nothing else derives a slicing rule.

The package, in dependency order: `kinds` (what every tensor of one kind shares), `dense` (the
load rules of one tensor), `refusals` (topologies and pipelines refused up front), `experts` (EP
slots, complete expert sets), `files` (the file layout and headers), `make` (make_plan).
"""

from tpshard.cuts import ceil_div, even_cuts
from tpshard.manifest import FILE_METADATA
from tpshard.plan.dense import PADDED_ROLES, Layout, cut_tensor, expected_shape, group_of
from tpshard.plan.refusals import refuse_pipeline, refuse_topology
from tpshard.plan.files import file_header, spec_layout
from tpshard.plan.make import make_plan

__all__ = [
    "FILE_METADATA", "PADDED_ROLES", "Layout", "ceil_div", "cut_tensor", "even_cuts", "expected_shape", "file_header",
    "group_of", "make_plan", "refuse_pipeline", "refuse_topology", "spec_layout",
]  # fmt: skip
