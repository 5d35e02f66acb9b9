"""split then check on tiny real MoE / MLA checkpoints (transformers' own save_pretrained): every
rank held to the independent contract of tests/contract.py at several tp / ep / attn-dp; check shown
failing on outputs broken the ways MoE and MLA outputs can be (issue 8)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from contract import expected_rank_tensor
from tpshard.manifest import read_manifest
from tpshard.topology import Topology


def source_tensors(model: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in model.glob("*.safetensors"):
        out |= load_file(f)
    return out


def assert_contract(model: Path, out: Path, topo: Topology) -> None:
    config = json.loads((model / "config.json").read_text())
    full = source_tensors(model)
    for rank in range(topo.tp):
        tensors = tpshard.open_rank(out, rank)
        want = {
            name: t
            for name, src in full.items()
            if (t := expected_rank_tensor(
                name, src, rank, tp=topo.tp, attn_dp=topo.attn_dp, ep=topo.ep, moe_dense_tp=topo.moe_dense_tp, config=config
            )) is not None
        }  # fmt: skip
        assert set(tensors) == set(want), f"rank {rank}: {sorted(set(tensors) ^ set(want))[:4]}"
        for name, t in tensors.items():
            assert t.dtype == want[name].dtype and torch.equal(t, want[name]), f"rank {rank}: {name} {list(t.shape)} vs {list(want[name].shape)}"


SLOW = pytest.mark.slow
CASES = [
    ("qwen3_moe", Topology(tp=4)),
    pytest.param("qwen3_moe", Topology(tp=8, attn_dp=2, ep=8), marks=SLOW),
    ("qwen3_moe", Topology(tp=4, attn_dp=2, ep=2)),
    ("qwen2_moe", Topology(tp=8, attn_dp=2, ep=4)),
    pytest.param("qwen2_moe", Topology(tp=2), marks=SLOW),
    pytest.param("mixtral", Topology(tp=8), marks=SLOW),
    ("mixtral", Topology(tp=8, ep=2)),
    ("deepseek_v3", Topology(tp=8, attn_dp=2, ep=8)),
    ("deepseek_v3", Topology(tp=4, ep=2, moe_dense_tp=1)),
    pytest.param("deepseek_v3", Topology(tp=8), marks=SLOW),
    ("deepseek_v2", Topology(tp=4, attn_dp=2, ep=4)),
    ("glm4_moe", Topology(tp=2)),
    ("glm4_moe", Topology(tp=4, ep=2)),
    ("glm4_moe", Topology(tp=8, attn_dp=2, ep=8)),
    pytest.param("glm4_moe", Topology(tp=8, attn_dp=4, ep=2, moe_dense_tp=1), marks=SLOW),
]


def _id(case) -> str:
    fixture, topo = case.values if hasattr(case, "values") else case
    return f"{fixture}-{topo.describe().replace(' ', '_')}"


@pytest.mark.parametrize("fixture, topo", CASES, ids=[_id(c) for c in CASES])
def test_every_rank_matches_the_contract(request, tmp_path, fixture, topo):
    model = request.getfixturevalue(fixture)
    out = tmp_path / "out"
    tpshard.split(model, out, topo)
    report = tpshard.check(out, model)
    assert report.ok, [p.message for p in report.problems][:5]
    assert_contract(model, out, topo)


def test_deepseek_v3_tp8_attn_dp2_ep8_per_rank(deepseek_v3, tmp_path):
    """the MoE and MLA worked tables of docs/contracts.md at tiny scale: experts [r, r+1) whole, MLA heads of a = r % 4 (shared by r and
    r + 4), shared experts and lm_head over tp 8, the MTP layer cut like a MoE layer."""
    out = tmp_path / "out"
    tpshard.split(deepseek_v3, out, Topology(tp=8, attn_dp=2, ep=8))
    full = source_tensors(deepseek_v3)
    for r in range(8):
        t = tpshard.open_rank(out, r)
        for layer in (1, 2, 3):  # 3 is the MTP layer
            held = sorted({int(n.split(".")[5]) for n in t if n.startswith(f"model.layers.{layer}.mlp.experts.")})
            assert held == [r]
            assert torch.equal(t[f"model.layers.{layer}.mlp.experts.{r}.down_proj.weight"], full[f"model.layers.{layer}.mlp.experts.{r}.down_proj.weight"])
        a = r % 4
        assert torch.equal(t["model.layers.1.self_attn.q_b_proj.weight"], full["model.layers.1.self_attn.q_b_proj.weight"][48 * a : 48 * a + 48])  # 2 heads x 24
        assert torch.equal(t["model.layers.1.self_attn.kv_b_proj.weight"], full["model.layers.1.self_attn.kv_b_proj.weight"][64 * a : 64 * a + 64])  # 2 heads x 32
        assert torch.equal(t["model.layers.1.self_attn.o_proj.weight"], full["model.layers.1.self_attn.o_proj.weight"][:, 32 * a : 32 * a + 32])
        assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (4, 64)  # 32 / tp 8
        assert t["model.layers.3.eh_proj.weight"].shape == (64, 128)
        assert t["model.layers.3.embed_tokens.weight"].shape == (64, 64)  # 256 / attn_tp 4
        assert t["model.layers.3.shared_head.head.weight"].shape == (32, 64)  # 256 / tp 8
    m = read_manifest(out)
    assert m.plan.topology.ep == 8 and m.plan.model.num_nextn_predict_layers == 1
    experts = [s for s in m.plan.shards if s.expert is not None]
    assert experts and all(s.ranks == (s.expert,) and s.ep_slot == s.expert for s in experts)


def test_moe_dense_tp_1_keeps_dense_layers_whole(deepseek_v3, tmp_path):
    out = tmp_path / "out"
    tpshard.split(deepseek_v3, out, Topology(tp=4, moe_dense_tp=1))
    full = source_tensors(deepseek_v3)
    for r in range(4):
        t = tpshard.open_rank(out, r)
        assert torch.equal(t["model.layers.0.mlp.gate_proj.weight"], full["model.layers.0.mlp.gate_proj.weight"])
        assert t["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape == (8, 64)  # shared experts stay over tp


# ---- broken outputs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ds_good(deepseek_v3, tmp_path_factory) -> Path:
    """DeepSeek-V3 at tp 4, ep 2 (moe_tp 2): experts 0-3 on ranks 0-1, 4-7 on ranks 2-3, each cut in two."""
    out = tmp_path_factory.mktemp("ds_good") / "out"
    tpshard.split(deepseek_v3, out, Topology(tp=4, ep=2))
    return out


def problems(out, source):
    return [f"[{p.check}] {p.message}" for p in tpshard.check(out, source).problems]


def test_two_experts_swapped_is_caught(ds_good, deepseek_v3, copy_of):
    out = copy_of(ds_good)
    a, b = "model.layers.1.mlp.experts.0.up_proj.weight", "model.layers.1.mlp.experts.1.up_proj.weight"
    ta, tb = (tpshard.open_rank(out, 0)[n].clone() for n in (a, b))
    overwrite_tensor(out, 0, a, tb)
    overwrite_tensor(out, 0, b, ta)
    rewrite_checksums(out)
    assert not problems(out, None), "with consistent checksums only the source can tell"
    found = problems(out, deepseek_v3)
    assert any(a in p and "[reassembly]" in p for p in found) and any(b in p for p in found), found


def test_expert_on_the_wrong_ep_slot_is_caught(ds_good, deepseek_v3, copy_of):
    """Rank 2 (slot 1) holds expert 0's bytes where its expert 4 belongs."""
    out = copy_of(ds_good)
    name = "model.layers.2.mlp.experts.4.gate_proj.weight"
    overwrite_tensor(out, 2, name, tpshard.open_rank(out, 0)["model.layers.2.mlp.experts.0.gate_proj.weight"].clone())
    rewrite_checksums(out)
    found = problems(out, deepseek_v3)
    assert any(name in p and "[reassembly]" in p for p in found), found


