"""A command pointed at the folder beside the right one says what that folder is (issue 28 item 6):
tpshard's own engine export, or the checkpoint, instead of "not a tpshard output"."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tpshard
from tpshard.topology import Topology


def one_error(*args) -> str:
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.fixture(scope="module")
def export(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("wrong") / "out"
    tpshard.split(llama, out, Topology(tp=2))
    dest = out.parent / "my deploy"
    from tpshard.export import export as do_export

    do_export(out, dest, "vllm")
    return out, dest


def test_verify_of_an_export_names_it_and_what_to_run(llama, export):
    out, dest = export
    line = one_error("verify", dest, "--source", llama)
    assert f"{dest}: a tpshard export for vllm (tpshard-export.json), not a tpshard output" in line
    assert f"`tpshard check '{dest}' --source {llama}`" in line  # quoted: the path has a space
    assert f"the tpshard output it was exported from ({out})" in line
    assert "not a tpshard output, or a split" not in line


def test_reshard_of_an_export_names_it(export, tmp_path):
    line = one_error("reshard", export[1], "-o", tmp_path / "x", "--tp", 1)
    assert "a tpshard export for vllm" in line


@pytest.mark.parametrize("command", [["check"], ["verify", "--source", "{model}"], ["export", "-o", "{tmp}/x", "--format", "vllm"]])
def test_a_checkpoint_given_for_an_output_is_named(llama, tmp_path, command):
    args = [a.format(model=llama, tmp=tmp_path) for a in command]
    line = one_error(args[0], llama, *args[1:])
    assert f"{llama}: a Hugging Face checkpoint (config.json and safetensors), not a tpshard output: split it first" in line


def test_any_other_folder_keeps_the_plain_refusal(tmp_path):
    assert one_error("check", tmp_path) == f"error: {tmp_path}: no tpshard-manifest.json; not a tpshard output, or a split that did not finish"
