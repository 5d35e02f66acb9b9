"""verify exercises or compares every byte of every rank, not only what reaches rank 0's outputs.

Compared with what: whole copies (norms, row biases, input scales) with the source's bytes, each
rank's files with the manifest's checksums, padding with zeros, every rank's logits and activations
with transformers' and their replica peers', a bias alone (zero input) with the source bias exactly,
and quantized layers' inputs quantized with the *source* activation scales.

Each breakage below passed verify before (it touches bytes no compared output depended on) and
must now fail it, naming the rank. Where a whole copy is changed on one rank only, that rank's
folder gets a private copy of the shared file first (split hard-links identical files).
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from broken import overwrite_tensor, rewrite_checksums
from checkpoints import make_checkpoint
from quant_fixtures import DEFAULT_SPECS, write_quant_checkpoint

import tpshard
from tpshard.manifest import rank_dir, read_manifest
from tpshard.topology import Topology
from tpshard.verify import verify_many


def copy(good: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    return dst


def file_of(out: Path, rank: int, name: str) -> str:
    return next(s.file for s in read_manifest(out).plan.rank_shards(rank) if s.name == name)


def unshare(out: Path, rank: int, name: str) -> None:
    """Give `rank` its own copy of the file holding `name` (the others keep the shared one)."""
    path = out / rank_dir(rank) / file_of(out, rank, name)
    private = path.with_suffix(".private")
    shutil.copyfile(path, private)
    os.replace(private, path)


def scale_on_rank(out: Path, rank: int, name: str, factor: float) -> None:
    unshare(out, rank, name)
    overwrite_tensor(out, rank, name, tpshard.open_rank(out, rank)[name] * factor)


def test_every_rank_every_byte_tp8_attn_dp2(biased, tmp_path):
    model, good = biased
    outs = {}
    # Norms on non-first ranks of an attention-DP replica: rank 5 is attn_tp rank 1 of replica 1,
    # rank 6 attn_tp rank 2. Their post-attention / final norm outputs are gathered away (the MLP and
    # lm_head take one copy per replica), so before, nothing compared them.
    outs["post_norm_rank5"] = copy(good, tmp_path / "post_norm_rank5")
    scale_on_rank(outs["post_norm_rank5"], 5, "model.layers.1.post_attention_layernorm.weight", 10.0)
    outs["final_norm_rank6"] = copy(good, tmp_path / "final_norm_rank6")
    scale_on_rank(outs["final_norm_rank6"], 6, "model.norm.weight", 10.0)
    # The row-parallel bias on group rank 2 (world rank 2): held, never added (group rank 0 adds it).
    outs["row_bias_rank2"] = copy(good, tmp_path / "row_bias_rank2")
    scale_on_rank(outs["row_bias_rank2"], 2, "model.layers.0.self_attn.o_proj.bias", 1.01)
    # Vocab padding rows of the last embedding shard (world ranks 3, 7) not zero; checksums agree.
    out = outs["vocab_padding"] = copy(good, tmp_path / "vocab_padding")
    emb = tpshard.open_rank(out, 3)["model.embed_tokens.weight"].clone()
    emb[-6:] = 0.5
    overwrite_tensor(out, 3, "model.embed_tokens.weight", emb)
    rewrite_checksums(out)
    # One flipped byte in every file of every rank (in the tensor data), checksums not rewritten.
    out = outs["flipped"] = copy(good, tmp_path / "flipped")
    rng = random.Random(0)
    flipped = {}
    for r in range(8):
        for f in read_manifest(out).plan.rank_files(r):
            path = out / rank_dir(r) / f.name
            if path.stat().st_nlink > 1:  # shared with other ranks: this rank gets its own copy
                shutil.copyfile(path, path.with_suffix(".private"))
                os.replace(path.with_suffix(".private"), path)
            data = bytearray(path.read_bytes())
            header = 8 + int.from_bytes(data[:8], "little")
            at = rng.randrange(header, len(data))
            data[at] ^= 1 << rng.randrange(8)
            path.write_bytes(bytes(data))
            flipped[(r, f.name)] = at

    reports = dict(zip(outs, verify_many(list(outs.values()), [model] * len(outs), model=True)))

    def tensors(name: str) -> str:
        r = reports[name]
        assert not r.ok and r.tensors is not None
        return "\n".join(r.tensors.problems)

    for name, rank, tensor in (
        ("post_norm_rank5", 5, "model.layers.1.post_attention_layernorm.weight"),
        ("final_norm_rank6", 6, "model.norm.weight"),
    ):
        m = reports[name].model
        assert not m.ok, f"{name}: --model must fail"
        assert f"world ranks [{rank}] hold activations that differ from their attention-DP replica's" in "; ".join(m.problems)
        assert f"{tensor} on world ranks [{rank}]: bytes differ from the source's {tensor}: max |x|" in tensors(name)
        assert "(x10)" in tensors(name)
    assert "model.layers.0.self_attn.o_proj.bias on world ranks [2]: bytes differ from the source's" in tensors("row_bias_rank2")
    assert "(x1.01)" in tensors("row_bias_rank2")
    assert reports["row_bias_rank2"].model.ok, "the copy on group rank 2 is not added: only the byte comparison sees it"
    pad = tensors("vocab_padding")
    assert "model.embed_tokens.weight on rank 3: its 6 padding entries along dim 0 are not zero" in pad
    assert "model.embed_tokens.weight on rank 7: its 6 padding entries" in pad
    assert all(x.ok for x in reports["vocab_padding"].layers), "padding rows never reach an output"
    flips = tensors("flipped")
    for r, fname in flipped:
        assert f"rank {r}: {fname} of ranks [{r}]: " in flips, (r, fname, flips)


@pytest.fixture(scope="module")
def biased_tp2(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("biased-tp2")
    model = make_checkpoint(root / "model", "llama", attention_bias=True)
    out = root / "out"
    tpshard.split(model, out, Topology(tp=2))
    return model, out


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_one_percent_row_bias_error_caught_in_half_precision(biased_tp2, tmp_path, dtype):
    """o_proj.bias x 1.01 (checksums rewritten): next to x @ W.T in bf16 it hides under the
    tolerance; the zero-input probe sees the bias alone and must match it exactly. The good output
    passes in the same dtype (the probe is exact, not merely within tolerance)."""
    model, good = biased_tp2
    bad = copy(good, tmp_path / "bias")
    name = "model.layers.0.self_attn.o_proj.bias"
    overwrite_tensor(bad, 0, name, tpshard.open_rank(bad, 0)[name] * 1.01)
    rewrite_checksums(bad)
    # And a flipped byte in a safetensors header (rank 1's own file): a finding, not a crash.
    header = copy(good, tmp_path / "header")
    f = read_manifest(header).plan.rank_files(1)[0].name
    path = header / rank_dir(1) / f
    data = bytearray(path.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") // 2] ^= 0x40
    path.write_bytes(bytes(data))
    ok, wrong, unreadable = verify_many([good, bad, header], [model] * 3, dtype=dtype)
    assert ok.ok, ok.failures()
    assert not unreadable.ok and f"rank 1: {f} of ranks [1]: safetensors header differs from the planned one" in unreadable.tensors.problems
    o_proj = next(x for x in wrong.layers if x.layer == "model.layers.0.self_attn.o_proj")
    assert not o_proj.ok
    assert any(p.startswith("bias (zero input): output differs from the reference") for p in o_proj.problems), o_proj.problems
    assert f"{name} on world ranks [0, 1]: bytes differ" in "\n".join(wrong.tensors.problems)


@pytest.fixture(scope="module")
def static_scales(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    made = {}
    for fmt in ("fp8_tensor", "ct_nvfp4"):
        root = tmp_path_factory.mktemp(fmt)
        write_quant_checkpoint(root / "model", DEFAULT_SPECS[fmt])
        tpshard.split(root / "model", root / "out", Topology(tp=2))
        made[fmt] = (root / "model", root / "out")
    return made


def test_activation_scales_are_used(static_scales, tmp_path):
    """q_proj's input_scale (FP8) and input_global_scale (NVFP4) x 10, checksums rewritten: the
    reference quantizes the layer input with the source scale, the ranks with theirs."""
    jobs = []
    for fmt, suffix in (("fp8_tensor", "input_scale"), ("ct_nvfp4", "input_global_scale")):
        model, good = static_scales[fmt]
        bad = copy(good, tmp_path / fmt)
        name = f"model.layers.0.self_attn.q_proj.{suffix}"
        assert torch.equal(tpshard.open_rank(bad, 0)[name], tpshard.open_rank(bad, 1)[name])
        overwrite_tensor(bad, 0, name, tpshard.open_rank(bad, 0)[name] * 10)
        rewrite_checksums(bad)
        jobs += [(fmt, model, good), (fmt + " x10", model, bad)]
    reports = verify_many([o for _, _, o in jobs], [m for _, m, _ in jobs])
    for (what, _, _), r in zip(jobs, reports):
        qkv = next(x for x in r.layers if x.layer == "model.layers.0.self_attn.qkv_proj")
        if "x10" not in what:
            assert r.ok, (what, r.failures())
            continue
        assert not qkv.ok, what
        assert any("piece q of group rank" in p for p in qkv.problems), (what, qkv.problems)
        assert [x.layer for x in r.layers if not x.ok] == ["model.layers.0.self_attn.qkv_proj"], what
