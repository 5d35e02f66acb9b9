"""Helpers of the pipeline tests: the tpshard command run in this process, the stages holding a tensor."""

from __future__ import annotations

import sys

import pytest


def cli(capsys, monkeypatch, *args) -> tuple[int, str, str]:
    """The tpshard command in this process: (exit code, stdout, stderr); a traceback fails the test."""
    from tpshard.cli import main

    monkeypatch.setattr(sys, "argv", ["tpshard", *map(str, args)])
    capsys.readouterr()  # what came before (a fixture saving a checkpoint) is not the command's
    with pytest.raises(SystemExit) as stop:
        main()
    captured = capsys.readouterr()
    return stop.value.code, captured.out, captured.err


def held_stages(plan, t) -> set[int]:
    """The pipeline stages whose ranks hold a cut of TensorPlan `t`."""
    return {r // plan.topology.tp for c in t.cuts for r in plan.files[c.file].ranks}
