"""Engine exports of the MoE and MLA families (vLLM only): names, shapes and dtypes per rank against
tables worked by hand from vLLM 0.33.0's model classes, the bytes of the stacked expert tensors
against slices cut here with torch from the source (not from tpshard's plan), check on the export,
and the refusals (SGLang, EP layouts vLLM does not build)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

import tpshard
from tpshard.check import check
from tpshard.export import ExportError, export
from test_export import VLLM_BUFFERS, _messages, _source, headers, rewrite_export_checksums

BF = "BF16"
# Shared by all: hidden 64, vocab 250 -> 256 rows padded, 128 per rank at tp 2; 3 layers.
GLOBAL = {"model.embed_tokens.weight": (BF, (128, 64)), "lm_head.weight": (BF, (128, 64)), "model.norm.weight": (BF, (64,))}
NORMS = {"input_layernorm.weight": (BF, (64,)), "post_attention_layernorm.weight": (BF, (64,))}
# 8 experts of intermediate 32 (Mixtral: 96): w13 holds each expert's 16 gate then 16 up rows at tp 2.
LAYER_TP2 = {
    "qwen3_moe": {  # head_dim 16: qkv = 4 q heads + 1 k + 1 v = 96 rows; router kept under the FusedMoE
        **NORMS, **VLLM_BUFFERS,
        "self_attn.qkv_proj.weight": (BF, (96, 64)), "self_attn.o_proj.weight": (BF, (64, 64)),
        "self_attn.q_norm.weight": (BF, (16,)), "self_attn.k_norm.weight": (BF, (16,)),
        "mlp.experts.gate.weight": (BF, (8, 64)),
        "mlp.experts.routed_experts.w13_weight": (BF, (8, 32, 64)), "mlp.experts.routed_experts.w2_weight": (BF, (8, 64, 16)),
    },
    "qwen2_moe": {  # head_dim 8, q/k/v biases; shared expert of 48 (24 per rank) and its gate
        **NORMS, **VLLM_BUFFERS,
        "self_attn.qkv_proj.weight": (BF, (48, 64)), "self_attn.qkv_proj.bias": (BF, (48,)), "self_attn.o_proj.weight": (BF, (64, 32)),
        "mlp.gate.weight": (BF, (8, 64)),
        "mlp.experts._shared_experts._layer.expert_gate.weight": (BF, (1, 64)),
        "mlp.experts._shared_experts._layer.gate_up_proj.weight": (BF, (48, 64)),
        "mlp.experts._shared_experts._layer.down_proj.weight": (BF, (64, 24)),
        "mlp.experts.routed_experts.w13_weight": (BF, (8, 32, 64)), "mlp.experts.routed_experts.w2_weight": (BF, (8, 64, 16)),
    },
    "mixtral": {  # experts of intermediate 96 (48 per rank)
        **NORMS, **VLLM_BUFFERS,
        "self_attn.qkv_proj.weight": (BF, (48, 64)), "self_attn.o_proj.weight": (BF, (64, 32)),
        "block_sparse_moe.gate.weight": (BF, (8, 64)),
        "block_sparse_moe.experts.routed_experts.w13_weight": (BF, (8, 96, 64)),
        "block_sparse_moe.experts.routed_experts.w2_weight": (BF, (8, 64, 48)),
    },
}  # fmt: skip


def worked(arch: str, layers: int = 3) -> dict:
    table = dict(GLOBAL)
    for i in range(layers):
        table.update({f"model.layers.{i}.{k}": v for k, v in LAYER_TP2[arch].items()})
    return table


def _split_export(src, root, **topo):
    tpshard.split(src, root / "out", tpshard.Topology(**topo))
    export(root / "out", root / "vllm", "vllm")
    return root / "vllm"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_moe_names_shapes_dtypes_and_expert_bytes_tp2(request, tmp_path, arch):
    """Every key at tp 2 as worked above; w13 = per expert [gate rows of the rank; up rows], w2 = the
    rank's down columns, cut here with torch from the source."""
    src = request.getfixturevalue(arch)
    dest = _split_export(src, tmp_path, tp=2)
    assert headers(dest, 0) == headers(dest, 1) == worked(arch)
    w = _source(src)
    block, (g, u, d) = ("block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral" else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    i = 48 if arch == "mixtral" else 16
    for r in (0, 1):
        got = load_file(dest / f"model-rank-{r}-part-0.safetensors")
        for layer in range(3):
            at = f"model.layers.{layer}.{block}.experts."
            w13 = torch.stack([torch.cat([w[f"{at}{e}.{g}.weight"][i * r : i * r + i], w[f"{at}{e}.{u}.weight"][i * r : i * r + i]]) for e in range(8)])
            w2 = torch.stack([w[f"{at}{e}.{d}.weight"][:, i * r : i * r + i] for e in range(8)])
            assert torch.equal(got[at + "routed_experts.w13_weight"], w13)
            assert torch.equal(got[at + "routed_experts.w2_weight"], w2)
    report = check(dest, src)
    assert report.ok, report.problems


def test_qwen3_moe_ep_equals_tp_is_vllm_expert_parallel(tmp_path, qwen3_moe):
    """--ep 2 at tp 2 is vLLM's --enable-expert-parallel (EP size = tp, the experts' own tp 1) with its
    default linear placement: rank r holds whole experts 4r..4r+3."""
    dest = _split_export(qwen3_moe, tmp_path, tp=2, ep=2)
    want = worked("qwen3_moe")
    for layer in range(3):
        at = f"model.layers.{layer}.mlp.experts.routed_experts."
        want[at + "w13_weight"], want[at + "w2_weight"] = (BF, (4, 64, 64)), (BF, (4, 64, 32))
    assert headers(dest, 0) == headers(dest, 1) == want
    w = _source(qwen3_moe)
    at = "model.layers.2.mlp.experts."
    got = load_file(dest / "model-rank-1-part-0.safetensors")
    assert torch.equal(got[at + "routed_experts.w13_weight"], torch.stack([torch.cat([w[f"{at}{e}.gate_proj.weight"], w[f"{at}{e}.up_proj.weight"]]) for e in range(4, 8)]))
    assert torch.equal(got[at + "routed_experts.w2_weight"], torch.stack([w[f"{at}{e}.down_proj.weight"] for e in range(4, 8)]))
    assert check(dest, qwen3_moe).ok


def test_check_catches_a_flipped_byte_in_a_w13_part(tmp_path, copy_of, qwen3_moe):
    dest = copy_of(_split_export(qwen3_moe, tmp_path, tp=2))
    m = tpshard.export.read_export_manifest(dest)
    f = next(f for f in m.files if f.rank == 1)
    from tpshard.plan import file_header

    _, offsets = file_header([(t.name, t.dtype, t.shape) for t in f.tensors])
    k = next(i for i, t in enumerate(f.tensors) if t.name == "model.layers.1.mlp.experts.routed_experts.w13_weight")
    path = dest / f.name
    data = bytearray(path.read_bytes())
    data[offsets[k] + 5 * 32 * 64 * 2 + 17 * 64 * 2 + 3] ^= 0x01  # expert 5, row 17 (its first up row), col 1
    path.write_bytes(bytes(data))
    assert "does not match its crc32" in _messages(check(dest))
    rewrite_export_checksums(dest)
    report = check(dest, qwen3_moe)
    assert not report.ok and "model.layers.1.mlp.experts.5.up_proj.weight" in _messages(report), _messages(report)


def test_moe_refusals_one_clear_line(tmp_path, qwen3_moe):
    tpshard.split(qwen3_moe, tmp_path / "tp2", tpshard.Topology(tp=2))
    with pytest.raises(ExportError, match=r"--format sglang: Qwen3MoeForCausalLM has routed experts; SGLang's sharded_state loads"):
        export(tmp_path / "tp2", tmp_path / "x", "sglang")
    tpshard.split(qwen3_moe, tmp_path / "ep2", tpshard.Topology(tp=4, ep=2))
    with pytest.raises(ExportError, match=r"--ep 2 \(moe_tp 2\) at tp 4; vLLM builds either every expert cut over tp 4 \(--ep 1\) or.*2 whole experts per rank \(--ep 4\)"):
        export(tmp_path / "ep2", tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists()


def test_deepseek_moe_dense_tp_refused_for_vllm(tmp_path, deepseek_v2):
    tpshard.split(deepseek_v2, tmp_path / "out", tpshard.Topology(tp=2, moe_dense_tp=1))
    with pytest.raises(ExportError, match=r"--moe-dense-tp 1; vLLM has no such option and cuts the dense layers' MLP over tp 2"):
        export(tmp_path / "out", tmp_path / "x", "vllm")


MLA_BUFFERS = {f"self_attn.mla_attn.mla_attn.{b}": ("F32", ()) for b in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")}
# DeepSeek-V3 at tp 2: 8 heads of nope 16 + rope 8 (q_b 4 x 24 = 96 rows), v 16 (kv_b 4 x 32 = 128
# rows, o_proj 4 x 16 = 64 columns), q_lora 32, kv_lora 16 + rope 8 (fused_qkv_a 32 + 24 = 56 rows,
# whole on every rank); layer 0 dense (intermediate 96), layers 1-2 MoE with one shared expert of 32.
MLA = {
    **NORMS, **MLA_BUFFERS,
    "self_attn.fused_qkv_a_proj.weight": (BF, (56, 64)), "self_attn.mla_attn.q_a_layernorm.weight": (BF, (32,)),
    "self_attn.mla_attn.q_b_proj.weight": (BF, (96, 32)), "self_attn.kv_a_layernorm.weight": (BF, (16,)),
    "self_attn.kv_b_proj.weight": (BF, (128, 16)), "self_attn.mla_attn.o_proj.weight": (BF, (64, 64)),
}
DEEPSEEK_V3_TP2 = {
    0: {**MLA, "mlp.gate_up_proj.weight": (BF, (96, 64)), "mlp.down_proj.weight": (BF, (64, 48))},
    1: {
        **MLA,
        "mlp.experts.gate.weight": (BF, (8, 64)),
        "mlp.experts.gate.e_score_correction_bias": ("F32", (8,)),  # vLLM builds it in float32: written so (docs/deploy.md)
        "mlp.experts._shared_experts._layer.gate_up_proj.weight": (BF, (32, 64)),
        "mlp.experts._shared_experts._layer.down_proj.weight": (BF, (64, 16)),
        "mlp.experts.routed_experts.w13_weight": (BF, (8, 32, 64)), "mlp.experts.routed_experts.w2_weight": (BF, (8, 64, 16)),
    },
}  # fmt: skip


def with_noaux_tc(path):
    """DeepSeek-V3's own config.json says topk_method "noaux_tc"; transformers' config class does not write it."""
    import json

    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "topk_method": "noaux_tc"}, indent=1))
    return path


