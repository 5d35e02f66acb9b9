"""--dcp / --dcp-replicate-q-proj (issue 25 item 1): SGLang's decode context parallelism as a topology option.

What SGLang 0.5.23 builds under --dcp-size N (the expected values below follow its source, not tpshard's):
- Qwen3.5 (models/qwen3_5.py L1287-1297): the full-attention QKVParallelLinear takes
  kv_parallel_group=ReplicatedParallelGroup("attn_tp", N); layers/linear.py _ReplicatedGroup gives
  kv rank = attn_tp_rank // N of kv size attn_tp / N, then the usual GQA rule on that group (one head
  shared by kv size / kv heads consecutive kv ranks, or kv heads / kv size heads each). q, o_proj, the
  linear attention, the MoE: as without --dcp.
- DeepSeek MLA (models/deepseek_v2.py L2053-2204): every projection stays over attn_tp; with
  --dcp-replicate-q-proj the model runner all-gathers q_b_proj after loading (model_runner.py
  L1130-1160): the files are those of a split without --dcp.
- Every other class tpshard knows (Qwen3-Next, Llama, ...) never reads the DCP size: refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

import tpshard
import tpshard.arch as arch
from checkpoints import make_checkpoint
from test_moe_split import source_tensors
from tpshard.checkpoint import open_checkpoint
from tpshard.errors import TopologyError
from tpshard.manifest import MANIFEST_NAME, Options, read_manifest
from tpshard.plan import make_plan
from tpshard.topology import Topology

Q35 = "Qwen3_5MoeForCausalLM"
HEAD_DIM = 8


@pytest.fixture(scope="module")
def q35(tmp_path_factory) -> dict[int, Path]:
    """Qwen3.5-MoE tiny checkpoints with 2 and 4 kv heads (8 attention heads, layer 3 full attention)."""
    root = tmp_path_factory.mktemp("dcp")
    return {
        2: make_checkpoint(root / "kv2", "qwen3_5_moe", max_shard_size="100KB"),
        4: make_checkpoint(root / "kv4", "qwen3_5_moe", seed=3, max_shard_size="100KB", num_key_value_heads=4),
    }


def run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "250"}
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300, env=env)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def sglang_kv(full: torch.Tensor, rank: int, kv_heads: int, attn_tp: int, dcp: int) -> torch.Tensor:
    """QKVParallelLinear's k or v rows on `rank` with kv_parallel_group = ReplicatedParallelGroup("attn_tp", dcp)."""
    kv_rank, kv_size = (rank % attn_tp) // dcp, attn_tp // dcp
    heads = full.view(kv_heads, HEAD_DIM, -1)
    if kv_size >= kv_heads:  # one head, shared by kv_size / kv_heads consecutive kv ranks
        first, n = kv_rank // (kv_size // kv_heads), 1
    else:
        n = kv_heads // kv_size
        first = kv_rank * n
    return heads[first : first + n].reshape(n * HEAD_DIM, -1)


CASES = [  # (kv heads, topology): every one with a rank holding other kv heads than without --dcp, but the last
    (2, Topology(tp=2, dcp=2)),  # kv size 1: both kv heads on both ranks
    (4, Topology(tp=4, dcp=2)),  # kv size 2: ranks 0-1 heads 0-1, ranks 2-3 heads 2-3
    (4, Topology(tp=8, attn_dp=2, ep=2, dcp=2)),  # the same in each attention-DP replica
    (2, Topology(tp=4, dcp=4)),  # kv size 1 over 4 ranks
    (2, Topology(tp=4, dcp=2)),  # kv size 2 = kv heads: the layout of a split without --dcp
]


