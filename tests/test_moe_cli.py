"""Item 7 refusals as a user meets them: one line on stderr, exit 2, no output folder."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(*args) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return p


@pytest.fixture(scope="module")
def deepseek_6_heads(tmp_path_factory):
    """MLA with 6 heads: q_b_proj / kv_b_proj / o_proj cannot be cut by whole heads over 4 ranks."""
    from checkpoints import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("ds6") / "model", "deepseek_v2", hidden_size=96, num_attention_heads=6, num_key_value_heads=6
    )


@pytest.mark.parametrize(
    "fixture, args, message",
    [
        ("mixtral", ["--tp", "4", "--ep", "3"], "--ep 3 does not divide --tp 4"),
        ("qwen3_moe", ["--tp", "6", "--ep", "6", "--attn-dp", "3"], "--ep 6 does not divide the 8 routed experts"),
        ("qwen3_moe", ["--tp", "6", "--ep", "2", "--attn-dp", "3"], "expert intermediate size 32 does not divide over moe_tp 3"),
        ("qwen2_moe", ["--tp", "16", "--attn-dp", "2"], "tp size 16 is greater than the 8 routed experts"),
        ("deepseek_v3", ["--tp", "8", "--moe-dense-tp", "2"], "--moe-dense-tp 2: SGLang accepts only 1"),
        ("qwen3_moe", ["--tp", "4", "--moe-dense-tp", "1"], "--moe-dense-tp applies to DeepSeek's dense MLP layers"),
        ("llama", ["--tp", "4", "--ep", "2"], "--ep 2: LlamaForCausalLM has no routed experts"),
        ("deepseek_v3", ["--tp", "8", "--dp-lm-head"], "--dp-lm-head needs --attn-dp > 1"),
        ("mixtral", ["--tp", "8", "--attn-dp", "2"], "--attn-dp 2: MixtralForCausalLM has no attention-DP layout"),
        ("qwen2_tied", ["--tp", "8", "--attn-dp", "2", "--dp-lm-head"], "lm_head over the full tp group whatever --enable-dp-lm-head says"),
        ("deepseek_6_heads", ["--tp", "4"], "6 attention heads do not divide over the attn_tp group of 4 ranks"),
    ],
)  # fmt: skip
def test_refusals_exit_2_with_one_line_and_no_output(request, tmp_path, fixture, args, message):
    model = request.getfixturevalue(fixture)
    out = tmp_path / "out"
    # plan refuses from the same make_plan as split; one case runs both, the rest only split
    commands = (["plan", model], ["split", model, "-o", out]) if fixture == "mixtral" else (["split", model, "-o", out],)
    for command in commands:
        p = run(*command, *args)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_plan_shows_ep_slots_and_experts(deepseek_v3):
    import json

    data = json.loads(run("plan", deepseek_v3, "--tp", "8", "--attn-dp", "2", "--ep", "4", "--json").stdout)
    assert data["plan"]["topology"]["ep"] == 4
    rows = data["by_rank"]
    assert [(r["ep_slot"], r["moe_tp"], r["experts"]) for r in rows] == [(r // 2, r % 2, f"{2 * (r // 2)}-{2 * (r // 2) + 1}") for r in range(8)]
    assert all(r["expert_bytes"] > 0 for r in rows)
    human = run("plan", deepseek_v3, "--tp", "8", "--attn-dp", "2", "--ep", "4").stdout
    assert "ep slot" in human and "expert bytes" in human


def test_explain_walks_a_moe_layer_and_mla(deepseek_v3):
    import json

    rows = json.loads(run("explain", deepseek_v3, "--tp", "8", "--attn-dp", "2", "--ep", "8", "--layer", "1", "--json").stdout)
    tensors = [r["tensor"] for r in rows]
    # forward order: MLA, router, routed experts, shared experts
    order = [next(i for i, t in enumerate(tensors) if part in t) for part in ("q_a_proj", "q_b_proj", "kv_b_proj", "o_proj", "mlp.gate.weight", ".experts.", "shared_experts")]
    assert order == sorted(order)
    gate = [r for r in rows if ".experts.[" in r["tensor"] and "gate_proj" in r["tensor"]]
    assert [(r["tensor"], r["ranks"]) for r in gate] == [(f"model.layers.1.mlp.experts.[{e}].gate_proj.weight", [e]) for e in range(8)]
    assert all("EP slot" in r["group"] and "all-reduce over tp" in r["reduction"] for r in gate)
    q_b = [r for r in rows if "q_b_proj" in r["tensor"]]
    assert [r["ranks"] for r in q_b] == [[a, a + 4] for a in range(4)] and all(r["group"].startswith("attn_tp") for r in q_b)
    mtp = run("explain", deepseek_v3, "--tp", "2", "--layer", "3").stdout
    assert "eh_proj" in mtp and "shared_head" in mtp
