"""`verify --model` on quantized outputs (issue 24, "Tests and proof": dequantized).

Compared with what: every rank runs the TP decoder on its own quantized shards, dequantized per
rank by tpshard's dequantizer; rank 0 runs transformers' forward in float32 on the *source*
dequantized by other projects' code (tpshard/verify/source_dequant.py: compressed-tensors'
compressors, transformers' Fp8Dequantize and convert_moe_packed_tensors). The checkpoints are the
ones the quantized-layer tests build: tiny Llamas packed by tpshard's packers (tests/quant_fixtures.py,
cross-checked against compressed-tensors in tests/test_quant_packing.py) and MoE checkpoints saved by
transformers whose experts compressed-tensors' own compressors packed (tests/quant_moe.py).

Broken on purpose, checksums rewritten (only the source can tell): another rank's FP8 block scales,
a flipped byte of INT4 codes on one rank, an expert's packed weight swapped with another expert's.
Each fails --model (the logits), not only its layer. Formats --model has no independent dequantizer
for (GPTQ, AWQ, ...) are refused in one line naming the format.

Default: one launch per world size (tp 2: dense FP8 block and W4A16 with two breakages; tp 4 ep 2:
Qwen3-MoE W4A16 experts and a swap); the other formats and families are slow.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from broken import overwrite_tensor, rewrite_checksums
from quant_fixtures import DEFAULT_SPECS, TINY, TinyLlama, write_quant_checkpoint

import tpshard
from tpshard.errors import TpshardError
from tpshard.manifest import read_manifest
from tpshard.topology import Topology
from tpshard.verify import verify_many

pytest.importorskip("compressed_tensors", reason="the reference dequantizes compressed-tensors checkpoints with compressed-tensors")

FP8_LLAMA = TinyLlama(head_dim=128)  # q 512, kv 256, intermediate 512: whole 128-blocks at tp 2
DOWN = "model.layers.{i}.mlp.down_proj.{s}"
EXPERT = "model.layers.1.mlp.experts.{e}.{p}_proj.weight_packed"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> a quantized source checkpoint, each built once."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name in made:
            return made[name]
        path = tmp_path_factory.mktemp(name) / "model"
        if name in DEFAULT_SPECS:  # a dense Llama, every projection in the format
            write_quant_checkpoint(path, DEFAULT_SPECS[name], shape=FP8_LLAMA if "fp8_block" in name else TINY)
        else:  # family-scheme: experts (or, with "-all", every linear) packed by compressed-tensors
            from quant_moe import quantize_linears

            family, scheme, *every = name.split("-")
            if family == "kimi":  # DeepSeek-V3's architecture with Kimi-K2's INT4 experts
                from moe_configs import make_moe_checkpoint

                make_moe_checkpoint(path, "deepseek_v3", moe_intermediate_size=128, max_shard_size="200KB")
            else:  # the sizes of tests/test_quant_experts.py: whole groups / 128-blocks per MoE-TP rank
                from checkpoints import make_checkpoint

                sizes = dict(moe_intermediate_size=128)
                if scheme == "fp8_block":
                    sizes = dict(hidden_size=128, moe_intermediate_size=256, intermediate_size=256, head_dim=16)
                if family == "mixtral":  # its experts are intermediate_size wide
                    sizes = {"intermediate_size": sizes["moe_intermediate_size"]}
                make_checkpoint(path, family, max_shard_size="200KB", **sizes)
            quantize_linears(path, scheme, experts_only=not every)
        made[name] = path
        return path

    return get


def split(src: Path, out: Path, topo: Topology) -> Path:
    tpshard.split(src, out, topo)
    return out


def copy(good: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    return dst


def assert_model_passes(report, name: str) -> None:
    assert report.ok, (name, report.failures())
    m = report.model
    assert m is not None and m.ok and m.top1 == 1.0 and m.max_rel < 1e-5, (name, m)
    plan = read_manifest(report.out_dir).plan  # a quantized output was run, not a dense copy
    assert plan.quant_layers or plan.model.expert_block, name


def assert_model_fails(report, name: str) -> None:
    assert not report.ok, name
    m = report.model
    assert m is not None and not m.ok and m.max_rel > 1e-3, (name, m)  # the logits, not only a layer


def test_dense_tp2_pass_and_broken_fail(sources, tmp_path):
    """FP8 block and compressed-tensors W4A16 Llamas at tp 2 pass --model; rank 1's FP8 down_proj scales
    replaced by rank 0's, and one flipped byte of rank 1's W4A16 codes, fail it."""
    fp8, w4 = sources("fp8_block"), sources("ct_w4a16")
    good_fp8 = split(fp8, tmp_path / "fp8", Topology(tp=2))
    good_w4 = split(w4, tmp_path / "w4", Topology(tp=2))
    other_scales = copy(good_fp8, tmp_path / "other_scales")
    name = DOWN.format(i=0, s="weight_scale_inv")  # K-cut: rank 1 holds the other half's scale columns
    overwrite_tensor(other_scales, 1, name, tpshard.open_rank(other_scales, 0)[name].clone())
    rewrite_checksums(other_scales)
    flipped = copy(good_w4, tmp_path / "flipped")
    name = DOWN.format(i=0, s="weight_packed")
    codes = tpshard.open_rank(flipped, 1)[name].clone()
    codes.view(torch.uint8).view(-1)[7] ^= 0xFF  # one byte: two int4 codes of one weight row
    overwrite_tensor(flipped, 1, name, codes)
    rewrite_checksums(flipped)
    reports = verify_many([good_fp8, good_w4, other_scales, flipped], [fp8, w4, fp8, w4], model=True)
    assert_model_passes(reports[0], "fp8_block")
    assert_model_passes(reports[1], "ct_w4a16")
    for r, what in zip(reports[2:], ("other rank's scales", "flipped code byte")):
        assert_model_fails(r, what)
        assert [x.layer for x in r.layers if not x.ok] == ["model.layers.0.mlp.down_proj"], (what, r.failures())


def test_moe_experts_tp4_ep2_pass_and_swapped_expert_fails(sources, tmp_path):
    """Qwen3-MoE with Kimi-K2-style INT4 experts (pack-quantized group 32) at tp 4 ep 2 passes --model;
    on rank 0 (EP slot 0), expert 1's and expert 2's gate_proj codes exchanged fails it."""
    src = sources("qwen3_moe-w4a16_g32")
    good = split(src, tmp_path / "good", Topology(tp=4, ep=2))
    swapped = copy(good, tmp_path / "swapped")
    a, b = EXPERT.format(e=1, p="gate"), EXPERT.format(e=2, p="gate")
    held = tpshard.open_rank(swapped, 0)
    ta, tb = held[a].clone(), held[b].clone()
    overwrite_tensor(swapped, 0, a, tb)
    overwrite_tensor(swapped, 0, b, ta)
    rewrite_checksums(swapped)
    good_r, bad_r = verify_many([good, swapped], [src, src], model=True)
    assert_model_passes(good_r, "qwen3_moe w4a16")
    assert_model_fails(bad_r, "swapped experts")
    assert [x.layer for x in bad_r.layers if not x.ok] == ["model.layers.1.mlp.experts"], bad_r.failures()


def test_formats_without_an_independent_dequantizer_are_refused(sources, tmp_path):
    """GPTQ and AWQ: no dequantizer but tpshard's own is at hand, so --model refuses, naming the format
    (before any rank starts); compressed-tensors act order ("group"), which compressed-tensors 0.20.1
    no longer reads, likewise."""
    for name, what in (("gptq", "gptq"), ("awq", "awq"), ("ct_w4a16_asym_actorder", "actorder")):
        out = split(sources(name), tmp_path / name, Topology(tp=2))
        with pytest.raises(TpshardError, match=f"--model: model-level verify .*{what}") as e:
            verify_many([out], [sources(name)], model=True)
        assert len(str(e.value).splitlines()) == 1, str(e.value)


@pytest.mark.slow
def test_cli_exit_codes(sources, tmp_path):
    """The CLI: exit 0 on a good W4A16 output with --model, 1 on the same with one rank's scales from
    another rank, 2 (one line) on GPTQ."""
    src = sources("ct_w4a16")
    good = split(src, tmp_path / "good", Topology(tp=2))
    bad = copy(good, tmp_path / "bad")
    name = "model.layers.1.mlp.gate_proj.weight_scale"  # N-cut: rank 0's rows' scales on rank 1
    overwrite_tensor(bad, 1, name, tpshard.open_rank(bad, 0)[name].clone())
    rewrite_checksums(bad)
    gptq = split(sources("gptq"), tmp_path / "gptq", Topology(tp=2))
    for out, source, code in ((good, src, 0), (bad, src, 1), (gptq, sources("gptq"), 2)):
        p = subprocess.run(
            [sys.executable, "-m", "tpshard", "verify", str(out), "--source", str(source), "--model"],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert p.returncode == code and "Traceback" not in p.stderr, (out.name, p.returncode, p.stderr[-2000:])
        if code == 1:
            assert any(line.startswith("FAIL model (") for line in p.stdout.splitlines()), p.stdout
        if code == 2:
            assert len(p.stderr.strip().splitlines()) == 1 and "gptq" in p.stderr, p.stderr


SLOW_DENSE = ("ct_nvfp4", "ct_w8a8_int8", "ct_w8a8_int8_static", "ct_fp8", "ct_fp8_block", "ct_w8a16_channel", "ct_w3a16")


@pytest.mark.slow
def test_other_dense_formats_tp2(sources, tmp_path):
    """Every other compressed-tensors format at tp 2 (static activation scales included: --model runs
    the weights; layer level checks the scales)."""
    outs = [split(sources(n), tmp_path / n, Topology(tp=2)) for n in SLOW_DENSE]
    for name, r in zip(SLOW_DENSE, verify_many(outs, [sources(n) for n in SLOW_DENSE], model=True)):
        assert_model_passes(r, name)


@pytest.mark.slow
def test_moe_families_and_formats(sources, tmp_path):
    """tp 4: Kimi-K2-style INT4 experts in DeepSeek-V3 (ep 4, attention DP 2), NVFP4 and W8A8 int8
    Qwen3-MoE experts (ep 2), every linear W8A8 in Qwen2-MoE (ep 2); tp 2 ep 2: DeepSeek-V3 FP8 block
    as it ships (every linear but the router), GLM-4.5 FP8 block experts, Mixtral NVFP4 experts,
    gpt-oss MXFP4."""
    from gpt_oss_fixtures import make_gpt_oss, make_gpt_oss_mxfp4
    from moe_configs import make_fp8_deepseek

    four = {
        "kimi-w4a16_g32": Topology(tp=4, ep=4, attn_dp=2), "qwen3_moe-nvfp4": Topology(tp=4, ep=2),
        "qwen3_moe-w8a8_int8": Topology(tp=4, ep=2), "qwen2_moe-w8a8_int8-all": Topology(tp=4, ep=2),
    }  # fmt: skip
    outs = [split(sources(n), tmp_path / n, t) for n, t in four.items()]
    for name, r in zip(four, verify_many(outs, [sources(n) for n in four], model=True)):
        assert_model_passes(r, name)
    fp8 = make_fp8_deepseek(tmp_path / "deepseek_fp8")
    mxfp4 = make_gpt_oss_mxfp4(tmp_path / "gpt_oss_mxfp4", make_gpt_oss(tmp_path / "gpt_oss"))
    two = {"deepseek_v3 fp8_block": fp8, "gpt_oss mxfp4": mxfp4, "glm4_moe-fp8_block": None, "mixtral-nvfp4": None}
    two = {name: src or sources(name) for name, src in two.items()}
    outs = [split(src, tmp_path / f"{i}-out", Topology(tp=2, ep=2)) for i, src in enumerate(two.values())]
    for name, r in zip(two, verify_many(outs, list(two.values()), model=True)):
        assert_model_passes(r, name)


def test_fp8_block_reference_keeps_the_checkpoint_block():
    """A weight that is not whole 128-blocks (DeepSeek-V3's kv_a_proj_with_mqa: N 576): transformers'
    Fp8Dequantize alone reads the block off the grid (192 rows over 2 scale rows: 96-row blocks); the
    reference pads to whole blocks first, so row 100 takes the first block's scale, row 130 the second's."""
    from tpshard.verify.source_dequant import fp8_dequantize

    weight = torch.ones(192, 128).to(torch.float8_e4m3fn)
    scale = torch.tensor([[2.0], [3.0]])
    w = fp8_dequantize(weight, scale, (128, 128))
    assert w.shape == (192, 128) and w.dtype == torch.float32
    assert w[100, 0] == 2.0 and w[130, 0] == 3.0 and w[127].eq(2.0).all() and w[128:].eq(3.0).all()
    with pytest.raises(ValueError, match="not one per 128x128 block"):
        fp8_dequantize(weight, torch.ones(1, 1), (128, 128))


def test_reference_never_runs_with_a_weight_transformers_did_not_load(sources, monkeypatch):
    """A dequantized weight missing from the state dict would leave transformers' random init in the
    reference: the reference refuses to exist instead, naming the weight."""
    import tpshard.verify.source_dequant as source_dequant

    full = source_dequant.dense_state_dict

    def lacking(ckpt, read):
        state = full(ckpt, read)
        del state["model.layers.0.mlp.down_proj.weight"]
        return state

    monkeypatch.setattr(source_dequant, "dense_state_dict", lacking)
    with pytest.raises(TpshardError, match="did not load 1 dequantized weights, first model.layers.0.mlp.down_proj.weight"):
        source_dequant.dense_model(str(sources("ct_w4a16")), dtype=torch.float32)
