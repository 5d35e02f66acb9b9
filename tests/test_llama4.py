"""Llama-4 text (Llama4ForConditionalGeneration, tpshard/arch/llama4.py) on tiny bf16 checkpoints
saved by transformers' own Llama4ForConditionalGeneration (tests/llama4_fixtures.py).

What each rank holds is SGLang's models/mllama4.py + llama4.py, written out here from its loader,
not from tpshard's plan: `experts.gate_up_proj` [E, H, 2I] chunked in two on the last dim, each half
narrowed to the rank's I / moe_tp (so the rank holds its slice of the gate half, then its slice of
the up half), `experts.down_proj` [E, I, H] on dim 1, the router whole, the shared expert and the
dense layers' MLP over the full tp, attention over attn_tp (kv heads replicated past 2 ranks), the
embedding whole under attention DP (enable_tp=not is_dp_attention_enabled()), lm_head over tp.
Then the refusals, layouts broken on purpose that check --source and verify must see, and verify
--model against transformers' Llama4ForCausalLM on the same weights.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import tpshard
from broken import overwrite_tensor, reorder_experts, rewrite_checksums, swap_ranks, take_from_rank
from llama4_fixtures import make_llama4
from test_gpt_oss import tpshard_cli
from test_moe_split import source_tensors
from tpshard.topology import Topology
from tpshard.verify import verify_many

E, H, I, MLP, HEADS, KV, HD = 4, 64, 32, 48, 8, 2, 16
P = "language_model.model.layers.{i}."


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    return make_llama4(tmp_path_factory.mktemp("llama4") / "model")


@pytest.fixture(scope="module")
def tp4_dp2(llama4, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("llama4_tp4_dp2") / "out"
    tpshard.split(llama4, out, Topology(tp=4, attn_dp=2))
    return out


def rows(t: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    """Piece r of n along dim."""
    k = t.shape[dim] // n
    return t.narrow(dim, r * k, k)


def sglang_rank(full: dict, topo: Topology, rank: int) -> dict[str, torch.Tensor]:
    """What SGLang's Llama4ForConditionalGeneration loads on `rank` (ep 1: moe_tp = tp), in HF names."""
    attn_tp, t = topo.tp // topo.attn_dp, topo.tp
    a, m = rank % attn_tp, rank % t
    kv = a // (attn_tp // KV) if attn_tp >= KV else a  # QKVParallelLinear: the kv block of this attention rank
    kv_n = min(KV, attn_tp)
    want = {}
    for i in range(4):
        p = P.format(i=i)
        want[p + "self_attn.q_proj.weight"] = rows(full[p + "self_attn.q_proj.weight"], a, attn_tp)
        want[p + "self_attn.k_proj.weight"] = rows(full[p + "self_attn.k_proj.weight"], kv, kv_n)
        want[p + "self_attn.v_proj.weight"] = rows(full[p + "self_attn.v_proj.weight"], kv, kv_n)
        want[p + "self_attn.o_proj.weight"] = rows(full[p + "self_attn.o_proj.weight"], a, attn_tp, 1)
        mlp = p + ("feed_forward.shared_expert." if i % 2 else "feed_forward.")
        for proj in ("gate_proj", "up_proj"):
            want[mlp + proj + ".weight"] = rows(full[mlp + proj + ".weight"], m, t)  # LlamaMLP over the full tp
        want[mlp + "down_proj.weight"] = rows(full[mlp + "down_proj.weight"], m, t, 1)
        if i % 2:  # Llama4MoE: _handle_expert_weight_params
            x = p + "feed_forward.experts."
            gate, up = full[x + "gate_up_proj"].chunk(2, dim=-1)
            want[x + "gate_up_proj"] = torch.cat((rows(gate, m, t, 2), rows(up, m, t, 2)), -1)
            want[x + "down_proj"] = rows(full[x + "down_proj"], m, t, 1)
            want[p + "feed_forward.router.weight"] = full[p + "feed_forward.router.weight"]
    return want


