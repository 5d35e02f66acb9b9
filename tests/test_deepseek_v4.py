"""DeepSeek-V4 (DeepseekV4ForCausalLM, tpshard/arch/deepseek_v4.py) on a tiny checkpoint in the
release's native names (tests/v4_checkpoint.py: transformers' random-init model renamed, a native
config.json with compress_ratios and num_hash_layers, an MTP layer mtp.0).

`engine_rank_tensor` states what each rank holds as SGLang 0.5.23's deepseek_v4.py builds it, written
from the engine's classes (not from tpshard's rules): every rank's full tensor set is compared with it
at tp 2/4/8, with attention DP and EP. Then the refusals, layouts broken on purpose (check --source
or verify must see each), reshard, and verify at layer level.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tpshard
import tpshard.arch as arch
from broken import only_the_source_tells, overwrite_tensor, problems, rewrite_checksums, take_from_rank
from test_moe_split import source_tensors
from tpshard.reshard import reshard
from tpshard.topology import Topology
from tpshard.verify import verify_many
from v4_checkpoint import make_v4, save_transformers

V4 = "DeepseekV4ForCausalLM"
E, VOCAB = 8, 256


def tpshard_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


@pytest.fixture(scope="module")
def v4(tmp_path_factory) -> Path:
    return make_v4(tmp_path_factory.mktemp("v4") / "model")


def rows(t: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    size = t.shape[dim] // n
    return t.narrow(dim, r * size, size)


def engine_rank_tensor(name: str, t: torch.Tensor, rank: int, topo: Topology) -> torch.Tensor | None:
    """What SGLang's DeepseekV4ForCausalLM on `rank` loads from source tensor `name` (None: nothing)."""
    attn_tp = topo.tp // topo.attn_dp
    a = rank % attn_tp
    moe_tp = topo.tp // topo.ep
    if name in ("embed.weight", "mtp.0.emb.tok_emb.weight"):  # VocabParallelEmbedding(enable_tp=not dp_attention)
        return t if topo.attn_dp > 1 else rows(t, rank, topo.tp)
    if name == "head.weight":  # ParallelLMHead over tp
        return rows(t, rank, topo.tp)
    # A quantized linear's scale (the FP8 release's `.scale`) is cut as its weight, in whole blocks
    if re.search(r"\.attn\.(wq_b|wo_a)\.(weight|scale)$", name) and ".indexer." not in name:  # ColumnParallelLinear, attn_tp
        return rows(t, a, attn_tp)
    if re.search(r"\.attn\.wo_b\.(weight|scale)$", name):  # RowParallelLinear, attn_tp
        return rows(t, a, attn_tp, 1)
    m = re.search(r"\.ffn\.experts\.(\d+)\.(w\d)\.(weight|scale)$", name)
    if m:  # FusedMoE: E / ep experts per EP slot, each over moe_tp
        slot, in_slot = divmod(rank, moe_tp)
        if int(m.group(1)) // (E // topo.ep) != slot:
            return None
        return rows(t, in_slot, moe_tp, 1 if m.group(2) == "w2" else 0)
    m = re.search(r"\.ffn\.shared_experts\.(w\d)\.(weight|scale)$", name)
    if m:  # DeepseekV2MLP over the full tp
        return rows(t, rank, topo.tp, 1 if m.group(1) == "w2" else 0)
    return t  # everything else whole: wq_a, wkv, norms, attn_sink, compressors, indexer, mHC, router, tid2eid


def assert_engine_layout(model: Path, out: Path, topo: Topology) -> None:
    full = source_tensors(model)
    for rank in range(topo.tp):
        held = tpshard.open_rank(out, rank)
        want = {n: w for n, t in full.items() if (w := engine_rank_tensor(n, t, rank, topo)) is not None}
        assert set(held) == set(want), f"rank {rank}: {sorted(set(held) ^ set(want))[:4]}"
        for n, t in held.items():
            assert t.dtype == want[n].dtype and torch.equal(t, want[n]), f"rank {rank}: {n} {list(t.shape)} vs {list(want[n].shape)}"


@pytest.mark.parametrize(
    "topo",
    [Topology(tp=2), Topology(tp=4, ep=2), Topology(tp=8, attn_dp=2, ep=8), Topology(tp=8, attn_dp=4, ep=4)],
    ids=["tp2", "tp4-ep2", "tp8-dp2-ep8", "tp8-dp4-ep4"],
)
def test_every_rank_as_sglang_builds_it(v4, tmp_path, topo):
    out = tmp_path / "out"
    tpshard.split(v4, out, topo)
    assert tpshard.check(out, v4).ok
    assert_engine_layout(v4, out, topo)


