"""Qwen3.5-MoE and Qwen3-Next as the releases ship them (tpshard/arch/qwen_next.py): the MTP layer
(`mtp.*`) and, for Qwen3.5, the routed experts stored fused. The checkpoints are tests/checkpoints.py's
transformers-saved tiny ones turned into the release's form by tests/qwen_release.py.

- MTP: every rank holds what SGLang's draft classes load (models/qwen3_5_mtp.py Qwen3_5ForCausalLMMTP,
  qwen3_next_mtp.py Qwen3NextForCausalLMMTP), stated here from their loaders: mtp.fc (an nn.Linear)
  and the norms whole, mtp.layers.0 cut as a full-attention MoE layer of the main model (test_hybrid's
  expected_tensor), its K/V without --dcp's replication (`dcp_size = 1 if is_nextn`).
- Fused experts: every rank byte-equal to the split of the per-expert checkpoint they were fused from
  (the same FusedMoE parameters w13 / w2): gate_up_proj [E_slot, 2I/moe_tp, H] = per expert the rank's
  gate rows then its up rows, down_proj [E_slot, H, I/moe_tp].
- Broken on purpose: another rank's MTP slice, the [gate | up] halves read as one contiguous slice,
  another EP slot's experts, the MTP K/V replicated as the main model's: check --source sees each.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpshard
import tpshard.arch as arch
import tpshard.arch.qwen_next as qwen_next
from broken import only_the_source_tells, rewrite_checksums, take_from_rank
from qwen_release import released
from test_hybrid import NEXT, Q35, expected_tensor
from test_moe_split import source_tensors
from tpshard.topology import Topology


@pytest.fixture(scope="module")
def release(hybrid_models, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen_release")
    return {
        "q35_mtp": released(hybrid_models[Q35], root / "q35_mtp", mtp=True, fused=False),
        "next_mtp": released(hybrid_models[NEXT], root / "next_mtp", mtp=True, fused=False),
        "q35_fused": released(hybrid_models[Q35], root / "q35_fused", mtp=False, fused=True),
        "q35_both": released(hybrid_models[Q35], root / "q35_both", mtp=True, fused=True),
    }


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


def draft_tensor(family: str, name: str, full: torch.Tensor, rank: int, topo: Topology) -> torch.Tensor | None:
    """What the rank loads: the draft's own for mtp.* (fc an nn.Linear, whole; K/V over attn_tp without
    DCP; the rest as the main model's full-attention layer), the main class's otherwise."""
    if name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight"):
        return full  # nn.Linear, GemmaRMSNorm
    if name.startswith("mtp.") and name.endswith(("k_proj.weight", "v_proj.weight")):
        attn_tp = topo.tp // topo.attn_dp
        return full.chunk(2)[(rank % attn_tp) // (attn_tp // 2)] if attn_tp >= 2 else full  # 2 kv heads
    return expected_tensor(family, name, full, rank, topo)


TOPOLOGIES = [Topology(tp=2), Topology(tp=4, attn_dp=2, ep=2), Topology(tp=8, ep=4)]


@pytest.mark.parametrize("key, family", [("q35_mtp", Q35), ("next_mtp", NEXT)])
def test_mtp_every_rank_as_the_draft_loads_it(release, tmp_path, key, family):
    """Today: "the checkpoint holds the MTP layer ..., which tpshard has no rule for" (Qwen3.5), "no
    Qwen3NextForCausalLM rule covers mtp.fc.weight" (Qwen3-Next)."""
    source = release[key]
    full = source_tensors(source)
    assert "mtp.layers.0.mlp.experts.7.down_proj.weight" in full and "mtp.fc.weight" in full
    for topo in TOPOLOGIES:
        out = tmp_path / f"tp{topo.tp}-dp{topo.attn_dp}-ep{topo.ep}"
        tpshard.split(source, out, topo)
        assert tpshard.check(out, source).ok
        for r in range(topo.world_size):
            held = tpshard.open_rank(out, r)
            want = {n: t for n, x in full.items() if (t := draft_tensor(family, n, x, r, topo)) is not None}
            assert sorted(held) == sorted(want), (r, sorted(set(held) ^ set(want))[:4])
            for n, t in want.items():
                assert torch.equal(held[n], t), (key, r, n)


