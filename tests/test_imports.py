"""The package imports on first use: `tpshard plan` and a loader of one rank need not import the
writer, check or numpy, and the public names are what they were when the package imported them all."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"], capture_output=True, text=True, timeout=120, check=True)
    return set(out.stdout.split())


def test_the_plan_path_imports_neither_numpy_nor_the_writer():
    loaded = _modules_after("import tpshard, tpshard.cli, tpshard.plan, tpshard.report, tpshard.rank")
    assert not loaded & {"numpy", "torch", "tpshard.writer", "tpshard.check", "tpshard.pieces"}, loaded


def test_public_names_resolve_on_first_use():
    code = """
import tpshard
import tpshard.check  # binding the submodule to its package leaves tpshard.check the function
from tpshard.check import check
from tpshard.writer import split
assert tpshard.check is check and tpshard.split is split and callable(tpshard.check)
assert tpshard.open_rank.__module__ == "tpshard.rank" and tpshard.Topology.__module__ == "tpshard.topology"
assert tpshard.writer.split is split  # submodules as attributes, as when all were imported
assert set(tpshard.__all__) <= set(dir(tpshard))
try:
    tpshard.no_such_name
except AttributeError as e:
    assert "no_such_name" in str(e)
else:
    raise AssertionError("no AttributeError")
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_check_without_a_source_imports_neither_numpy_nor_the_writer(llama, tmp_path):
    """Their imports were a sixth of `tpshard check OUT` at 9k tensors; only --source reads with them."""
    import tpshard
    from tpshard.topology import Topology

    tpshard.split(llama, tmp_path / "out", Topology(tp=2))
    loaded = _modules_after(f"import tpshard, tpshard.cli\nassert tpshard.check({str(tmp_path / 'out')!r}).ok")
    assert not loaded & {"numpy", "torch", "tpshard.writer", "tpshard.plan", "tpshard.pieces", "tpshard.checkpoint"}, loaded