def test_dp_lm_head(v4, tmp_path):
    """DeepseekV4ForCausalLM's ParallelLMHead(use_attn_tp_group=enable_dp_lm_head): head over attn_tp,
    the MTP layer's too, the embedding whole."""
    out = tmp_path / "out"
    tpshard.split(v4, out, Topology(tp=4, attn_dp=2, ep=2), tpshard.Options(dp_lm_head=True))
    assert tpshard.check(out, v4).ok
    full = source_tensors(v4)
    for r in range(4):
        t = tpshard.open_rank(out, r)
        assert torch.equal(t["head.weight"], rows(full["head.weight"], r % 2, 2))
        assert torch.equal(t["embed.weight"], full["embed.weight"])


def test_dtypes_kept_and_global_expert_ids(v4, tmp_path):
    """fp32 sinks, mHC tensors, compressor ape, router and bias; int32 tid2eid with global ids on every EP slot."""
    out = tmp_path / "out"
    tpshard.split(v4, out, Topology(tp=4, ep=4))
    full = source_tensors(v4)
    for r in range(4):
        t = tpshard.open_rank(out, r)
        for n in ("layers.1.attn.attn_sink", "layers.1.hc_attn_fn", "hc_head_base", "layers.1.attn.compressor.ape",
                  "layers.3.attn.indexer.compressor.ape", "layers.1.ffn.gate.bias", "mtp.0.hc_ffn_scale"):  # fmt: skip
            assert t[n].dtype == torch.float32 and torch.equal(t[n], full[n]), n
        assert t["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
        assert torch.equal(t["layers.0.ffn.gate.tid2eid"], full["layers.0.ffn.gate.tid2eid"])
        assert t["layers.0.attn.wq_b.weight"].dtype == torch.bfloat16
    assert int(full["layers.0.ffn.gate.tid2eid"].max()) >= E // 4  # ids beyond slot 0's: a local rewrite shows


# ---- refusals: one line, exit 2, nothing written --------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tp", "16", "--attn-dp", "4", "--ep", "2"), "tp size 16 is greater than the 8 routed experts of DeepseekV4ForCausalLM"),
        (("--tp", "6", "--ep", "2"), "8 attention heads do not divide over the attn_tp group of 6 ranks"),
        (("--tp", "2", "--pp", "2"), "--pp 2: no pipeline layout of DeepseekV4ForCausalLM is on record"),
    ],
    ids=["tp-above-experts", "heads", "pp"],
)
def test_topology_refusals(v4, tmp_path, args, message):
    p = tpshard_cli("split", v4, "-o", tmp_path / "out", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(quantization_config={"quant_method": "gptq", "bits": 4}), "tpshard splits DeepSeek-V4 in bf16 or in its release's form"),
        (dict(compress_ratios=None), "no compress_ratios / num_hash_layers"),
        (dict(compress_ratios=[0, 4, 64, 4]), "must give each of the 4 layers 0, 4 or 128"),
        (dict(num_nextn_predict_layers=2), 'asserts "Only 1 nextn layer is supported"'),
    ],
    ids=["quantized", "no-compress-ratios", "ratio-64", "two-mtp"],
)
def test_config_refusals(v4, copy_of, change, message):
    model = copy_of(v4)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in (cfg | change).items() if v is not None}))
    p = tpshard_cli("plan", model, "--tp", "2")
    assert p.returncode == 2 and "Traceback" not in p.stderr and message in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_o_groups_not_dividing_attn_tp_is_refused(tmp_path):
    model = make_v4(tmp_path / "model", mtp=False, o_groups=2, o_lora_rank=32)
    p = tpshard_cli("plan", model, "--tp", "4")
    assert p.returncode == 2 and "o_groups 2 does not divide over the attn_tp group of 4 ranks" in p.stderr, p.stderr
    assert tpshard_cli("plan", model, "--tp", "4", "--attn-dp", "2").returncode == 0  # attn_tp 2: whole groups


def test_transformers_spelling_is_refused(tmp_path):
    """transformers' save_pretrained keeps model., writes attn.norm for attn.kv_norm, drops compress_ratios."""
    model = save_transformers(tmp_path / "hf")
    p = tpshard_cli("split", model, "-o", tmp_path / "out", "--tp", "2")
    assert p.returncode == 2 and "transformers' save_pretrained" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_export_refused(v4, tmp_path):
    out = tmp_path / "out"
    tpshard.split(v4, out, Topology(tp=2))
    for fmt, message in (("vllm", "no vllm name table for DeepseekV4ForCausalLM"), ("sglang", "DeepseekV4ForCausalLM has routed experts")):
        p = tpshard_cli("export", out, "--format", fmt, "-o", tmp_path / f"exp-{fmt}")
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / f"exp-{fmt}").exists()


