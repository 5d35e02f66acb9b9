"""benchmarks/gpu_check.sh on a CPU machine: every step runs on CPU ranks, the GPU steps are skipped,
the planted faults are caught (exit 1), the report says so. Slow (several verify launches)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_gpu_check_runs_on_cpu_with_gpu_steps_skipped(tmp_path):
    out = tmp_path / "gpu-check"
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--no-install", "--cpu", "--small", str(out)],
        capture_output=True, text=True, timeout=1800, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["ok"] and report["gpus"] == 0
    steps = {s["step"]: s for s in report["steps"]}
    assert all(s["result"] == "skipped" for name, s in steps.items() if "NCCL" in name)
    faults = [s for name, s in steps.items() if name.startswith("fault") and "NCCL" not in name]
    assert len(faults) == 2 and all(s["exit"] == 1 and s["result"] == "ok" for s in faults)
    assert steps["dense tp 2, layers + model, auto backend"]["model"]["top1"] == 1.0
    assert "| fault: swapped down_proj | ok | 1 (1) |" in (out / "report.md").read_text()
