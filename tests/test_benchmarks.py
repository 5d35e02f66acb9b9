"""The benchmark scripts stay runnable: every name they import from tpshard exists (a renamed one
broke benchmarks/split_phases.py unnoticed), and each answers --help."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_what_a_benchmark_imports_from_tpshard_exists(script):
    for node in ast.walk(ast.parse((BENCHMARKS / script).read_text())):  # inside functions too
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpshard":
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{script}:{node.lineno}: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tpshard":
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_answers_help(script):
    p = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr[-500:]