def test_manifest_moving_an_expert_to_another_slot_is_caught(ds_good, deepseek_v3, copy_of):
    import msgspec

    from tpshard.manifest import MANIFEST_NAME, encode_manifest

    out = copy_of(ds_good)
    m = read_manifest(out)
    # The ranks of a shard are its file's (manifest v2): the expert's record now claims slot 1.
    plan = m.plan.with_shards(
        msgspec.structs.replace(s, ep_slot=1) if s.name == "model.layers.1.mlp.experts.0.down_proj.weight" else s
        for s in m.plan.shards
    )  # fmt: skip
    (out / MANIFEST_NAME).write_bytes(encode_manifest(m.with_plan(plan)))
    found = problems(out, deepseek_v3)
    assert any("[experts]" in p and "experts.0.down_proj" in p and "belongs to slot 0" in p for p in found), found
    assert any("[rules]" in p and "ep_slot=1" in p for p in found), found


def test_shifted_moe_tp_slice_is_caught(ds_good, deepseek_v3, copy_of):
    """Rank 1's half of expert 2's down_proj taken one column too early."""
    out = copy_of(ds_good)
    name = "model.layers.1.mlp.experts.2.down_proj.weight"
    full = source_tensors(deepseek_v3)[name]
    overwrite_tensor(out, 1, name, full[:, 15:31].contiguous())
    rewrite_checksums(out)
    found = problems(out, deepseek_v3)
    assert any(name in p and "[reassembly]" in p for p in found), found


