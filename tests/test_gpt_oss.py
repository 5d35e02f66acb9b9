"""gpt-oss (GptOssForCausalLM, tpshard/arch/gpt_oss.py) on a tiny bf16 checkpoint saved by
transformers' own GptOssForCausalLM (tests/gpt_oss_fixtures.py).

What each rank holds is SGLang's models/gpt_oss.py, written out here from its loader, not from
tpshard's plan: the experts' fused gate_up_proj [E, H, 2I] cut as ONE contiguous slice of its
interleaved last dim (weight_loader_fused narrows the transposed w13 by 2I / moe_tp at
moe_tp_rank), down_proj on dim 1, the down bias whole, the sinks with the q heads
(`[attn_tp_rank * h, +h)`), the router whole, the embedding whole under attention DP
(enable_tp=not is_dp_attention_enabled()). Then the refusals, layouts broken on purpose (check
--source and verify must see each), and verify --model against transformers.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpshard
from broken import overwrite_tensor, reorder_experts, rewrite_checksums, swap_ranks, take_from_rank
from gpt_oss_fixtures import make_gpt_oss
from test_moe_split import source_tensors
from tpshard.topology import Topology
from tpshard.verify import verify_many

E, H, I, HEADS, KV, HD = 8, 64, 96, 8, 2, 16
EXPERTS = "model.layers.{i}.mlp.experts."


def tpshard_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model")


@pytest.fixture(scope="module")
def tp4_dp2(gpt_oss, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpt_oss_tp4_dp2") / "out"
    tpshard.split(gpt_oss, out, Topology(tp=4, attn_dp=2))
    return out


def sglang_rank(full: dict, topo: Topology, rank: int) -> dict[str, torch.Tensor]:
    """What SGLang's GptOssForCausalLM loads on `rank` of layer 0 (ep 1: moe_tp = tp), in HF names."""
    attn_tp = topo.tp // topo.attn_dp
    a, t = rank % attn_tp, topo.tp
    h, kv_per = HEADS // attn_tp, max(1, KV // attn_tp)
    kv = a // (attn_tp // KV) if attn_tp >= KV else a  # the kv head block of this attention rank
    p, x = "model.layers.0.self_attn.", EXPERTS.format(i=0)
    w = 2 * I // t  # the rank's contiguous slice of the interleaved gate/up dim
    return {
        p + "sinks": full[p + "sinks"][a * h : (a + 1) * h],
        p + "q_proj.bias": full[p + "q_proj.bias"][a * h * HD : (a + 1) * h * HD],
        p + "k_proj.weight": full[p + "k_proj.weight"][kv * kv_per * HD : (kv + 1) * kv_per * HD],
        p + "o_proj.weight": full[p + "o_proj.weight"][:, a * h * HD : (a + 1) * h * HD],
        p + "o_proj.bias": full[p + "o_proj.bias"],
        x + "gate_up_proj": full[x + "gate_up_proj"][:, :, rank % t * w : (rank % t + 1) * w],
        x + "gate_up_proj_bias": full[x + "gate_up_proj_bias"][:, rank % t * w : (rank % t + 1) * w],
        x + "down_proj": full[x + "down_proj"][:, rank % t * (I // t) : (rank % t + 1) * (I // t)],
        x + "down_proj_bias": full[x + "down_proj_bias"],
        "model.layers.0.mlp.router.weight": full["model.layers.0.mlp.router.weight"],
        "model.layers.0.mlp.router.bias": full["model.layers.0.mlp.router.bias"],
    }


@pytest.mark.parametrize("topo", [Topology(tp=2), Topology(tp=4, attn_dp=2), Topology(tp=8), Topology(tp=8, attn_dp=4)], ids=str)
def test_per_rank_as_sglang_loads(gpt_oss, tmp_path, topo):
    out = tmp_path / "out"
    tpshard.split(gpt_oss, out, topo)
    assert tpshard.check(out, gpt_oss).ok
    full = source_tensors(gpt_oss)
    assert full[EXPERTS.format(i=0) + "gate_up_proj"].shape == (E, H, 2 * I)  # as transformers saves it
    for r in range(topo.tp):
        held = tpshard.open_rank(out, r)
        for name, want in sglang_rank(full, topo, r).items():
            assert torch.equal(held[name], want), (r, name)
        embed = held["model.embed_tokens.weight"]
        if topo.attn_dp > 1:  # whole, padded to 64: VocabParallelEmbedding(enable_tp=False)
            assert embed.shape == (256, H) and torch.equal(embed[:250], full["model.embed_tokens.weight"])
        else:
            assert embed.shape == (256 // topo.tp, H)
    # The [gate | up] reading of the fused dim is another layout from tp 2 on: the test above tells them apart.
    g = full[EXPERTS.format(i=0) + "gate_up_proj"]
    halves = torch.cat((g[..., : I // topo.tp], g[..., I : I + I // topo.tp]), -1)
    assert not torch.equal(halves, sglang_rank(full, topo, 0)[EXPERTS.format(i=0) + "gate_up_proj"])


def test_pipeline_stages_and_reshard(gpt_oss, tp4_dp2, tmp_path):
    """pp 2: lm_head on every stage (GptOssForCausalLM builds it unconditionally); a reshard of the
    tp 4 attn-dp 2 output to tp 2 pp 2 is byte-identical to a split."""
    split = tmp_path / "split"
    tpshard.split(gpt_oss, split, Topology(tp=2, pp_layers=(1, 1)))
    assert tpshard.check(split, gpt_oss).ok
    for r in range(4):
        assert "lm_head.weight" in tpshard.open_rank(split, r)
    p = tpshard_cli("reshard", tp4_dp2, "-o", tmp_path / "re", "--tp", "2", "--pp", "2")
    assert p.returncode == 0, p.stderr
    assert tpshard_cli("check", tmp_path / "re", "--source", gpt_oss).returncode == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tp", "4", "--ep", "2"), "--ep 2: model.layers.0.mlp.experts."),
        (("--tp", "16"), "attention heads do not divide"),
    ],
    ids=["ep-bf16", "heads"],
)
def test_refusals(gpt_oss, tmp_path, args, message):
    p = tpshard_cli("split", gpt_oss, "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
    if args[-1] == "2":  # SGLang's bf16 loader, not tpshard, is what cannot do it
        assert "weight_loader_fused" in p.stderr and "cannot load --ep > 1" in p.stderr


def test_vllm_export_of_attention_dp_refused(tp4_dp2, tmp_path):
    """vLLM's exports of gpt-oss: tests/test_export_families.py."""
    p = tpshard_cli("export", tp4_dp2, "--format", "vllm", "-o", tmp_path / "deploy")
    assert p.returncode == 2 and "--format vllm: split with --attn-dp 2" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# ---- broken on purpose ------------------------------------------------------------------------------


def break_copy(good: Path, dst: Path, gpt_oss: Path) -> Path:
    """tp 4 attn-dp 2 output broken four ways, each in its own layer and shard (checksums rewritten,
    so only the comparison with the source or the numbers can see them)."""
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    full = source_tensors(gpt_oss)
    x0, x1 = EXPERTS.format(i=0), EXPERTS.format(i=1)
    g, b = full[x0 + "gate_up_proj"], full[x0 + "gate_up_proj_bias"]
    for r in range(4):  # layer 0: every rank's gate/up read as [gate | up] halves
        c = I // 4
        overwrite_tensor(dst, r, x0 + "gate_up_proj", torch.cat((g[..., r * c : (r + 1) * c], g[..., I + r * c : I + (r + 1) * c]), -1))
        overwrite_tensor(dst, r, x0 + "gate_up_proj_bias", torch.cat((b[:, r * c : (r + 1) * c], b[:, I + r * c : I + (r + 1) * c]), -1))
    # layer 1: rank 1's experts round-robin (even ids, then odd) on the experts axis
    reorder_experts(dst, 1, (x1 + "gate_up_proj", x1 + "down_proj"), list(range(0, E, 2)) + list(range(1, E, 2)))
    # layer 0: attention rank 0 (world ranks 0, 2) holds attention rank 1's sinks
    take_from_rank(dst, 0, "model.layers.0.self_attn.sinks", 1)
    # layer 1: the kv heads swapped between the two attention ranks
    swap_ranks(dst, "model.layers.1.self_attn.k_proj.weight", 0, 1)
    rewrite_checksums(dst)
    return dst


@pytest.fixture(scope="module")
def broken(gpt_oss, tp4_dp2, tmp_path_factory) -> Path:
    return break_copy(tp4_dp2, tmp_path_factory.mktemp("gpt_oss_broken") / "out", gpt_oss)


def test_check_source_sees_each_breakage(broken, gpt_oss):
    found = " ".join(p.message for p in tpshard.check(broken, gpt_oss).problems)
    for name in (
        "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.gate_up_proj_bias",
        "model.layers.1.mlp.experts.down_proj", "model.layers.0.self_attn.sinks", "model.layers.1.self_attn.k_proj.weight",
    ):  # fmt: skip
        assert name in found, (name, found)


def test_sinks_whole_is_not_the_rules(gpt_oss, tmp_path, monkeypatch):
    """A split whose plan keeps the sinks whole on every rank is self-consistent, and check --source
    refuses it: its manifest is not what SGLang's layout gives."""
    import tpshard.plan.dense as dense
    from tpshard.cuts import Cutting
    from tpshard.manifest import Cut

    monkeypatch.setattr(dense, "sinks_cut", lambda name, shape, param, model, g: Cutting("replicated", None, 1, 1, [Cut(0, 0, shape[0], 0, 0)]))
    out = tmp_path / "out"
    tpshard.split(gpt_oss, out, Topology(tp=2))
    monkeypatch.undo()
    report = tpshard.check(out, gpt_oss)
    assert not report.ok and any("sinks" in p.message for p in report.problems), [p.message for p in report.problems]


@pytest.fixture(scope="module")
def verified(broken, tp4_dp2, gpt_oss):
    """verify --model of the broken and the good tp 4 attn-dp 2 outputs, in one launch."""
    return verify_many([broken, tp4_dp2], [gpt_oss, gpt_oss], model=True)


def test_verify_names_each_breakage(verified):
    report = verified[0]
    failed = {r.layer: " ".join(r.problems) for r in report.layers if r.problems}
    assert "differs" in failed["model.layers.0.mlp.experts"]
    assert "expert 2 on MoE-TP rank 1/4 differs" in failed["model.layers.1.mlp.experts"]
    assert "sinks of group rank 0 differ (it holds group rank 1's heads)" in failed["model.layers.0.self_attn.sinks"]
    assert "model.layers.1.self_attn.qkv_proj" in failed
    assert report.model is not None and not report.model.ok


def test_verify_model_against_transformers(verified):
    """tp 4 attn-dp 2: sinks, the sliding layer 0 (window 4 < 16 tokens), yarn, the router's bias,
    the clamped SwiGLU and both expert biases, the whole embedding of each DP replica."""
    report = verified[1]
    assert report.ok, [(r.layer, r.problems) for r in report.layers if r.problems] + [report.model.problems if report.model else None]
    assert report.model is not None and report.model.top1 == 1.0 and report.model.max_rel < 1e-5


@pytest.mark.slow
def test_verify_model_tp8(gpt_oss, tmp_path):
    out = tmp_path / "out"
    tpshard.split(gpt_oss, out, Topology(tp=8))
    (report,) = verify_many([out], [gpt_oss], model=True)
    assert report.ok and report.model.top1 == 1.0


# ---- MXFP4 (the released layout: *_blocks / *_scales, stored transposed) ------------------------------


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(gpt_oss, tmp_path_factory) -> Path:
    from gpt_oss_fixtures import make_gpt_oss_mxfp4

    return make_gpt_oss_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model", gpt_oss)


def test_mxfp4_dequantize_is_transformers(gpt_oss_mxfp4):
    """tpshard's dequantization of the fixture's blocks and scales, transposed to gate_up_proj
    [E, H, 2I] / down_proj [E, I, H], is transformers' own (integrations/mxfp4.py)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tpshard.verify.fused_layers import dequantized

    full = source_tensors(gpt_oss_mxfp4)
    x = EXPERTS.format(i=0)
    held = {p: full[x + p] for p in ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")}
    ours = dequantized(held)
    for p in ("gate_up_proj", "down_proj"):
        theirs = convert_moe_packed_tensors(held[p + "_blocks"], held[p + "_scales"], dtype=torch.float32)
        assert ours[p].shape == theirs.shape and torch.equal(ours[p], theirs), p
    assert ours["gate_up_proj"].shape == (E, H, 2 * I) and ours["down_proj"].shape == (E, I, H)


def test_mxfp4_per_rank_as_sglang_loads(gpt_oss_mxfp4, tmp_path):
    """tp 2: 3 blocks of 32 give ceil(3 / 2) = 2 blocks (64 values) to rank 0 and 1 block to rank 1,
    zero-padded; not I / 2 = 48 each as the bf16 cut."""
    out = tmp_path / "out"
    tpshard.split(gpt_oss_mxfp4, out, Topology(tp=2))
    assert tpshard.check(out, gpt_oss_mxfp4).ok
    full = source_tensors(gpt_oss_mxfp4)
    x = EXPERTS.format(i=1)
    for r, (lo, hi) in enumerate(((0, 64), (64, 96))):  # SGLang: start = r * 64, end = min(start + 64, I)
        held = tpshard.open_rank(out, r)
        for p, dim, a, b in (
            ("gate_up_proj_blocks", 1, 2 * lo, 2 * hi), ("gate_up_proj_scales", 1, 2 * lo, 2 * hi),
            ("gate_up_proj_bias", 1, 2 * lo, 2 * hi), ("down_proj_blocks", 2, lo // 32, hi // 32),
            ("down_proj_scales", 2, lo // 32, hi // 32),
        ):  # fmt: skip
            t, want = held[x + p], full[x + p].narrow(dim, a, b - a)
            assert torch.equal(t.narrow(dim, 0, b - a), want), (r, p)
            assert t.shape[dim] == full[x + p].shape[dim] * 2 // 3 and not t.narrow(dim, b - a, t.shape[dim] - (b - a)).any()
        assert torch.equal(held[x + "down_proj_bias"], full[x + "down_proj_bias"])


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tp", "4"), "3 MXFP4 blocks of the expert intermediate size over moe_tp 4: 1 per rank leaves moe_tp rank 3 none"),
        (("--tp", "8", "--ep", "2"), "3 MXFP4 blocks of the expert intermediate size over moe_tp 4"),
    ],
    ids=["empty-rank", "empty-rank-ep"],
)
def test_mxfp4_refusals(gpt_oss_mxfp4, tmp_path, args, message):
    p = tpshard_cli("split", gpt_oss_mxfp4, "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_mxfp4_breakages_seen(gpt_oss_mxfp4, tmp_path):
    """tp 2, checksums rewritten: layer 0's gate/up blocks, scales and bias read as [gate | up] halves
    on both ranks; layer 1's down scales of rank 0 one block off (blocks [1, 3) for [0, 2)). check
    --source names each tensor; verify fails both layers, and --model the logits."""
    out = tmp_path / "out"
    tpshard.split(gpt_oss_mxfp4, out, Topology(tp=2))
    full = source_tensors(gpt_oss_mxfp4)
    x0, x1 = EXPERTS.format(i=0), EXPERTS.format(i=1)
    for r, (lo, hi) in enumerate(((0, 64), (64, 96))):
        for p in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias"):
            t = full[x0 + p]
            halves = torch.cat((t[:, lo:hi], t[:, I + lo : I + hi]), 1)
            pad = torch.zeros_like(t[:, : 128 - halves.shape[1]])
            overwrite_tensor(out, r, x0 + p, torch.cat((halves, pad), 1))
    overwrite_tensor(out, 0, x1 + "down_proj_scales", full[x1 + "down_proj_scales"][:, :, 1:3].contiguous())
    rewrite_checksums(out)
    found = " ".join(p.message for p in tpshard.check(out, gpt_oss_mxfp4).problems)
    for p in ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias"):
        assert x0 + p in found
    assert x1 + "down_proj_scales" in found
    (report,) = verify_many([out], [gpt_oss_mxfp4])
    failed = {r.layer for r in report.layers if r.problems}
    assert failed == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}, failed
    p = tpshard_cli("verify", out, "--source", gpt_oss_mxfp4, "--model")  # against transformers' dequantized MXFP4
    assert p.returncode == 1 and "FAIL model (" in p.stdout, p.stderr


def test_mxfp4_expert_parallel(gpt_oss_mxfp4, tmp_path):
    """--tp 2 --ep 2 (moe_tp 1): each rank holds its EP slot's 4 experts of every fused tensor, the
    whole intermediate size, the down bias sliced too (SGLang's _load_mxfp4_experts_weights slices
    [ep_rank * E/ep, +E/ep) of each). A round-robin placement (experts 0, 2, 4, 6 on rank 0) is seen
    by check --source and by verify."""
    out = tmp_path / "out"
    tpshard.split(gpt_oss_mxfp4, out, Topology(tp=2, ep=2))
    assert tpshard.check(out, gpt_oss_mxfp4).ok
    full = source_tensors(gpt_oss_mxfp4)
    x = EXPERTS.format(i=0)
    params = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales", "down_proj_bias")
    for r in range(2):
        held = tpshard.open_rank(out, r)
        for p in params:
            assert torch.equal(held[x + p], full[x + p][4 * r : 4 * r + 4]), (r, p)
    for r in range(2):  # round-robin: rank r holds experts r, r + 2, r + 4, r + 6
        for p in params:
            overwrite_tensor(out, r, x + p, full[x + p][r::2].contiguous())
    rewrite_checksums(out)
    found = " ".join(p.message for p in tpshard.check(out, gpt_oss_mxfp4).problems)
    assert all(x + p in found for p in params), found
    (report,) = verify_many([out], [gpt_oss_mxfp4])
    failed = {r.layer: " ".join(r.problems) for r in report.layers if r.problems}
    assert set(failed) == {"model.layers.0.mlp.experts"} and "expert 1 on MoE-TP rank 0/1 differs (it holds expert 2)" in failed[x[:-1]], failed