def test_missing_compressor_is_refused(v4, copy_of):
    """A ratio-128 layer without its compressor's ape is incomplete (compress_ratios says it has one)."""
    model = copy_of(v4)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    del index["weight_map"]["layers.2.attn.compressor.ape"]
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    p = tpshard_cli("plan", model, "--tp", "2")
    assert p.returncode == 2 and "layers.2.attn.compressor.ape" in p.stderr, p.stderr


# ---- layouts broken on purpose: check --source must see each -------------------------------------


def split_with(model: Path, out: Path, topo: Topology, monkeypatch, **changes) -> None:
    """Split with V4's Arch changed (a plan that gets one placement wrong); the real one back after."""
    good = arch.ARCHITECTURES[V4]
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, V4, dataclasses.replace(good, **changes))
        tpshard.split(model, out, topo)


def rules_with(change) -> tuple:
    return tuple(change(r) or r for r in arch.ARCHITECTURES[V4].rules)


def test_embedding_over_attn_tp_under_dp_is_caught(v4, tmp_path, monkeypatch):
    """V3's layout (the embedding over attn_tp under attention DP) is not V4's (whole)."""
    out = tmp_path / "out"
    split_with(v4, out, Topology(tp=4, attn_dp=2, ep=2), monkeypatch, embed_group="attn_tp")
    found = problems(out, v4)
    assert any("[rules]" in p and "embed.weight" in p for p in found), found[:4]


def test_wo_a_cut_on_its_input_dim_is_caught(v4, tmp_path, monkeypatch):
    out = tmp_path / "out"
    wrong = rules_with(lambda r: r._replace(layer_class="RowParallelLinear") if r.module.endswith("wo_a") else None)
    split_with(v4, out, Topology(tp=2), monkeypatch, rules=wrong)
    found = problems(out, v4)
    assert any("[rules]" in p and "attn.wo_a.weight" in p for p in found), found[:4]


def test_shared_expert_over_the_moe_group_is_caught(v4, tmp_path, monkeypatch):
    out = tmp_path / "out"
    wrong = rules_with(lambda r: r._replace(role="expert") if r.role == "shared_expert" else None)
    split_with(v4, out, Topology(tp=4, ep=2), monkeypatch, rules=wrong)
    found = problems(out, v4)
    assert any("[rules]" in p and "ffn.shared_experts." in p and "(rules: 'tp')" in p for p in found), found[:4]


