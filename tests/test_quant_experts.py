"""Quantized routed experts in every MoE family (issue 24 item 3): plan / split / check / verify.

What is compared with what:
- experts packed by compressed-tensors' own compressors (tests/quant_moe.py: Kimi-K2's INT4
  pack-quantized group 32, W8A8 int8, NVFP4) or DeepSeek's FP8 block layout, in Qwen3-MoE,
  Qwen2-MoE, Mixtral, DeepSeek-V3 (Kimi-K2's architecture) and GLM-4.5 checkpoints saved by
  transformers; split at tp 2 / 4 / 8 with EP; `check --source` passes; on every rank,
  `dequantize(the rank's tensors)` equals the rank's logical slice of compressed-tensors'
  `decompress` of the source expert, bit-exact, and each expert sits only on its EP slot's ranks;
- refusals in one line: a group cut at a moe_tp rank, int-quantized with asymmetric weights,
  auto-round packing formats SGLang does not read;
- auto-round (GPTQ and AWQ packing formats) dense and experts, resolved per module;
- layer-level verify (one launch): good outputs pass; a scale of another expert, experts dealt
  round-robin and a packed weight of another MoE-TP rank are caught.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint
from quant_moe import quantize_linears
from test_quant_split import assert_rank_dequant

import tpshard
from tpshard.check import check
from tpshard.errors import PlanError
from tpshard.manifest import read_manifest
from tpshard.plan import make_plan
from tpshard.checkpoint import open_checkpoint
from tpshard.quant.config import read_quant_config
from tpshard.quant.formats import QuantSpec
from tpshard.topology import Topology

pytest.importorskip("compressed_tensors", reason="the fixtures pack experts with compressed-tensors' own compressors")

# Expert intermediate 128: moe_tp 4 leaves 32 per rank (one group of 32; NVFP4's 16 twice).
SIZES = dict(moe_intermediate_size=128)
FP8_SIZES = dict(hidden_size=128, moe_intermediate_size=256, intermediate_size=256, head_dim=16)  # 128-blocks at moe_tp 2
TOPOLOGIES = {"tp2": Topology(tp=2), "tp4-ep2": Topology(tp=4, ep=2), "tp8-ep2": Topology(tp=8, ep=2),
              "tp4-ep4-dp2": Topology(tp=4, ep=4, attn_dp=2), "tp4": Topology(tp=4), "tp2-ep2": Topology(tp=2, ep=2)}  # fmt: skip
SPECS = {
    "w4a16_g32": QuantSpec(format="ct_int", bits=4, group_size=32),
    "w4a16_g32_actorder": QuantSpec(format="ct_int", bits=4, group_size=32, desc_act=True),
    "w8a8_int8": QuantSpec(format="ct_int8_channel", bits=8),
    "nvfp4": QuantSpec(format="ct_nvfp4", bits=4, group_size=16, static_input=True),
    "fp8_block": QuantSpec(format="fp8_block", bits=8),
}
CASES = [  # default: one per family, every format, EP and attention DP
    ("qwen3_moe", "w4a16_g32", "tp4-ep2"), ("deepseek_v3", "w4a16_g32", "tp4-ep4-dp2"), ("mixtral", "w4a16_g32", "tp4-ep2"),
    ("glm4_moe", "fp8_block", "tp2-ep2"), ("qwen3_moe", "nvfp4", "tp8-ep2"), ("qwen3_moe", "w4a16_g32_actorder", "tp4-ep2"),
]  # fmt: skip
SLOW = [
    ("qwen3_moe", "w4a16_g32", "tp2"), ("qwen3_moe", "w4a16_g32", "tp8-ep2"), ("qwen2_moe", "w4a16_g32", "tp4"),
    ("glm4_moe", "w4a16_g32", "tp4-ep2"), ("deepseek_v3", "nvfp4", "tp4-ep2"), ("qwen3_moe", "w8a8_int8", "tp4-ep2"),
    ("qwen3_moe", "fp8_block", "tp2"), ("qwen3_moe", "nvfp4", "tp2"), ("qwen3_moe", "nvfp4", "tp4-ep2"),
    ("qwen3_moe", "w8a8_int8", "tp2"), ("qwen3_moe", "w8a8_int8", "tp8-ep2"), ("mixtral", "nvfp4", "tp4"),
    ("glm4_moe", "nvfp4", "tp4-ep4-dp2"), ("deepseek_v3", "w8a8_int8", "tp8-ep2"), ("qwen2_moe", "nvfp4", "tp2"),
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[tuple, tuple[Path, dict]] = {}

    def get(family: str, scheme: str, experts_only: bool = True):
        key = (family, scheme, experts_only)
        if key not in made:
            path = tmp_path_factory.mktemp(f"{family}-{scheme}") / "model"
            sizes = FP8_SIZES if scheme == "fp8_block" else SIZES
            if family == "mixtral":  # its experts are intermediate_size wide (no dense MLP)
                sizes = {"intermediate_size": sizes["moe_intermediate_size"]}
            make_checkpoint(path, family, max_shard_size="200KB", **sizes)
            made[key] = (path, quantize_linears(path, scheme, experts_only=experts_only))
        return made[key]

    return get


def assert_experts_on_their_slots(out: Path) -> None:
    """Every routed expert's tensors sit exactly on the ranks of EP slot expert // (E / ep)."""
    m = read_manifest(out)
    topo, experts = m.plan.topology, m.plan.model.num_experts
    for s in m.plan.shards:
        if s.expert is not None and s.layer_class == "FusedMoE":
            slot = s.expert // (experts // topo.ep)
            assert s.ep_slot == slot, (s.name, s.ep_slot, slot)
            assert all(topo.ep_rank(r) == slot for r in s.ranks), (s.name, s.ranks)


