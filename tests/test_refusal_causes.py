"""Refusals name the real cause first (issue 28 item 7): the head counts before the vocab, the
tensor and count that do not divide, the architecture before its config keys, and no Python None."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from checkpoints import make_checkpoint


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=120)


def one_error(p: subprocess.CompletedProcess) -> str:
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    return lines[0]


@pytest.mark.parametrize("tp", [3, 16])
def test_heads_are_named_before_the_vocab_and_on_q(llama, tp):
    """8 heads, 2 kv heads, vocab 250 (256 padded): tp 3 divides neither heads nor vocab, and the
    embedding is first on disk; tp 16 replicates the 2 kv heads fine, q's 8 heads are the cause."""
    line = one_error(run("plan", llama, "--tp", tp))
    assert f"model.layers.0.self_attn.q_proj.weight: 8 attention heads do not divide over the tp group of {tp} ranks" in line
    assert "vocab" not in line and "k_proj" not in line


def test_kv_heads_are_named_on_k_with_their_count(tmp_path):
    """12 heads over 4 kv heads at tp 6: q divides; k's 4 kv heads neither split nor replicate over 6."""
    model = make_checkpoint(tmp_path / "m", hidden_size=96, num_attention_heads=12, num_key_value_heads=4)
    line = one_error(run("plan", model, "--tp", 6))
    assert "self_attn.k_proj.weight: 4 kv heads and the tp group of 6 ranks: neither divides the other" in line
    assert "vocab" not in line


def test_unsupported_architecture_before_its_config_keys(tmp_path):
    """A GPT-2 config has n_embd, not hidden_size: the architecture is what tpshard refuses."""
    import transformers

    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=16)).save_pretrained(tmp_path / "gpt2")
    line = one_error(run("plan", tmp_path / "gpt2", "--tp", 2))
    assert "architecture GPT2LMHeadModel is not supported; supported: " in line and "LlamaForCausalLM" in line
    assert "lacks" not in line


def test_no_python_none_for_a_config_key_that_is_absent(deepseek_v3, tmp_path):
    """transformers' DeepseekV3Config writes no topk_method; the refusal says so, not `topk_method None`."""
    config = json.loads((deepseek_v3 / "config.json").read_text())
    assert "topk_method" not in config
    line = one_error(run("split", deepseek_v3, "-o", tmp_path / "x", "--tp", 2, "--format", "vllm"))
    assert "config.json names no topk_method" in line and "None" not in line


def test_no_python_none_for_an_absent_quant_method(tmp_path):
    from tpshard.errors import CheckpointError
    from tpshard.quant.config import read_quant_config

    with pytest.raises(CheckpointError, match="quantization_config names no quant_method; supported: ") as e:
        read_quant_config(tmp_path, {"quantization_config": {"bits": 4}})
    assert "None" not in str(e.value) and "''" not in str(e.value)


@pytest.mark.parametrize("fixture", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("tp", [3, 16])
def test_moe_heads_are_named_before_the_experts(fixture, tp, request):
    """8 heads and 8 experts 32 wide: tp 3 divides neither the heads nor the expert intermediate,
    tp 16 is more than both; SGLang builds a layer's attention before its experts, so the heads first."""
    line = one_error(run("plan", request.getfixturevalue(fixture), "--tp", tp))
    assert "model.layers.0.self_attn.q_proj.weight: 8 attention heads do not divide" in line
    assert "expert" not in line


def test_the_experts_are_named_when_the_heads_divide(tmp_path):
    model = make_checkpoint(tmp_path / "m", "qwen3_moe", moe_intermediate_size=20)  # 8 heads over tp 8; 20 over moe_tp 8 not
    line = one_error(run("plan", model, "--tp", 8))
    assert line == (
        "error: expert intermediate size 20 does not divide over moe_tp 8 (tp 8 / ep 1); SGLang's FusedMoE"
        " asserts it. Choose --ep so that tp / ep divides it"
    )
