"""Hybrid decoders (tpshard/arch/qwen_next.py): Qwen3.5-MoE (Qwen3_5MoeForCausalLM) and Qwen3-Next
(Qwen3NextForCausalLM) on tiny checkpoints saved by transformers' own classes (tests/checkpoints.py:
layers 0-2 gated DeltaNet with 8 key heads of 4 and 16 value heads of 4, layer 3 gated full attention
with 8 heads over 2 kv heads, 8 experts and a shared expert per layer).

What each rank holds is SGLang's models/qwen3_5.py / qwen3_next.py, stated here independently with
torch indexing (`expected_tensor`): Qwen3.5's in_proj_qkv and both families' conv1d hold the rank's
slice of each of the q, k, v segments, concatenated; Qwen3-Next's fused in_proj_qkvz / in_proj_ba
are cut contiguously (whole key-head groups). Then reshard, the refusals, and layouts broken on
purpose that check --source must see.
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
from checkpoints import make_checkpoint
from test_moe_split import source_tensors
from test_verify_moe import round_robin_split
from tpshard.reshard import reshard
from tpshard.topology import Topology

Q35, NEXT = "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"
K, V = 8 * 4, 16 * 4  # linear attention: key heads x key dim, value heads x value dim


@pytest.fixture(scope="module")
def models(hybrid_models) -> dict[str, Path]:
    return hybrid_models  # conftest: one pair of checkpoints for this module and its sibling


def tpshard_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


def chunk(x: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    return x.chunk(n, dim)[r]


def segments(x: torch.Tensor, sizes: tuple[int, ...], r: int, n: int) -> torch.Tensor:
    """Rank r's slice of each segment of dim 0, concatenated."""
    return torch.cat([chunk(s, r, n) for s in x.split(sizes)])


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def expected_tensor(family: str, name: str, full: torch.Tensor, rank: int, topo: Topology) -> torch.Tensor | None:
    """What SGLang's class loads on `rank` from HF tensor `name`; None: another EP slot's expert."""
    attn_tp, moe_tp = topo.tp // topo.attn_dp, topo.tp // topo.ep
    a = rank % attn_tp
    if ".experts." in name:
        e = int(name.split(".")[5])
        if e // (8 // topo.ep) != rank // moe_tp:
            return None
        return chunk(full, rank % moe_tp, moe_tp, 1 if "down_proj" in name else 0)
    if name.endswith(("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight")):
        return full
    if name == "model.embed_tokens.weight":
        whole = padded_rows(full, 256)  # vocab 250 padded to 64
        if family == Q35 and topo.attn_dp > 1:
            return whole  # Qwen3.5: enable_tp = not DP attention
        return chunk(whole, rank if family == Q35 else a, topo.tp if family == Q35 else attn_tp)
    if name == "lm_head.weight":
        return chunk(padded_rows(full, 256), rank, topo.tp)
    if ".shared_expert." in name:
        return chunk(full, rank, topo.tp, 1 if "down_proj" in name else 0)
    if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
        return segments(full, (K, K, V), a, attn_tp)
    if name.endswith(("out_proj.weight", "o_proj.weight")):
        return chunk(full, a, attn_tp, 1)
    if name.endswith(("k_proj.weight", "v_proj.weight")):
        return chunk(full, a // (attn_tp // 2), 2) if attn_tp >= 2 else full
    # q_proj ([q_h | gate_h] per head), in_proj_z / b / a, Qwen3-Next's packed in_proj_qkvz / in_proj_ba, A_log, dt_bias
    return chunk(full, a, attn_tp)


def assert_ranks(family: str, model: Path, out: Path, topo: Topology) -> None:
    full = source_tensors(model)
    for r in range(topo.world_size):
        held = tpshard.open_rank(out, r)
        want = {n: t for n, x in full.items() if (t := expected_tensor(family, n, x, r, topo)) is not None}
        assert sorted(held) == sorted(want), (r, sorted(set(held) ^ set(want))[:4])
        for n, t in want.items():
            assert torch.equal(held[n], t), (family, r, n)


TOPOLOGIES = [Topology(tp=2), Topology(tp=4, attn_dp=2, ep=2), Topology(tp=8, ep=4), Topology(tp=8, attn_dp=2, ep=8)]


@pytest.mark.parametrize("family", [Q35, NEXT])
def test_every_rank_as_sglang_loads_it(models, tmp_path, family):
    source = models[family]
    full = source_tensors(source)
    assert f"model.layers.0.linear_attn.{'in_proj_qkv' if family == Q35 else 'in_proj_qkvz'}.weight" in full
    assert "intermediate_size" not in json.loads((source / "config.json").read_text()) or family == NEXT
    for topo in TOPOLOGIES:
        out = tmp_path / f"tp{topo.tp}-dp{topo.attn_dp}-ep{topo.ep}"
        tpshard.split(source, out, topo)
        assert tpshard.check(out, source).ok
        assert_ranks(family, source, out, topo)


def test_segments_are_not_one_block(models, tmp_path):
    """At attn_tp 2, rank 1's in_proj_qkv is q[16:32] | k[16:32] | v[32:64], not rows 64-127."""
    out = tmp_path / "out"
    tpshard.split(models[Q35], out, Topology(tp=2))
    w = source_tensors(models[Q35])["model.layers.1.linear_attn.in_proj_qkv.weight"]
    got = tpshard.open_rank(out, 1)["model.layers.1.linear_attn.in_proj_qkv.weight"]
    assert torch.equal(got, torch.cat([w[16:32], w[48:64], w[96:128]])) and not torch.equal(got, w[64:])
    p = tpshard_cli("explain", models[Q35], "--tp", "2", "--layer", "1")
    assert p.returncode == 0 and "[16, 32) + [48, 64) + [96, 128)" in p.stdout, p.stdout[-2000:]


def test_reshard_matches_a_split(models, tmp_path):
    source = models[Q35]
    first, again, direct = tmp_path / "tp8", tmp_path / "re", tmp_path / "direct"
    topo = Topology(tp=4, attn_dp=2, ep=2)
    tpshard.split(source, first, Topology(tp=8, ep=4))
    reshard(first, again, topo)
    tpshard.split(source, direct, topo)
    assert tpshard.check(again, source).ok
    p = tpshard_cli("check", again, "--from", first)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in range(4):
        a, b = tpshard.open_rank(again, r), tpshard.open_rank(direct, r)
        assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


# ---- refusals: one line, exit 2, nothing written --------------------------------------------------


@pytest.mark.parametrize(
    "family, args, message",
    [
        (Q35, ("--tp", "16", "--ep", "2", "--attn-dp", "2"), "tp size 16 is greater than the 8 routed experts of Qwen3_5MoeForCausalLM"),
        (NEXT, ("--tp", "16", "--ep", "2", "--attn-dp", "2"), "tp size 16 is greater than the 8 routed experts of Qwen3NextForCausalLM"),
        (Q35, ("--tp", "2", "--pp", "2"), "--pp 2: no pipeline layout of Qwen3_5MoeForCausalLM is on record"),
        (NEXT, ("--tp", "2", "--pp", "2"), "--pp 2: no pipeline layout of Qwen3NextForCausalLM is on record"),
    ],
)
def test_topology_refusals(models, tmp_path, family, args, message):
    p = tpshard_cli("split", models[family], "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch_name", ["qwen3_5_moe", "qwen3_next"])
def test_key_heads_not_dividing_is_refused(tmp_path, arch_name):
    """2 key heads (8 value heads) at tp 4; the full attention's 8 heads would divide."""
    model = make_checkpoint(tmp_path / "model", arch_name, linear_num_key_heads=2, linear_num_value_heads=8)
    p = tpshard_cli("split", model, "-o", tmp_path / "out", "--tp", "4")
    message = "2 linear-attention key heads and 8 linear-attention value heads must each divide over the attn_tp group of 4 ranks"
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "out").exists()


