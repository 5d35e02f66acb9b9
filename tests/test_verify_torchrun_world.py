"""verify --torchrun refuses, before torchrun starts, a world that is not the output's (issue 28
item 8): one line and exit 2, instead of every rank's traceback around verify's own line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import tpshard
from tpshard.topology import Topology


@pytest.fixture(scope="module")
def tp2(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "out"
    tpshard.split(llama, out, Topology(tp=2))
    return out


@pytest.mark.parametrize(
    "options, said",
    [
        ("--standalone --nproc-per-node 3", "would start 3 processes, but {out} was split for tp=2"),
        ("--nproc_per_node=1", "would start 1 processes"),
        ("--nnodes 2 --node-rank 0 --nproc-per-node 2", "would start 4 processes"),
        ("--nnodes 1:2 --nproc-per-node 2", "--nnodes 1:2 (an elastic range)"),
        ("--nproc-per-node gpu", "--nproc-per-node gpu leaves the processes per node to torchrun"),
    ],
)
def test_a_world_that_is_not_the_outputs_is_refused_in_one_line(llama, tp2, options, said):
    p = subprocess.run(
        [sys.executable, "-m", "tpshard", "verify", tp2, "--source", llama, "--torchrun", options],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert said.format(out=tp2) in lines[0] and "whose product is 2" in lines[0], lines[0]


def test_torchrun_world_reads_options_as_torchrun_does(monkeypatch):
    from tpshard.verify.verdict import torchrun_world

    assert torchrun_world(["--standalone", "--nproc-per-node", "8"]) == 8
    assert torchrun_world(["--nnodes=2:2", "--nproc_per_node=4", "--rdzv-endpoint", "h:1"]) == 8
    assert torchrun_world([]) == 1  # torchrun's defaults: one node, one process
    monkeypatch.setenv("PET_NPROC_PER_NODE", "4")  # torchrun takes an absent option from PET_*
    monkeypatch.setenv("PET_NNODES", "2")
    assert torchrun_world(["--standalone"]) == 8
    assert isinstance(torchrun_world(["--nproc-per-node"]), str)  # no value: why, not a number