def test_mtp_kv_without_dcp_replication(release, tmp_path, monkeypatch):
    """--dcp 2 at tp 2: the main layer 3's K/V whole on both ranks (kv group of 1), the draft's one kv
    head a rank; a split that cuts the draft's K/V as the main model's is caught by check --source."""
    source, topo = release["q35_mtp"], Topology(tp=2, dcp=2)
    out, bad = tmp_path / "out", tmp_path / "bad"
    tpshard.split(source, out, topo)
    assert tpshard.check(out, source).ok
    full = source_tensors(source)
    for r in range(2):
        held = tpshard.open_rank(out, r)
        assert torch.equal(held["model.layers.3.self_attn.k_proj.weight"], full["model.layers.3.self_attn.k_proj.weight"])
        assert torch.equal(held["mtp.layers.0.self_attn.k_proj.weight"], full["mtp.layers.0.self_attn.k_proj.weight"].chunk(2)[r])
    good = arch.ARCHITECTURES[Q35]
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, Q35, dataclasses.replace(good, rules=tuple(r._replace(nextn=False) for r in good.rules)))
        tpshard.split(source, bad, topo)
    found = [p.message for p in tpshard.check(bad, source).problems]
    assert found and any("mtp.layers.0.self_attn.k_proj.weight" in p for p in found), found[:4]


def test_another_ranks_mtp_slice_is_caught(release, tmp_path):
    """Rank 0 holds rank 1's mtp q_proj, checksums rewritten: only the source tells."""
    out, source = tmp_path / "out", release["q35_mtp"]
    tpshard.split(source, out, Topology(tp=2))
    name = "mtp.layers.0.self_attn.q_proj.weight"
    take_from_rank(out, 0, name, 1)
    found = only_the_source_tells(out, source)
    assert any(name in p and "holds the slice of group rank 1" in p for p in found), found[:4]


def test_explain_and_vllm_export_leave_the_draft_apart(release, hybrid_models, tmp_path):
    """explain --layer 4 (num_hidden_layers) shows the MTP layer; the vLLM export leaves mtp.* out
    (vLLM's target classes drop the prefix): its rank files are byte-equal to those of the
    checkpoint without it."""
    source, plain = release["q35_mtp"], hybrid_models[Q35]
    p = cli("explain", source, "--tp", 2, "--layer", 4)
    assert p.returncode == 0 and "mtp.layers.0.self_attn.q_proj.weight" in p.stdout and "model.layers.3." not in p.stdout, p.stdout[-2000:]
    for src, name in ((source, "a"), (plain, "b")):
        tpshard.split(src, tmp_path / name, Topology(tp=2))
        r = cli("export", tmp_path / name, "--format", "vllm", "-o", tmp_path / f"x{name}")
        assert r.returncode == 0, r.stderr
    assert cli("check", tmp_path / "xa", "--source", source).returncode == 0
    for f in sorted((tmp_path / "xb").glob("*.safetensors")):
        assert (tmp_path / "xa" / f.name).read_bytes() == f.read_bytes(), f.name


FUSED_TOPOLOGIES = [Topology(tp=2), Topology(tp=4), Topology(tp=4, attn_dp=2, ep=2), Topology(tp=8, ep=4), Topology(tp=8, attn_dp=2, ep=8)]


