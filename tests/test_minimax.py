"""MiniMax-M2 (MiniMaxM2ForCausalLM, tpshard/arch/minimax.py) on a tiny checkpoint saved by
transformers' own MiniMaxM2ForCausalLM: 8 heads of 16 over 2 kv heads (kv replicated at attn_tp 4),
q_norm [8 * 16] and k_norm [2 * 16] over the whole projection, partial rotary (rotary_dim 8), 8
experts of intermediate 32 under `block_sparse_moe` (w1/w3/w2, the release's names, which
transformers 5 saves back), the router in bf16 and its correction bias in fp32.

What each rank holds is SGLang's models/minimax_m2.py: attention and the embedding over attn_tp,
q_norm / k_norm cut by heads like q / k (MiniMaxM2RMSNormTP: k_norm replicated with the kv heads),
experts in contiguous EP blocks, the router whole. The per-rank contract is tests/contract.py; here
the MiniMax specifics, the refusals, layouts broken on purpose (check --source must see each), and
verify (layer level, the decoder against transformers, and a runtime whose norm forgets the
all-reduce must fail).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpshard
import tpshard.arch as arch
from broken import only_the_source_tells, overwrite_tensor, problems, take_from_rank
from test_moe_split import assert_contract, source_tensors
from test_verify_moe import round_robin_split
from tpshard.reshard import reshard
from tpshard.topology import Topology
from tpshard.verify import verify_many

MINIMAX = "MiniMaxM2ForCausalLM"
TP4_EP2 = Topology(tp=4, ep=2)  # attn_tp 4: q heads 2r, 2r+1 on rank r; kv head r // 2; moe_tp 2
# What the release's config.json says and transformers' class always does (tpshard refuses a config
# with which SGLang would build another model).
RELEASE = dict(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True)


def make_minimax(path: Path, *, seed: int = 0, **overrides) -> Path:
    import transformers

    config = transformers.MiniMaxM2Config(**{
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 250, "max_position_embeddings": 128, "intermediate_size": 32, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rotary_dim": 8, "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
        **RELEASE, **overrides,
    })  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.MiniMaxM2ForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():  # random init leaves norms at 1 and the bias at 0: make every byte matter
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
        for layer in model.model.layers:  # the release keeps the correction bias in fp32
            layer.mlp.e_score_correction_bias = torch.randn(config.num_local_experts) * 0.1
    model.save_pretrained(path, max_shard_size="100KB")
    return path


def tpshard_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip


@pytest.fixture(scope="module")
def minimax(tmp_path_factory) -> Path:
    return make_minimax(tmp_path_factory.mktemp("minimax") / "model")


@pytest.fixture(scope="module")
def minimax_good(minimax, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("minimax_good") / "out"
    tpshard.split(minimax, out, TP4_EP2)
    return out


def test_saved_names_are_the_releases(minimax):
    names = set(source_tensors(minimax))
    assert {"model.layers.0.block_sparse_moe.experts.7.w3.weight", "model.layers.1.block_sparse_moe.gate.weight",
            "model.layers.1.block_sparse_moe.e_score_correction_bias", "model.layers.0.self_attn.k_norm.weight"} <= names  # fmt: skip
    assert not [n for n in names if ".mlp." in n or "gate_up_proj" in n]


def test_tp4_ep2_per_rank(minimax_good, minimax):
    assert tpshard.check(minimax_good, minimax).ok
    assert_contract(minimax, minimax_good, TP4_EP2)
    full = source_tensors(minimax)
    a = "model.layers.1.self_attn."
    for r in range(4):
        t = tpshard.open_rank(minimax_good, r)
        kv = r // 2  # 2 kv heads over attn_tp 4: ranks 0, 1 hold head 0; ranks 2, 3 head 1
        # k_norm goes with its kv head, exactly as k_proj's rows (not cut 4 ways like q)
        assert torch.equal(t[a + "k_norm.weight"], full[a + "k_norm.weight"][16 * kv : 16 * kv + 16])
        assert torch.equal(t[a + "k_proj.weight"], full[a + "k_proj.weight"][16 * kv : 16 * kv + 16])
        assert torch.equal(t[a + "q_norm.weight"], full[a + "q_norm.weight"][32 * r : 32 * r + 32])
        for name in ("model.layers.1.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.e_score_correction_bias"):
            assert t[name].dtype == full[name].dtype and torch.equal(t[name], full[name])
        held = sorted({int(n.split(".")[5]) for n in t if ".block_sparse_moe.experts." in n and n.startswith("model.layers.0.")})
        assert held == list(range(4 * (r // 2), 4 * (r // 2) + 4))


def test_attn_dp_ep8_and_reshard(minimax, minimax_good, tmp_path):
    """tp 8, attn-dp 2, ep 8: attention, norms and embedding over attn_tp 4, one expert per rank;
    and a reshard of the tp 4 output to it (and to tp 2), held to the same contract."""
    topo = Topology(tp=8, attn_dp=2, ep=8)
    out = tmp_path / "split8"
    tpshard.split(minimax, out, topo)
    assert_contract(minimax, out, topo)
    for new, t in (("re8", topo), ("re2", Topology(tp=2))):
        reshard(minimax_good, tmp_path / new, t)
        assert tpshard.check(tmp_path / new, minimax).ok
        assert_contract(minimax, tmp_path / new, t)
    p = tpshard_cli("check", tmp_path / "re8", "--from", minimax_good)
    assert p.returncode == 0, p.stdout + p.stderr


# ---- refusals: one line, exit 2, nothing written --------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tp", "16", "--ep", "2", "--attn-dp", "2"), "tp size 16 is greater than the 8 routed experts of MiniMaxM2ForCausalLM; SGLang minimax_m2.py refuses it"),
        (("--tp", "2", "--pp", "2"), "--pp 2: no pipeline layout of MiniMaxM2ForCausalLM is on record"),
        (("--tp", "4", "--attn-dp", "2", "--dp-lm-head"), "--dp-lm-head"),
    ],
    ids=["tp-above-experts", "pp", "dp-lm-head"],
)
def test_topology_refusals(minimax, tmp_path, args, message):
    p = tpshard_cli("split", minimax, "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_heads_not_dividing_attn_tp_is_refused(tmp_path):
    model = make_minimax(tmp_path / "model", num_attention_heads=12)
    p = tpshard_cli("plan", model, "--tp", "8", "--ep", "8")
    assert p.returncode == 2 and "12 attention heads do not divide over the attn_tp group of 8" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(use_qk_norm=None), "use_qk_norm is None, not True: SGLang's MiniMaxM2Attention then builds no q_norm / k_norm"),
        (dict(qk_norm_type="per_head"), "qk_norm_type is 'per_head', not 'per_layer'"),
        (dict(use_routing_bias=False), "use_routing_bias is False, not True: SGLang's MiniMaxM2MoE then builds no e_score_correction_bias"),
        (dict(scoring_func="softmax"), "scoring_func is 'softmax', not 'sigmoid'"),
        (dict(rotary_dim=16), "rotary_dim 16, but transformers rotates head_dim 16 x partial_rotary_factor 0.5 dims"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ],
    ids=["no-qk-norm", "qk-norm-type", "no-routing-bias", "softmax", "rotary-dim", "gelu"],
)
def test_config_refusals(minimax, copy_of, change, message):
    model = copy_of(minimax)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in (cfg | change).items() if v is not None}))
    p = tpshard_cli("plan", model, "--tp", "2")
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_mtp_module_tensors_refused(minimax, copy_of):
    """An MTP module stored as layer num_hidden_layers (num_mtp_modules): SGLang's main model skips
    it and tpshard does not model the draft class, so it is refused, not carried."""
    from safetensors.torch import load_file, save_file

    model = copy_of(minimax)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    mtp = {}
    for name, file in index["weight_map"].items():
        if name.startswith("model.layers.1."):
            mtp[name.replace("model.layers.1.", "model.layers.2.")] = load_file(model / file)[name]
    save_file(mtp, model / "model-mtp.safetensors", metadata={"format": "pt"})
    index["weight_map"] |= {n: "model-mtp.safetensors" for n in mtp}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    p = tpshard_cli("plan", model, "--tp", "2")
    assert p.returncode == 2 and "layer 2, but config.json has 2 layers" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "engine, message",
    [("vllm", "split with --ep 2 (moe_tp 2) at tp 4; vLLM builds either"), ("sglang", "--format sglang: MiniMaxM2ForCausalLM has routed experts")],
)
def test_export_refused(minimax_good, tmp_path, engine, message):
    p = tpshard_cli("export", minimax_good, "--format", engine, "-o", tmp_path / "exp")
    assert p.returncode == 2 and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "exp").exists()


# ---- layouts broken on purpose: check --source must see each -------------------------------------


def test_k_norm_cut_like_q_heads_is_caught(minimax, tmp_path, monkeypatch):
    """A plan that cuts k_norm evenly over attn_tp (8 of its 32 values per rank, as q's width is cut)
    instead of with the kv heads (16 values, each on 2 ranks): self-consistent, only the rules tell."""
    good = arch.ARCHITECTURES[MINIMAX]
    rules = tuple(
        r._replace(layer_class="ColumnParallelLinear", piece="", shape="") if r.module.endswith("k_norm") else r
        for r in good.rules
    )  # fmt: skip
    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, MINIMAX, dataclasses.replace(good, rules=rules))
        tpshard.split(minimax, out, TP4_EP2)
    assert tpshard.open_rank(out, 1)["model.layers.0.self_attn.k_norm.weight"].shape == (8,)
    assert not problems(out, None)
    found = problems(out, minimax)
    assert any("[rules]" in p and "self_attn.k_norm.weight" in p for p in found), found[:4]


@pytest.mark.parametrize(
    ("name", "rank", "donor"),
    [("model.layers.1.self_attn.k_norm.weight", 0, 2), ("model.layers.0.self_attn.v_proj.weight", 1, 3)],
    ids=["k_norm", "v_proj"],
)
def test_the_other_kv_heads_slice_is_caught(minimax_good, minimax, copy_of, name, rank, donor):
    """A rank of kv head 0 holds kv head 1's slice (ranks 2 and 3's), of the k_norm or of v_proj:
    checksums rewritten, only the source tells."""
    out = copy_of(minimax_good)
    take_from_rank(out, rank, name, donor)
    found = only_the_source_tells(out, minimax)
    assert any(name in p and "holds the slice of group rank 1 (meant for ranks [2, 3])" in p for p in found), found[:4]


def test_experts_round_robin_is_caught(minimax, tmp_path):
    out = tmp_path / "out"
    round_robin_split(minimax, out, TP4_EP2)
    found = problems(out, minimax)
    assert any("[experts]" in p and "block_sparse_moe.experts.1." in p and "belongs to slot 0" in p for p in found), found[:4]


def test_router_cut_is_caught(minimax_good, minimax, copy_of):
    """Rank 3's router is its tp slice of the experts' rows (tiled to the whole shape) instead of whole."""
    out = copy_of(minimax_good)
    name = "model.layers.1.block_sparse_moe.gate.weight"
    whole = tpshard.open_rank(out, 3)[name]
    overwrite_tensor(out, 3, name, whole[6:8].repeat(4, 1).clone())
    found = only_the_source_tells(out, minimax)
    assert any(name in p for p in found), found[:4]


# ---- verify: layer level and against transformers' MiniMaxM2ForCausalLM ---------------------------

# Every spawned rank runs this first: MiniMax's q/k norms computed over the rank's own heads only,
# as a runtime that forgets MiniMaxM2RMSNormTP's all-reduce would.
PER_RANK_NORM = """
import tpshard.runtime.norms as norms