@pytest.fixture(scope="module")
def v4_tp4_ep2(v4, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v4_tp4_ep2") / "out"
    tpshard.split(v4, out, Topology(tp=4, ep=2))
    return out


def test_sinks_cut_like_heads_is_caught(v4, v4_tp4_ep2, copy_of):
    """Rank 1 holds its attn_tp slice of the sinks (tiled to the whole [heads]), as gpt-oss cuts them."""
    out = copy_of(v4_tp4_ep2)
    name = "layers.1.attn.attn_sink"
    whole = tpshard.open_rank(out, 1)[name]
    overwrite_tensor(out, 1, name, whole[2:4].repeat(4).clone())
    found = only_the_source_tells(out, v4)
    assert any(name in p for p in found), found[:4]


def test_tid2eid_rewritten_to_local_ids_is_caught(v4, v4_tp4_ep2, copy_of):
    """EP slot 1 (ranks 2, 3) with tid2eid turned into its local expert ids (global id - 4)."""
    out = copy_of(v4_tp4_ep2)
    name = "layers.0.ffn.gate.tid2eid"
    ids = tpshard.open_rank(out, 2)[name]
    overwrite_tensor(out, 2, name, (ids % (E // 2)).clone())
    found = only_the_source_tells(out, v4)
    assert any(name in p for p in found), found[:4]


def test_reshard_tp2_to_tp8_dp2_ep8(v4, tmp_path):
    tp2 = tmp_path / "tp2"
    tpshard.split(v4, tp2, Topology(tp=2))
    topo = Topology(tp=8, attn_dp=2, ep=8)
    reshard(tp2, tmp_path / "tp8", topo)
    assert tpshard.check(tmp_path / "tp8", v4).ok
    assert_engine_layout(v4, tmp_path / "tp8", topo)


# ---- verify at layer level ------------------------------------------------------------------------


@pytest.mark.slow
def test_verify_layers_and_a_broken_output(v4, v4_tp4_ep2, copy_of):
    """Every computed layer kind of V4 (column wq_b / wo_a, row wo_b, replicated wq_a / wkv /
    compressors / indexer / e_proj, vocab, experts, the shared expert) on every rank against the
    source; rank 0 holding rank 1's wq_b and another slot's expert fails those layers only.
    `verify --model` with the default 16 tokens is refused (the compressors would be idle;
    tests/test_deepseek_v4_model.py runs it with enough)."""
    bad = copy_of(v4_tp4_ep2)
    name = "layers.1.attn.wq_b.weight"
    take_from_rank(bad, 0, name, 1)
    name = "layers.2.ffn.experts.1.w2.weight"
    take_from_rank(bad, 0, name, 1)
    rewrite_checksums(bad)
    good, broken = verify_many([v4_tp4_ep2, bad], [v4] * 2)
    assert good.ok, good.failures()
    layers = {x.layer for x in good.layers}
    assert {"model.layers.1.self_attn.wo_a", "model.layers.1.self_attn.indexer.compressor.wkv_gate", "model.mtp.0.e_proj",
            "model.layers.2.mlp.experts", "model.layers.3.mlp.shared_experts.gate_up_proj", "model.embed_tokens"} <= layers  # fmt: skip
    failing = {x.layer for x in broken.layers if not x.ok}
    assert failing == {"model.layers.1.self_attn.wq_b", "model.layers.2.mlp.experts"}, broken.failures()
    p = tpshard_cli("verify", v4_tp4_ep2, "--source", v4, "--model")
    assert p.returncode == 2 and "--tokens 16 leaves" in p.stderr and "Traceback" not in p.stderr, p.stderr


@pytest.mark.parametrize("stray", ["layers.1.attn.foo", "layers.1.hc_attn_extra", "hc_head_bias", "layers.2.ffn.gate.e_score"])
def test_a_stray_parameter_is_refused(v4, copy_of, stray):
    """The rules match module paths: a tensor of a known module under a name V4 does not have is
    not understood, so not replicated."""
    from safetensors.torch import save_file

    model = copy_of(v4)
    save_file({stray: torch.zeros(4)}, str(model / "extra.safetensors"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"][stray] = "extra.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    p = tpshard_cli("plan", model, "--tp", "2")
    assert p.returncode == 2 and f"no DeepseekV4ForCausalLM rule covers {stray}" in p.stderr, p.stderr


@pytest.mark.parametrize(
    "stray, message",
    [("layers.4.attn_norm.weight", "layer 4, but config.json has 4 layers"), ("mtp.1.enorm.weight", "MTP layer 1, but config.json has 1 MTP layer(s)")],
    ids=["layer-past-the-last", "second-mtp"],
)
def test_a_layer_config_json_has_no_place_for_is_refused(v4, copy_of, stray, message):
    """V4 keeps its MTP layer apart (mtp.0): layers.N stops at num_hidden_layers, mtp.K at num_nextn_predict_layers."""
    from safetensors.torch import save_file

    model = copy_of(v4)
    save_file({stray: torch.ones(64, dtype=torch.bfloat16)}, str(model / "extra.safetensors"))
    index = json.loads((model / "model.safetensors.index.json").read_text())
    index["weight_map"][stray] = "extra.safetensors"
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    p = tpshard_cli("plan", model, "--tp", "2")
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_the_native_names_are_what_transformers_reads(v4):
    """transformers' from_pretrained maps the release's names onto its own (conversion_mapping.py
    "deepseek_v4"): every parameter of its model is the checkpoint's tensor under tests/v4_checkpoint's
    native name, so the test checkpoint is in the release's spelling, not one made up here."""
    from transformers import DeepseekV4ForCausalLM
    from v4_checkpoint import native_name

    model = DeepseekV4ForCausalLM.from_pretrained(v4, dtype=torch.float32)
    full = source_tensors(v4)
    for k, v in model.state_dict().items():
        n = native_name(k)
        if n.endswith(".experts.gate_up_proj"):  # [E, 2I, H]: experts.e.w1 rows, then w3
            want = torch.stack([torch.cat([full[n.replace("gate_up_proj", f"{e}.{w}.weight")] for w in ("w1", "w3")]) for e in range(E)])
        elif n.endswith(".experts.down_proj"):
            want = torch.stack([full[n.replace("down_proj", f"{e}.w2.weight")] for e in range(E)])
        else:
            want = full[n]
        assert torch.equal(v.to(want.dtype), want), (k, n)


def test_explain_walks_one_layer_of_native_names(v4):
    """explain --layer reads V4's layers.N (and mtp.0 as layer num_hidden_layers), not model.layers.N only."""
    p = tpshard_cli("explain", v4, "--tp", "2", "--layer", "1", "--json")
    assert p.returncode == 0, p.stderr
    names = {r["tensor"] for r in json.loads(p.stdout)}
    assert "layers.1.attn.wo_a.weight" in names and "layers.1.attn.indexer.wq_b.weight" in names
    assert not [n for n in names if n.startswith(("layers.0.", "layers.2.", "mtp.")) or n == "norm.weight"], sorted(names)[:5]
    p = tpshard_cli("explain", v4, "--tp", "2", "--layer", "4", "--json")
    names = {r["tensor"] for r in json.loads(p.stdout)}
    assert "mtp.0.e_proj.weight" in names and not [n for n in names if n.startswith("layers.")], sorted(names)[:5]