@pytest.mark.parametrize("topo", [Topology(tp=2), Topology(tp=4, attn_dp=2), Topology(tp=8), Topology(tp=8, attn_dp=4)], ids=str)
def test_per_rank_as_sglang_loads(llama4, tmp_path, topo):
    out = tmp_path / "out"
    tpshard.split(llama4, out, topo)
    assert tpshard.check(out, llama4).ok
    full = source_tensors(llama4)
    x = P.format(i=1) + "feed_forward.experts."
    assert full[x + "gate_up_proj"].shape == (E, H, 2 * I) and full[x + "down_proj"].shape == (E, I, H)  # as transformers saves them
    for r in range(topo.tp):
        held = tpshard.open_rank(out, r)
        for name, want in sglang_rank(full, topo, r).items():
            assert torch.equal(held[name], want), (r, name)
        embed, head = held["language_model.model.embed_tokens.weight"], held["language_model.lm_head.weight"]
        if topo.attn_dp > 1:  # whole, padded to 256 rows
            assert embed.shape == (256, H) and torch.equal(embed[:250], full["language_model.model.embed_tokens.weight"])
        else:
            assert embed.shape == (256 // topo.tp, H)
        assert head.shape == (256 // topo.tp, H)
    # gpt-oss's interleaved reading (one contiguous slice of the 2I axis) is another layout from tp 2 on
    g = full[x + "gate_up_proj"]
    assert not torch.equal(rows(g, 0, topo.tp, 2), sglang_rank(full, topo, 0)[x + "gate_up_proj"])


def test_reshard_is_a_split(llama4, tp4_dp2, tmp_path):
    """tp 4 attn-dp 2 -> tp 8 attn-dp 2 and -> tp 2: byte-identical to splitting the source so."""
    for args, topo in ((("--tp", "8", "--attn-dp", "2"), Topology(tp=8, attn_dp=2)), (("--tp", "2"), Topology(tp=2))):
        re, split = tmp_path / f"re{topo.tp}", tmp_path / f"split{topo.tp}"
        p = tpshard_cli("reshard", tp4_dp2, "-o", re, *args)
        assert p.returncode == 0, p.stderr
        assert tpshard_cli("check", re, "--source", llama4).returncode == 0
        tpshard.split(llama4, split, topo)
        for r in range(topo.tp):
            a, b = tpshard.open_rank(re, r), tpshard.open_rank(split, r)
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), r


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if key == "architectures":
            config[key] = value
        else:
            config["text_config"][key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tp", "8", "--ep", "8"), "--ep 8 does not divide the 4 routed experts"),
        (("--tp", "16"), "8 attention heads do not divide over the attn_tp group of 16 ranks"),
        (("--tp", "2", "--pp", "2"), "no pipeline layout of Llama4ForConditionalGeneration"),
        (("--tp", "2", "--moe-dense-tp", "1"), "--moe-dense-tp applies to DeepSeek's dense MLP layers"),
    ],
    ids=["ep", "heads", "pp", "moe-dense-tp"],
)
def test_refusals(llama4, tmp_path, args, message):
    p = tpshard_cli("split", llama4, "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_checkpoint_refusals(llama4, tmp_path):
    """The vision tower, transformers' text-only Llama4ForCausalLM, and configs SGLang would serve as
    another model than transformers' (moe_layers its step would not give, RoPE layers other than its
    hard-coded ones, top-2 routing with the weight on the input): one line each, nothing written."""
    cases = [
        (make_llama4(tmp_path / "vision", text_only=False), "holds the vision tower (multi_modal_projector.linear_1.weight"),
        (_edit_config(llama4, tmp_path / "causal", architectures=["Llama4ForCausalLM"]), "LlamaForCausalLM.load_weights, which has no mapping"),
        (_edit_config(llama4, tmp_path / "layers", moe_layers=[0, 2]), "moe_layers [0, 2] are not the layers interleave_moe_layer_step 2 gives ([1, 3])"),
        (_edit_config(llama4, tmp_path / "nope", no_rope_layers=[1, 0, 1, 1]), "Llama4Attention rotates every layer but each 4th ([1, 1, 1, 0])"),
        (_edit_config(llama4, tmp_path / "top2", num_experts_per_tok=2), "which its FusedMoE runs for top-1 only"),
    ]
    for src, message in cases:
        p = tpshard_cli("split", src, "-o", tmp_path / "out", "--tp", "2")
        assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert not (tmp_path / "out").exists()


def test_export_refused(tp4_dp2, tmp_path):
    p = tpshard_cli("export", tp4_dp2, "--format", "vllm", "-o", tmp_path / "deploy")
    # vLLM's Llama-4 export is tests/test_export_llama4.py's; under attention DP vLLM holds other slices
    assert p.returncode == 2 and "split with --attn-dp 2, but vLLM's dense models" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = tpshard_cli("export", tp4_dp2, "--format", "sglang", "-o", tmp_path / "deploy")
    assert p.returncode == 2 and "routed experts" in p.stderr and not (tmp_path / "deploy").exists()


# ---- broken on purpose ------------------------------------------------------------------------------


def break_copy(good: Path, dst: Path, llama4: Path) -> Path:
    """tp 4 attn-dp 2 output broken four ways, each in its own layer and shard (checksums rewritten,
    so only the comparison with the source or the numbers can see them)."""
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    full = source_tensors(llama4)
    x1, x3 = P.format(i=1) + "feed_forward.experts.", P.format(i=3) + "feed_forward.experts."
    g = full[x1 + "gate_up_proj"]
    for r in range(4):  # layer 1: every rank's gate/up read interleaved (one contiguous slice of the 2I axis)
        overwrite_tensor(dst, r, x1 + "gate_up_proj", rows(g, r, 4, 2).clone())
    # layer 3: rank 1's experts round-robin (even ids, then odd) on the experts axis
    reorder_experts(dst, 1, (x3 + "gate_up_proj", x3 + "down_proj"), list(range(0, E, 2)) + list(range(1, E, 2)))
    # layer 0: the kv heads swapped between the two attention ranks
    swap_ranks(dst, P.format(i=0) + "self_attn.k_proj.weight", 0, 1)
    # layer 3: the shared expert cut by the attention rank (over attn_tp 2, halves of the tp 4 slices)
    # instead of the full tp: ranks 2 and 3 hold ranks 0 and 1's slices of gate_proj
    for r in (2, 3):
        take_from_rank(dst, r, P.format(i=3) + "feed_forward.shared_expert.gate_proj.weight", r - 2)
    rewrite_checksums(dst)
    return dst


@pytest.fixture(scope="module")
def broken(llama4, tp4_dp2, tmp_path_factory) -> Path:
    return break_copy(tp4_dp2, tmp_path_factory.mktemp("llama4_broken") / "out", llama4)


def test_check_source_sees_each_breakage(broken, llama4):
    found = " ".join(p.message for p in tpshard.check(broken, llama4).problems)
    for name in (
        P.format(i=1) + "feed_forward.experts.gate_up_proj", P.format(i=3) + "feed_forward.experts.down_proj",
        P.format(i=0) + "self_attn.k_proj.weight", P.format(i=3) + "feed_forward.shared_expert.gate_proj.weight",
    ):  # fmt: skip
        assert name in found, (name, found)


def test_verify(broken, tp4_dp2, llama4):
    """verify --model of the good and the broken tp 4 attn-dp 2 outputs, in one launch. The good one
    passes every layer (the fused experts' segmented gate/up included) and matches transformers'
    logits (chunked attention and the NoPE layer's temperature tuning act within the 16 tokens); the
    broken one names each breakage and its logits differ."""
    good, bad = verify_many([tp4_dp2, broken], [llama4, llama4], model=True)
    assert good.ok, [(r.layer, r.problems) for r in good.layers if r.problems] + [good.model.problems if good.model else None]
    assert any(r.layer_class == "FusedExperts" for r in good.layers)
    assert good.model is not None and good.model.top1 == 1.0 and good.model.max_rel < 1e-5
    failed = {r.layer: " ".join(r.problems) for r in bad.layers if r.problems}
    assert "differs" in failed[P.format(i=1) + "feed_forward.experts"]
    assert "expert 2 on MoE-TP rank 1/4 differs" in failed[P.format(i=3) + "feed_forward.experts"]
    assert P.format(i=0) + "self_attn.qkv_proj" in failed
    assert P.format(i=3) + "feed_forward.shared_expert.gate_up_proj" in failed
    assert bad.model is not None and not bad.model.ok


@pytest.mark.slow
def test_verify_model_tp8(llama4, tmp_path):
    """tp 8: the kv heads replicated 4 ways, one head per rank."""
    out = tmp_path / "out"
    tpshard.split(llama4, out, Topology(tp=8))
    (report,) = verify_many([out], [llama4], model=True)
    assert report.ok and report.model.top1 == 1.0
