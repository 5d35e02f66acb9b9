"""vLLM exports of the 2026 MoE families (bf16): names, shapes and dtypes per rank against tables
worked by hand from vLLM 0.33.0's model classes (and its CPU build, docs/deploy.md), the bytes against
slices cut here with torch from the source (not from tpshard's plan), check --source on the export,
the export broken on purpose (two ranks swapped, gate and up read the wrong way, another expert's
rows) caught by check --source, and the refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tpshard
from tpshard.check import check
from tpshard.errors import PlanError
from tpshard.export import ExportError, export
from test_export import VLLM_BUFFERS, _source, headers
from test_export_quant import _broken, _bytes, _findings, _replace

BF, F32 = "BF16", "F32"
NORMS = {"input_layernorm.weight": (BF, (64,)), "post_attention_layernorm.weight": (BF, (64,))}
GLOBAL = {"model.embed_tokens.weight": (BF, (128, 64)), "lm_head.weight": (BF, (128, 64)), "model.norm.weight": (BF, (64,))}

# GLM-4.5 in small (tests/checkpoints.py) at tp 2: 8 heads of 16 over 2 kv heads -> qkv 4 q + 1 k + 1 v
# heads = 96 rows with biases, o_proj 4 heads = 64 columns, q/k norms [head_dim]; layer 0 a dense MLP of
# 96 (48 per rank); layers 1-2 the float32 router [8, 64] and correction bias [8], one shared expert
# of 32 (16 per rank) and 8 experts of 32 (w13: 16 gate + 16 up rows each). Layer 3 (MTP) is not built.
GLM_ATTENTION = {
    **NORMS, **VLLM_BUFFERS,
    "self_attn.qkv_proj.weight": (BF, (96, 64)), "self_attn.qkv_proj.bias": (BF, (96,)), "self_attn.o_proj.weight": (BF, (64, 64)),
    "self_attn.q_norm.weight": (BF, (16,)), "self_attn.k_norm.weight": (BF, (16,)),
}
GLM_TP2 = {
    0: {**GLM_ATTENTION, "mlp.gate_up_proj.weight": (BF, (96, 64)), "mlp.down_proj.weight": (BF, (64, 48))},
    1: {
        **GLM_ATTENTION,
        "mlp.gate.weight": (F32, (8, 64)), "mlp.experts.routed_experts.e_score_correction_bias": (F32, (8,)),
        "mlp.experts._shared_experts._layer.gate_up_proj.weight": (BF, (32, 64)),
        "mlp.experts._shared_experts._layer.down_proj.weight": (BF, (64, 16)),
        "mlp.experts.routed_experts.w13_weight": (BF, (8, 32, 64)), "mlp.experts.routed_experts.w2_weight": (BF, (8, 64, 16)),
    },
}  # fmt: skip


def worked(per_layer: dict, layers: int = 3) -> dict:
    table = dict(GLOBAL)
    for i in range(layers):
        table.update({f"model.layers.{i}.{k}": v for k, v in per_layer[min(i, max(per_layer))].items()})
    return table


def split_export(src: Path, root: Path, **topo) -> Path:
    tpshard.split(src, root / "out", tpshard.Topology(**topo))
    export(root / "out", root / "vllm", "vllm")
    return root / "vllm"


@pytest.fixture(scope="module")
def glm_vllm(glm4_moe, tmp_path_factory) -> Path:
    return split_export(glm4_moe, tmp_path_factory.mktemp("glm-vllm"), tp=2)


def stacked(w: dict, at: str, experts, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's w13 [E, 2 I_r, H] (each expert's gate rows, then its up rows) and w2 [E, H, I_r], from the HF experts."""
    w13 = torch.stack([torch.cat([w[f"{at}{e}.gate_proj.weight"][rows], w[f"{at}{e}.up_proj.weight"][rows]]) for e in experts])
    return w13, torch.stack([w[f"{at}{e}.down_proj.weight"][:, cols] for e in experts])


