"""tpshard: presharded tensor-parallel checkpoints, planned as data and proved right.

    tpshard.make_plan(open_checkpoint(path), Topology(tp=8, attn_dp=2))  # what every rank holds
    tpshard.split(path, out, Topology(tp=8, attn_dp=2))                  # write it
    tpshard.check(out, source=path)                                       # prove it, on a CPU
    tpshard.open_rank(out, rank)                                          # one rank's tensors, lazily
    tpshard.load_rank(out, rank)                                          # ... all in memory, fast
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
    return sorted(set(globals()) | set(__all__))


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