def fused_from(per_expert: dict[str, torch.Tensor], module: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The rank's fused tensors as its per-expert split holds them: [gate_e; up_e] and down_e, stacked by expert."""
    ids = sorted({int(n.split(".")[-3]) for n in per_expert if n.startswith(f"{module}.") and n.endswith("down_proj.weight")})
    if not ids:
        return None
    w = lambda e, p: per_expert[f"{module}.{e}.{p}.weight"]  # noqa: E731
    return torch.stack([torch.cat([w(e, "gate_proj"), w(e, "up_proj")]) for e in ids]), torch.stack([w(e, "down_proj") for e in ids])


@pytest.mark.parametrize("fused_key, unfused_key", [("q35_fused", None), ("q35_both", "q35_mtp")])
def test_fused_experts_byte_equal_to_the_per_expert_split(release, hybrid_models, tmp_path, fused_key, unfused_key):
    """Today: "experts stored fused (...): ... a cut tpshard does not make yet"."""
    fused, unfused = release[fused_key], release[unfused_key] if unfused_key else hybrid_models[Q35]
    for topo in FUSED_TOPOLOGIES:
        a, b = tmp_path / f"f-{topo.tp}-{topo.attn_dp}-{topo.ep}", tmp_path / f"u-{topo.tp}-{topo.attn_dp}-{topo.ep}"
        tpshard.split(fused, a, topo)
        tpshard.split(unfused, b, topo)
        assert tpshard.check(a, fused).ok
        for r in range(topo.world_size):
            got, want = tpshard.open_rank(a, r), tpshard.open_rank(b, r)
            assert {n for n in got if ".experts." not in n} == {n for n in want if ".experts." not in n}
            for n, t in got.items():
                if ".experts." not in n:
                    assert t.reshape(-1).view(torch.uint8).equal(want[n].reshape(-1).view(torch.uint8)), (r, n)
            modules = {n.rpartition(".")[0] for n in got if n.endswith(".experts.gate_up_proj")}
            assert len(modules) == 4 + (unfused_key is not None), sorted(modules)
            for module in modules:
                gate_up, down = fused_from(want, module)
                assert got[f"{module}.gate_up_proj"].view(torch.uint8).equal(gate_up.view(torch.uint8)), (topo, r, module)
                assert got[f"{module}.down_proj"].view(torch.uint8).equal(down.view(torch.uint8)), (topo, r, module)


def test_reshard_of_the_release_form_is_a_split(release, tmp_path):
    """reshard reads the MTP layer and the fused experts back from the output (tp 2 -> tp 4, attention DP 2, EP 2)."""
    from tpshard.reshard import reshard

    source = release["q35_both"]
    topo = Topology(tp=4, attn_dp=2, ep=2)
    tpshard.split(source, tmp_path / "tp2", Topology(tp=2))
    reshard(tmp_path / "tp2", tmp_path / "re", topo)
    tpshard.split(source, tmp_path / "direct", topo)
    assert tpshard.check(tmp_path / "re", source).ok
    for r in range(4):
        got, want = tpshard.open_rank(tmp_path / "re", r), tpshard.open_rank(tmp_path / "direct", r)
        assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want), r


def test_gate_up_read_as_one_slice_is_caught(release, tmp_path, monkeypatch):
    """[gate | up] cut as one contiguous slice of the 2I rows (gpt-oss's interleaved reading) at tp 2."""
    source, out = release["q35_fused"], tmp_path / "out"
    wrong = qwen_next.FUSED.params["gate_up_proj"]._replace(layout="interleaved")
    good = arch.ARCHITECTURES[Q35]
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, Q35, dataclasses.replace(good, fused_experts=good.fused_experts._replace(params={**good.fused_experts.params, "gate_up_proj": wrong})))
        tpshard.split(source, out, Topology(tp=2))
    found = [f"[{p.check}] {p.message}" for p in tpshard.check(out, source).problems]
    assert found and all("experts.gate_up_proj" in p for p in found), found[:4]


def test_another_slots_experts_are_caught(release, tmp_path):
    """At tp 4 ep 2, rank 0 holds rank 2's (EP slot 1's) gate_up_proj, checksums rewritten."""
    source, out = release["q35_fused"], tmp_path / "out"
    tpshard.split(source, out, Topology(tp=4, ep=2))
    name = "model.layers.1.mlp.experts.gate_up_proj"
    take_from_rank(out, 0, name, 2)
    found = only_the_source_tells(out, source)
    assert any(name in p for p in found), found[:4]


