"""Issue 27: quantized routed experts exported for vLLM 0.33.0's sharded_state loader, in the layout
its FusedMoE quant methods' create_weights build per rank (docs/deploy.md, "Quantized checkpoints").

The checkpoints' experts are packed by compressed-tensors' own compressors (tests/quant_moe.py:
Kimi-K2's W4A16 group 32, W8A8-FP8 channel, NVFP4) or in the GPTQ / AWQ layouts, in Qwen3-MoE,
DeepSeek-V3 and Mixtral checkpoints saved by transformers. The expected expert tensors are built
here from the checkpoint with torch alone and vLLM's per-method table below (which dim is N and
which K, stacked how, per-slot scales, casts, the constants a method adds), not from tpshard's code;
then `check --source` must prove the export and catch it broken on purpose: two ranks swapped,
another expert's scale, gate and up out of order.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_checkpoint

import tpshard
from tpshard.check import check
from tpshard.export import ExportError, split_and_export

sys.path.insert(0, str(Path(__file__).parent))
from test_export_quant import DTYPES, _broken, _bytes, _findings, _replace, _all_source, read_rank, same  # noqa: E402

pytest.importorskip("compressed_tensors", reason="the fixtures pack experts with compressed-tensors' own compressors")

TP = 2
# hidden 128: vLLM builds GPTQ / AWQ experts with its Marlin MoE methods only when hidden % 128 == 0
# (utils/marlin_utils.py check_moe_marlin_supports_config); expert intermediate 256 != hidden, so
# that w13 and w2 differ in every dim.
SIZES = {
    "qwen3_moe": dict(hidden_size=128, moe_intermediate_size=256, head_dim=16),
    "deepseek_v3": dict(hidden_size=128, moe_intermediate_size=256, intermediate_size=256),
    "mixtral": dict(hidden_size=128, intermediate_size=256, head_dim=16),
}
BLOCK = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"), "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
         "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}  # fmt: skip
# GPTQ / AWQ as the tools write them for experts only (attention, shared experts, dense MLPs, routers unquantized)
QUANT_CONFIG = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True, "checkpoint_format": "gptq",
             "lm_head": False, "dynamic": {"-:.*self_attn.*": {}, "-:.*shared_expert.*": {}, "-:.*mlp\\.(gate|up|down)_proj$": {},
                                           "-:.*(mlp|block_sparse_moe)\\.gate$": {}}},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": ["self_attn", "shared_expert", "mlp.gate", "mlp.up_proj", "mlp.down_proj", "block_sparse_moe.gate"]},
}  # fmt: skip

# scheme -> {checkpoint suffix: (vLLM suffix, vLLM dtype or None = the checkpoint's, N dim, K dim)} of one expert
# matrix; N dim None: one value per slot (w13 [E, 2], w2 [E]); K dim None: not cut by down's row split.
# Stacked experts: w13 = [gate; up] along the N dim of each expert, then the experts along a new dim 0.
TABLE = {
    "w4a16_g32": {"weight_packed": ("weight_packed", None, 0, 1), "weight_scale": ("weight_scale", None, 0, 1)},
    "w8a8_fp8": {"weight": ("weight", None, 0, 1), "weight_scale": ("weight_scale", "F32", 0, None)},
    "nvfp4": {"weight_packed": ("weight_packed", None, 0, 1), "weight_scale": ("weight_scale", None, 0, 1),
              "weight_global_scale": ("weight_global_scale", "F32", None, None), "input_global_scale": ("input_global_scale", "F32", None, None)},
    # [K, N]-major (is_transposed): gate and up side by side in every row; the checkpoint's g_idx has no parameter
    "gptq": {"qweight": ("qweight", None, 1, 0), "scales": ("scales", None, 1, 0), "qzeros": ("qzeros", None, 1, 0)},
    "awq": {"qweight": ("qweight", None, 1, 0), "scales": ("scales", None, 1, 0), "qzeros": ("qzeros", None, 1, 0)},
}  # fmt: skip
TORCH = {v: k for k, v in DTYPES.items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def get(family: str, scheme: str) -> Path:
        if (family, scheme) not in made:
            from quant_moe import quantize_linears

            path = tmp_path_factory.mktemp(f"{family}-{scheme}") / "model"
            make_checkpoint(path, family, max_shard_size="300KB", **SIZES[family])
            quantize_linears(path, scheme)
            config = json.loads((path / "config.json").read_text())
            if scheme in QUANT_CONFIG:
                config["quantization_config"] = QUANT_CONFIG[scheme]
            if family == "deepseek_v3":  # vLLM builds e_score_correction_bias for it (models/deepseek_v2.py)
                config["topk_method"] = "noaux_tc"
            (path / "config.json").write_text(json.dumps(config, indent=1))
            made[family, scheme] = path
        return made[family, scheme]

    return get


def rank_slice(t: torch.Tensor, dim: int | None, parts: int, part: int) -> torch.Tensor:
    return t if dim is None or parts == 1 else torch.chunk(t, parts, dim=dim)[part]


def expected_experts(source: dict[str, torch.Tensor], config: dict, family: str, scheme: str, ep: int, rank: int) -> dict[str, torch.Tensor]:
    """vLLM's create_weights state of one rank's routed experts, from the checkpoint and TABLE."""
    experts = config.get("num_experts") or config.get("n_routed_experts") or config["num_local_experts"]
    first = config.get("first_k_dense_replace", 0)
    block, gate, up, down = BLOCK[family]
    moe_tp, local = TP // ep, experts // ep
    ids = range(local * rank, local * (rank + 1)) if ep > 1 else range(experts)
    part = rank % moe_tp
    model_dtype = source["model.embed_tokens.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    for layer in range(first, config["num_hidden_layers"]):
        p, q = f"model.layers.{layer}.{block}.experts", f"model.layers.{layer}.{block}.experts.routed_experts"
        for suffix, (vname, vdtype, n_dim, k_dim) in TABLE[scheme].items():
            def get(e: int, m: str, dim: int | None) -> torch.Tensor:
                t = rank_slice(source[f"{p}.{e}.{m}.{suffix}"], dim, moe_tp, part)
                return t.reshape(-1) if n_dim is None else t

            w13 = torch.stack([torch.cat([get(e, gate, n_dim), get(e, up, n_dim)], dim=n_dim or 0) for e in ids])
            w2 = torch.stack([get(e, down, k_dim) for e in ids])
            w2 = w2.reshape(len(ids)) if n_dim is None else w2
            out[f"{q}.w13_{vname}"], out[f"{q}.w2_{vname}"] = (t.to(TORCH[vdtype]) if vdtype else t for t in (w13, w2))
        if scheme == "w4a16_g32":  # the source's unsliced [N, K] of the last shard loaded (up, down), in the model dtype
            out[f"{q}.w13_weight_shape"] = torch.stack([source[f"{p}.{e}.{up}.weight_shape"] for e in ids]).to(model_dtype)
            out[f"{q}.w2_weight_shape"] = torch.stack([source[f"{p}.{e}.{down}.weight_shape"] for e in ids]).to(model_dtype)
        if scheme == "gptq":  # AutoGPTQMoEMethod creates expert biases, zeros in the model dtype
            out[f"{q}.w13_bias"] = torch.zeros(len(ids), out[f"{q}.w13_qweight"].shape[-1], dtype=model_dtype)
            out[f"{q}.w2_bias"] = torch.zeros(len(ids), out[f"{q}.w2_qweight"].shape[-1], dtype=model_dtype)
    return out


def _export(models, tmp_path, family, scheme, ep, tp=TP):
    src, dest = models(family, scheme), tmp_path / "vllm"
    split_and_export(src, dest, tpshard.Topology(tp=tp, ep=ep), "vllm")
    return src, dest


CASES = [("qwen3_moe", "w4a16_g32", 1), ("deepseek_v3", "w4a16_g32", 2), ("mixtral", "nvfp4", 1), ("qwen3_moe", "w8a8_fp8", 2),
         ("deepseek_v3", "gptq", 1), ("qwen3_moe", "awq", 2)]  # fmt: skip
SLOW = [(f, s, ep) for f in SIZES for s in TABLE for ep in (1, 2) if (f, s, ep) not in CASES]


@pytest.mark.parametrize(
    "family, scheme, ep", [pytest.param(*c, id="-".join(map(str, c))) for c in CASES] + [pytest.param(*c, id="-".join(map(str, c)), marks=pytest.mark.slow) for c in SLOW]
)
def test_each_rank_holds_vllms_fused_moe_layout_bit_for_bit(models, tmp_path, family, scheme, ep):
    src, dest = _export(models, tmp_path, family, scheme, ep)
    source, config = _all_source(src), json.loads((src / "config.json").read_text())
    for rank in range(TP):
        got = read_rank(dest, rank)
        want = expected_experts(source, config, family, scheme, ep, rank)
        assert sorted(k for k in got if ".routed_experts." in k) == sorted(want)
        bad = [(k, DTYPES[got[k].dtype], list(got[k].shape), DTYPES[want[k].dtype], list(want[k].shape)) for k in want if not same(got[k], want[k])]
        assert not bad, bad[:4]
    report = check(dest, src)
    assert report.ok and report.tensors_reassembled > 0, _findings(report)


@pytest.mark.slow
def test_tp4_ep1_and_ep4(models, tmp_path):
    """moe_tp 4 (the expert intermediate 256 in slices of 64 rows, two groups of 32 each) and whole experts at ep 4."""
    for scheme, ep in (("w4a16_g32", 1), ("awq", 4)):
        src, dest = models("qwen3_moe", scheme), tmp_path / f"{scheme}-{ep}"
        split_and_export(src, dest, tpshard.Topology(tp=4, ep=ep), "vllm")
        assert check(dest, src).ok


W13 = "model.layers.1.mlp.experts.routed_experts.w13_"
R0, R1 = "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"


def _part_of(dest: Path, rank: int, key: str) -> str:
    from safetensors import safe_open

    for path in sorted(dest.glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(path, "pt") as f:
            if key in f.keys():
                return path.name
    raise KeyError(key)


@pytest.mark.parametrize("scheme", [pytest.param("w4a16_g32", marks=pytest.mark.slow), "awq"])  # every shard located: ~20-40 s loaded
def test_two_ranks_swapped_are_caught(models, tmp_path, copy_of, scheme):
    src, dest = _export(models, tmp_path, "qwen3_moe", scheme, 1)

    def swap(d: Path) -> None:
        for p in sorted(d.glob("model-rank-0-part-*.safetensors")):
            other = d / p.name.replace("rank-0", "rank-1")
            shutil.move(p, d / "swap")
            shutil.move(other, p)
            shutil.move(d / "swap", other)

    report = check(_broken(copy_of, dest, swap), src)
    assert not report.ok
    text = _findings(report)  # the first findings: reassembly of the stacked tensors that are their shards back to back
    what = "weight_packed" if scheme == "w4a16_g32" else "qweight"
    assert f"model.layers.0.mlp.experts.0.down_proj.{what} (group moe_tp rank 0/2, ranks [0]): holds the slice of group rank 1" in text, text


@pytest.mark.parametrize("scheme, suffix", [("w4a16_g32", "weight_scale"), ("awq", "scales"), ("nvfp4", "weight_global_scale")])
def test_another_experts_scale_is_caught(models, tmp_path, copy_of, scheme, suffix):
    """Expert 1's gate scale overwritten with expert 0's, on rank 1."""
    src, dest = _export(models, tmp_path, "qwen3_moe", scheme, 1)
    key = W13 + suffix
    f = _part_of(dest, 1, key)

    def edit(d: Path) -> None:
        data = bytearray(_bytes(d / f, key))
        per = len(data) // 8  # 8 experts
        if scheme == "nvfp4":  # [E, 2] float32: expert 1's gate slot := expert 0's
            data[8:12] = data[0:4]
        elif scheme == "awq":  # [E, G, 2 I_r]: expert 1's gate columns := expert 0's
            t = torch.frombuffer(data, dtype=torch.bfloat16).reshape(8, -1, 2, 128).clone()
            assert not torch.equal(t[1, :, 0], t[0, :, 0])
            t[1, :, 0] = t[0, :, 0]
            data = bytearray(t.view(torch.uint8).reshape(-1).numpy().tobytes())
        else:  # [E, 2 I_r, G]: expert 1 := expert 0, gate half
            data[per : per + per // 2] = data[: per // 2]
        _replace(d / f, key, bytes(data))

    report = check(_broken(copy_of, dest, edit), src)
    assert not report.ok
    text = _findings(report)
    assert f"model.layers.1.mlp.experts.1.gate_proj.{suffix}" in text, text
    if scheme == "awq":
        assert "it holds slot 0 (model.layers.1.mlp.experts.0.gate_proj.scales): slots out of order" in text, text


@pytest.mark.parametrize("scheme, suffix", [("w4a16_g32", "weight_packed"), ("gptq", "qweight")])
def test_gate_and_up_out_of_order_are_caught(models, tmp_path, copy_of, scheme, suffix):
    """One expert's w13 with its up slice where its gate slice belongs (and the other way round)."""
    src, dest = _export(models, tmp_path, "qwen3_moe", scheme, 1)
    key = W13 + suffix
    f = _part_of(dest, 0, key)

    def edit(d: Path) -> None:
        t = torch.frombuffer(bytearray(_bytes(d / f, key)), dtype=torch.int32)
        if scheme == "gptq":  # [E, H/8, 2 I_r]: columns
            t = t.reshape(8, 16, 2, -1).clone()
            t[3] = t[3].flip(1)
        else:  # [E, 2 I_r, H/8]: rows
            t = t.reshape(8, 2, -1).clone()
            t[3] = t[3].flip(0)
        _replace(d / f, key, t.numpy().tobytes())

    report = check(_broken(copy_of, dest, edit), src)
    assert not report.ok
    text = _findings(report)
    assert "model.layers.1.mlp.experts.3.gate_proj" in text and "model.layers.1.mlp.experts.3.up_proj" in text, text
    if scheme == "gptq":
        assert "it holds slot 7 (model.layers.1.mlp.experts.3.up_proj.qweight): slots out of order" in text, text