def test_deepseek_v3_mla_names_and_mtp_left_out(tmp_path, copy_of, deepseek_v3):
    """vLLM's DeepseekV3ForCausalLM has no layer 3 (the MTP layer): the export leaves it out, and
    check --source still passes (the MTP tensors are the draft model's, not this export's)."""
    with pytest.raises(ExportError, match=r"e_score_correction_bias but config.json names no topk_method; vllm builds"):
        _split_export(deepseek_v3, tmp_path / "plain", tp=2)
    deepseek_v3 = with_noaux_tc(copy_of(deepseek_v3))
    dest = _split_export(deepseek_v3, tmp_path, tp=2)
    want = dict(GLOBAL)
    for i in range(3):
        want.update({f"model.layers.{i}.{k}": v for k, v in DEEPSEEK_V3_TP2[min(i, 1)].items()})
    assert headers(dest, 0) == headers(dest, 1) == want
    w = _source(deepseek_v3)
    assert any(k.startswith("model.layers.3.") for k in w)
    got = load_file(dest / "model-rank-1-part-0.safetensors")
    at = "model.layers.2.self_attn."
    assert torch.equal(got[at + "fused_qkv_a_proj.weight"], torch.cat([w[at + "q_a_proj.weight"], w[at + "kv_a_proj_with_mqa.weight"]]))
    assert torch.equal(got[at + "mla_attn.q_b_proj.weight"], w[at + "q_b_proj.weight"][96:])
    assert torch.equal(got[at + "mla_attn.o_proj.weight"], w[at + "o_proj.weight"][:, 64:])
    at = "model.layers.2.mlp.experts."
    w13 = torch.stack([torch.cat([w[f"{at}{e}.gate_proj.weight"][16:], w[f"{at}{e}.up_proj.weight"][16:]]) for e in range(8)])
    assert torch.equal(got[at + "routed_experts.w13_weight"], w13)
    bias = got[at + "gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and torch.equal(bias, w["model.layers.2.mlp.gate.e_score_correction_bias"].float())
    report = check(dest, deepseek_v3)
    assert report.ok, report.problems


def test_deepseek_v2_without_q_lora_keeps_kv_a_alone(tmp_path, deepseek_v2):
    dest = _split_export(deepseek_v2, tmp_path, tp=2)
    h = headers(dest, 0)
    assert h["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (BF, (24, 64))
    assert h["model.layers.0.self_attn.mla_attn.q_proj.weight"] == (BF, (96, 64))
    assert not any("fused_qkv_a_proj" in k or "q_a_layernorm" in k for k in h)
    assert h["model.layers.1.mlp.experts._shared_experts._layer.gate_up_proj.weight"] == (BF, (64, 64))  # 2 shared experts of 32
    assert check(dest, deepseek_v2).ok