def test_export_refused(models, tmp_path):
    """(verify --model runs: tests/test_hybrid_model.py)"""
    out = tmp_path / "out"
    tpshard.split(models[NEXT], out, Topology(tp=2))
    p = tpshard_cli("export", out, "--format", "sglang", "-o", tmp_path / "exp")  # vLLM's: tests/test_export_families.py
    assert p.returncode == 2 and "Qwen3NextForCausalLM has routed experts" in p.stderr and not (tmp_path / "exp").exists()


# ---- layouts broken on purpose: check --source must see each -------------------------------------


def split_with(family: str, model: Path, out: Path, topo: Topology, monkeypatch, rules) -> None:
    good = arch.ARCHITECTURES[family]
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, family, dataclasses.replace(good, rules=rules))
        tpshard.split(model, out, topo)


def rule_problems(out: Path, source: Path, what: str) -> list[str]:
    found = [f"[{p.check}] {p.message}" for p in tpshard.check(out, source).problems]
    return [p for p in found if "[rules]" in p and what in p] or found[:4]


def test_qwen3_5_contiguous_instead_of_segments_is_caught(models, tmp_path, monkeypatch):
    out = tmp_path / "out"
    rules = tuple(r._replace(segments="") for r in arch.ARCHITECTURES[Q35].rules)
    split_with(Q35, models[Q35], out, Topology(tp=2), monkeypatch, rules)
    for what in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
        found = rule_problems(out, models[Q35], what)
        assert found and all(what in p for p in found), found