@pytest.mark.parametrize("kv, topo", CASES, ids=[f"kv{k}-{t.describe()}" for k, t in CASES])
def test_qwen3_5_kv_heads_per_rank_as_sglang_builds_them(q35, tmp_path, kv, topo):
    """Each rank's k_proj / v_proj bytes against SGLang's rule; every other tensor byte for byte as
    the split without --dcp writes it; check --source reassembles it."""
    source, out, plain = q35[kv], tmp_path / "dcp", tmp_path / "plain"
    tpshard.split(source, out, topo)
    tpshard.split(source, plain, Topology(tp=topo.tp, attn_dp=topo.attn_dp, ep=topo.ep))
    assert read_manifest(out).topology.dcp == topo.dcp
    full = source_tensors(source)
    attn_tp = topo.attn_tp
    changed = False
    for r in range(topo.world_size):
        held, before = tpshard.open_rank(out, r), tpshard.open_rank(plain, r)
        assert sorted(held) == sorted(before)
        for name, t in held.items():
            if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
                assert torch.equal(t, sglang_kv(full[name], r, kv, attn_tp, topo.dcp)), (r, name)
                changed |= t.shape != before[name].shape or not torch.equal(t, before[name])
            else:
                assert torch.equal(t, before[name]), (r, name)
    assert changed == (attn_tp // topo.dcp < kv)
    assert tpshard.check(out, source).ok


def test_reshard_between_dcp_and_plain(q35, tmp_path):
    from tpshard.reshard import reshard

    source, a, b, c = q35[4], tmp_path / "a", tmp_path / "b", tmp_path / "c"
    tpshard.split(source, a, Topology(tp=4, dcp=2))
    reshard(a, b, Topology(tp=4))
    reshard(b, c, Topology(tp=4, dcp=2))
    assert tpshard.check(b, source).ok and tpshard.check(c, source).ok
    for r in range(4):
        x, y = tpshard.open_rank(a, r), tpshard.open_rank(c, r)
        assert all(torch.equal(x[n], y[n]) for n in x)


def split_kv_over_attn_tp(source: Path, out: Path, topo: Topology, monkeypatch) -> None:
    """Broken on purpose: the manifest says dcp, the K/V are cut over the whole attention group."""
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, Q35, dataclasses.replace(arch.ARCHITECTURES[Q35], dcp="neutral"))
        tpshard.split(source, out, topo)


@pytest.mark.parametrize("kv, tp", [(2, 2), (4, 4)])
def test_kv_cut_over_the_whole_attention_group_is_caught(q35, tmp_path, monkeypatch, kv, tp):
    out = tmp_path / "out"
    split_kv_over_attn_tp(q35[kv], out, Topology(tp=tp, dcp=2), monkeypatch)
    assert read_manifest(out).topology.dcp == 2
    found = [f"[{p.check}] {p.message}" for p in tpshard.check(out, q35[kv]).problems]
    assert any("[rules]" in p and "self_attn.k_proj" in p for p in found), found[:4]
    assert any("[rules]" in p and "self_attn.v_proj" in p for p in found), found[:4]


def test_another_dcp_groups_kv_heads_are_caught(q35, tmp_path):
    """Rank 0 holding the kv heads of the other DCP group (ranks 2-3's heads 2-3): same shape, other bytes."""
    from broken import overwrite_tensor, rewrite_checksums

    out, name = tmp_path / "out", "model.layers.3.self_attn.v_proj.weight"
    tpshard.split(q35[4], out, Topology(tp=4, dcp=2))
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 2)[name].clone())
    rewrite_checksums(out)
    found = [f"[{p.check}] {p.message}" for p in tpshard.check(out, q35[4]).problems]
    assert any(name in p for p in found), found[:4]


@pytest.mark.slow
def test_verify_runs_each_ranks_kv_heads(q35, tmp_path, monkeypatch):
    """Layer level at tp 2, dcp 2: each rank's QKVParallelLinear built as SGLang's (both kv heads on
    both ranks) computes its K/V against the source; the K/V cut over attn_tp fails qkv_proj."""
    from tpshard.verify import verify_many

    good, bad = tmp_path / "good", tmp_path / "bad"
    tpshard.split(q35[2], good, Topology(tp=2, dcp=2))
    split_kv_over_attn_tp(q35[2], bad, Topology(tp=2, dcp=2), monkeypatch)
    ok, broken = verify_many([good, bad], [q35[2], q35[2]])
    assert ok.ok, ok.failures()
    assert any(x.layer == "model.layers.3.self_attn.qkv_proj" and x.ok for x in ok.layers)
    failing = {x.layer for x in broken.layers if not x.ok}
    assert failing == {"model.layers.3.self_attn.qkv_proj"}, broken.failures()