def test_quantized_mla_attention_in_another_format_than_fp8_block_is_refused(tmp_path):
    """DeepSeek-V3 with every linear (MLA attention included) in W4A16: refused in one line, before a byte is written."""
    from quant_moe import quantize_linears

    src = make_checkpoint(tmp_path / "ds", "deepseek_v3", kv_lora_rank=32, **SIZES["deepseek_v3"])  # K of kv_b: one group of 32
    quantize_linears(src, "w4a16_g32", experts_only=False)
    with pytest.raises(ExportError, match=r"^--format vllm: the checkpoint is quantized \(ct_int\): model\.layers\.\d+\.self_attn\.\w+ is ct_int: tpshard maps MLA attention for vLLM in FP8 block format only") as e:
        split_and_export(src, tmp_path / "x", tpshard.Topology(tp=TP), "vllm")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()


@pytest.mark.parametrize("scheme", ["gptq", "awq"])
def test_gptq_awq_experts_vllm_builds_with_moe_wna16_are_refused(tmp_path, scheme):
    """hidden 64: vLLM's Marlin MoE methods do not take it, and it falls back to MoeWNA16Method,
    whose weight loader repacks the codes: refused in one line with that reason."""
    from quant_moe import quantize_linears

    src = make_checkpoint(tmp_path / "m", "qwen3_moe", moe_intermediate_size=128)
    quantize_linears(src, scheme)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, quantization_config=QUANT_CONFIG[scheme])))
    with pytest.raises(ExportError, match=rf"{scheme.upper()} experts of hidden 64, 64 intermediate per rank, group 32: vLLM 0.33.0 builds them with MoeWNA16Method") as e:
        split_and_export(src, tmp_path / "x", tpshard.Topology(tp=TP), "vllm")
    assert "\n" not in str(e.value) and not (tmp_path / "x").exists()
