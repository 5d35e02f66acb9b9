"""verify --model for DeepSeek-V4 (tpshard/verify/v4_model.py, tpshard/runtime/v4_attention.py,
v4_moe.py): every rank's logits against transformers' DeepseekV4ForCausalLM on the tiny native
checkpoint of tests/v4_checkpoint.py (4 layers: sliding window + hash routing, ratio 4 with the
indexer, ratio 128, ratio 4; swiglu_limit 0.5 so the clamp acts).

160 tokens a sequence: past the window (8), one closed ratio-128 window, 40 ratio-4 entries of
which the indexer keeps 4. Fewer is refused. Layouts broken on purpose (another rank's wq_b, wo_a
cut on its o_lora dim, the sinks of the other heads, an expert of another EP slot, tid2eid in
local ids) fail the model; a forward that drops one piece (sinks, mHC, the ratio-128 compressor,
the indexer's choice, the clamp, hash routing, the shared expert) disagrees with transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpshard
import tpshard.runtime.v4_attention as v4_attention
import tpshard.runtime.v4_moe as v4_moe
import tpshard.verify.v4_model as v4_model
from broken import overwrite_tensor, rewrite_checksums
from test_moe_split import source_tensors
from tpshard.manifest import read_manifest
from tpshard.topology import Topology
from tpshard.verify import verify_many
from v4_checkpoint import make_v4

TOKENS = 160


def tpshard_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> Path:
    return make_v4(tmp_path_factory.mktemp("v4m") / "model")


def split(v4: Path, where: Path, topo: Topology) -> Path:
    tpshard.split(v4, where, topo)
    return where


def copy(out: Path, name: str) -> Path:
    dst = out.with_name(name)
    subprocess.run(["cp", "-a", str(out), str(dst)], check=True)
    return dst


def model_of(report):
    assert report.model is not None
    return report.model


# ---- the TP forward against transformers (gloo), and layouts broken on purpose ---------------------


def sinks_of_the_other_heads(out: Path) -> None:
    """Every rank's attn_sink of layer 1 with its two halves swapped: attention rank 0 slices heads
    0..3 in the forward and reads the sinks of heads 4..7."""
    name = "layers.1.attn.attn_sink"
    t = tpshard.open_rank(out, 0)[name]
    for rank in range(4):
        overwrite_tensor(out, rank, name, t.roll(4).clone())


def test_verify_model_tp4_attention_dp_ep(v4, tmp_path):
    """tp 4, attention DP 2, EP 2: every rank's logits agree with transformers' (the replicas run
    different batches); the sinks of the other heads fail the model on every rank. Fails before
    tpshard.verify.v4_model: --model was refused for DeepSeek-V4."""
    good = split(v4, tmp_path / "tp4", Topology(tp=4, attn_dp=2, ep=2))
    bad = copy(good, "sinks")
    sinks_of_the_other_heads(bad)
    rewrite_checksums(bad)
    ok, broken = verify_many([good, bad], [v4] * 2, model=True, tokens=TOKENS)
    m = model_of(ok)
    assert ok.ok, ok.failures()
    assert m.batches == 2 and m.tokens == TOKENS and m.top1 == 1.0 and m.max_rel < 1e-5, m
    assert not model_of(broken).ok, broken.model
    assert model_of(broken).top1 < 1.0


@pytest.mark.slow
def test_verify_model_tp2(v4, tmp_path):
    (r,) = verify_many([split(v4, tmp_path / "tp2", Topology(tp=2))], [v4], model=True, tokens=TOKENS)
    assert r.ok, r.failures()
    assert model_of(r).batches == 1


@pytest.mark.slow
def test_verify_model_dp4_ep4_and_broken_layouts(v4, tmp_path):
    """tp 4 with attention DP 4 (attn_tp 1: every rank its own batch, the embedding whole) and EP 4
    (moe_tp 1) agrees; at tp 4 EP 2 each layout broken on purpose fails the model."""
    dp4 = split(v4, tmp_path / "dp4", Topology(tp=4, attn_dp=4, ep=4))
    base = split(v4, tmp_path / "tp4", Topology(tp=4, ep=2))
    full = source_tensors(v4)
    breaks = {}

    def broken(label, edit):
        out = copy(base, label)
        edit(out)
        rewrite_checksums(out)
        breaks[label] = out

    name = "layers.1.attn.wq_b.weight"  # rank 0 holds rank 1's heads
    broken("wq_b", lambda out: overwrite_tensor(out, 0, name, tpshard.open_rank(out, 1)[name].clone()))
    wo_a = "layers.3.attn.wo_a.weight"  # [groups, o_lora, in] cut on o_lora, not on the groups: the same shape

    def o_lora_cut(out):
        g, o = 4, 16
        view = full[wo_a].view(g, o, -1)
        for rank in range(4):
            overwrite_tensor(out, rank, wo_a, view[:, rank * o // 4 : (rank + 1) * o // 4].reshape(g * o // 4, -1).clone())

    broken("wo_a", o_lora_cut)
    expert = "layers.2.ffn.experts.1.w2.weight"  # rank 0 (EP slot 0) holds expert 5 of slot 1 in its place
    broken("expert", lambda out: overwrite_tensor(out, 0, expert, full["layers.2.ffn.experts.5.w2.weight"][:, :16].clone()))
    tid = "layers.0.ffn.gate.tid2eid"  # global expert ids rewritten to ids inside an EP slot

    def local_ids(out):
        for rank in range(4):
            overwrite_tensor(out, rank, tid, full[tid] % 4)

    broken("tid2eid", local_ids)
    reports = verify_many([dp4, *breaks.values()], [v4] * (1 + len(breaks)), model=True, tokens=TOKENS)
    assert reports[0].ok, reports[0].failures()
    assert model_of(reports[0]).batches == 4
    for label, r in zip(breaks, reports[1:]):
        assert not model_of(r).ok, (label, r.model)


# ---- the released FP8 + FP4 form, dequantized ----------------------------------------------------


@pytest.mark.slow
def test_verify_model_fp8_fp4_release_dequantized(tmp_path):
    """tests/v4_quant.py's release form (FP8 linears with ue8m0 128-blocks, FP4 experts; index_head_dim
    64 so that transformers' indexer can rotate its heads): each rank dequantizes its own shards, rank 0
    runs transformers on the source dequantized by transformers' Fp8Dequantize. An FP4 expert holding
    another expert's scales fails the model."""
    from v4_quant import make_v4_quant

    model = make_v4_quant(tmp_path / "q", index_head_dim=64)
    good = split(model, tmp_path / "tp4", Topology(tp=4, attn_dp=2, ep=2))
    bad = copy(good, "scales")
    name = "layers.3.ffn.experts.1.w1.scale"
    overwrite_tensor(bad, 0, name, tpshard.open_rank(bad, 0)["layers.3.ffn.experts.2.w1.scale"].clone())
    rewrite_checksums(bad)
    ok, broken = verify_many([good, bad], [model] * 2, model=True, tokens=TOKENS)
    assert ok.ok, ok.failures()
    assert model_of(ok).max_rel < 1e-5 and model_of(ok).top1 == 1.0, ok.model
    assert not model_of(broken).ok, broken.model


