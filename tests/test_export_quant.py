"""Issue 27: quantized checkpoints exported for vLLM 0.33.0's sharded_state loader, in the layout its
quant methods' create_weights build per rank (docs/deploy.md, "Quantized checkpoints").

The expected files are built here from the checkpoint with torch alone, from vLLM's per-format
parameter table (names, dtypes, which dim is N and which K, fused along which dim, per-slot
scales, the attention parameters each method adds), not from tpshard's code; then `check --source`
must prove the export and catch it broken on purpose: two ranks swapped, a scale of another rank,
two slots out of order.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import tpshard
from tpshard.check import check
from tpshard.export import ExportError, export, split_and_export

sys.path.insert(0, str(Path(__file__).parent))
from quant_fixtures import DEFAULT_SPECS, TinyLlama, write_quant_checkpoint  # noqa: E402
from test_export import rewrite_export_checksums  # noqa: E402

TP = 2
SHAPES = {"fp8_block": TinyLlama(kv_heads=4), "ct_fp8_block": TinyLlama(kv_heads=4)}  # FP8 blocks of 128 rows: k/v of 2 x 64 would not cut at tp 2

# format -> {checkpoint suffix: (vLLM suffix, vLLM dtype or None = the checkpoint's, N dim, K dim)};
# N dim None: a per-tensor scale (one slot per fused matrix); K dim None: not cut by a row split.
# Fused matrices are concatenated along the N dim (AWQ's tensors are [K, N]: side by side).
TABLE = {
    "fp8_block": {"weight": ("weight", None, 0, 1), "weight_scale_inv": ("weight_scale_inv", "F32", 0, 1)},
    "fp8_tensor": {"weight": ("weight", None, 0, 1), "weight_scale": ("weight_scale", "F32", None, None), "input_scale": ("input_scale", "F32", None, None)},
    "ct_w4a16": {"weight_packed": ("weight_packed", None, 0, 1), "weight_scale": ("weight_scale", None, 0, 1)},
    "ct_fp8_dynamic": {"weight": ("weight", None, 0, 1), "weight_scale": ("weight_scale", "F32", 0, None)},
    "ct_fp8": {"weight": ("weight", None, 0, 1), "weight_scale": ("weight_scale", "F32", None, None), "input_scale": ("input_scale", "F32", None, None)},
    "ct_fp8_block": {"weight": ("weight", None, 0, 1), "weight_scale": ("weight_scale", "F32", 0, 1)},
    "ct_nvfp4": {
        "weight_packed": ("weight_packed", None, 0, 1), "weight_scale": ("weight_scale", None, 0, 1),
        "weight_global_scale": ("weight_global_scale", "F32", None, None), "input_global_scale": ("input_global_scale", "F32", None, None),
    },
    "awq": {"qweight": ("qweight", None, 1, 0), "qzeros": ("qzeros", None, 1, 0), "scales": ("scales", None, 1, 0)},
    # [K, N] like AWQ; the checkpoint's g_idx is not a vLLM parameter without act-order
    "gptq": {"qweight": ("qweight", None, 1, 0), "qzeros": ("qzeros", None, 1, 0), "scales": ("scales", None, 1, 0)},
}  # fmt: skip
FP8_ATTN = {n: ("BF16", (), -1.0) for n in ("k_scale", "v_scale", "q_scale", "prob_scale")}  # kv_cache.py
CT_ATTN = {**{f"{n}_scale": ("F32", (1,), 1.0) for n in "kqv"}, **{f"{n}_zero_point": ("BF16", (1,), 0.0) for n in "kqv"}}
ATTENTION = {"fp8_block": FP8_ATTN, "fp8_tensor": FP8_ATTN, "ct_w4a16": CT_ATTN, "ct_fp8_dynamic": CT_ATTN, "ct_fp8": CT_ATTN, "ct_fp8_block": CT_ATTN, "ct_nvfp4": CT_ATTN, "awq": {}, "gptq": {}}
DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8", torch.float8_e4m3fn: "F8_E4M3"}
TORCH = {v: k for k, v in DTYPES.items()}
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
ROW_PARALLEL = {"o_proj", "down_proj"}


def source_tensors(src: Path) -> dict[str, torch.Tensor]:
    with safe_open(src / "model.safetensors", "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def rank_slice(t: torch.Tensor, dim: int | None, rank: int, tp: int = TP) -> torch.Tensor:
    return t if dim is None else torch.chunk(t, tp, dim=dim)[rank]


def expected_rank(fmt: str, src: dict[str, torch.Tensor], shape: TinyLlama, rank: int, tp: int = TP) -> dict[str, torch.Tensor]:
    """vLLM's create_weights state of one rank, from the checkpoint and the table above."""
    model_dtype = src["model.embed_tokens.weight"].dtype
    out: dict[str, torch.Tensor] = {}
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = torch.zeros(-(-shape.vocab // 64) * 64, shape.hidden, dtype=model_dtype)
        padded[: shape.vocab] = src[name]
        out[name] = rank_slice(padded, 0, rank, tp)
    out["model.norm.weight"] = src["model.norm.weight"]
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{p}.{norm}.weight"] = src[f"{p}.{norm}.weight"]
        for b in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):
            out[f"{p}.self_attn.attn.{b}"] = torch.tensor(1.0)
        for n, (dtype, dims, value) in ATTENTION[fmt].items():
            out[f"{p}.self_attn.attn.{n}"] = torch.full(dims, value, dtype=TORCH[dtype])
        for fused, members in FUSED.items():
            block = "self_attn" if fused in ("qkv_proj", "o_proj") else "mlp"
            for suffix, (vname, vdtype, n_dim, k_dim) in TABLE[fmt].items():
                parts = []
                for m in members:
                    t = src[f"{p}.{block}.{m}.{suffix}"]
                    parts.append(rank_slice(t, k_dim if fused in ROW_PARALLEL else n_dim, rank, tp).reshape(-1) if n_dim is None else
                                 rank_slice(t, k_dim if fused in ROW_PARALLEL else n_dim, rank, tp))  # fmt: skip
                t = torch.cat(parts, dim=n_dim or 0)
                out[f"{p}.{block}.{fused}.{vname}"] = t.to(TORCH[vdtype]) if vdtype else t
            if fmt == "ct_w4a16":  # the source's unsliced [N, K] of the last matrix vLLM's loader copies in
                out[f"{p}.{block}.{fused}.weight_shape"] = src[f"{p}.{block}.{members[-1]}.weight_shape"]
    return out


def read_rank(dest: Path, rank: int) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(dest.glob(f"model-rank-{rank}-part-*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """fmt -> (checkpoint, its vLLM export at tp 2)."""
    root = tmp_path_factory.mktemp("quant")
    made = {}
    for fmt in TABLE:
        src = root / fmt
        write_quant_checkpoint(src, DEFAULT_SPECS[fmt], shape=SHAPES.get(fmt, TinyLlama()))
        split_and_export(src, root / f"{fmt}-vllm", tpshard.Topology(tp=TP), "vllm")
        made[fmt] = src, root / f"{fmt}-vllm"
    return made


@pytest.mark.parametrize("fmt", list(TABLE))
def test_each_rank_holds_vllms_create_weights_layout_bit_for_bit(exported, fmt):
    src, dest = exported[fmt]
    source = source_tensors(src)
    for rank in range(TP):
        want, got = expected_rank(fmt, source, SHAPES.get(fmt, TinyLlama()), rank), read_rank(dest, rank)
        assert sorted(got) == sorted(want)
        bad = [(k, DTYPES[got[k].dtype], list(got[k].shape), DTYPES[want[k].dtype], list(want[k].shape)) for k in want if not same(got[k], want[k])]
        assert not bad, bad[:4]
    report = check(dest, src)
    assert report.ok and report.tensors_reassembled > 0, [p.message for p in report.problems]


# Wide enough for tp 8 (docs/deploy.md's vLLM proof at tp 4 and 8): every row-parallel K per rank is
# 256 (two groups of 128), every column-parallel N per rank a multiple of 128 (k/v: 8 heads x 128 / 8).
WIDE = TinyLlama(hidden=1024, intermediate=2048, heads=16, kv_heads=8, head_dim=128, vocab=1024)


def test_group_128_cut_at_tp_8_on_a_wider_llama(tmp_path, copy_of):
    """CT W4A16 group 128 at tp 8: each rank holds vLLM's create_weights layout for its eighth (two
    groups of o/down's K each); two ranks swapped are caught by check --source."""
    src, dest = tmp_path / "ct_w4a16", tmp_path / "ct_w4a16-vllm"
    write_quant_checkpoint(src, DEFAULT_SPECS["ct_w4a16"], shape=WIDE)
    split_and_export(src, dest, tpshard.Topology(tp=8), "vllm")
    source = source_tensors(src)
    for rank in range(8):
        want, got = expected_rank("ct_w4a16", source, WIDE, rank, tp=8), read_rank(dest, rank)
        assert sorted(got) == sorted(want)
        assert got["model.layers.0.mlp.down_proj.weight_scale"].shape == (1024, 2)  # K 256 per rank, 2 groups
        bad = [(k, DTYPES[got[k].dtype], list(got[k].shape), DTYPES[want[k].dtype], list(want[k].shape)) for k in want if not same(got[k], want[k])]
        assert not bad, bad[:4]
    assert check(dest, src).ok

    def swap(d: Path) -> None:
        a, b, tmp = d / "model-rank-3-part-0.safetensors", d / "model-rank-6-part-0.safetensors", d / "swap"
        shutil.move(a, tmp)
        shutil.move(b, a)
        shutil.move(tmp, b)

    report = check(_broken(copy_of, dest, swap), src)
    assert not report.ok and "(group tp rank 3/8, ranks [3]): holds the slice of group rank 6" in _findings(report), _findings(report)


def test_launch_dtype_is_the_models_not_the_scales(exported):
    """More float32 scale tensors than bf16 ones per layer: the launch line still says bfloat16."""
    from tpshard.export import read_export_manifest
    from tpshard.export.launch import launch_line

    _, dest = exported["fp8_block"]
    assert launch_line(read_export_manifest(dest), dest).endswith("--dtype bfloat16")


def _tensor_at(path: Path, name: str) -> tuple[int, int]:
    """(data offset, bytes) of tensor `name` in a safetensors file."""
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    begin, end = json.loads(data[8 : 8 + n])[name]["data_offsets"]
    return 8 + n + begin, end - begin


def _replace(path: Path, name: str, content: bytes) -> None:
    at, n = _tensor_at(path, name)
    assert len(content) == n
    data = bytearray(path.read_bytes())
    data[at : at + n] = content
    path.write_bytes(bytes(data))


def _bytes(path: Path, name: str) -> bytes:
    at, n = _tensor_at(path, name)
    return path.read_bytes()[at : at + n]


def _broken(copy_of, dest: Path, edit) -> Path:
    broken = copy_of(dest)
    edit(broken)
    rewrite_export_checksums(broken)  # the manifest agrees with the files: only the source can tell
    assert check(broken).ok
    return broken


def _findings(report) -> str:
    return "\n".join(p.message for p in report.problems)


@pytest.mark.parametrize("fmt", ["awq", "fp8_block"])
def test_two_ranks_swapped_are_caught_and_named(exported, copy_of, fmt):
    src, dest = exported[fmt]

    def swap(d: Path) -> None:
        a, b = d / "model-rank-0-part-0.safetensors", d / "model-rank-1-part-0.safetensors"
        tmp = d / "swap"
        shutil.move(a, tmp)
        shutil.move(b, a)
        shutil.move(tmp, b)

    report = check(_broken(copy_of, dest, swap), src)
    assert not report.ok
    text = _findings(report)
    if fmt == "awq":  # fused along dim 1: compared slot by slot
        assert "qkv_proj.qweight slot 0 (model.layers.0.self_attn.q_proj.qweight, group rank 0) differs from the source: it holds the shard of rank(s) [1]" in text, text
    else:
        assert "holds the slice of group rank 1" in text, text


@pytest.mark.parametrize("fmt, key", [("awq", "model.layers.1.mlp.gate_up_proj.scales"), ("fp8_block", "model.layers.1.mlp.gate_up_proj.weight_scale_inv")])
def test_a_scale_of_another_rank_is_caught(exported, copy_of, fmt, key):
    src, dest = exported[fmt]
    r0, r1 = "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"
    report = check(_broken(copy_of, dest, lambda d: _replace(d / r1, key, _bytes(d / r0, key))), src)
    assert not report.ok
    text = _findings(report)
    assert ("it holds the shard of rank(s) [0]" if fmt == "awq" else "holds the slice of group rank 0") in text, text


def test_slots_out_of_order_are_caught(exported, copy_of):
    """AWQ's gate_up_proj: gate and up side by side in every row; swapped, check names the slot. FP8
    per-tensor: qkv_proj.weight_scale [q, k, v] with q and k swapped."""
    src, dest = exported["awq"]
    key, f = "model.layers.0.mlp.gate_up_proj.qweight", "model-rank-1-part-0.safetensors"

    def swap_halves(d: Path) -> None:
        t = torch.frombuffer(bytearray(_bytes(d / f, key)), dtype=torch.int32).reshape(256, -1)
        half = t.shape[1] // 2
        _replace(d / f, key, torch.cat([t[:, half:], t[:, :half]], dim=1).contiguous().numpy().tobytes())

    text = _findings(check(_broken(copy_of, dest, swap_halves), src))
    assert "gate_up_proj.qweight slot 0 (model.layers.0.mlp.gate_proj.qweight, group rank 1) differs from the source: it holds slot 1" in text, text

    src, dest = exported["fp8_tensor"]
    key = "model.layers.0.self_attn.qkv_proj.weight_scale"

    def swap_slots(d: Path) -> None:
        q, k, v = struct.unpack("<3f", _bytes(d / f, key))
        assert q != k
        _replace(d / f, key, struct.pack("<3f", k, q, v))

    report = check(_broken(copy_of, dest, swap_slots), src)
    assert not report.ok and "self_attn.q_proj.weight_scale" in _findings(report), _findings(report)


def test_a_shard_damaged_in_the_tpshard_output_is_refused_where_the_export_recomputes_bytes(tmp_path):
    """AWQ fuses along dim 1, so the export's digest is of the bytes it writes: each shard is proven
    against the tpshard manifest first, and a damaged one stops the export in one line."""
    src, out = tmp_path / "awq", tmp_path / "out"
    write_quant_checkpoint(src, DEFAULT_SPECS["awq"])
    tpshard.split(src, out, tpshard.Topology(tp=TP))
    victim = out / "rank-00001" / "model-tp-001-of-002.safetensors"
    if not victim.exists():
        victim = sorted((out / "rank-00001").glob("*.safetensors"))[0]
    at, n = _tensor_at(victim, "model.layers.0.self_attn.q_proj.qweight")
    data = bytearray(victim.read_bytes())
    data[at + n // 2] ^= 0x40
    victim.write_bytes(bytes(data))
    with pytest.raises(tpshard.errors.OutputError, match="differs from its crc32 in the manifest; run tpshard check"):
        export(out, tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "spec, wanted",
    [
        ("gptq_v2_3bit", "GPTQ checkpoint_format gptq_v2: vLLM 0.33.0's AutoGPTQ reads qzeros as v1"),
        ("gptq_act_order", 'vLLM 0.33.0 refuses it (quantization/utils/gptq_utils.py: "desc_act=True is no longer supported")'),
        ("marlin", "legacy Marlin (B, s): vLLM 0.33.0 has no parameter for it"),
        ("ct_w4a16_asym_actorder", "compressed-tensors with act-order (weight_g_idx): not mapped"),
    ],
)
def test_what_vllm_cannot_load_is_refused_in_one_line(tmp_path, spec, wanted):
    src = tmp_path / spec
    write_quant_checkpoint(src, DEFAULT_SPECS[spec])
    with pytest.raises(ExportError, match="^--format vllm: the checkpoint is quantized: ") as e:
        split_and_export(src, tmp_path / "x", tpshard.Topology(tp=TP), "vllm")
    assert wanted in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "x").exists()


def test_sglang_refusal_says_what_to_do_instead(exported, tmp_path):
    src, _ = exported["fp8_tensor"]
    with pytest.raises(ExportError, match=r"sglang: the checkpoint is quantized \(fp8_tensor\); .*serve the HF checkpoint with the engine's own loader, or export for vLLM \(--format vllm\)"):
        split_and_export(src, tmp_path / "x", tpshard.Topology(tp=TP), "sglang")


def test_gptq_export_tells_vllm_which_layers_are_quantized(exported, copy_of, tmp_path):
    """vLLM matches the HF modules of a fused layer against modules_in_block_to_quantize (or the
    files' quantized names, which in an export are the fused ones): the export's config.json is the
    source's with exactly that list added, the manifest says so, and check --source accepts that
    addition and nothing else."""
    from tpshard.export import read_export_manifest

    src, dest = exported["gptq"]
    source, held = json.loads((src / "config.json").read_text()), json.loads((dest / "config.json").read_text())
    modules = [f"model.layers.{i}.{m}" for i in range(2) for m in ("mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj")]
    assert held == dict(source, quantization_config={**source["quantization_config"], "modules_in_block_to_quantize": modules})
    assert read_export_manifest(dest).config.added == {"modules_in_block_to_quantize": modules}
    assert "config" not in json.loads((exported["awq"][1] / "tpshard-export.json").read_text())  # others: copied as they are

    more = copy_of(dest)  # one more key, resealed in the manifest: only the source can tell
    edited = dict(held, quantization_config={**held["quantization_config"], "lm_head": True})
    (more / "config.json").write_text(json.dumps(edited, indent=2) + "\n")
    data = json.loads((more / "tpshard-export.json").read_text())
    data["config"].update(size=(more / "config.json").stat().st_size, checksum=hashlib.sha256((more / "config.json").read_bytes()).hexdigest())
    (more / "tpshard-export.json").write_text(json.dumps(data))
    assert check(more).ok
    assert "config.json: not the source's with exactly ['modules_in_block_to_quantize'] added" in _findings(check(more, src))

    less = copy_of(dest)  # the addition left out of the manifest: the copy no longer matches the source's
    data = json.loads((less / "tpshard-export.json").read_text())
    del data["config"]
    (less / "tpshard-export.json").write_text(json.dumps(data))
    assert "config.json: sha256 differs from the source's copy" in _findings(check(less))
    assert "config.json: the export adds nothing to quantization_config, the rules add ['modules_in_block_to_quantize']" in _findings(check(less, src))


# --- DeepSeek-V3 in FP8 block format: MLA and routed experts -----------------------------------


@pytest.fixture(scope="module")
def deepseek_fp8_noaux(deepseek_fp8, tmp_path_factory):
    """The FP8 DeepSeek-V3 checkpoint with DeepSeek-V3's topk_method (vLLM builds the router bias for it)."""
    src = tmp_path_factory.mktemp("dsfp8") / "model"
    shutil.copytree(deepseek_fp8, src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(dict(config, topk_method="noaux_tc"), indent=1))
    return src


def _all_source(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_deepseek_fp8_experts_mla_and_router_bias_in_vllms_layout(deepseek_fp8_noaux, tmp_path, ep):
    """Fp8MoEMethod.create_weights: w13_weight [E_local, 2 I_r, H] (each expert's gate rows, then its
    up rows), w13_weight_scale_inv [E_local, 2 I_r/128, H/128], w2 alike; fused_qkv_a_proj with its
    block-scale rows [q_a; kv_a]; e_score_correction_bias in float32; no quant-method scales on MLA
    attention; the MTP layer left out. At --ep 2 (vLLM --enable-expert-parallel) rank r holds experts
    4r..4r+3 whole."""
    src, dest = deepseek_fp8_noaux, tmp_path / "vllm"
    split_and_export(src, dest, tpshard.Topology(tp=TP, ep=ep), "vllm")
    source = _all_source(src)
    config = json.loads((src / "config.json").read_text())
    experts, layers = config["n_routed_experts"], config["num_hidden_layers"]
    moe_tp = TP // ep
    for rank in range(TP):
        got = read_rank(dest, rank)
        assert not any(k.startswith(f"model.layers.{layers}.") for k in got)  # MTP
        assert not [k for k in got if k.rsplit(".", 1)[1] in ("k_scale", "v_scale", "q_scale", "prob_scale")]
        local = range(experts // ep * (rank if ep > 1 else 0), experts // ep * ((rank if ep > 1 else 0) + 1))
        part = rank % moe_tp
        for layer in range(config["first_k_dense_replace"], layers):
            p = f"model.layers.{layer}"
            for suffix, vsuffix in (("weight", "weight"), ("weight_scale_inv", "weight_scale_inv")):
                def e(i, m):
                    return rank_slice(source[f"{p}.mlp.experts.{i}.{m}.{suffix}"], 0 if m != "down_proj" else 1, part) if moe_tp > 1 else source[f"{p}.mlp.experts.{i}.{m}.{suffix}"]
                w13 = torch.stack([torch.cat([e(i, "gate_proj"), e(i, "up_proj")]) for i in local])
                w2 = torch.stack([e(i, "down_proj") for i in local])
                assert same(got[f"{p}.mlp.experts.routed_experts.w13_{vsuffix}"], w13)
                assert same(got[f"{p}.mlp.experts.routed_experts.w2_{vsuffix}"], w2)
            bias = source[f"{p}.mlp.gate.e_score_correction_bias"]
            assert same(got[f"{p}.mlp.experts.gate.e_score_correction_bias"], bias.float())
        for layer in range(layers):
            p = f"model.layers.{layer}.self_attn"
            for suffix in ("weight", "weight_scale_inv"):
                fused = torch.cat([source[f"{p}.q_a_proj.{suffix}"], source[f"{p}.kv_a_proj_with_mqa.{suffix}"]])
                assert same(got[f"{p}.fused_qkv_a_proj.{suffix}"], fused)
                assert same(got[f"{p}.kv_b_proj.{suffix}"], rank_slice(source[f"{p}.kv_b_proj.{suffix}"], 0, rank))
                assert same(got[f"{p}.mla_attn.o_proj.{suffix}"], rank_slice(source[f"{p}.o_proj.{suffix}"], 1, rank))
    report = check(dest, src)
    assert report.ok, _findings(report)


def test_quantized_moe_for_sglang_is_refused(deepseek_fp8_noaux):
    """SGLang loads after its post-processing: any quantized MoE says what to do instead, in one line
    (the other formats' experts for vLLM: tests/test_export_quant_moe.py)."""
    from tpshard.checkpoint import open_checkpoint
    from tpshard.export.layout import refuse_quantized
    from tpshard.export.names import TABLES
    from tpshard.plan import make_plan

    plan = make_plan(open_checkpoint(deepseek_fp8_noaux), tpshard.Topology(tp=TP))
    table = TABLES["vllm"][plan.model.architecture]
    refuse_quantized(plan, "vllm", ["fp8_block"], table)  # mapped
    with pytest.raises(ExportError, match=r"serve the HF checkpoint with the engine's own loader, or export for vLLM"):
        refuse_quantized(plan, "sglang", ["fp8_block"], table)


@pytest.mark.parametrize("kind, ep", [("qwen3_moe", 2), ("mixtral", 1)])
def test_fp8_block_experts_of_qwen3_moe_and_mixtral(tmp_path, kind, ep):
    """The same Fp8MoEMethod layout for Qwen3-MoE and Mixtral, whose attention gets Fp8KVCacheMethod's
    q/k/v/prob scales (0-d, -1.0, model dtype) beside vLLM's own buffers."""
    from moe_configs import make_fp8_moe

    src, dest = make_fp8_moe(tmp_path / kind, kind), tmp_path / "vllm"
    split_and_export(src, dest, tpshard.Topology(tp=TP, ep=ep), "vllm")
    source = source_tensors(src)
    block, (gate, up, down) = ("mlp", ("gate_proj", "up_proj", "down_proj")) if kind == "qwen3_moe" else ("block_sparse_moe", ("w1", "w3", "w2"))
    experts = 4
    for rank in range(TP):
        got = read_rank(dest, rank)
        local = range(rank * experts // ep, (rank + 1) * experts // ep) if ep > 1 else range(experts)
        cut = (lambda t, d: t) if ep > 1 else (lambda t, d: rank_slice(t, d, rank))
        for layer in range(2):
            p = f"model.layers.{layer}"
            for s in ("weight", "weight_scale_inv"):
                e = lambda i, m, d: cut(source[f"{p}.{block}.experts.{i}.{m}.{s}"], d)  # noqa: E731
                assert same(got[f"{p}.{block}.experts.routed_experts.w13_{s}"], torch.stack([torch.cat([e(i, gate, 0), e(i, up, 0)]) for i in local]))
                assert same(got[f"{p}.{block}.experts.routed_experts.w2_{s}"], torch.stack([e(i, down, 1) for i in local]))
            for n in ("k_scale", "v_scale", "q_scale", "prob_scale"):
                assert same(got[f"{p}.self_attn.attn.{n}"], torch.tensor(-1.0, dtype=torch.bfloat16))
    report = check(dest, src)
    assert report.ok, _findings(report)
