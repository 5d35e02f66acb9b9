"""vLLM exports of Llama-4 (bf16, tests/llama4_fixtures.py): names, shapes and dtypes per rank against
tables worked by hand from vLLM 0.33.0's Llama4ForConditionalGeneration with --language-model-only
(and its CPU build, docs/deploy.md), the bytes against slices cut here with torch from the source
after vLLM's own q/k permutation (models/llama4.py permute_qk_weight_for_rotary, rewritten here, not
tpshard's), check --source on the export, and the export broken on purpose (q/k left in the
checkpoint's row order, another rank's qkv) caught by check."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tpshard
from tpshard.check import check
from tpshard.export import export
from tpshard.export.launch import launch_line
from tpshard.export.manifest import read_export_manifest
from test_export import VLLM_BUFFERS, _source, headers
from test_export_quant import _broken, _bytes, _findings, _replace

BF = "BF16"
LM, T = "language_model.", "language_model.model.layers."
SHARED = "feed_forward.experts._shared_experts._layer."
ROUTED = "feed_forward.experts.routed_experts."


def worked(tp: int, ep: int) -> dict:
    """The fixture's text model (hidden 64, 8 heads of 16 over 2 kv heads, 4 layers, experts in 1 and 3:
    4 of 32, a shared expert of 32, dense MLPs of 48, vocab 250 padded to 256) as vLLM builds rank r
    at `tp` (kv heads replicated past 2), with --enable-expert-parallel at ep = tp: E / ep whole experts."""
    q, kv = 8 // tp, max(2 // tp, 1)
    experts, i = (4 // ep, 32) if ep > 1 else (4, 32 // tp)
    table = {LM + "model.embed_tokens.weight": (BF, (256 // tp, 64)), LM + "lm_head.weight": (BF, (256 // tp, 64)), LM + "model.norm.weight": (BF, (64,))}
    for layer in range(4):
        p = f"{T}{layer}."
        table.update({p + k: v for k, v in VLLM_BUFFERS.items()})
        table.update({
            p + "input_layernorm.weight": (BF, (64,)), p + "post_attention_layernorm.weight": (BF, (64,)),
            p + "self_attn.qkv_proj.weight": (BF, ((q + 2 * kv) * 16, 64)), p + "self_attn.o_proj.weight": (BF, (64, q * 16)),
        })  # fmt: skip
        if layer % 2 == 0:
            table.update({p + "feed_forward.gate_up_proj.weight": (BF, (2 * 48 // tp, 64)), p + "feed_forward.down_proj.weight": (BF, (64, 48 // tp))})
        else:
            table.update({
                p + "feed_forward.router.weight": (BF, (4, 64)),
                p + SHARED + "gate_up_proj.weight": (BF, (2 * 32 // tp, 64)), p + SHARED + "down_proj.weight": (BF, (64, 32 // tp)),
                p + ROUTED + "w13_weight": (BF, (experts, 2 * i, 64)), p + ROUTED + "w2_weight": (BF, (experts, 64, i)),
            })  # fmt: skip
    return table


def rotary_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """vLLM 0.33.0 models/llama4.py L833-838, on the whole checkpoint tensor (before its loader cuts it)."""
    f_out, f_in = w.shape
    return w.view(heads, f_out // heads // 2, 2, f_in).transpose(1, 2).reshape(f_out, f_in)


def rows(t: torch.Tensor, r: int, n: int) -> torch.Tensor:
    k = t.shape[0] // n
    return t[r * k : (r + 1) * k]


def want_qkv(w: dict, layer: int, r: int, tp: int) -> torch.Tensor:
    a = f"{T}{layer}.self_attn."
    kv_r, kv_n = (r, tp) if tp <= 2 else (r // (tp // 2), 2)  # past 2 kv heads each is replicated
    q = rows(rotary_order(w[a + "q_proj.weight"], 8), r, tp)
    k = rows(rotary_order(w[a + "k_proj.weight"], 2), kv_r, kv_n)
    return torch.cat([q, k, rows(w[a + "v_proj.weight"], kv_r, kv_n)])


def split_export(src: Path, root: Path, **topo) -> Path:
    tpshard.split(src, root / "out", tpshard.Topology(**topo))
    export(root / "out", root / "vllm", "vllm")
    return root / "vllm"


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    from llama4_fixtures import make_llama4

    return make_llama4(tmp_path_factory.mktemp("llama4") / "model")


@pytest.fixture(scope="module")
def llama4_vllm(llama4, tmp_path_factory) -> Path:
    return split_export(llama4, tmp_path_factory.mktemp("llama4-vllm"), tp=2)


@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 4)])
def test_every_rank_holds_vllms_keys_and_bytes(llama4, llama4_vllm, tmp_path, tp, ep):
    """q/k rows in vLLM's rotary order, w13 each expert's [gate_r; up_r] rows (the segmented halves
    of gate_up_proj [E, H, 2I], transposed), w2 down's rows transposed; at ep = tp one whole expert a rank."""
    dest = llama4_vllm if (tp, ep) == (2, 1) else split_export(llama4, tmp_path, tp=tp, ep=ep)
    w = _source(llama4)
    for r in range(tp):
        assert headers(dest, r) == worked(tp, ep)
        got = load_file(dest / f"model-rank-{r}-part-0.safetensors")
        for layer in range(4):
            assert torch.equal(got[f"{T}{layer}.self_attn.qkv_proj.weight"], want_qkv(w, layer, r, tp)), (r, layer)
        for layer in (1, 3):
            x = f"{T}{layer}.feed_forward."
            gu, down = w[x + "experts.gate_up_proj"], w[x + "experts.down_proj"]
            if ep > 1:
                w13, w2 = gu[r : r + 1], down[r : r + 1]
            else:
                j = slice(32 // tp * r, 32 // tp * (r + 1))
                w13, w2 = torch.cat([gu[:, :, :32][:, :, j], gu[:, :, 32:][:, :, j]], 2), down[:, j]
            assert torch.equal(got[x + "experts.routed_experts.w13_weight"], w13.transpose(1, 2))
            assert torch.equal(got[x + "experts.routed_experts.w2_weight"], w2.transpose(1, 2))
    report = check(dest, llama4)
    assert report.ok, report.problems
    line = launch_line(read_export_manifest(dest), dest)
    assert "--language-model-only" in line and ("--enable-expert-parallel" in line) == (ep > 1), line


QKV = f"{T}0.self_attn.qkv_proj.weight"


def _unpermuted(d: Path) -> None:
    """Rank 1's q and k heads back in the checkpoint's row order (what the export held before vLLM's permutation was mapped)."""
    path = d / "model-rank-1-part-0.safetensors"
    qkv = torch.frombuffer(bytearray(_bytes(path, QKV)), dtype=torch.bfloat16).reshape(96, 64)
    q, k, v = qkv[:64], qkv[64:80], qkv[80:]
    back = [x.view(-1, 2, 8, 64).transpose(1, 2).reshape(-1, 64) for x in (q, k)]
    _replace(path, QKV, torch.cat([*back, v]).contiguous().view(torch.uint8).numpy().tobytes())


def _rank0s(d: Path) -> None:
    _replace(d / "model-rank-1-part-0.safetensors", QKV, _bytes(d / "model-rank-0-part-0.safetensors", QKV))


@pytest.mark.parametrize(
    "edit, named",
    [
        pytest.param(_unpermuted, [f"{QKV} slot 0 ({T}0.self_attn.q_proj.weight, group rank 1) differs", f"{QKV} slot 1 ({T}0.self_attn.k_proj.weight, group rank 1) differs"], id="q-k-unpermuted"),
        pytest.param(_rank0s, [f"{QKV} slot 0 ({T}0.self_attn.q_proj.weight, group rank 1) differs from the source: it holds the shard of rank(s) [0]"], id="rank-0s-qkv"),
    ],
)  # fmt: skip
def test_broken_qkv_is_caught(llama4_vllm, llama4, copy_of, tmp_path, edit, named):
    """With the export manifest's checksums rewritten to agree only the source tells (check --source);
    as written, check alone sees the files differ from their checksums."""
    text = _findings(check(_broken(copy_of, llama4_vllm, edit), llama4))
    assert all(n in text for n in named), text
    raw = tmp_path / "raw"
    shutil.copytree(llama4_vllm, raw)
    edit(raw)
    assert not check(raw).ok