# ---- refusals --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp1_out(v4, tmp_path_factory) -> Path:
    return split(v4, tmp_path_factory.mktemp("v4tp1") / "out", Topology(tp=1))


def test_too_few_tokens_is_refused_in_one_line(v4, tp1_out):
    """127 tokens: the ratio-128 compressor would be idle, which a pass must not hide."""
    p = tpshard_cli("verify", tp1_out, "--source", v4, "--model", "--tokens", "127")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "--tokens 127 leaves DeepSeek-V4's ratio-128 compressor (acts from 128 tokens) idle" in p.stderr, p.stderr
    assert "--tokens 128 or more" in p.stderr, p.stderr


def test_a_config_transformers_cannot_run_is_refused(v4, tp1_out):
    """index_head_dim below the rope dims: transformers' indexer cannot rotate its heads (no reference)."""
    from tpshard.verify.model import unsupported_reason

    config = json.loads((v4 / "config.json").read_text()) | {"index_head_dim": 4}  # 8 rope dims
    reason = unsupported_reason(read_manifest(tp1_out).plan, config, TOKENS)
    assert reason and "index_head_dim 4 is smaller than the 8 rope dims" in reason, reason
    assert unsupported_reason(read_manifest(tp1_out).plan, json.loads((v4 / "config.json").read_text()), TOKENS) is None


