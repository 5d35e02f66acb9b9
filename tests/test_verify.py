"""verify on CPU with gloo: real tensor-parallel layers loaded from the shards, compared with the
source math (layer level) and with transformers' logits (model level), on real checkpoints.

Compared with what: every layer's combined TP output against a float64 reference computed on rank 0
from the *source* tensors; the TP decoder's logits against AutoModelForCausalLM's float32 forward.
Each broken output below keeps consistent checksums (only the numbers can tell) and verify must
exit non-zero naming the broken layer. Spawning costs a torch import per rank, so outputs of one
world size are verified in one launch (verify_many).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import msgspec
import pytest

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from tpshard.errors import TpshardError
from tpshard.manifest import MANIFEST_NAME, encode_manifest, read_manifest
from tpshard.topology import Topology
from tpshard.verify import choose_backend, verify_many


def run(*args, env=None) -> subprocess.CompletedProcess:
    p = subprocess.run(
        [sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
    )  # fmt: skip
    assert "Traceback" not in p.stderr, p.stderr
    return p


# Attention-DP layouts come from Qwen3: SGLang's Llama keeps attention over the full tp group.
@pytest.fixture(scope="module")
def qwen3_tp8(qwen3, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v8") / "out"
    tpshard.split(qwen3, out, Topology(tp=8, attn_dp=2))
    return out


def test_cli_qwen3_tp8_attn_dp2_passes_with_report_and_junit(qwen3, qwen3_tp8, tmp_path):
    """The 'done when': a per-layer table, report.json and junit.xml, exit 0, well under a minute."""
    report, junit = tmp_path / "report.json", tmp_path / "junit.xml"
    p = run("verify", qwen3_tp8, "--source", qwen3, "--report", report, "--junit", junit)
    assert p.returncode == 0, p.stderr
    assert "layers.{0-1}.self_attn.qkv_proj" in p.stdout and "ok" in p.stdout  # alike layers folded into one row
    data = json.loads(report.read_text())
    assert data["ok"] and data["topology"] == {"tp": 8, "attn_dp": 2, "attn_cp": 1, "ep": 1, "moe_dense_tp": None} and data["backend"] == "gloo"
    layers = {r["layer"]: r for r in data["layers"]}
    assert len(layers) == 10  # embed, 2 x (qkv, o, gate_up, down), lm_head
    assert layers["model.layers.0.self_attn.o_proj"]["batches"] == 2  # one batch per DP replica
    assert layers["model.layers.0.mlp.down_proj"]["batches"] == 1
    assert all(0 <= r["max_rel"] <= 1e-5 for r in data["layers"])
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("tests") == "11" and suite.get("failures") == "0"  # + every byte (tensors)
    t = data["tensors"]
    assert t["problems"] == [] and t["files"] >= 8 and t["padded"] > 0
    assert t["whole"] == 8 * 9  # per rank: 2 x (input, post-attention norm, q_norm, k_norm), the final norm
    assert "verify: 8 ranks, backend gloo on CPU: auto" in p.stderr  # the backend is announced
    assert data["seconds"] < 120  # ~7 s on an idle 2-core box; generous for a loaded CI machine


def broken_outputs(good: Path, root: Path) -> dict[str, Path]:
    """The three breakages of the issue, each on its own copy of `good` (tp 8, attn-dp 2)."""
    outs = {}

    def copy(name: str) -> Path:
        dst = root / name
        subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
        outs[name] = dst
        return dst

    # kv heads swapped between ranks: rank 0's kv file (shared by ranks 0, 1, 4, 5) holds kv head 1
    # and rank 2's (ranks 2, 3, 6, 7) kv head 0 -- weights and biases -- checksums rewritten.
    out = copy("kv_swapped")
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        k0, k2 = (tpshard.open_rank(out, r)[name].clone() for r in (0, 2))
        overwrite_tensor(out, 0, name, k2)
        overwrite_tensor(out, 2, name, k0)
    rewrite_checksums(out)

    # The row-parallel bias recorded as replicated (a rule table that files o_proj.bias with the
    # norms: "whole on every rank"), so every rank applies it and the all-reduce counts it
    # attn_tp = 4 times. The bytes are untouched: the checksums stay right.
    out = copy("row_bias_replicated")
    m = read_manifest(out)
    shards = tuple(
        msgspec.structs.replace(s, kind="replicated", group="replicated", factor=1, group_rank=0, group_size=1)
        if s.name == "model.layers.0.self_attn.o_proj.bias" else s
        for s in m.plan.shards
    )  # fmt: skip
    (out / MANIFEST_NAME).write_bytes(encode_manifest(m.with_plan(m.plan.with_shards(shards))))

    # The embedding shard of attn_tp rank 1 (world ranks 1, 5) replaced by rank 2's, checksums rewritten.
    out = copy("embed_wrong_rank")
    name = "model.embed_tokens.weight"
    overwrite_tensor(out, 1, name, tpshard.open_rank(out, 2)[name].clone())
    rewrite_checksums(out)
    return outs


def test_broken_outputs_fail_naming_the_layer(biased, tmp_path):
    """Layer and model level on the good output and on each breakage, in one 8-rank launch."""
    model, good = biased
    outs = broken_outputs(good, tmp_path)
    for out in outs.values():  # only the source can tell: checksums and alignment are consistent...
        report = tpshard.check(out)
        assert all(p.check == "reduction" for p in report.problems), report.problems  # ...but check 5 sees the bias
    names = ["good", *outs]
    reports = dict(zip(names, verify_many([good, *outs.values()], [model] * len(names), model=True)))

    good_report = reports["good"]
    assert good_report.ok, good_report.failures()
    assert good_report.model.top1 == 1.0 and good_report.model.max_rel < 1e-5

    def failing(name: str) -> dict[str, str]:
        r = reports[name]
        assert not r.ok
        assert r.model is not None and not r.model.ok, f"{name}: the logits must differ too"
        return {x.layer: "; ".join(x.problems) for x in r.layers if not x.ok}

    kv = failing("kv_swapped")
    assert list(kv) == ["model.layers.1.self_attn.qkv_proj"], kv
    assert "piece k of group rank 0/2 differs (it is group rank 1's slice) on world ranks [0, 1, 4, 5]" in kv["model.layers.1.self_attn.qkv_proj"]

    bias = failing("row_bias_replicated")
    assert list(bias) == ["model.layers.0.self_attn.o_proj"], bias
    assert "the bias is added 4 times instead of once" in bias["model.layers.0.self_attn.o_proj"]
    assert "recorded as replicated" in bias["model.layers.0.self_attn.o_proj"]

    emb = failing("embed_wrong_rank")
    assert list(emb) == ["model.embed_tokens"], emb
    assert "token ids of group rank(s) [1] (shards held by world ranks [1, 5])" in emb["model.embed_tokens"]


def test_cli_exits_1_on_swapped_kv_heads(qwen3, qwen3_tp8, tmp_path):
    out = tmp_path / "broken"
    subprocess.run(["cp", "-a", str(qwen3_tp8), str(out)], check=True)
    name = "model.layers.0.self_attn.v_proj.weight"
    v0, v2 = (tpshard.open_rank(out, r)[name].clone() for r in (0, 2))
    overwrite_tensor(out, 0, name, v2)
    overwrite_tensor(out, 2, name, v0)
    rewrite_checksums(out)
    junit = tmp_path / "junit.xml"
    p = run("verify", out, "--source", qwen3, "--junit", junit)
    assert p.returncode == 1, p.stderr
    assert "FAIL model.layers.0.self_attn.qkv_proj" in p.stdout and "piece v of group rank" in p.stdout
    failed = [tc.get("name") for tc in ET.parse(junit).getroot().iter("testcase") if tc.find("failure") is not None]
    assert failed == ["model.layers.0.self_attn.qkv_proj"]


def test_qwen2_tied_and_llama_at_tp4_layer_and_model_level(qwen2_tied, llama, tmp_path):
    """Qwen2: q/k/v biases, lm_head tied to the embedding shards. Both against transformers."""
    outs = [tmp_path / "qwen2", tmp_path / "llama"]
    tpshard.split(qwen2_tied, outs[0], Topology(tp=4))
    tpshard.split(llama, outs[1], Topology(tp=4))
    for r in verify_many(outs, [qwen2_tied, llama], model=True):
        assert r.ok, r.failures()
        assert r.model.top1 == 1.0 and r.model.max_rel < 1e-5 and r.model.kl < 1e-9
    assert "lm_head" in [x.layer for x in r.layers]


def test_model_level_tp2_json(mistral, tmp_path):
    out = tmp_path / "out"
    tpshard.split(mistral, out, Topology(tp=2))
    p = run("verify", out, "--source", mistral, "--model", "--json")
    assert p.returncode == 0, p.stderr
    data = json.loads(p.stdout)
    assert data["ok"] and data["model"]["architecture"] == "MistralForCausalLM" and data["model"]["top1"] == 1.0


def test_world_size_must_equal_tp_under_torchrun(qwen3, qwen3_tp8):
    p = run("verify", qwen3_tp8, "--source", qwen3, env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert p.returncode == 2 and "torchrun started 2 processes" in p.stderr and "tp=8" in p.stderr


def test_user_errors(llama, qwen3_tp8, qwen3, tmp_path):
    with pytest.raises(TpshardError, match="nccl needs one GPU per rank"):
        choose_backend(8, "nccl") if not _gpus(8) else pytest.skip("has 8 GPUs")
    p = run("verify", qwen3_tp8, "--source", llama)
    assert p.returncode == 2 and "not the checkpoint" in p.stderr
    part = tmp_path / "part"
    tpshard.split(llama, part, Topology(tp=8, attn_dp=2), ranks=[0, 1])
    p = run("verify", part, "--source", llama)
    assert p.returncode == 2 and "ranks [2, 3, 4, 5, 6, 7] were not written" in p.stderr


def _gpus(n: int) -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= n


@pytest.mark.slow
def test_layer_level_bfloat16_and_qwen3_tp4_attn_dp2_model(qwen3, tmp_path):
    out = tmp_path / "out"
    tpshard.split(qwen3, out, Topology(tp=4, attn_dp=2))
    r = tpshard.verify.verify(out, qwen3, model=True)
    assert r.ok, r.failures()
    r = tpshard.verify.verify(out, qwen3, dtype="bfloat16")
    assert r.ok and max(x.max_rel for x in r.layers) > 1e-5, "bf16 rounding shows"