def test_wrong_mla_head_range_is_caught(ds_good, deepseek_v3, copy_of):
    """Rank 0 holds heads 2-3 of kv_b_proj (rank 1's) instead of heads 0-1."""
    out = copy_of(ds_good)
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 1)[name].clone())
    rewrite_checksums(out)
    found = problems(out, deepseek_v3)
    assert any(name in p and "holds the slice of group rank 1" in p for p in found), found


# ---- FP8 block (item 6) -------------------------------------------------------------------------


@pytest.mark.parametrize("topo", [Topology(tp=4, ep=2), Topology(tp=8, attn_dp=2, ep=8)], ids=["tp4-ep2", "tp8-dp2-ep8"])
def test_fp8_deepseek_experts_and_scales_cut_on_blocks(deepseek_fp8, tmp_path, topo):
    """Every weight and its weight_scale_inv: the weight by the contract, the scale the same range
    in 128-blocks; check reassembles every source tensor bit-exact."""
    out = tmp_path / "out"
    tpshard.split(deepseek_fp8, out, topo)
    report = tpshard.check(out, deepseek_fp8)
    assert report.ok, [p.message for p in report.problems][:5]
    config = json.loads((deepseek_fp8 / "config.json").read_text())
    full = source_tensors(deepseek_fp8)
    for rank in range(topo.tp):
        held = tpshard.open_rank(out, rank)
        for name, t in held.items():
            if name.endswith("weight_scale_inv"):
                w = held[name.removesuffix("_scale_inv")]
                block = [-(-d // 128) for d in w.shape]
                assert list(t.shape) == block, name  # the scale covers exactly the rank's blocks
                continue
            want = expected_rank_tensor(name, full[name], rank, tp=topo.tp, attn_dp=topo.attn_dp, ep=topo.ep, config=config)
            assert want is not None and torch.equal(t.view(torch.uint8), want.view(torch.uint8)), name
    m = read_manifest(out)
    scales = [s for s in m.plan.shards if s.name.endswith("experts.3.down_proj.weight_scale_inv")]
    assert all(s.quant == "fp8_block" and s.expert == 3 and s.ep_slot == 3 // (8 // topo.ep) for s in scales)


def test_fp8_misaligned_topology_is_refused_before_a_byte(deepseek_fp8, tmp_path):
    """tp 8 without EP: experts 256 / 8 = 32 rows per rank, o_proj 512 / 8 = 64 columns: refused,
    naming tensor, ranks and numbers; nothing written."""
    import subprocess
    import sys

    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "tpshard", "split", str(deepseek_fp8), "-o", str(out), "--tp", "8"], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "experts.0.gate_proj.weight_scale_inv: N 256 over moe_tp of 8 gives 32 per rank" in p.stderr
    assert "self_attn.o_proj.weight_scale_inv: K 512 over attn_tp of 8 gives 64 per rank" in p.stderr
    assert "choose --ep" in p.stderr and "misaligned ranks [0, 1, 2, 3, 4, 5, 6, 7]" in p.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))