# ---- a forward that drops one piece disagrees with transformers (one rank, in process) --------------


@pytest.fixture(scope="module")
def tp1(v4, tp1_out):
    """A tp-1 split's decoder, built as verify builds it, transformers' logits of one batch, and its ids."""
    from tpshard.verify.build import build_layer
    from tpshard.verify.layer_specs import sharded_layers
    from tpshard.verify.model import hf_logits, model_tokens
    from tpshard.verify.moe_layers import hf_config

    plan = read_manifest(tp1_out).plan
    tensors = tpshard.open_rank(tp1_out, 0)
    cpu = torch.device("cpu")
    layers = {lay.layer: build_layer(lay, plan, 0, tensors, dtype=torch.float32, device=cpu) for lay in sharded_layers(plan)}
    norms = {s.name: tensors[s.name].float() for s in plan.rank_shards(0) if s.layer_class == "Replicated"}
    decoder = v4_model.V4Decoder(plan, 0, layers, norms, cpu, hf_config(tensors))
    ids = model_tokens(plan, 0, seed=0, tokens=TOKENS)
    return plan, decoder, ids, hf_logits(str(v4), [ids])


def agreement(tp1):
    from tpshard.verify.model import compare_logits

    plan, decoder, ids, ref = tp1
    with torch.no_grad():
        logits = decoder.forward(ids)
    return compare_logits(plan, {0: {"batch": 0, "logits": logits, "disagree": {}}}, ref, tokens=TOKENS)


def no_mhc(h, fn, base, scale, cfg):
    post, comb, _ = v4_attention.hyper_pre(h, fn, base, scale, cfg)
    return torch.ones_like(post), torch.eye(cfg.hc_mult).expand_as(comb).clone(), h.mean(2)


def hash_by_score(cfg, x, weight, *, bias=None, tid2eid=None, ids=None):
    return ROUTE(cfg, x, weight, bias=torch.zeros(weight.shape[0]) if tid2eid is not None else bias)


ROUTE = v4_moe.route_v4
COMPRESS = v4_attention.Compressor.__call__
ABLATIONS = {
    "no sinks": (v4_attention.V4Attention, "local_sinks", lambda self, heads: torch.full((heads,), float("-inf"))),
    "no mHC": (v4_model, "hyper_pre", no_mhc),
    "ratio-128 compressor idle": (
        v4_attention.Compressor, "__call__", lambda self, x, cos_at, eps: COMPRESS(self, x, cos_at, eps)[:, : 0 if self.ratio == 128 else None]
    ),
    "the indexer keeps every entry": (
        v4_attention, "indexer_pick", lambda x, q, keys, *a: v4_attention.visible(x.shape[1], keys.shape[1], a[-1], x.device).expand(x.shape[0], -1, -1)
    ),
    "no swiglu clamp": (v4_moe, "swiglu", lambda g, u, limit: torch.nn.functional.silu(g) * u),
    "hash layers routed by score": (v4_moe, "route_v4", hash_by_score),
    "no shared expert": (v4_moe, "shared_partial", lambda cfg, gate_up, down, x: torch.zeros_like(x)),
}  # fmt: skip
def test_the_forward_agrees_with_transformers_at_tp1(tp1):
    r = agreement(tp1)
    assert r.ok and r.max_rel < 1e-6, r


@pytest.mark.parametrize("piece", ABLATIONS)
def test_a_forward_without_one_piece_disagrees(tp1, monkeypatch, piece):
    where, attr, replacement = ABLATIONS[piece]
    monkeypatch.setattr(where, attr, replacement)
    r = agreement(tp1)
    assert not r.ok and r.max_rel > 1e-2, (piece, r)