@pytest.mark.parametrize(
    "family,scheme,topo",
    [pytest.param(*c, id="-".join(c)) for c in CASES] + [pytest.param(*c, id="-".join(c), marks=pytest.mark.slow) for c in SLOW],
)
def test_quantized_experts_split_check_dequant(models, tmp_path, family, scheme, topo):
    src, expected = models(family, scheme)
    out = tmp_path / "out"
    manifest = tpshard.split(src, out, TOPOLOGIES[topo])
    report = check(out, src)
    assert report.ok, report.problems
    quant = {s.name.rpartition(".")[0] for s in manifest.plan.shards if s.quant}
    assert quant == set(expected), sorted(set(expected) ^ quant)[:4]  # every expert (and nothing else) quantized
    assert_rank_dequant(out, SPECS[scheme], expected)
    assert_experts_on_their_slots(out)
    if scheme.endswith("actorder"):  # SGLang's load_full_w2: down's scales whole on every moe_tp rank, g_idx sliced
        down = {s.name.rpartition(".")[2]: s for s in manifest.plan.shards if s.name.startswith("model.layers.0.mlp.experts.0.down_proj.")}
        assert down["weight_scale"].dim is None and down["weight_g_idx"].dim == 0, down


def test_w8a8_int8_dense_and_experts(models, tmp_path):
    """int-quantized on every linear (attention, dense and shared MLPs, experts): each rank dequantizes
    to its slice of compressed-tensors' own decompress."""
    src, expected = models("qwen2_moe", "w8a8_int8", experts_only=False)
    assert any(".self_attn.q_proj" in m for m in expected) and any("shared_expert." in m for m in expected)
    out = tmp_path / "out"
    tpshard.split(src, out, Topology(tp=4, ep=2))
    assert check(out, src).ok
    assert_rank_dequant(out, SPECS["w8a8_int8"], expected)


def _refusal(src: Path, *args: str) -> str:
    p = subprocess.run([sys.executable, "-m", "tpshard", "plan", str(src), *args], capture_output=True, text=True)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    return p.stderr


def test_group_cut_at_a_moe_tp_rank_is_refused_in_one_line(models, tmp_path):
    src, _ = models("qwen3_moe", "w4a16_g32")
    err = _refusal(src, "--tp", "8")  # moe_tp 8: 16 of the expert intermediate 128 per rank, group 32
    assert "model.layers.0.mlp.experts.0.down_proj.weight_scale: K 128 over moe_tp of 8 gives 16 per rank" in err
    assert "quantization group of 32" in err and "choose --ep" in err
    assert len([line for line in err.splitlines() if "breaks the" in line]) == 1  # experts and layers folded


