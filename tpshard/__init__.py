"""tpshard: presharded tensor-parallel checkpoints, planned as data and proved right.

    tpshard.make_plan(open_checkpoint(path), Topology(tp=8, attn_dp=2))  # what every rank holds
    tpshard.split(path, out, Topology(tp=8, attn_dp=2))                  # write it
    tpshard.check(out, source=path)                                       # prove it, on a CPU
    tpshard.open_rank(out, rank)                                          # one rank's tensors, lazily
    tpshard.load_rank(out, rank)                                          # ... all in memory, fast
"""

__version__ = "0.1.0"

from tpshard.checkpoint import open_checkpoint  # noqa: E402
from tpshard.manifest import Options, Plan, read_manifest  # noqa: E402
from tpshard.plan import make_plan  # noqa: E402
from tpshard.rank import load_rank, open_rank  # noqa: E402
from tpshard.topology import Topology  # noqa: E402
from tpshard.writer import split  # noqa: E402
from tpshard.check import check  # noqa: E402

__all__ = [
    "Options", "Plan", "Topology", "check", "load_rank", "make_plan", "open_checkpoint", "open_rank", "read_manifest",
    "split",
]  # fmt: skip