def test_glm_every_rank_holds_vllms_keys_and_bytes_tp2(glm_vllm, glm4_moe):
    assert headers(glm_vllm, 0) == headers(glm_vllm, 1) == worked(GLM_TP2)
    w = _source(glm4_moe)
    assert any(k.startswith("model.layers.3.") for k in w)  # the MTP layer is in the checkpoint, not in vLLM's model
    for r in (0, 1):
        got = load_file(glm_vllm / f"model-rank-{r}-part-0.safetensors")
        half = slice(16 * r, 16 * r + 16)
        for layer in (1, 2):
            p = f"model.layers.{layer}.mlp."
            w13, w2 = stacked(w, p + "experts.", range(8), half, half)
            assert torch.equal(got[p + "experts.routed_experts.w13_weight"], w13)
            assert torch.equal(got[p + "experts.routed_experts.w2_weight"], w2)
            shared = p + "experts._shared_experts._layer."
            gate_up = torch.cat([w[p + "shared_experts.gate_proj.weight"][half], w[p + "shared_experts.up_proj.weight"][half]])
            assert torch.equal(got[shared + "gate_up_proj.weight"], gate_up)
            assert torch.equal(got[shared + "down_proj.weight"], w[p + "shared_experts.down_proj.weight"][:, half])
            assert got[p + "gate.weight"].dtype == torch.float32 and torch.equal(got[p + "gate.weight"], w[p + "gate.weight"])
            bias = got[p + "experts.routed_experts.e_score_correction_bias"]
            assert torch.equal(bias, w[p + "gate.e_score_correction_bias"].float())
        a = "model.layers.0.self_attn."
        qkv = torch.cat([w[a + "q_proj.bias"][64 * r : 64 * r + 64], w[a + "k_proj.bias"][16 * r : 16 * r + 16], w[a + "v_proj.bias"][16 * r : 16 * r + 16]])
        assert torch.equal(got[a + "qkv_proj.bias"], qkv)
    report = check(glm_vllm, glm4_moe)
    assert report.ok, report.problems


def test_glm_bf16_router_is_written_in_float32(glm4_moe, copy_of, tmp_path):
    """A checkpoint whose router is bf16: vLLM's GateLinear is float32 and its loader casts; the
    export writes the exact cast, and check --source proves it against the bf16 source."""
    src = copy_of(glm4_moe)
    for f in src.glob("*.safetensors"):
        t = load_file(f)
        if any(k.endswith(".mlp.gate.weight") for k in t):
            from safetensors.torch import save_file

            save_file({k: v.bfloat16() if k.endswith(".mlp.gate.weight") else v for k, v in t.items()}, f, metadata={"format": "pt"})
    dest = split_export(src, tmp_path, tp=2)
    got = load_file(dest / "model-rank-1-part-0.safetensors")["model.layers.2.mlp.gate.weight"]
    assert got.dtype == torch.float32 and torch.equal(got, _source(src)["model.layers.2.mlp.gate.weight"].float())
    assert check(dest, src).ok


def test_glm_ep_equals_tp_is_vllm_expert_parallel(glm4_moe, tmp_path):
    """--ep 2 at tp 2 = vLLM's --enable-expert-parallel: rank 1 holds experts 4-7 whole; the shared
    expert stays cut over tp, as vLLM's Glm4MoeMLP is."""
    dest = split_export(glm4_moe, tmp_path, tp=2, ep=2)
    want = worked(GLM_TP2)
    for layer in (1, 2):
        at = f"model.layers.{layer}.mlp.experts.routed_experts."
        want[at + "w13_weight"], want[at + "w2_weight"] = (BF, (4, 64, 64)), (BF, (4, 64, 32))
    assert headers(dest, 0) == headers(dest, 1) == want
    w = _source(glm4_moe)
    got = load_file(dest / "model-rank-1-part-0.safetensors")
    w13, w2 = stacked(w, "model.layers.2.mlp.experts.", range(4, 8), slice(None), slice(None))
    assert torch.equal(got["model.layers.2.mlp.experts.routed_experts.w13_weight"], w13)
    assert torch.equal(got["model.layers.2.mlp.experts.routed_experts.w2_weight"], w2)
    shared = got["model.layers.2.mlp.experts._shared_experts._layer.down_proj.weight"]
    assert torch.equal(shared, w["model.layers.2.mlp.shared_experts.down_proj.weight"][:, 16:])
    assert check(dest, glm4_moe).ok


