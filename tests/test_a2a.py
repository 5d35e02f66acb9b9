"""--moe-a2a-backend (issue 24 item 4): SGLang's all-to-all MoE backends as a topology option.

What SGLang 0.5.23 does under one (the expected values below are its source, not tpshard's output):
- every backend of _A2A_EP_SPANNING_BACKENDS sets ep_size = tp_size
  (sglang/srt/arg_groups/overrides.py, _a2a_ep_size);
- DeepseekV2MoE builds the shared experts "replicated" under every one of them (deepseek_v2.py
  L874-897); Qwen2MoeSparseMoeBlock only under deepep, deepep_v2, mori, megamoe, flashinfer,
  flashinfer_megamoe, ascend_fuseep (qwen2_moe.py L362-382); Glm4MoeSparseMoeBlock only under
  deepep, mooncake, nixl, mori, ascend_fuseep, flashinfer, flashinfer_megamoe (glm4_moe.py L471-491);
  elsewhere they stay over tp. Qwen3-MoE and Mixtral have no shared expert.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import msgspec
import pytest

import fake_models as fm
import tpshard
import tpshard.arch as arch
from tpshard.checkpoint import open_checkpoint
from tpshard.errors import PlanError, TopologyError
from tpshard.manifest import MANIFEST_NAME, encode_manifest, read_manifest
from tpshard.plan import make_plan
from tpshard.topology import Topology


def run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def shared_specs(plan, rank: int) -> list:
    return [s for s in plan.rank_shards(rank) if ".shared_expert" in s.name and ".shared_expert_gate" not in s.name]


def test_deepep_lets_v3_fp8_run_tp32_ep32_with_the_shared_experts_whole():
    """SGLang 0.5.23's MoE refusals: DeepSeek-V3 FP8 at tp 32 ep 32 needs the shared experts off the tp group (2048 / 32
    = 64 rows, half an FP8 block); only an all-to-all backend gives that."""
    ckpt = fm.deepseek_v3(layers=4)
    with pytest.raises(PlanError, match=r"shared_experts\..*128"):
        make_plan(ckpt, Topology(tp=32, ep=32, moe_dense_tp=1))
    plan = make_plan(ckpt, Topology(tp=32, ep=32, moe_dense_tp=1, moe_a2a_backend="deepep"))
    for r in (0, 17, 31):
        specs = shared_specs(plan, r)
        assert len(specs) == 2 * 6  # layer 3 and the MTP layer 4: gate, up, down and their scales
        for s in specs:
            assert s.group == "replicated" and s.ranks == tuple(range(32)), s
            assert s.shape == s.source_shape and s.start == 0 and not s.pad
        experts = {s.expert for s in plan.rank_shards(r) if s.expert is not None}
        assert experts == set(range(8 * r, 8 * r + 8))  # 256 / ep 32: a contiguous block per rank


@pytest.mark.parametrize(
    "fixture, backend, whole",
    [
        ("deepseek_v3", "deepep", True), ("deepseek_v3", "pplx", True), ("deepseek_v3", "mooncake", True),
        ("qwen2_moe", "deepep", True), ("qwen2_moe", "megamoe", True), ("qwen2_moe", "mooncake", False),
        ("qwen2_moe", "pplx", False), ("glm4_moe", "mooncake", True), ("glm4_moe", "flashinfer", True),
        ("glm4_moe", "megamoe", False), ("glm4_moe", "deepep_v2", False),
    ],
)  # fmt: skip
def test_shared_experts_follow_each_family_and_backend(request, fixture, backend, whole):
    ckpt = open_checkpoint(request.getfixturevalue(fixture))
    plan = make_plan(ckpt, Topology(tp=4, ep=4, moe_a2a_backend=backend))
    by_ep = make_plan(ckpt, Topology(tp=4, ep=4))  # the same experts: ep = tp either way
    for r in range(4):
        specs = shared_specs(plan, r)
        assert specs
        for s in specs:
            if whole:
                assert s.group == "replicated" and s.shape == s.source_shape and s.start == 0, s
            else:
                assert s.group == "tp" and s.dim is not None and s.shape[s.dim] == s.source_shape[s.dim] // 4, s
        others = lambda p: [(s.name, s.shape, s.start, s.ranks) for s in p.rank_shards(r) if ".shared_expert" not in s.name]  # noqa: E731
        assert others(plan) == others(by_ep)


@pytest.mark.parametrize("fixture", ["qwen3_moe", "mixtral"])
def test_families_without_shared_experts_only_get_ep_tp(request, fixture):
    ckpt = open_checkpoint(request.getfixturevalue(fixture))
    plan, by_ep = make_plan(ckpt, Topology(tp=4, ep=4, moe_a2a_backend="deepep")), make_plan(ckpt, Topology(tp=4, ep=4))
    assert plan.tensors == by_ep.tensors and plan.files == by_ep.files


def test_topology_refusals():
    with pytest.raises(TopologyError, match=r"ep=2 with moe_a2a_backend=deepep: SGLang sets .* would run ep=8"):
        Topology(tp=8, ep=2, moe_a2a_backend="deepep")
    with pytest.raises(TopologyError, match=r"moe_a2a_backend='deep': choose one of deepep, deepep_v2, mooncake"):
        Topology(tp=8, ep=8, moe_a2a_backend="deep")
    with pytest.raises(TopologyError, match=r"ascend_tp moves no weight"):
        Topology(tp=8, ep=8, moe_a2a_backend="ascend_tp")
    assert Topology(tp=8, moe_a2a_backend="none") == Topology(tp=8)  # the default, recorded as nothing
    assert b"moe_a2a_backend" not in msgspec.json.encode(Topology(tp=8, moe_a2a_backend="none"))


def test_split_records_it_check_and_plan_show_it(deepseek_v3, tmp_path):
    out = tmp_path / "out"
    p = run("split", deepseek_v3, "-o", out, "--tp", "4", "--moe-a2a-backend", "deepep")
    assert p.returncode == 0, p.stderr
    said = " ".join(p.stdout.split())  # rich wraps the headline at the terminal's width
    assert "ep=4 (moe_tp=1) moe_a2a_backend=deepep" in said
    assert "start SGLang with --moe-a2a-backend deepep --ep-size 4" in said
    recorded = json.loads((out / MANIFEST_NAME).read_bytes())["topology"]
    assert recorded["ep"] == 4 and recorded["moe_a2a_backend"] == "deepep"
    t = tpshard.open_rank(out, 2)
    full = tpshard.open_rank(out, 0)
    name = "model.layers.1.mlp.shared_experts.down_proj.weight"
    assert t[name].shape == (64, 32) and t[name].equal(full[name])  # whole [H, I_e], the same on every rank
    assert run("check", out, "--source", deepseek_v3).returncode == 0
    p = run("plan", deepseek_v3, "--tp", "4", "--moe-a2a-backend", "deepep")
    assert p.returncode == 0 and "moe_a2a_backend=deepep" in p.stdout.splitlines()[0], p.stdout


@pytest.mark.parametrize(
    "fixture, args, message",
    [
        ("deepseek_v3", ["--tp", "4", "--ep", "2", "--moe-a2a-backend", "deepep"],
         "--ep 2 with --moe-a2a-backend deepep: SGLang sets the expert-parallel size to the tp size"),
        ("deepseek_v3", ["--tp", "4", "--moe-a2a-backend", "deep"], "--moe-a2a-backend 'deep': choose one of"),
        ("llama", ["--tp", "2", "--moe-a2a-backend", "deepep"], "--moe-a2a-backend deepep: LlamaForCausalLM has no routed experts"),
        ("deepseek_v3", ["--tp", "2", "--pp", "2", "--engine", "vllm", "--moe-a2a-backend", "deepep"],
         "--moe-a2a-backend deepep (an SGLang server option)"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_exit_2(request, tmp_path, fixture, args, message):
    out = tmp_path / "out"
    p = run("split", request.getfixturevalue(fixture), "-o", out, *args)
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()


def test_vllm_export_of_an_a2a_output_is_refused(qwen2_moe, tmp_path):
    out = tmp_path / "out"
    tpshard.split(qwen2_moe, out, Topology(tp=2, ep=2, moe_a2a_backend="deepep"))
    p = run("export", out, "--format", "vllm", "-o", tmp_path / "exp")
    assert p.returncode == 2 and "--moe-a2a-backend deepep, an SGLang server option" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "exp").exists()


# ---- broken on purpose: check --source must see each ----------------------------------------------


def problems(out, source) -> list[str]:
    return [f"[{p.check}] {p.message}" for p in tpshard.check(out, source).problems]


@pytest.mark.parametrize("fixture, architecture", [("glm4_moe", "Glm4MoeForCausalLM"), ("deepseek_v3", "DeepseekV3ForCausalLM")])
def test_shared_experts_cut_over_tp_under_deepep_is_caught(request, tmp_path, monkeypatch, fixture, architecture):
    """A split that says deepep but cut the shared experts over tp (as without the backend)."""
    model, out = request.getfixturevalue(fixture), tmp_path / "out"
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, architecture, dataclasses.replace(arch.ARCHITECTURES[architecture], a2a_shared=frozenset()))
        tpshard.split(model, out, Topology(tp=4, ep=4, moe_a2a_backend="deepep"))
    assert read_manifest(out).topology.moe_a2a_backend == "deepep"
    found = problems(out, model)
    assert any("[rules]" in p and ".mlp.shared_experts." in p and "(rules: 'replicated')" in p for p in found), found[:4]


def test_check_reads_the_backend_from_the_manifest(deepseek_v3, tmp_path):
    """Whole shared experts under a manifest that no longer names the backend: the rules say tp."""
    out = tmp_path / "out"
    tpshard.split(deepseek_v3, out, Topology(tp=4, ep=4, moe_a2a_backend="deepep"))
    assert not problems(out, deepseek_v3)
    m = read_manifest(out)
    (out / MANIFEST_NAME).write_bytes(encode_manifest(msgspec.structs.replace(m, topology=Topology(tp=4, ep=4))))
    found = problems(out, deepseek_v3)
    assert any("[rules]" in p and ".mlp.shared_experts." in p and "(rules: 'tp')" in p for p in found), found[:4]


@pytest.mark.slow
def test_verify_model_with_whole_shared_experts(glm4_moe, tmp_path):
    """The TP decoder with each rank's whole shared experts added after the experts' reduction (SGLang's
    DeepEP forward) against transformers, for the three families with shared experts, in one launch."""
    from moe_configs import make_moe_checkpoint
    from tpshard.verify import verify_many

    models = [make_moe_checkpoint(tmp_path / k, k, seed=i) for i, k in enumerate(("deepseek_v3", "qwen2_moe"))] + [glm4_moe]
    outs = [tmp_path / f"out{i}" for i in range(3)]
    for model, out in zip(models, outs):
        tpshard.split(model, out, Topology(tp=2, ep=2, moe_a2a_backend="deepep"))
    for r in verify_many(outs, models, model=True):
        assert r.ok and r.model.top1 == 1.0 and r.model.max_rel < 1e-5, r.failures()
        assert any(x.layer.endswith(("shared_experts.gate_up_proj", "shared_expert.gate_up_proj")) for x in r.layers)