def test_qwen3_next_qkvz_by_segments_is_caught(models, tmp_path, monkeypatch):
    """in_proj_qkvz cut as q | k | v | z segments (Qwen3.5's rule) instead of whole key-head groups."""
    out = tmp_path / "out"
    monkeypatch.setitem(arch.SEGMENTS, "qkvz_as_segments", lambda m: (K, K, V, V))
    rules = tuple(r._replace(segments="qkvz_as_segments") if r.module.endswith("in_proj_qkvz") else r for r in arch.ARCHITECTURES[NEXT].rules)
    split_with(NEXT, models[NEXT], out, Topology(tp=4), monkeypatch, rules)
    found = rule_problems(out, models[NEXT], "in_proj_qkvz.weight")
    assert found and all("in_proj_qkvz.weight" in p for p in found), found


@pytest.mark.parametrize("family", [Q35, NEXT])
def test_shared_expert_over_moe_group_is_caught(models, tmp_path, monkeypatch, family):
    out = tmp_path / "out"
    rules = tuple(r._replace(role="expert") if r.role == "shared_expert" else r for r in arch.ARCHITECTURES[family].rules)
    split_with(family, models[family], out, Topology(tp=4, ep=2), monkeypatch, rules)
    found = rule_problems(out, models[family], "mlp.shared_expert.")
    assert found and all("mlp.shared_expert." in p for p in found), found
    assert any("group='moe_tp' (rules: 'tp')" in p for p in found), found[:4]


@pytest.mark.parametrize("family", [Q35, NEXT])
def test_experts_round_robin_is_caught(models, tmp_path, family):
    out = tmp_path / "out"
    round_robin_split(models[family], out, Topology(tp=4, ep=2))
    found = [f"[{p.check}] {p.message}" for p in tpshard.check(out, models[family]).problems]
    assert any("[experts]" in p and "mlp.experts.1." in p and "belongs to slot 0" in p for p in found), found[:4]


def test_another_ranks_segments_are_caught(models, tmp_path):
    """Rank 0 holds rank 1's in_proj_qkv (its q | k | v slices), checksums rewritten: only the source tells."""
    from broken import overwrite_tensor, rewrite_checksums

    out = tmp_path / "out"
    tpshard.split(models[Q35], out, Topology(tp=2))
    name = "model.layers.2.linear_attn.in_proj_qkv.weight"
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 1)[name].clone())
    rewrite_checksums(out)
    assert tpshard.check(out, None).ok
    found = [p.message for p in tpshard.check(out, models[Q35]).problems]
    assert any(name in p and "holds the slice of group rank 1" in p for p in found), found[:4]


# ---- verify: the projections at layer level, conv1d / A_log / dt_bias by their bytes ----------------


