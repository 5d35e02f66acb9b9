"""DeepSeek-V4's released quantized form (tests/v4_quant.py: FP8 linears with 128x128 ue8m0 block
scales in `<module>.scale`, FP4 routed experts with per-32 E8M0 scales), split as SGLang 0.5.23 loads
it: every rank's tensors against `engine_rank_tensor` (tests/test_deepseek_v4.py, written from the
engine's classes: a scale is cut as its weight, in whole blocks) at tp 2/4/8 with attention DP and
EP, the MTP layer included; what the ranks dequantize to against SGLang's own dequantization; the
refusals of cuts SGLang refuses; and layouts broken on purpose that check --source or verify catch.
"""

from __future__ import annotations

import json

import pytest
import torch

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from test_deepseek_v4 import assert_engine_layout, problems, rows, tpshard_cli
from test_moe_split import source_tensors
from test_verify_moe import round_robin_split
from tpshard.quant.formats import QuantSpec, dequantize
from tpshard.topology import Topology
from tpshard.verify import verify_many
from v4_quant import dequant_fp4, dequant_fp8, make_v4_quant

TP4_EP2 = Topology(tp=4, ep=2)


@pytest.fixture(scope="module")
def v4q(tmp_path_factory):
    return make_v4_quant(tmp_path_factory.mktemp("v4q") / "model")


@pytest.fixture(scope="module")
def v4q_tp4_ep2(v4q, tmp_path_factory):
    out = tmp_path_factory.mktemp("v4q_tp4_ep2") / "out"
    tpshard.split(v4q, out, TP4_EP2)
    return out


@pytest.mark.parametrize(
    "topo",
    [Topology(tp=2), Topology(tp=8), Topology(tp=8, attn_dp=2, ep=8)],
    ids=["tp2", "tp8", "tp8-dp2-ep8"],
)
def test_every_rank_as_sglang_builds_it(v4q, tmp_path, topo):
    out = tmp_path / "out"
    tpshard.split(v4q, out, topo)
    assert tpshard.check(out, v4q).ok
    assert_engine_layout(v4q, out, topo)


def test_tp4_ep2_dtypes_and_the_mtp_layer(v4q, v4q_tp4_ep2):
    """Scales stay F8_E8M0, FP4 experts I8; the MTP layer's FP8 e_proj / h_proj whole on every rank
    (ReplicatedLinear in deepseek_v4_nextn.py), its experts cut as the main layers'; the compressors
    the checkpoint keeps in bf16 stay bf16, whole."""
    assert tpshard.check(v4q_tp4_ep2, v4q).ok
    assert_engine_layout(v4q, v4q_tp4_ep2, TP4_EP2)
    full = source_tensors(v4q)
    for rank in range(4):
        held = tpshard.open_rank(v4q_tp4_ep2, rank)
        assert held["mtp.0.e_proj.scale"].dtype == torch.float8_e8m0fnu and torch.equal(held["mtp.0.h_proj.weight"], full["mtp.0.h_proj.weight"])
        assert held["layers.1.ffn.experts.0.w1.weight" if rank < 2 else "layers.1.ffn.experts.4.w1.weight"].dtype == torch.int8
        assert held["layers.1.attn.compressor.wkv.weight"].dtype == torch.bfloat16
        assert "layers.1.attn.compressor.wkv.scale" not in held


def test_ranks_dequantize_to_what_sglang_loads(v4q, v4q_tp4_ep2):
    """wo_a: SGLang's deepseek_v4.py dequantizes the whole FP8 wo_a (_dequant_fp8) before its
    ColumnParallelLinear cuts it; a rank's FP8 rows and scale rows dequantize to exactly that cut.
    FP4 experts: the rank's packed slice with its scale slice is the slice of the dequantized expert."""
    full = source_tensors(v4q)
    whole_wo_a = dequant_fp8(full["layers.2.attn.wo_a.weight"], full["layers.2.attn.wo_a.scale"])
    w2 = dequant_fp4(full["layers.3.ffn.experts.5.w2.weight"], full["layers.3.ffn.experts.5.w2.scale"])
    w1 = dequant_fp4(full["mtp.0.ffn.experts.1.w1.weight"], full["mtp.0.ffn.experts.1.w1.scale"])
    assert w2.abs().max() > 0 and whole_wo_a.abs().max() > 0
    for rank in range(4):
        held = tpshard.open_rank(v4q_tp4_ep2, rank)
        got = dequant_fp8(held["layers.2.attn.wo_a.weight"], held["layers.2.attn.wo_a.scale"])
        assert torch.equal(got, rows(whole_wo_a, rank, 4))
        slot, in_slot = divmod(rank, 2)
        if slot == 1:  # experts 4..7
            got = dequant_fp4(held["layers.3.ffn.experts.5.w2.weight"], held["layers.3.ffn.experts.5.w2.scale"])
            assert torch.equal(got, rows(w2, in_slot, 2, dim=1))
        else:
            got = dequant_fp4(held["mtp.0.ffn.experts.1.w1.weight"], held["mtp.0.ffn.experts.1.w1.scale"])
            assert torch.equal(got, rows(w1, in_slot, 2))


