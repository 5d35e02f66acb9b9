"""Hugging Face checkpoints presharded per rank for tensor-parallel inference, and proved right.

    import tpshard
    from tpshard import Options, Topology

    topology = Topology(tp=8, attn_dp=2)                                  # SGLang's ranks (docs/contracts.md)
    plan = tpshard.make_plan(tpshard.open_checkpoint("model"), topology)  # what every rank holds, as data
    tpshard.split("model", "out", topology, Options(pad=True))            # out/rank-00000 ... rank-00007
    assert tpshard.check("out", source="model").ok                        # every shard bit-exact, on a CPU
    with tpshard.open_rank("out", 3) as tensors: ...                      # one rank's tensors, read lazily
    state_dict = tpshard.load_rank("out", 3)                              # ... or all in memory, fast

tpshard.read_manifest("out") is what an output records; `tpshard --help` the same from a shell (README.md).
"""

from __future__ import annotations

import importlib
import sys
import types

from tpshard.version import __version__

# Imported on first use: `tpshard plan` or a loader reading one rank need not import the writer,
# check and numpy (half a second of start-up, more than the plan of a 9,000-tensor checkpoint).
_EXPORTS = {
    "Options": "tpshard.manifest", "Plan": "tpshard.manifest", "read_manifest": "tpshard.manifest",
    "Topology": "tpshard.topology", "open_checkpoint": "tpshard.checkpoint", "make_plan": "tpshard.plan",
    "load_rank": "tpshard.rank", "open_rank": "tpshard.rank", "split": "tpshard.writer",
}  # fmt: skip

__all__ = [
    "Options", "Plan", "Topology", "check", "load_rank", "make_plan", "open_checkpoint", "open_rank", "read_manifest",
    "split",
]  # fmt: skip


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:  # a submodule, as `tpshard.writer` was when this package imported every module
        try:
            value = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    # The public API only: the lazy exports are listed before their first use (for completion and
    # help()), and the machinery that makes them lazy (importlib, _EXPORTS, __getattr__) is not.
    return sorted({*__all__, "__version__"})


class _Package(types.ModuleType):
    """`tpshard.check` is the check function, as when the package imported it eagerly: importing the
    submodule tpshard.check binds the module to that name on its package, which this ignores."""

    @property
    def check(self):
        from tpshard.check import check

        return check

    @check.setter
    def check(self, _submodule) -> None:
        pass


sys.modules[__name__].__class__ = _Package