# ---- DeepSeek: the class reads dcp, no weight changes -------------------------------------------------


def test_deepseek_dcp_and_replicated_q_proj_change_no_byte(deepseek_v3, tmp_path):
    out, plain = tmp_path / "out", tmp_path / "plain"
    p = run("split", deepseek_v3, "-o", out, "--tp", "4", "--dcp", "2", "--dcp-replicate-q-proj")
    assert p.returncode == 0, p.stderr
    said = " ".join(p.stdout.split())
    assert "dcp=2 dcp_replicate_q_proj" in said and "start SGLang with --dcp-size 2 --dcp-replicate-q-proj" in said, said
    recorded = json.loads((out / MANIFEST_NAME).read_bytes())["topology"]
    assert recorded["dcp"] == 2 and recorded["dcp_replicate_q_proj"] is True
    tpshard.split(deepseek_v3, plain, Topology(tp=4))
    for r in range(4):
        x, y = tpshard.open_rank(out, r), tpshard.open_rank(plain, r)
        assert sorted(x) == sorted(y) and all(torch.equal(x[n], y[n]) for n in x)
        q_b = x["model.layers.0.self_attn.q_b_proj.weight"]  # 8 heads of 24 rows over attn_tp 4: two heads each
        assert torch.equal(q_b, source_tensors(deepseek_v3)["model.layers.0.self_attn.q_b_proj.weight"].chunk(4)[r])
    assert run("check", out, "--source", deepseek_v3).returncode == 0
    p = run("plan", deepseek_v3, "--tp", "4", "--dcp", "2")
    assert p.returncode == 0 and "dcp=2" in p.stdout.splitlines()[0], p.stdout


def test_deepseek_q_proj_replicated_over_the_dcp_group_is_caught(deepseek_v3, tmp_path, monkeypatch):
    """vLLM's --dcp-q-replicate layout (each rank the DCP group's q heads; at tp = dcp = 2 all of
    them), written under a manifest that says SGLang's --dcp-replicate-q-proj: check sees it."""
    out, name = tmp_path / "out", "DeepseekV3ForCausalLM"
    good = arch.ARCHITECTURES[name]
    rules = tuple(r._replace(layer_class="ReplicatedLinear", role="replicated") if r.shape == "mla_q_b" else r for r in good.rules)
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, name, dataclasses.replace(good, rules=rules))
        tpshard.split(deepseek_v3, out, Topology(tp=2, dcp=2, dcp_replicate_q_proj=True))
    assert tpshard.open_rank(out, 1)["model.layers.0.self_attn.q_b_proj.weight"].shape[0] == 8 * 24
    found = [f"[{p.check}] {p.message}" for p in tpshard.check(out, deepseek_v3).problems]
    assert any("[rules]" in p and "q_b_proj" in p for p in found), found[:4]


def test_vllm_export_of_a_deepseek_dcp_split(deepseek_v2, tmp_path):
    """vLLM 0.33.0 keeps DeepSeek's tp cut under --decode-context-parallel-size (no q replication): the
    export is the plain split's, file for file, and its launch line says the size; with SGLang's
    --dcp-replicate-q-proj (vLLM's --dcp-q-replicate loads another layout) it is refused."""
    split = tmp_path / "split"
    tpshard.split(deepseek_v2, split, Topology(tp=2, dcp=2))
    p = run("export", split, "--format", "vllm", "-o", tmp_path / "exp", "--json")
    assert p.returncode == 0, p.stderr
    assert "--tensor-parallel-size 2 --decode-context-parallel-size 2" in json.loads(p.stdout)["launch"]
    assert run("split", deepseek_v2, "-o", tmp_path / "plain", "--tp", "2", "--format", "vllm").returncode == 0
    for f in sorted((tmp_path / "plain").glob("model-rank-*.safetensors")):
        assert (tmp_path / "exp" / f.name).read_bytes() == f.read_bytes(), f.name
    assert run("check", tmp_path / "exp", "--source", deepseek_v2).returncode == 0
    p = run("split", deepseek_v2, "-o", tmp_path / "q", "--tp", "2", "--dcp", "2", "--dcp-replicate-q-proj", "--format", "vllm")
    assert p.returncode == 2 and "--dcp-q-replicate loads each DCP group's q heads" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "q").exists()


