"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM, tpshard/arch/glm.py) on a tiny checkpoint saved by
transformers' own Glm4MoeForCausalLM (tests/checkpoints.py "glm4_moe": 8 heads of 16 over 2 kv
heads, q/k/v biases, q/k norms, layer 0 dense, 8 experts + 1 shared expert, fp32 router and
correction bias, the MTP layer 3 in its own file).

What each rank holds is SGLang's models/glm4_moe.py: attention and the embedding over attn_tp, the
shared expert over the full tp even under EP, experts in contiguous EP blocks, the router whole. The
per-rank contract is tests/contract.py (test_moe_split.py's cases); here the GLM specifics, the
refusals, layouts broken on purpose (check --source must see them), and verify (layer level, and
the decoder against transformers' own Glm4MoeForCausalLM).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpshard
import tpshard.arch as arch
from broken import only_the_source_tells, overwrite_tensor, problems, rewrite_checksums, take_from_rank
from checkpoints import make_checkpoint
from test_moe_split import assert_contract, source_tensors
from test_verify_moe import round_robin_split
from tpshard.manifest import read_manifest
from tpshard.topology import Topology
from tpshard.verify import verify_many

GLM = "Glm4MoeForCausalLM"
TP4_EP2 = Topology(tp=4, ep=2)  # attn_tp 4 (kv head r // 2 on rank r), moe_tp 2: slot 0 = ranks 0-1
SHARED = "model.layers.{i}.mlp.shared_experts.gate_proj.weight"


def tpshard_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def glm_good(glm4_moe, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("glm_good") / "out"
    tpshard.split(glm4_moe, out, TP4_EP2)
    return out


def test_tp4_ep2_per_rank(glm_good, glm4_moe):
    full = source_tensors(glm4_moe)
    assert full["model.layers.1.mlp.gate.weight"].dtype == torch.float32  # as transformers saves GLM
    assert "model.layers.1.self_attn.o_proj.bias" not in full and "model.layers.1.self_attn.q_proj.bias" in full
    for r in range(4):
        t = tpshard.open_rank(glm_good, r)
        assert not [n for n in t if n.endswith("o_proj.bias")]
        for i in (1, 2, 3):  # 3 is the MTP layer, a sparse layer whatever first_k_dense_replace says
            held = sorted({int(n.split(".")[5]) for n in t if n.startswith(f"model.layers.{i}.mlp.experts.")})
            assert held == list(range(4 * (r // 2), 4 * (r // 2) + 4))  # contiguous blocks of E / ep
            s = r % 2
            name = f"model.layers.{i}.mlp.experts.{held[1]}.up_proj.weight"
            assert torch.equal(t[name], full[name][16 * s : 16 * s + 16])
            # the shared expert over the full tp (32 / 4 rows), not over moe_tp (32 / 2)
            assert torch.equal(t[SHARED.format(i=i)], full[SHARED.format(i=i)][8 * r : 8 * r + 8])
            for p in ("weight", "e_score_correction_bias"):
                name = f"model.layers.{i}.mlp.gate.{p}"
                assert t[name].dtype == torch.float32 and torch.equal(t[name], full[name])
        a = "model.layers.2.self_attn."
        kv = r // 2  # 2 kv heads over attn_tp 4: ranks 0, 1 share head 0; ranks 2, 3 head 1
        for p in ("k_proj", "v_proj"):
            assert torch.equal(t[a + p + ".weight"], full[a + p + ".weight"][16 * kv : 16 * kv + 16])
            assert torch.equal(t[a + p + ".bias"], full[a + p + ".bias"][16 * kv : 16 * kv + 16])
        assert torch.equal(t[a + "q_proj.bias"], full[a + "q_proj.bias"][32 * r : 32 * r + 32])
        assert torch.equal(t[a + "o_proj.weight"], full[a + "o_proj.weight"][:, 32 * r : 32 * r + 32])
        assert torch.equal(t[a + "q_norm.weight"], full[a + "q_norm.weight"])
        assert torch.equal(t["model.layers.0.mlp.gate_proj.weight"], full["model.layers.0.mlp.gate_proj.weight"][24 * r : 24 * r + 24])
        assert not [n for n in t if n.startswith("model.layers.0.mlp.experts")]
        for whole in ("eh_proj", "enorm", "hnorm", "shared_head.norm"):
            assert torch.equal(t[f"model.layers.3.{whole}.weight"], full[f"model.layers.3.{whole}.weight"])
        assert t["model.layers.3.embed_tokens.weight"].shape == (64, 64)  # 256 / attn_tp 4
    assert read_manifest(glm_good).plan.model.num_nextn_predict_layers == 1


def test_attn_dp_and_moe_dense_tp_1(glm4_moe, tmp_path):
    """tp 8, attn-dp 2, ep 8: attention and both embeddings over attn_tp 4 (rank r as r % 4), one
    whole expert per rank, the shared expert over tp 8, the dense layer whole (--moe-dense-tp 1)."""
    out = tmp_path / "out"
    topo = Topology(tp=8, attn_dp=2, ep=8, moe_dense_tp=1)
    tpshard.split(glm4_moe, out, topo)
    assert tpshard.check(out, glm4_moe).ok
    assert_contract(glm4_moe, out, topo)
    full = source_tensors(glm4_moe)
    for r in range(8):
        t = tpshard.open_rank(out, r)
        assert torch.equal(t["model.layers.0.mlp.down_proj.weight"], full["model.layers.0.mlp.down_proj.weight"])
        assert torch.equal(t["model.layers.1.self_attn.q_proj.weight"], tpshard.open_rank(out, r % 4)["model.layers.1.self_attn.q_proj.weight"])
        assert t[SHARED.format(i=1)].shape == (4, 64) and t["model.layers.3.embed_tokens.weight"].shape == (64, 64)
        assert sorted({n.split(".")[5] for n in t if ".mlp.experts." in n}) == [str(r)]


def test_complete_without_mtp_layer(tmp_path):
    """attention_bias and no o_proj.bias is complete (Glm4MoeAttention builds none); the MTP layer is optional."""
    model = make_checkpoint(tmp_path / "model", "glm4_moe")
    out = tmp_path / "out"
    tpshard.split(model, out, Topology(tp=2))
    assert tpshard.check(out, model).ok


# ---- refusals: one line, exit 2, nothing written --------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tp", "16", "--ep", "2", "--attn-dp", "2"), "tp size 16 is greater than the 8 routed experts of Glm4MoeForCausalLM; SGLang glm4_moe.py refuses it"),
        (("--tp", "2", "--pp", "2"), "--pp 2: no pipeline layout of Glm4MoeForCausalLM is on record"),
        (("--tp", "6", "--ep", "3", "--attn-dp", "3"), "--ep 3 does not divide the 8 routed experts"),
    ],
    ids=["tp-above-experts", "pp", "ep-not-dividing"],
)
def test_topology_refusals(glm4_moe, tmp_path, args, message):
    p = tpshard_cli("split", glm4_moe, "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "config, args, message",
    [
        (dict(num_nextn_predict_layers=2), ("--tp", "2"), 'asserts "Only 1 nextn layer is supported"'),
        (dict(hidden_act="gelu"), ("--tp", "2"), "hidden_act 'gelu'; SGLang's Glm4MoeSparseMoeBlock supports only silu"),
    ],
    ids=["two-mtp-layers", "gelu"],
)
def test_config_refusals(glm4_moe, copy_of, tmp_path, config, args, message):
    model = copy_of(glm4_moe)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(cfg | config))
    p = tpshard_cli("plan", model, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr


def test_stray_o_proj_bias_is_refused(glm4_moe, copy_of, tmp_path):
    """Glm4MoeAttention builds o_proj without a bias and SGLang's load_weights skips an extra '.bias'
    unread (glm4_moe.py L268-276, L1234-1236): a split must not carry a weight the engine drops."""
    from safetensors.torch import save_file

    model = copy_of(glm4_moe)
    name = "model.layers.1.self_attn.o_proj.bias"
    save_file({name: torch.randn(64).to(torch.bfloat16)}, model / "stray.safetensors", metadata={"format": "pt"})
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"][name] = "stray.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "out"
    for command in (("plan", model), ("split", model, "-o", out)):
        p = tpshard_cli(*command, "--tp", "2")
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert f"{name}: SGLang glm4_moe.py builds model.layers.1.self_attn.o_proj without a bias" in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and not out.exists()


def test_heads_not_dividing_attn_tp_is_refused(tmp_path):
    model = make_checkpoint(tmp_path / "model", "glm4_moe", num_hidden_layers=2, num_attention_heads=12)
    p = tpshard_cli("plan", model, "--tp", "8")
    assert p.returncode == 2 and "12 attention heads do not divide over the attn_tp group of 8" in p.stderr, p.stderr


def test_vllm_export_of_ep_below_tp_refused(glm_good, tmp_path):
    """vLLM places experts at --ep 1 or --ep tp only (tests/test_export_families.py has the exports)."""
    p = tpshard_cli("export", glm_good, "--format", "vllm", "-o", tmp_path / "exp")
    assert p.returncode == 2 and "split with --ep 2 (moe_tp 2) at tp 4; vLLM builds either" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "exp").exists()


# ---- layouts broken on purpose: check --source must see each -------------------------------------


def split_with(model: Path, out: Path, topo: Topology, monkeypatch, **changes) -> None:
    """Split with GLM's Arch changed (a plan that gets one placement wrong); the real one back after."""
    good = arch.ARCHITECTURES[GLM]
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, GLM, dataclasses.replace(good, **changes))
        tpshard.split(model, out, topo)


def rules_with(role_of) -> tuple:
    return tuple(r._replace(role=role_of(r)) for r in arch.ARCHITECTURES[GLM].rules)


@pytest.mark.parametrize("wrong", ["expert", "replicated"], ids=["shared-over-moe_tp", "shared-whole"])
def test_shared_expert_not_over_tp_is_caught(glm4_moe, tmp_path, monkeypatch, wrong):
    out = tmp_path / "out"
    split_with(glm4_moe, out, TP4_EP2, monkeypatch, rules=rules_with(lambda r: wrong if r.role == "shared_expert" else r.role))
    found = problems(out, glm4_moe)
    assert any("[rules]" in p and "mlp.shared_experts." in p and "(rules: 'tp')" in p for p in found), found[:4]


def test_embedding_over_tp_under_attn_dp_is_caught(glm4_moe, tmp_path, monkeypatch):
    """Glm4MoeModel builds the embedding over attn_tp under attention DP, not over tp (Llama's layout)."""
    out = tmp_path / "out"
    split_with(glm4_moe, out, Topology(tp=4, attn_dp=2, ep=2), monkeypatch, embed_group="tp")
    found = problems(out, glm4_moe)
    assert any("[rules]" in p and "model.embed_tokens.weight" in p for p in found), found[:4]
    assert any("[rules]" in p and "model.layers.3.embed_tokens.weight" in p for p in found), found[:4]


def test_experts_round_robin_is_caught(glm4_moe, tmp_path):
    out = tmp_path / "out"
    round_robin_split(glm4_moe, out, TP4_EP2)
    found = problems(out, glm4_moe)
    assert any("[experts]" in p and "mlp.experts.1." in p and "belongs to slot 0" in p for p in found), found[:4]


def test_kv_heads_swapped_is_caught(glm_good, glm4_moe, copy_of):
    """Rank 0 holds kv head 1 (ranks 2 and 3's) with its bias: checksums rewritten, only the source tells."""
    out = copy_of(glm_good)
    for p in ("weight", "bias"):
        name = f"model.layers.1.self_attn.k_proj.{p}"
        take_from_rank(out, 0, name, 2)
    found = only_the_source_tells(out, glm4_moe)
    assert any("k_proj.weight" in p and "holds the slice of group rank 1 (meant for ranks [2, 3])" in p for p in found), found[:4]
    assert any("k_proj.bias" in p for p in found), found[:4]


def test_router_cut_is_caught(glm_good, glm4_moe, copy_of):
    """Rank 3's router is its tp slice of the experts' rows (tiled to the whole shape) instead of whole."""
    out = copy_of(glm_good)
    name = "model.layers.2.mlp.gate.weight"
    whole = tpshard.open_rank(out, 3)[name]
    overwrite_tensor(out, 3, name, whole[6:8].repeat(4, 1).clone())
    found = only_the_source_tells(out, glm4_moe)
    assert any(name in p for p in found), found[:4]


# ---- verify: layer level and against transformers' Glm4MoeForCausalLM -------------------------------


@pytest.mark.slow
def test_verify_tp2_and_tp4_ep_and_a_broken_output(glm4_moe, glm_good, tmp_path):
    """Every engine layer of GLM (QKV with biases, the fp32 router, FusedMoE, the shared expert, the
    MTP layer's) on every rank against the source, and the decoder's logits against transformers'
    (partial rotary, q/k norms, grouped sigmoid routing with the correction bias, routed_scaling_factor);
    a broken output fails on the layers it breaks and in the logits."""
    tp2 = tmp_path / "tp2"
    tpshard.split(glm4_moe, tp2, Topology(tp=2, ep=2))
    r = verify_many([tp2], [glm4_moe], model=True)[0]
    assert r.ok and r.model.top1 == 1.0 and r.model.max_rel < 1e-5, r.failures()
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-a", str(glm_good), str(bad)], check=True)
    name = "model.layers.1.self_attn.v_proj.bias"
    take_from_rank(bad, 0, name, 2)
    name = "model.layers.2.mlp.experts.1.down_proj.weight"
    take_from_rank(bad, 0, name, 1)
    rewrite_checksums(bad)
    good, broken = verify_many([glm_good, bad], [glm4_moe] * 2, model=True)
    assert good.ok and good.model.top1 == 1.0 and good.model.max_rel < 1e-5, good.failures()
    layers = {x.layer for x in good.layers}
    assert {"model.layers.1.mlp.gate", "model.layers.1.mlp.experts", "model.layers.1.mlp.shared_experts.gate_up_proj"} <= layers
    assert {"model.layers.3.eh_proj", "model.layers.3.mlp.experts", "model.layers.0.mlp.gate_up_proj"} <= layers
    failing = {x.layer for x in broken.layers if not x.ok}
    assert failing == {"model.layers.1.self_attn.qkv_proj", "model.layers.2.mlp.experts"}, broken.failures()
    assert not broken.model.ok
    p = tpshard_cli("verify", bad, "--source", glm4_moe)
    assert p.returncode == 1 and "model.layers.2.mlp.experts" in p.stdout + p.stderr


@pytest.mark.slow
def test_verify_model_air_style_attn_dp_and_dense_tp_1(tmp_path):
    """GLM-4.5-Air's attention (no q/k norms) and GLM-4.5's, under attention DP and --moe-dense-tp 1,
    against transformers, in one launch."""
    models = [
        make_checkpoint(tmp_path / "air", "glm4_moe", seed=1, use_qk_norm=False, n_group=1, topk_group=1),
        make_checkpoint(tmp_path / "full", "glm4_moe", seed=2, max_shard_size="100KB", mtp=True),
    ]
    outs = [tmp_path / "out-air", tmp_path / "out-full"]
    for model, out in zip(models, outs):
        tpshard.split(model, out, Topology(tp=4, attn_dp=2, ep=2, moe_dense_tp=1))
    for r in verify_many(outs, models, model=True):
        assert r.ok and r.model.top1 == 1.0 and r.model.max_rel < 1e-5, r.failures()