_init = norms.RMSNormTP.__init__


def _per_rank(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.reduce = False


norms.RMSNormTP.__init__ = _per_rank
"""


@pytest.mark.slow
def test_verify_model_tp4_ep2_and_attn_dp(minimax, minimax_good, tmp_path):
    """Every engine layer (QKV, q/k norms over all heads, the router with its correction bias, FusedMoE,
    embedding, lm_head) on every rank, and the logits against transformers' MiniMaxM2ForCausalLM (partial
    rotary, sigmoid routing), at tp 4 / ep 2 and tp 4 / attn-dp 2 / ep 4 in one launch."""
    dp = tmp_path / "dp"
    tpshard.split(minimax, dp, Topology(tp=4, attn_dp=2, ep=4))
    for r in verify_many([minimax_good, dp], [minimax] * 2, model=True):
        assert r.ok and r.model.top1 == 1.0 and r.model.max_rel < 1e-5, r.failures()
        assert {"model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.k_norm"} <= {x.layer for x in r.layers}


@pytest.mark.slow
def test_verify_fails_when_the_norm_is_per_rank(minimax, minimax_good, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(PER_RANK_NORM)
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    p = tpshard_cli("verify", minimax_good, "--source", minimax, "--model", env=env)
    text = p.stdout + p.stderr
    assert p.returncode == 1, text[-3000:]
    assert "layers.{0-1}.self_attn.q_norm" in text and "layers.{0-1}.self_attn.k_norm" in text, text[-3000:]
    assert "top-1" in text or "logit" in text, text[-3000:]
