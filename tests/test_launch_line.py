"""The launch line an export prints starts the engine in exactly the exported layout (issue 28
item 4): every topology flag, the weights' dtype, paths quoted for the shell."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

CASES = {
    "sglang attn-dp": ("qwen3", ["--tp", "8", "--attn-dp", "2", "--format", "sglang"],
                       "python -m sglang.launch_server --model-path {dest} --load-format sharded_state --tp-size 8 --attn-dp-size 2 --dtype bfloat16"),
    "sglang dp-lm-head": ("qwen3", ["--tp", "4", "--attn-dp", "2", "--dp-lm-head", "--format", "sglang"],
                          "python -m sglang.launch_server --model-path {dest} --load-format sharded_state --tp-size 4 --attn-dp-size 2 --enable-dp-lm-head --dtype bfloat16"),
    "sglang tp": ("llama", ["--tp", "2", "--format", "sglang"],
                  "python -m sglang.launch_server --model-path {dest} --load-format sharded_state --tp-size 2 --dtype bfloat16"),
    "vllm ep": ("qwen3_moe", ["--tp", "4", "--ep", "4", "--format", "vllm"],
                "vllm serve {dest} --load-format sharded_state --tensor-parallel-size 4 --enable-expert-parallel --dtype bfloat16"),
    "vllm pp": ("llama", ["--tp", "2", "--pp", "2", "--format", "vllm"],
                "VLLM_PP_LAYER_PARTITION=1,1 vllm serve {dest} --load-format sharded_state --tensor-parallel-size 2 --pipeline-parallel-size 2 --dtype bfloat16"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_launch_line_carries_the_exported_layout(case, request, tmp_path):
    fixture, args, want = CASES[case]
    model = request.getfixturevalue(fixture)
    dest = tmp_path / "my deploy"  # a space: the pasted line must keep the path whole
    base = [sys.executable, "-m", "tpshard", "split", str(model), "-o", str(dest), *args]
    p = subprocess.run([*base, "--json"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    line = json.loads(p.stdout)["launch"]
    assert line == want.format(dest=shlex.quote(str(dest)))
    assert str(dest) in shlex.split(line)
    human = subprocess.run([*base, "--force"], capture_output=True, text=True, timeout=300)
    assert human.returncode == 0 and f"launch with: {line} (docs/" in human.stdout + human.stderr, human.stderr
    assert f"tpshard check {shlex.quote(str(dest))} --source MODEL" in human.stdout + human.stderr