def test_tpshard_dequantizes_as_sglang(v4q):
    """tpshard.quant's dsv4_fp8 / dsv4_fp4 (what verify runs on ranks and source) against the test's
    own dequantizers (SGLang's _dequant_fp8 and FP4 table), and close to the bf16 weights quantized."""
    full = source_tensors(v4q)
    bf16 = source_tensors(v4q.with_name(v4q.name + "-bf16"))
    for name, spec, ref in (
        ("layers.1.attn.wq_b", QuantSpec(format="dsv4_fp8", bits=8), dequant_fp8),
        ("layers.1.attn.indexer.wq_b", QuantSpec(format="dsv4_fp8", bits=8), dequant_fp8),  # partial blocks
        ("layers.0.ffn.experts.3.w2", QuantSpec(format="dsv4_fp4", bits=4, group_size=32), dequant_fp4),
    ):
        w, s = full[f"{name}.weight"], full[f"{name}.scale"]
        got = dequantize(spec, {"weight": w, "scale": s})
        assert torch.equal(got, ref(w, s)), name
        original = bf16[f"{name}.weight"].float()
        assert (got - original).abs().max() <= original.abs().max() / (2 if spec.bits == 4 else 8), name


@pytest.fixture(scope="module")
def v4q_small(tmp_path_factory):
    """The release's form on tests/v4_checkpoint.py's own dims (wo_a 4 groups x 16, experts of 32)."""
    return make_v4_quant(tmp_path_factory.mktemp("v4q_small") / "model", aligned=False)


def test_misaligned_shards_are_refused(v4q_small, tmp_path):
    """tp 2: wo_a's 32 rows a rank split a 128-block of its scale; the FP4 experts' 16 rows a rank
    are exact, but SGLang's Fp8MoEMethod raises ValueError for a per-rank intermediate size off
    weight_block_size: refused, nothing written."""
    out = tmp_path / "out"
    p = tpshard_cli("split", v4q_small, "-o", out, "--tp", "2")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "layers.0.attn.wo_a.scale" in p.stderr and "SGLang's Fp8MoEMethod" in p.stderr, p.stderr
    assert not out.exists()
    # tp 1: SGLang still checks gate / up (w1 / w3) against block_n, down (w2) only when it is cut
    p = tpshard_cli("plan", v4q_small, "--tp", "1")
    assert p.returncode == 2 and "ffn.experts.0.w1.weight" in p.stderr and ".w2." not in p.stderr, p.stderr


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(expert_dtype="int4"), "expert_dtype 'int4'"),
        (dict(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}), "has weight_block_size"),
    ],
    ids=["expert-dtype", "no-blocks"],
)
def test_config_refusals(v4q_small, copy_of, change, message):
    model = copy_of(v4q_small)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | change))
    p = tpshard_cli("plan", model, "--tp", "1")
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_a_scale_of_another_rank_is_caught(v4q, v4q_tp4_ep2, copy_of):
    """Rank 0 holding rank 1's wq_b scale rows (its own FP8 rows): self-consistent once the checksums
    are rewritten, wrong against the source."""
    out = copy_of(v4q_tp4_ep2)
    name = "layers.1.attn.wq_b.scale"
    theirs = tpshard.open_rank(out, 1)[name]
    assert not torch.equal(theirs.view(torch.uint8), tpshard.open_rank(out, 0)[name].view(torch.uint8))
    overwrite_tensor(out, 0, name, theirs.clone())
    rewrite_checksums(out)
    assert not problems(out, None)
    found = problems(out, v4q)
    assert any(name in p for p in found), found[:4]


def test_a_scale_of_another_expert_is_caught(v4q, v4q_tp4_ep2, copy_of):
    out = copy_of(v4q_tp4_ep2)
    name = "layers.2.ffn.experts.0.w2.scale"
    other = tpshard.open_rank(out, 0)["layers.2.ffn.experts.1.w2.scale"]
    overwrite_tensor(out, 0, name, other.clone())
    rewrite_checksums(out)
    found = problems(out, v4q)
    assert any(name in p for p in found), found[:4]


def test_experts_round_robin_is_caught(v4q, tmp_path):
    out = tmp_path / "out"
    round_robin_split(v4q, out, TP4_EP2)
    found = problems(out, v4q)
    assert any("ffn.experts." in p for p in found), found[:4]


@pytest.mark.slow
def test_verify_dequantized_layers_and_a_broken_scale(v4q, v4q_tp4_ep2, copy_of):
    """Layer-level verify on the dequantized shards (FP8 column / row / replicated linears, FP4
    experts, the MTP layer) against the dequantized source; rank 0 holding another expert's FP4 scale
    and rank 1's wo_b scale columns fails those two layers only."""
    bad = copy_of(v4q_tp4_ep2)
    overwrite_tensor(bad, 0, "layers.2.ffn.experts.0.w2.scale", tpshard.open_rank(bad, 0)["layers.2.ffn.experts.1.w2.scale"].clone())
    overwrite_tensor(bad, 0, "layers.1.attn.wo_b.scale", tpshard.open_rank(bad, 1)["layers.1.attn.wo_b.scale"].clone())
    rewrite_checksums(bad)
    good, broken = verify_many([v4q_tp4_ep2, bad], [v4q] * 2)
    assert good.ok, good.failures()
    layers = {x.layer for x in good.layers}
    assert {"model.layers.1.self_attn.wo_a", "model.layers.1.self_attn.wo_b", "model.mtp.0.e_proj", "model.layers.2.mlp.experts",
            "model.mtp.0.mlp.experts", "model.layers.3.mlp.shared_experts.gate_up_proj"} <= layers  # fmt: skip
    failing = {x.layer for x in broken.layers if not x.ok}
    assert failing == {"model.layers.1.self_attn.wo_b", "model.layers.2.mlp.experts"}, broken.failures()