def _w13(d: Path, rank: int, layer: int) -> tuple[Path, str, torch.Tensor]:
    path, key = d / f"model-rank-{rank}-part-0.safetensors", f"model.layers.{layer}.mlp.experts.routed_experts.w13_weight"
    return path, key, torch.frombuffer(bytearray(_bytes(path, key)), dtype=torch.bfloat16).reshape(8, 32, 64)


def swap_ranks(d: Path) -> None:
    a, b, tmp = d / "model-rank-0-part-0.safetensors", d / "model-rank-1-part-0.safetensors", d / "swap"
    shutil.move(a, tmp)
    shutil.move(b, a)
    shutil.move(tmp, b)


def gate_up_swapped(d: Path) -> None:
    """Each expert's up rows first in rank 1's layer-1 w13: gate and up read the wrong way."""
    path, key, w13 = _w13(d, 1, 1)
    _replace(path, key, torch.cat([w13[:, 16:], w13[:, :16]], dim=1).contiguous().view(torch.uint8).numpy().tobytes())


def another_expert(d: Path) -> None:
    """Expert 5's slot of rank 0's layer-2 w13 holds expert 4's rows."""
    path, key, w13 = _w13(d, 0, 2)
    w13[5] = w13[4]
    _replace(path, key, w13.contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(
    "breaking, named, not_named",
    [
        (swap_ranks, ["model.layers.1.mlp.experts.0.gate_proj.weight (group moe_tp rank 0/2, ranks [0]): holds the slice of group rank 1"], []),
        (gate_up_swapped, ["model.layers.1.mlp.experts.0.gate_proj.weight (group moe_tp rank 1/2", "model.layers.1.mlp.experts.7.up_proj.weight"], ["rank 0/2"]),
        (another_expert, ["model.layers.2.mlp.experts.5.gate_proj.weight (group moe_tp rank 0/2", "model.layers.2.mlp.experts.5.up_proj.weight"], ["experts.4.", "rank 1/2"]),
    ],
)
def test_glm_broken_exports_are_caught_by_check_source(glm_vllm, glm4_moe, copy_of, breaking, named, not_named):
    report = check(_broken(copy_of, glm_vllm, breaking), glm4_moe)
    text = _findings(report)
    assert not report.ok
    assert all(n in text for n in named) and not any(n in text for n in not_named), text


def test_glm_vllm_refusals(glm4_moe, tmp_path):
    tpshard.split(glm4_moe, tmp_path / "dp", tpshard.Topology(tp=2, attn_dp=2))
    with pytest.raises(ExportError, match=r"--format vllm: split with --attn-dp 2"):
        export(tmp_path / "dp", tmp_path / "x", "vllm")
    tpshard.split(glm4_moe, tmp_path / "ep", tpshard.Topology(tp=4, ep=2))
    with pytest.raises(ExportError, match=r"--ep 2 \(moe_tp 2\) at tp 4; vLLM builds either"):
        export(tmp_path / "ep", tmp_path / "x", "vllm")
    with pytest.raises(ExportError, match=r"--format sglang: Glm4MoeForCausalLM has routed experts"):
        export(tmp_path / "ep", tmp_path / "x", "sglang")
    assert not (tmp_path / "x").exists()


# MiniMax-M2 in small (tests/test_minimax.py) at tp 4: 8 heads of 16 over 2 kv heads -> qkv 2 q + 1 k + 1 v
# heads = 64 rows, o_proj 32 columns; q_norm [8 * 16] cut like q (32 per rank), k_norm [2 * 16] like
# k (kv head r // 2: 16); the bf16 router [8, 64] and the fp32 bias [8] in float32; 8 experts of 32
# (w13: 8 gate + 8 up rows each); vocab 256 / 4 = 64 rows.
MINIMAX_TP4 = {
    0: {
        **NORMS, **VLLM_BUFFERS,
        "self_attn.qkv_proj.weight": (BF, (64, 64)), "self_attn.o_proj.weight": (BF, (64, 32)),
        "self_attn.q_norm.weight": (BF, (32,)), "self_attn.k_norm.weight": (BF, (16,)),
        "block_sparse_moe.gate.weight": (F32, (8, 64)), "block_sparse_moe.e_score_correction_bias": (F32, (8,)),
        "block_sparse_moe.experts.routed_experts.w13_weight": (BF, (8, 16, 64)),
        "block_sparse_moe.experts.routed_experts.w2_weight": (BF, (8, 64, 8)),
    }
}  # fmt: skip


@pytest.fixture(scope="module")
def minimax(tmp_path_factory) -> Path:
    from test_minimax import make_minimax

    return make_minimax(tmp_path_factory.mktemp("minimax") / "model")


@pytest.fixture(scope="module")
def minimax_vllm(minimax, tmp_path_factory) -> Path:
    return split_export(minimax, tmp_path_factory.mktemp("minimax-vllm"), tp=4)


def test_minimax_every_rank_holds_vllms_keys_and_bytes_tp4(minimax_vllm, minimax):
    """q_norm / k_norm as vLLM's MiniMaxText01RMSNormTP loads them: q's heads of the rank, k's kv head
    r // 2 (replicated with it); the router cast to float32; experts w13 = [w1; w3] of the rank."""
    want = {**worked(MINIMAX_TP4, 2), "model.embed_tokens.weight": (BF, (64, 64)), "lm_head.weight": (BF, (64, 64))}
    w = _source(minimax)
    for r in range(4):
        assert headers(minimax_vllm, r) == want
        got = load_file(minimax_vllm / f"model-rank-{r}-part-0.safetensors")
        for layer in (0, 1):
            a, b = f"model.layers.{layer}.self_attn.", f"model.layers.{layer}.block_sparse_moe."
            assert torch.equal(got[a + "q_norm.weight"], w[a + "q_norm.weight"][32 * r : 32 * r + 32])
            assert torch.equal(got[a + "k_norm.weight"], w[a + "k_norm.weight"][16 * (r // 2) : 16 * (r // 2) + 16])
            assert w[b + "gate.weight"].dtype == torch.bfloat16 and torch.equal(got[b + "gate.weight"], w[b + "gate.weight"].float())
            assert torch.equal(got[b + "e_score_correction_bias"], w[b + "e_score_correction_bias"].float())
            rows = slice(8 * r, 8 * r + 8)
            w13 = torch.stack([torch.cat([w[f"{b}experts.{e}.w1.weight"][rows], w[f"{b}experts.{e}.w3.weight"][rows]]) for e in range(8)])
            assert torch.equal(got[b + "experts.routed_experts.w13_weight"], w13)
            assert torch.equal(got[b + "experts.routed_experts.w2_weight"], torch.stack([w[f"{b}experts.{e}.w2.weight"][:, rows] for e in range(8)]))
    report = check(minimax_vllm, minimax)
    assert report.ok, report.problems


def test_minimax_k_norm_of_another_kv_head_is_caught(minimax_vllm, minimax, copy_of):
    """Rank 2 holds rank 0's k_norm (kv head 0 instead of 1): check --source names it."""
    key, r0, r2 = "model.layers.1.self_attn.k_norm.weight", "model-rank-0-part-0.safetensors", "model-rank-2-part-0.safetensors"
    report = check(_broken(copy_of, minimax_vllm, lambda d: _replace(d / r2, key, _bytes(d / r0, key))), minimax)
    text = _findings(report)
    assert not report.ok and "model.layers.1.self_attn.k_norm.weight" in text and "holds the slice of group rank 0" in text, text


# Qwen3-Next / Qwen3.5-MoE in small (tests/checkpoints.py) at tp 2: layers 0-2 gated DeltaNet (8 key
# heads of 4: K 32; 16 value heads of 4: V 64), layer 3 gated full attention (8 heads of 8, q_proj
# [q_h | gate_h] per head: 4 x 16 rows + k 8 + v 8 = 80); in_proj_qkvz (2K + 2V) / 2 = 96 rows,
# in_proj_ba 2 x 16 / 2, conv1d (2K + V) / 2 = 64, A_log (float32) / dt_bias 8 value heads, the
# gated norm [4] whole; router kept under the FusedMoE, a shared expert of 48 (24 per rank) and its gate.
HYBRID_MOE = {
    **NORMS,
    "mlp.experts.gate.weight": (BF, (8, 64)),
    "mlp.experts._shared_experts._layer.expert_gate.weight": (BF, (1, 64)),
    "mlp.experts._shared_experts._layer.gate_up_proj.weight": (BF, (48, 64)),
    "mlp.experts._shared_experts._layer.down_proj.weight": (BF, (64, 24)),
    "mlp.experts.routed_experts.w13_weight": (BF, (8, 32, 64)), "mlp.experts.routed_experts.w2_weight": (BF, (8, 64, 16)),
}
HYBRID_TP2 = {
    0: {
        **HYBRID_MOE,
        "linear_attn.in_proj_qkvz.weight": (BF, (96, 64)), "linear_attn.in_proj_ba.weight": (BF, (16, 64)),
        "linear_attn.conv1d.weight": (BF, (64, 1, 4)), "linear_attn.A_log": (F32, (8,)), "linear_attn.dt_bias": (BF, (8,)),
        "linear_attn.norm.weight": (BF, (4,)), "linear_attn.out_proj.weight": (BF, (64, 32)),
    },
    3: {
        **HYBRID_MOE, **VLLM_BUFFERS,
        "self_attn.qkv_proj.weight": (BF, (80, 64)), "self_attn.o_proj.weight": (BF, (64, 32)),
        "self_attn.q_norm.weight": (BF, (8,)), "self_attn.k_norm.weight": (BF, (8,)),
    },
}  # fmt: skip
K, V = 32, 64


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Each hybrid family's checkpoint and its vLLM export at tp 2."""
    from checkpoints import make_checkpoint

    out = {}
    for arch in ("qwen3_next", "qwen3_5_moe"):
        root = tmp_path_factory.mktemp(arch)
        src = make_checkpoint(root / "model", arch, max_shard_size="100KB")
        out[arch] = src, split_export(src, root, tp=2)
    return out


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_every_rank_holds_vllms_keys_and_bytes_tp2(hybrid, arch):
    """The linear attention as vLLM's QwenGatedDeltaNetAttention loads it: Qwen3-Next's packed
    in_proj_qkvz / in_proj_ba by contiguous rows (whole key-head groups); Qwen3.5's [q_r; k_r; v_r; z_r]
    and [b_r; a_r]; conv1d's q, k and v segments each cut; A_log in float32."""
    src, dest = hybrid[arch]
    want = worked({i: HYBRID_TP2[0 if i < 3 else 3] for i in range(4)}, 4)
    w = _source(src)
    for r in (0, 1):
        assert headers(dest, r) == want
        got = load_file(dest / f"model-rank-{r}-part-0.safetensors")
        a = "model.layers.1.linear_attn."

        def rows(x: torch.Tensor, n: int) -> torch.Tensor:
            return x[n * r : n * r + n]

        if arch == "qwen3_next":
            qkvz, ba = rows(w[a + "in_proj_qkvz.weight"], 96), rows(w[a + "in_proj_ba.weight"], 16)
        else:
            qkv = w[a + "in_proj_qkv.weight"]
            qkvz = torch.cat([rows(qkv[:K], 16), rows(qkv[K : 2 * K], 16), rows(qkv[2 * K :], 32), rows(w[a + "in_proj_z.weight"], 32)])
            ba = torch.cat([rows(w[a + "in_proj_b.weight"], 8), rows(w[a + "in_proj_a.weight"], 8)])
        assert torch.equal(got[a + "in_proj_qkvz.weight"], qkvz) and torch.equal(got[a + "in_proj_ba.weight"], ba)
        conv = w[a + "conv1d.weight"]
        assert torch.equal(got[a + "conv1d.weight"], torch.cat([rows(conv[:K], 16), rows(conv[K : 2 * K], 16), rows(conv[2 * K :], 32)]))
        assert torch.equal(got[a + "A_log"], rows(w[a + "A_log"], 8).float()) and torch.equal(got[a + "dt_bias"], rows(w[a + "dt_bias"], 8))
        assert torch.equal(got["model.layers.3.self_attn.qkv_proj.weight"][:64], rows(w["model.layers.3.self_attn.q_proj.weight"], 64))
    report = check(dest, src)
    assert report.ok, report.problems


def test_qwen3_5_in_proj_ba_read_the_wrong_way_is_caught(hybrid, copy_of):
    """Rank 1's in_proj_ba holds [a_r; b_r]: check --source names both."""
    src, dest = hybrid["qwen3_5_moe"]
    key, f = "model.layers.0.linear_attn.in_proj_ba.weight", "model-rank-1-part-0.safetensors"

    def a_first(d: Path) -> None:
        ba = _bytes(d / f, key)
        _replace(d / f, key, ba[len(ba) // 2 :] + ba[: len(ba) // 2])

    text = _findings(check(_broken(copy_of, dest, a_first), src))
    assert "model.layers.0.linear_attn.in_proj_b.weight" in text and "model.layers.0.linear_attn.in_proj_a.weight" in text, text


def test_qwen3_next_conv1d_of_another_rank_is_caught(hybrid, copy_of):
    src, dest = hybrid["qwen3_next"]
    key, r0, r1 = "model.layers.2.linear_attn.conv1d.weight", "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"
    text = _findings(check(_broken(copy_of, dest, lambda d: _replace(d / r1, key, _bytes(d / r0, key))), src))
    assert "model.layers.2.linear_attn.conv1d.weight" in text and "holds the slice of group rank 0" in text, text


# gpt-oss bf16 in small (tests/gpt_oss_fixtures.py) at tp 2: 8 heads of 16 over 2 kv heads -> qkv
# 96 rows with biases, o_proj [64, 64] and its bias whole, sinks of the rank's 4 q heads; the router
# with its bias whole; 8 experts of 96: gate_up_proj [8, 64, 192] cut on dim 2 (48 interleaved
# gate/up pairs) and transposed per expert into w13 [8, 96, 64], down_proj [8, 96, 64] cut on dim 1
# and transposed into w2 [8, 64, 48]; w2_bias [8, 64] whole on rank 0, zeros on rank 1.
GPT_OSS_TP2 = {
    0: {
        **NORMS, **{k.replace("self_attn.", "attn.", 1): v for k, v in VLLM_BUFFERS.items()},
        "attn.qkv_proj.weight": (BF, (96, 64)), "attn.qkv_proj.bias": (BF, (96,)),
        "attn.o_proj.weight": (BF, (64, 64)), "attn.o_proj.bias": (BF, (64,)), "attn.sinks": (BF, (4,)),
        "mlp.router.weight": (BF, (8, 64)), "mlp.router.bias": (BF, (8,)),
        "mlp.experts.routed_experts.w13_weight": (BF, (8, 96, 64)), "mlp.experts.routed_experts.w13_bias": (BF, (8, 96)),
        "mlp.experts.routed_experts.w2_weight": (BF, (8, 64, 48)), "mlp.experts.routed_experts.w2_bias": (BF, (8, 64)),
    }
}  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> Path:
    from gpt_oss_fixtures import make_gpt_oss

    return make_gpt_oss(tmp_path_factory.mktemp("gpt_oss") / "model")


@pytest.fixture(scope="module")
def gpt_oss_vllm(gpt_oss, tmp_path_factory) -> Path:
    return split_export(gpt_oss, tmp_path_factory.mktemp("gpt-oss-vllm"), tp=2)


def test_gpt_oss_every_rank_holds_vllms_keys_and_bytes_tp2(gpt_oss_vllm, gpt_oss):
    """As vLLM's GptOssModel._load_weights_other loads a bf16 checkpoint: each expert's slice of the
    interleaved gate_up_proj and of down_proj transposed, the down bias on rank 0 only."""
    want = {**worked(GPT_OSS_TP2, 2), "model.embedding.weight": GLOBAL["model.embed_tokens.weight"]}
    del want["model.embed_tokens.weight"]
    w = _source(gpt_oss)
    for r in (0, 1):
        assert headers(gpt_oss_vllm, r) == want
        got = load_file(gpt_oss_vllm / f"model-rank-{r}-part-0.safetensors")
        for layer in (0, 1):
            x = f"model.layers.{layer}.mlp.experts."
            assert torch.equal(got[x + "routed_experts.w13_weight"], w[x + "gate_up_proj"][:, :, 96 * r : 96 * r + 96].transpose(1, 2))
            assert torch.equal(got[x + "routed_experts.w13_bias"], w[x + "gate_up_proj_bias"][:, 96 * r : 96 * r + 96])
            assert torch.equal(got[x + "routed_experts.w2_weight"], w[x + "down_proj"][:, 48 * r : 48 * r + 48].transpose(1, 2))
            bias = w[x + "down_proj_bias"] if r == 0 else torch.zeros(8, 64, dtype=torch.bfloat16)
            assert torch.equal(got[x + "routed_experts.w2_bias"], bias) and bias.abs().sum() > 0 or r == 1
            a = f"model.layers.{layer}.self_attn."
            assert torch.equal(got[f"model.layers.{layer}.attn.sinks"], w[a + "sinks"][4 * r : 4 * r + 4])
    report = check(gpt_oss_vllm, gpt_oss)
    assert report.ok, report.problems


W13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"


def _edit_w13(d: Path, edit) -> None:
    path = d / "model-rank-1-part-0.safetensors"
    w13 = torch.frombuffer(bytearray(_bytes(path, W13)), dtype=torch.bfloat16).reshape(8, 96, 64)
    _replace(path, W13, edit(w13).contiguous().view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda w13: w13.reshape(8, 48, 2, 64).flip(2).reshape(8, 96, 64), id="gate-up-pairs-swapped"),
        pytest.param(lambda w13: w13.transpose(1, 2).reshape(8, 96, 64), id="not-transposed"),
        pytest.param(lambda w13: w13[[1, 0, 2, 3, 4, 5, 6, 7]], id="experts-0-1-swapped"),
    ],
)
def test_gpt_oss_broken_w13_is_caught_by_check_source(gpt_oss_vllm, gpt_oss, copy_of, edit):
    report = check(_broken(copy_of, gpt_oss_vllm, lambda d: _edit_w13(d, edit)), gpt_oss)
    text = _findings(report)
    assert not report.ok and f"{W13} slot 0 (model.layers.1.mlp.experts.gate_up_proj, group rank 1) differs from the source" in text, text


def test_gpt_oss_down_bias_on_rank_1_is_caught(gpt_oss_vllm, copy_of):
    """vLLM zeroes it on moe-tp ranks != 0 (the bias is added once after the reduction): rank 1
    holding the bias would add it twice; check compares it with the zeros, checksums rewritten or not."""
    from test_export import rewrite_export_checksums

    key, r0, r1 = "model.layers.0.mlp.experts.routed_experts.w2_bias", "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"
    broken = copy_of(gpt_oss_vllm)
    _replace(broken / r1, key, _bytes(broken / r0, key))
    rewrite_export_checksums(broken)
    text = _findings(check(broken))
    assert f"{key} does not hold the constant 0.0" in text, text


def test_gpt_oss_ep_equals_tp_is_vllm_expert_parallel(gpt_oss, tmp_path, copy_of):
    """bf16 gpt-oss split for vLLM with --ep 2 (tp 2): vLLM's _load_weights_other under
    --enable-expert-parallel (models/gpt_oss.py L1186-1235) gives rank r experts [4r, 4r + 4) whole:
    w13 / w2 each expert transposed, w13_bias and w2_bias their rows, the down bias on every rank
    (no zeroing under EP). Without --engine vllm the split is refused (SGLang cannot load it); rank 1's
    down bias zeroed, as the ep-1 layout would hold it, is caught by check --source."""
    with pytest.raises(PlanError, match=r"--ep 2: .* cannot load --ep > 1; .* or split for vLLM \(--format vllm or --engine vllm\)"):
        tpshard.split(gpt_oss, tmp_path / "sglang", tpshard.Topology(tp=2, ep=2))
    dest = split_export(gpt_oss, tmp_path, tp=2, ep=2, engine="vllm")
    experts = {
        "mlp.experts.routed_experts.w13_weight": (BF, (4, 192, 64)), "mlp.experts.routed_experts.w13_bias": (BF, (4, 192)),
        "mlp.experts.routed_experts.w2_weight": (BF, (4, 64, 96)), "mlp.experts.routed_experts.w2_bias": (BF, (4, 64)),
    }  # fmt: skip
    want = {**worked({0: {**GPT_OSS_TP2[0], **experts}}, 2), "model.embedding.weight": GLOBAL["model.embed_tokens.weight"]}
    del want["model.embed_tokens.weight"]
    w = _source(gpt_oss)
    for r in (0, 1):
        assert headers(dest, r) == want
        got = load_file(dest / f"model-rank-{r}-part-0.safetensors")
        mine = slice(4 * r, 4 * r + 4)
        for layer in (0, 1):
            x = f"model.layers.{layer}.mlp.experts."
            assert torch.equal(got[x + "routed_experts.w13_weight"], w[x + "gate_up_proj"][mine].transpose(1, 2))
            assert torch.equal(got[x + "routed_experts.w2_weight"], w[x + "down_proj"][mine].transpose(1, 2))
            assert torch.equal(got[x + "routed_experts.w13_bias"], w[x + "gate_up_proj_bias"][mine])
            assert torch.equal(got[x + "routed_experts.w2_bias"], w[x + "down_proj_bias"][mine]) and got[x + "routed_experts.w2_bias"].abs().sum() > 0
    assert check(dest, gpt_oss).ok
    key = "model.layers.0.mlp.experts.routed_experts.w2_bias"
    broken = _broken(copy_of, dest, lambda d: _replace(d / "model-rank-1-part-0.safetensors", key, bytes(4 * 64 * 2)))
    report = check(broken, gpt_oss)
    assert not report.ok and "model.layers.0.mlp.experts.down_proj_bias (group tp rank 1/2, ranks [1]): differs from the source" in _findings(report)


def test_gpt_oss_more_ranks_than_kv_heads_refused(gpt_oss, tmp_path):
    tpshard.split(gpt_oss, tmp_path / "tp4", tpshard.Topology(tp=4))  # 2 kv heads: replicated by tpshard, none per rank in vLLM
    with pytest.raises(ExportError, match=r"gpt-oss at tp 4 over 2 kv heads; vLLM's OAIAttention \(models/gpt_oss.py\) gives each rank"):
        export(tmp_path / "tp4", tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists()


def test_glm_moe_dense_tp_and_tied_refused(glm4_moe, copy_of, tmp_path):
    tpshard.split(glm4_moe, tmp_path / "dense", tpshard.Topology(tp=2, moe_dense_tp=1))
    with pytest.raises(ExportError, match=r"--moe-dense-tp 1; vLLM has no such option.*Glm4MoeMLP, glm4_moe.py"):
        export(tmp_path / "dense", tmp_path / "x", "vllm")
    from checkpoints import make_checkpoint

    tied = make_checkpoint(tmp_path / "tied", "glm4_moe", tie_word_embeddings=True)  # no lm_head.weight on disk
    tpshard.split(tied, tmp_path / "tied-tp2", tpshard.Topology(tp=2))
    with pytest.raises(ExportError, match=r"ties lm_head to the embedding; vLLM's Glm4MoeForCausalLM \(models/glm4_moe.py\) never ties them"):
        export(tmp_path / "tied-tp2", tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists()


def test_quantized_glm_is_refused_for_vllm(tmp_path):
    """FP8 block passes the export's own quantization check (DeepSeek's, Qwen3-MoE's and Mixtral's
    are proven); the 2026 families' tables are proven for bf16 only, so a GLM-4.5-FP8 is refused."""
    from checkpoints import make_checkpoint
    from quant_moe import quantize_linears

    src = make_checkpoint(tmp_path / "glm", "glm4_moe", moe_intermediate_size=256, hidden_size=128)  # whole 128-blocks at tp 2
    quantize_linears(src, "fp8_block")
    tpshard.split(src, tmp_path / "out", tpshard.Topology(tp=2))
    with pytest.raises(ExportError, match=r"quantized \(fp8_block\); tpshard's vLLM table for Glm4MoeForCausalLM \(models/glm4_moe.py\) is proven for unquantized"):
        export(tmp_path / "out", tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists()