@pytest.mark.slow
def test_verify_layers_and_a_contiguous_qkv(models, tmp_path, monkeypatch):
    """Both families verify at layer level (in_proj_qkvz's segmented qkv piece against the source's
    columns in the engine's rank order, the gated q, the MoE block); a split that cuts in_proj_qkv
    contiguously fails in_proj_qkvz there, whatever its own manifest says, and a rank holding
    another rank's conv1d fails the bytes check."""
    from broken import overwrite_tensor, rewrite_checksums
    from tpshard.verify import verify_many

    outs = {"q35": tmp_path / "q35", "next": tmp_path / "next", "contiguous": tmp_path / "contiguous", "conv": tmp_path / "conv"}
    tpshard.split(models[Q35], outs["q35"], Topology(tp=2))
    tpshard.split(models[NEXT], outs["next"], Topology(tp=2, ep=2))
    rules = tuple(r._replace(segments="") for r in arch.ARCHITECTURES[Q35].rules)
    split_with(Q35, models[Q35], outs["contiguous"], Topology(tp=2), monkeypatch, rules)
    tpshard.split(models[Q35], outs["conv"], Topology(tp=2))
    name = "model.layers.1.linear_attn.conv1d.weight"
    overwrite_tensor(outs["conv"], 0, name, tpshard.open_rank(outs["conv"], 1)[name].clone())
    rewrite_checksums(outs["conv"])
    q35, nxt, contiguous, conv = verify_many(list(outs.values()), [models[Q35], models[NEXT], models[Q35], models[Q35]])
    assert q35.ok and nxt.ok, q35.failures() + nxt.failures()
    assert "model.layers.0.linear_attn.in_proj_qkvz" in {x.layer for x in q35.layers}
    assert not any("conv1d" in x.layer or x.layer_class == "HeadParameter" for x in q35.layers)
    failing = {x.layer for x in contiguous.layers if not x.ok}
    assert failing == {f"model.layers.{i}.linear_attn.in_proj_qkvz" for i in range(3)}, contiguous.failures()
    assert not conv.ok and any(name in p and "[0]" in p for p in conv.tensors.problems), conv.tensors.problems


# ---- Qwen3.5-397B-A17B's dims, from headers alone ----------------------------------------------------


def test_qwen3_5_397b_dims_tp8_ep8():
    """tp 8, ep 8 at the release's dims (4 layers: 3 linear, 1 full): K = 16 x 128, V = 64 x 128."""
    import fake_models as fm
    from tpshard.plan import make_plan

    plan = make_plan(fm.qwen3_5_moe(layers=4), Topology(tp=8, ep=8))
    rank3 = {s.name: s for s in plan.rank_shards(3)}
    kk, vv = 2048, 8192
    qkv = rank3["model.layers.0.linear_attn.in_proj_qkv.weight"]
    assert qkv.shape == ((2 * kk + vv) // 8, 4096) and qkv.segments == (1, 1, 4)
    assert (qkv.start, qkv.length) == (3 * kk // 8, kk // 8)  # in units of K: q[768:1024], k[2816:3072], v[7168:8192]
    assert rank3["model.layers.0.linear_attn.conv1d.weight"].shape == ((2 * kk + vv) // 8, 1, 4)
    assert rank3["model.layers.0.linear_attn.A_log"].shape == (8,) and rank3["model.layers.0.linear_attn.A_log"].dtype == "F32"
    assert rank3["model.layers.0.linear_attn.in_proj_z.weight"].shape == (vv // 8, 4096)
    assert rank3["model.layers.0.linear_attn.out_proj.weight"].shape == (4096, vv // 8)
    assert rank3["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 32 * 256 // 8, 4096)
    k = rank3["model.layers.3.self_attn.k_proj.weight"]  # 2 kv heads over attn_tp 8: ranks 0-3 hold head 0
    assert k.shape == (256, 4096) and (k.start, k.factor) == (0, 4)
    experts = sorted({s.expert for s in rank3.values() if s.expert is not None})
    assert experts == list(range(3 * 64, 4 * 64)) and rank3["model.layers.1.mlp.experts.200.down_proj.weight"].shape == (4096, 1024)
    assert rank3["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (4096, 1024 // 8)
    assert rank3["model.embed_tokens.weight"].shape == (248320 // 8, 4096)