def test_vllm_refuses_qwen3_5_dcp(q35):
    """vLLM 0.33.0 has no DCP for hybrid models (v1/core/single_type_kv_cache_manager.py L1485)."""
    from tpshard.export.dcp import dcp_refusal

    plan = make_plan(open_checkpoint(q35[2]), Topology(tp=2, dcp=2))
    assert "DCP not support mamba now" in dcp_refusal(plan, "vllm")
    assert dcp_refusal(plan, "sglang") is None
    assert dcp_refusal(make_plan(open_checkpoint(q35[2]), Topology(tp=2)), "vllm") is None


def test_sglang_launch_line_carries_dcp():
    from tpshard.export.launch import launch_line

    manifest = SimpleNamespace(
        from_=SimpleNamespace(topology=Topology(tp=4, dcp=2, dcp_replicate_q_proj=True), options=Options()), env=None, engine="sglang", files=(),
    )  # fmt: skip
    line = launch_line(manifest, Path("/deploy"))
    assert line == "python -m sglang.launch_server --model-path /deploy --load-format sharded_state --tp-size 4 --dcp-size 2 --dcp-replicate-q-proj"


# ---- the topology and the refusals ------------------------------------------------------------------


def test_defaults_are_recorded_as_nothing():
    assert Topology(tp=4, dcp=1, dcp_replicate_q_proj=False) == Topology(tp=4)
    assert b"dcp" not in msgspec.json.encode(Topology(tp=4, dcp=1, dcp_replicate_q_proj=False))
    t = msgspec.json.decode(msgspec.json.encode(Topology(tp=8, attn_dp=2, dcp=4)), type=Topology)
    assert t == Topology(tp=8, attn_dp=2, dcp=4) and t.dcp_size == 4 and Topology(tp=8).dcp_size == 1
    with pytest.raises(TopologyError, match=r"dcp=3 does not divide attn_tp 4"):
        Topology(tp=8, attn_dp=2, dcp=3)
    with pytest.raises(TopologyError, match=r"dcp_replicate_q_proj needs dcp > 1"):
        Topology(tp=4, dcp_replicate_q_proj=True)


@pytest.mark.parametrize(
    "fixture, args, message",
    [
        ("llama", ["--tp", "2", "--dcp", "2"], "--dcp 2: SGLang's llama.py never reads the decode-context-parallel size for LlamaForCausalLM"),
        ("qwen3_next", ["--tp", "2", "--dcp", "2"], "never reads the decode-context-parallel size for Qwen3NextForCausalLM"),
        ("q35_kv2", ["--tp", "2", "--dcp", "2", "--dcp-replicate-q-proj"], "--dcp-replicate-q-proj: SGLang replicates only DeepSeek MLA's q projection"),
        ("q35_kv2", ["--tp", "4", "--attn-dp", "2", "--ep", "2", "--dcp", "4"], "--dcp 4 does not divide attn_tp 2 = --tp 4 / (--attn-dp 2 x --attn-cp 1)"),
        ("deepseek_v3", ["--tp", "2", "--dcp-replicate-q-proj"], "--dcp-replicate-q-proj needs --dcp > 1: SGLang refuses it"),
        ("deepseek_v3", ["--tp", "2", "--pp", "2", "--engine", "vllm", "--dcp", "2", "--dcp-replicate-q-proj"], "--dcp-replicate-q-proj (SGLang's"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_exit_2(request, q35, tmp_path, fixture, args, message):
    if fixture == "qwen3_next":
        model = make_checkpoint(tmp_path / "next", "qwen3_next", max_shard_size="100KB")
    else:
        model = q35[2] if fixture == "q35_kv2" else request.getfixturevalue(fixture)
    out = tmp_path / "out"
    p = run("split", model, "-o", out, *args)
    assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()