@pytest.mark.parametrize(
    "drop, message",
    [
        ("mtp.fc.weight", "MTP layer is incomplete: it lacks mtp.fc.weight"),
        ("mtp.layers.0.mlp.experts.down_proj", "MTP layer is incomplete: it lacks mtp.layers.0.mlp.experts.*"),
        ("model.layers.2.mlp.experts.down_proj", "lacks model.layers.2.mlp.experts.0.down_proj.weight"),
    ],
)
def test_incomplete_release_refused_in_one_line(release, tmp_path, drop, message):
    src = tmp_path / "src"
    shutil.copytree(release["q35_both"], src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"][drop]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    r = cli("split", src, "-o", tmp_path / "out", "--tp", 2)
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_next_fused_experts_refused_in_one_line(hybrid_models, tmp_path):
    src = released(hybrid_models[NEXT], tmp_path / "src", mtp=False, fused=True)
    r = cli("split", src, "-o", tmp_path / "out", "--tp", 2)
    assert r.returncode == 2 and "qwen3_next.py" in r.stderr and "one by one" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


@pytest.mark.parametrize("family, backend, whole", [(Q35, "deepep", True), (Q35, "pplx", False), (NEXT, "mori", True), (NEXT, "mooncake", False)])
def test_a2a_backend_shared_expert(hybrid_models, family, backend, whole):
    """Qwen2MoeSparseMoeBlock (qwen2_moe.py L362-382): the shared expert "replicated" under deepep /
    mori / deepep_v2 / flashinfer / megamoe / ascend_fuseep, over tp under the others. Today refused
    ("where SGLang ... keeps the shared experts under an all-to-all backend is not established")."""
    from tpshard.checkpoint import open_checkpoint
    from tpshard.plan import make_plan

    ckpt = open_checkpoint(hybrid_models[family])
    plan, by_ep = make_plan(ckpt, Topology(tp=4, ep=4, moe_a2a_backend=backend)), make_plan(ckpt, Topology(tp=4, ep=4))
    for r in range(4):
        shared = [s for s in plan.rank_shards(r) if ".shared_expert." in s.name]
        assert len(shared) == 12, len(shared)
        for s in shared:
            assert (s.shape == s.source_shape) == whole and (s.group == "replicated") == whole, s
        others = lambda p: [(s.name, s.shape, s.start) for s in p.rank_shards(r) if ".shared_expert." not in s.name]  # noqa: E731
        assert others(plan) == others(by_ep)


def test_verify_model_on_mtp_and_fused(release, tmp_path):
    """One launch at tp 2 (ep 2 for the first): the MTP layer and the fused experts at layer level, the
    main model against transformers; rank 0 holding rank 1's fused down_proj fails both. Not slow: the
    only proof of verify on the fused [E, out, in] experts (layer level and the hybrid decoder's MoE)."""
    from tpshard.verify import MODEL_TOLERANCE, verify_many

    outs = {k: tmp_path / k for k in ("both", "next", "bad")}
    tpshard.split(release["q35_both"], outs["both"], Topology(tp=2, ep=2))
    tpshard.split(release["next_mtp"], outs["next"], Topology(tp=2))
    tpshard.split(release["q35_fused"], outs["bad"], Topology(tp=2))
    name = "model.layers.0.mlp.experts.down_proj"
    take_from_rank(outs["bad"], 0, name, 1)
    rewrite_checksums(outs["bad"])
    both, nxt, bad = verify_many(list(outs.values()), [release["q35_both"], release["next_mtp"], release["q35_fused"]], model=True)
    for report in (both, nxt):
        m = report.model
        assert report.ok and m is not None and m.ok and m.max_rel <= MODEL_TOLERANCE["max_rel"], (report.failures(), m)
        assert {"mtp.fc", "mtp.layers.0.self_attn.qkv_proj", "mtp.layers.0.mlp.experts"} <= {x.layer for x in report.layers}
    assert {x.layer_class for x in both.layers if x.layer.endswith(".mlp.experts")} == {"FusedExperts"}
    assert not bad.ok and bad.model is not None and not bad.model.ok
    assert {x.layer for x in bad.layers if not x.ok} == {"model.layers.0.mlp.experts"}, bad.failures()


@pytest.mark.parametrize("ep", [8, 2])
def test_qwen3_5_397b_release_dims_tp8(ep):
    """The release's form at Qwen3.5-397B-A17B's dims (512 experts of 1024, H 4096; 4 layers), from
    headers alone: at tp 8, ep 8 each rank its 64 experts whole; at ep 2 its slot's 256 experts, its
    moe_tp 4 slice of gate and of up (256 + 256 rows), and the MTP layer's alike."""
    import fake_models as fm
    from tpshard.plan import make_plan

    plan = make_plan(fm.qwen3_5_moe(layers=4, fused=True, mtp=True), Topology(tp=8, ep=ep))
    moe_tp, per = 8 // ep, 512 // ep
    for r in (0, 5):
        rank = {s.name: s for s in plan.rank_shards(r)}
        for p in ("model.layers.1", "mtp.layers.0"):
            gu, down = rank[f"{p}.mlp.experts.gate_up_proj"], rank[f"{p}.mlp.experts.down_proj"]
            assert gu.shape == (per, 2 * 1024 // moe_tp, 4096) and down.shape == (per, 4096, 1024 // moe_tp), (gu, down)
            first = (r // moe_tp) * per  # the slot's first expert
            if moe_tp == 1:  # a cut of dim 0 alone
                assert (gu.dim, gu.start, gu.length) == (0, first, per), gu
            else:  # the slot's block (a leading-dim range) cut on dim 1: its 256 gate rows, then its 256 up rows
                assert (gu.lead_start, gu.dim, gu.segments, gu.start, gu.length) == (first, 1, (1, 1), (r % moe_tp) * 256, 256), gu
        assert rank["mtp.fc.weight"].shape == (4096, 8192) and rank["mtp.norm.weight"].shape == (4096,)