def _write_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_int_quantized_asymmetric_is_refused(models, tmp_path):
    src, _ = models("qwen3_moe", "w8a8_int8")
    config = json.loads((src / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["weights"]["symmetric"] = False
    err = _refusal(_write_config(src, tmp_path / "m", config), "--tp", "2")
    assert "int-quantized with asymmetric 8-bit int weights" in err and err.count("\n") == 1


@pytest.mark.parametrize("packing", ["auto_round", "auto_round:gptqmodel", "auto_round:llm_compressor"])
def test_auto_round_formats_sglang_does_not_read_are_refused(tmp_path, packing):
    from tpshard.errors import CheckpointError

    config = {"quantization_config": {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": True, "packing_format": packing}}
    with pytest.raises(CheckpointError, match=rf"packing_format '{packing}': tpshard \(as SGLang\) reads auto_round:auto_awq, auto_round:auto_gptq"):
        read_quant_config(tmp_path, config)


def test_auto_round_resolves_per_module(tmp_path):
    raw = {"quant_method": "auto-round", "bits": 4, "group_size": 128, "sym": False, "packing_format": "auto_round:auto_gptq",
           "block_name_to_quantize": "model.layers", "extra_config": {
               "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 32}, "model.layers.1.self_attn.o_proj": {"bits": 16},
               r".*\.experts\.\d+\.up_proj": {"group_size": 64}}}  # fmt: skip
    q = read_quant_config(tmp_path, {"quantization_config": raw})
    assert q.spec_for("model.layers.0.mlp.down_proj", True) == QuantSpec(format="gptq", bits=8, group_size=32, sym=False)
    assert q.spec_for("model.layers.1.self_attn.o_proj", True) is None
    assert q.spec_for("model.layers.1.mlp.experts.3.up_proj", True) == QuantSpec(format="gptq", bits=4, group_size=64, sym=False)
    assert q.spec_for("model.layers.1.mlp.experts.3.gate_proj", True) == QuantSpec(format="gptq", bits=4, group_size=128, sym=False)
    assert q.spec_for("lm_head", True) is None and q.spec_for("model.mtp.proj", True) is None
    awq = read_quant_config(tmp_path, {"quantization_config": {**raw, "packing_format": "auto_round:auto_awq", "extra_config": {}}})
    assert awq.spec_for("model.layers.0.mlp.down_proj", True) == QuantSpec(format="awq", bits=4, group_size=128, sym=False)


@pytest.mark.parametrize("packing,fmt", [("auto_round:auto_gptq", "gptq"), pytest.param("auto_round:auto_awq", "awq", marks=pytest.mark.slow)])
def test_auto_round_dense_and_experts_split(tmp_path, packing, fmt):
    """auto-round checkpoints in GPTQ and AWQ layout (dense Llama and Qwen3-MoE experts) split, check
    and dequantize per rank like the GPTQ / AWQ checkpoints they are laid out as."""
    from quant_fixtures import TINY, write_quant_checkpoint

    spec = QuantSpec(format=fmt, bits=4, group_size=32, sym=fmt == "gptq")
    auto_round = {"quant_method": "auto-round", "bits": 4, "group_size": 32, "sym": spec.sym, "data_type": "int",
                  "packing_format": packing, "autoround_version": "0.7.0"}  # fmt: skip
    dense = tmp_path / "dense"
    expected = write_quant_checkpoint(dense, spec, shape=TINY)
    config = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**config, "quantization_config": auto_round}))
    out = tmp_path / "dense-out"
    tpshard.split(dense, out, Topology(tp=4))
    assert check(out, dense).ok
    assert_rank_dequant(out, spec, expected)
    moe = tmp_path / "moe"
    make_checkpoint(moe, "qwen3_moe", **SIZES)
    expected = quantize_linears(moe, fmt, experts_only=False)
    config = json.loads((moe / "config.json").read_text())
    (moe / "config.json").write_text(json.dumps({**config, "quantization_config": auto_round}))
    out = tmp_path / "moe-out"
    tpshard.split(moe, out, Topology(tp=4, ep=2))
    assert check(out, moe).ok
    assert_rank_dequant(out, spec, expected)


def test_plan_counts_quantized_experts_present_and_missing(models, tmp_path):
    """An expert stored as weight_packed counts as present; one whose weight_packed is missing is named."""
    src, _ = models("qwen3_moe", "w4a16_g32")
    make_plan(open_checkpoint(src), Topology(tp=2))  # today: "24 of 24 routed expert weights are missing"
    broken = tmp_path / "m"
    subprocess.run(["cp", "-a", str(src), str(broken)], check=True)
    from safetensors.torch import load_file, save_file

    index = json.loads((broken / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.experts.5.up_proj.weight_packed"
    f = index["weight_map"].pop(name)
    tensors = load_file(broken / f)
    del tensors[name]
    save_file(tensors, broken / f, metadata={"format": "pt"})
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError, match=r"model.layers.1: 1 of 24 routed expert weights are missing .*first: expert 5 w3"):
        make_plan(open_checkpoint(broken), Topology(tp=2))


@pytest.mark.slow
def test_layer_level_verify_and_broken_experts(models, tmp_path):
    """verify (layer level, one launch) dequantizes every rank's experts against the dequantized source:
    INT4 pack-quantized (Qwen3-MoE), NVFP4 (DeepSeek-V3) and W8A8 int8 (Qwen2-MoE, every linear) pass
    at tp 4 / ep 2; an expert holding another expert's scales, experts dealt round-robin to EP slots
    and a packed weight of the other MoE-TP rank are caught, by name."""
    from broken import overwrite_tensor, rewrite_checksums
    from test_verify_moe import copy, round_robin_split

    from tpshard.verify import verify_many

    topo = Topology(tp=4, ep=2)  # moe_tp 2: EP slot 0 (experts 0-3) = ranks 0, 1
    int4, _ = models("qwen3_moe", "w4a16_g32")
    sources = [int4, models("deepseek_v3", "nvfp4")[0], models("qwen2_moe", "w8a8_int8", experts_only=False)[0], int4, int4, int4]
    outs = [tmp_path / n for n in ("int4", "nvfp4", "int8", "other_scale", "round_robin", "other_rank")]
    for src, out in zip(sources[:3], outs[:3]):
        tpshard.split(src, out, topo)
    expert = "model.layers.1.mlp.experts.{e}.{p}_proj.{s}"
    copy(outs[0], outs[3])
    for p in ("gate", "up", "down"):  # rank 0's expert 1 holds expert 0's scales (its codes are its own)
        name = expert.format(e=0, p=p, s="weight_scale")
        overwrite_tensor(outs[3], 0, expert.format(e=1, p=p, s="weight_scale"), tpshard.open_rank(outs[3], 0)[name].clone())
    rewrite_checksums(outs[3])
    round_robin_split(int4, outs[4], topo)
    copy(outs[0], outs[5])
    name = expert.format(e=2, p="down", s="weight_packed")  # K-cut over moe_tp: rank 1 holds the other half
    overwrite_tensor(outs[5], 0, name, tpshard.open_rank(outs[5], 1)[name].clone())
    rewrite_checksums(outs[5])
    reports = verify_many(outs, sources)
    for out, r, scheme in zip(outs[:3], reports[:3], ("w4a16_g32", "nvfp4", "w8a8_int8")):
        assert r.ok, (out.name, r.failures())
        assert {x.quant for x in r.layers if x.layer_class == "FusedMoE"} == {SPECS[scheme].format}, out.name
    failed = {out.name: {x.layer: "; ".join(x.problems) for x in r.layers if not x.ok} for out, r in zip(outs[3:], reports[3:])}
    assert list(failed["other_scale"]) == ["model.layers.1.mlp.experts"], failed["other_scale"]
    assert "expert 1 (EP slot 0/2, MoE-TP rank 0/2) differs" in failed["other_scale"]["model.layers.1.mlp.experts"]
    assert set(failed["round_robin"]) == {f"model.layers.{i}.mlp.experts" for i in range(3)}, failed["round_robin"]
    assert "never loaded experts" in failed["round_robin"]["model.layers.0.mlp.experts"]
    assert list(failed["other_rank"]) == ["model.layers.1.mlp.experts"], failed["other_rank"]
    assert "expert 2 (EP slot 0/2, MoE-TP rank 0/2) differs" in failed["other_rank"]["model.layers.1.mlp.experts"]


def test_experts_sglang_does_not_load_are_a_warning(models):
    """The split of W8A8 int8 experts is exact, but SGLang's int8 MoE scheme is Ascend-only: plan warns."""
    src, _ = models("qwen3_moe", "w8a8_int8")
    assert any(w.startswith("int-quantized (W8A8 int8) experts: SGLang's") for w in make_plan(open_checkpoint(src), Topology(tp=2)).warnings)
    src, _ = models("qwen3_moe", "w4a16_g32")
    assert not any("SGLang's" in w for w in make_plan(open_checkpoint(src), Topology(tp=2)).warnings)
