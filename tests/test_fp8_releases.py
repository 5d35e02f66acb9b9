"""The newer families' FP8 block releases (tests/fp8_releases.py: MiniMax-M2, Qwen3-Next, Qwen3.5-MoE),
split as SGLang 0.5.23 loads them.

What each rank holds is stated here independently, with torch indexing, from SGLang's loaders: the FP8
codes are cut as the bf16 weight would be (the dense rules of tests/test_hybrid.py and
tests/test_minimax.py), and a weight_scale_inv [ceil(N/128), ceil(K/128)] is cut the same way in
units of 128 rows / columns (Fp8LinearMethod's BlockQuantScaleParameter: the merged loader's
`ceil(offset / 128)` offsets, layers/linear.py; Qwen3.5's in_proj_qkv split by blocks per segment,
models/qwen3_5.py L565-582; Qwen3-Next's packed in_proj_qkvz narrowed contiguously, qwen3_next.py
L300-342). conv1d, in_proj_ba / in_proj_a / in_proj_b, routers and norms stay bf16. Then the
refusals SGLang makes too, breakages check --source must see, and verify (layer level and against
transformers on the dequantized source).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import tpshard
from broken import only_the_source_tells, overwrite_tensor, problems, rewrite_checksums, take_from_rank
from checkpoints import make_checkpoint
from fp8_releases import quantize_llama4_fbgemm, quantize_release
from llama4_fixtures import make_llama4
from test_minimax import make_minimax
from test_moe_split import source_tensors
from tpshard.errors import CheckpointError, PlanError
from tpshard.topology import Topology
from tpshard.verify import verify_many

MM, NEXT, Q35 = "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM"
E, KD, VD = 8, 8 * 128, 16 * 128  # experts; linear attention K = key heads x 128, V = value heads x 128
HYBRID = dict(
    hidden_size=256, head_dim=128, moe_intermediate_size=256, shared_expert_intermediate_size=1024,
    linear_num_key_heads=8, linear_key_head_dim=128, linear_num_value_heads=16, linear_value_head_dim=128,
)  # fmt: skip
TOPOLOGIES = [Topology(tp=2), Topology(tp=4, ep=2), Topology(tp=8, ep=4), Topology(tp=8, attn_dp=2, ep=8)]


def make_release(path: Path, family: str, **overrides) -> Path:
    if family == MM:
        make_minimax(path, hidden_size=256, head_dim=128, intermediate_size=256, rotary_dim=64, **overrides)
    else:
        make_checkpoint(path, "qwen3_next" if family == NEXT else "qwen3_5_moe", max_shard_size="2MB", **{**HYBRID, **overrides})
    quantize_release(path, {MM: "minimax_m2", NEXT: "qwen3_next", Q35: "qwen3_5"}[family])
    return path


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_releases")
    return {f: make_release(root / f, f) for f in (MM, NEXT, Q35)}


@pytest.fixture(scope="module")
def tp2(releases, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_tp2")
    for f, src in releases.items():
        tpshard.split(src, root / f, Topology(tp=2))
    return {f: root / f for f in releases}


def chunk(x: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    return x.chunk(n, dim)[r]


def expected(family: str, name: str, full: torch.Tensor, rank: int, topo: Topology) -> torch.Tensor | None:
    """What SGLang's class loads on `rank` from `name` (a weight or its block scale); None: another EP slot's expert."""
    attn_tp, moe_tp = topo.tp // topo.attn_dp, topo.tp // topo.ep
    a = rank % attn_tp
    s = 128 if name.endswith(".weight_scale_inv") else 1  # a scale row / column per 128 of the weight's
    if ".experts." in name:
        e = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
        if e // (E // topo.ep) != rank // moe_tp:
            return None
        return chunk(full, rank % moe_tp, moe_tp, 1 if re.search(r"\.(w2|down_proj)\.", name) else 0)
    def kv() -> torch.Tensor:  # 2 kv heads: split, or each replicated attn_tp / 2 ways
        return chunk(full, a // (attn_tp // 2), 2)

    if family == MM and ".q_norm." in name:
        return chunk(full, a, attn_tp)  # MiniMaxM2RMSNormTP: the q heads' cut
    if family == MM and ".k_norm." in name:
        return kv()
    if name.endswith(("norm.weight", ".gate.weight", "shared_expert_gate.weight", "e_score_correction_bias")):
        return full
    vocab = torch.cat([full, full.new_zeros(6, *full.shape[1:])])  # 250 rows padded to 256 (vocab tensors only)
    if name == "model.embed_tokens.weight":
        if family == Q35:
            return vocab if topo.attn_dp > 1 else chunk(vocab, rank, topo.tp)
        return chunk(vocab, a, attn_tp)
    if name == "lm_head.weight":
        return chunk(vocab, rank, topo.tp)
    if ".shared_expert." in name:
        return chunk(full, rank, topo.tp, 1 if ".down_proj." in name else 0)
    if re.search(r"\.(in_proj_qkv|conv1d)\.", name):  # q | k | v segments, each cut over attn_tp
        return torch.cat([chunk(x, a, attn_tp) for x in full.split((KD // s, KD // s, VD // s))])
    if re.search(r"\.(out_proj|o_proj)\.", name):
        return chunk(full, a, attn_tp, 1)
    if re.search(r"\.[kv]_proj\.", name):
        return kv()
    # q_proj, in_proj_z / b / a, Qwen3-Next's packed in_proj_qkvz / in_proj_ba, A_log, dt_bias: contiguous
    return chunk(full, a, attn_tp)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_release_tensors(releases):
    """FP8 codes and block scales where the releases have them; bf16 where SGLang builds the layer unquantized."""
    for family, src in releases.items():
        full = source_tensors(src)
        fp8 = {n.removesuffix(".weight") for n, t in full.items() if t.dtype == torch.float8_e4m3fn}
        assert fp8 == {n.removesuffix(".weight_scale_inv") for n in full if n.endswith("weight_scale_inv")}
        scale = full[f"{sorted(fp8)[0]}.weight_scale_inv"].dtype
        assert scale == (torch.float32 if family == MM else torch.bfloat16)
        kept = [n for n in full if re.search(r"(conv1d|in_proj_ba|in_proj_a|in_proj_b|\.gate|norm)\.weight$", n)]
        assert kept and all(full[n].dtype == torch.bfloat16 for n in kept), family
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv" in source_tensors(releases[NEXT])
    assert "model.layers.0.block_sparse_moe.experts.7.w2.weight_scale_inv" in source_tensors(releases[MM])


@pytest.mark.parametrize("family", [MM, NEXT, Q35])
def test_every_rank_as_sglang_loads_it(releases, tmp_path, family):
    src = releases[family]
    full = source_tensors(src)
    for topo in TOPOLOGIES:
        out = tmp_path / f"tp{topo.tp}-dp{topo.attn_dp}-ep{topo.ep}"
        tpshard.split(src, out, topo)
        assert tpshard.check(out, src).ok, (topo, problems(out, src)[:3])
        for r in range(topo.world_size):
            held = tpshard.open_rank(out, r)
            want = {n: t for n, x in full.items() if (t := expected(family, n, x, r, topo)) is not None}
            assert sorted(held) == sorted(want), (topo, r, sorted(set(held) ^ set(want))[:4])
            for n, t in want.items():
                assert held[n].dtype == t.dtype and torch.equal(raw(held[n]), raw(t)), (topo, r, n)


def test_qwen3_5_qkv_scale_by_segments(releases, tp2):
    """Rank 1's in_proj_qkv scale rows are q's blocks 4-7, k's 12-15 and v's 24-31 (of 32), not rows 16-31."""
    name = "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv"
    full = source_tensors(releases[Q35])[name]
    got = tpshard.open_rank(tp2[Q35], 1)[name]
    assert torch.equal(got, torch.cat([full[4:8], full[12:16], full[24:32]])) and not torch.equal(got, full[16:])


def test_experts_off_a_block_refused_as_sglang(releases, tmp_path):
    """moe_tp 4 leaves 64 of each expert's 256 rows per rank: half a 128-block."""
    with pytest.raises(PlanError, match=r"(?s)w1\.weight_scale_inv: N 256 over moe_tp of 4 gives 64.*choose --ep"):
        tpshard.split(releases[MM], tmp_path / "out", Topology(tp=4))


def test_qwen3_next_partition_off_a_block_refused(tmp_path):
    """Key dim 8 x 64: at attn_tp 8 each rank's in_proj_qkvz is 640 rows, five whole blocks, but SGLang's
    merged layer checks each of its [K/8, K/8, V/8, V/8] = [64, 64, 256, 256] partitions (fp8.py L600-610)."""
    src = make_release(tmp_path / "src", NEXT, linear_key_head_dim=64)
    with pytest.raises(PlanError, match=r"in_proj_qkvz: fp8_block .* partitions are \[64, 64, 256, 256\].*block_n = 128"):
        tpshard.split(src, tmp_path / "out", Topology(tp=8, ep=4))
    tpshard.split(src, tmp_path / "ok", Topology(tp=8, attn_dp=2, ep=8))  # attn_tp 4: [128, 128, 512, 512]


def test_qwen3_5_segment_slice_off_a_block_refused(tmp_path):
    """Key dim 8 x 64: at attn_tp 8 a rank's slice of each of q and k is 64 rows, half a block (SGLang's
    merged loader narrows the scale to ceil(64 / 128) blocks per shard: a block of another rank's rows)."""
    src = make_release(tmp_path / "src", Q35, linear_key_head_dim=64)
    with pytest.raises(PlanError, match=r"in_proj_qkv\.weight_scale_inv: N 512 over attn_tp of 8 gives 64 per rank"):
        tpshard.split(src, tmp_path / "out", Topology(tp=8, ep=4))


def test_conv1d_never_quantized(releases, tmp_path):
    """SGLang builds conv1d with quant_config=None: a config that does not list it keeps it bf16 all the
    same; a conv1d stored FP8 with a scale is refused."""
    src = tmp_path / "src"
    shutil.copytree(releases[NEXT], src)
    config = json.loads((src / "config.json").read_text())
    q = config["quantization_config"]
    q["modules_to_not_convert"] = [m for m in q["modules_to_not_convert"] if "conv1d" not in m]
    (src / "config.json").write_text(json.dumps(config))
    tpshard.split(src, tmp_path / "out", Topology(tp=2))
    assert tpshard.check(tmp_path / "out", src).ok

    from safetensors.torch import load_file, save_file

    index = json.loads((src / "model.safetensors.index.json").read_text())
    name = "model.layers.0.linear_attn.conv1d.weight"
    f = src / index["weight_map"][name]
    tensors = load_file(f)
    tensors[name.replace(".weight", ".weight_scale_inv")] = torch.ones(32, 1)
    save_file(tensors, f, metadata={"format": "pt"})
    index["weight_map"][name.replace(".weight", ".weight_scale_inv")] = f.name
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(PlanError, match=r"conv1d\.weight_scale_inv: no rule for parameter 'weight_scale_inv'"):
        tpshard.split(src, tmp_path / "out2", Topology(tp=2))


def test_llama4_maverick_fbgemm_fp8_refused(tmp_path):
    """Maverick's FP8 release (per-channel FP8 experts, fused scales [E, 1, 2I] / [E, H, 1]) is
    fbgemm_fp8, which SGLang 0.5.23 does not register: refused in one line before any tensor is cut."""
    src = make_llama4(tmp_path / "src")
    quantize_llama4_fbgemm(src)
    names = source_tensors(src)
    assert names["language_model.model.layers.1.feed_forward.experts.gate_up_proj_scale"].shape == (4, 1, 64)
    assert names["language_model.model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    with pytest.raises(CheckpointError, match=r"fbgemm_fp8\): SGLang 0.5.23 registers no fbgemm_fp8 method.*bf16 release") as e:
        tpshard.split(src, tmp_path / "out", Topology(tp=2))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("family", "name", "donor"),
    [
        (MM, "model.layers.1.self_attn.o_proj.weight_scale_inv", 1),  # the other rank's scale
        (NEXT, "model.layers.1.linear_attn.in_proj_qkvz.weight_scale_inv", 1),
        (Q35, "model.layers.2.linear_attn.in_proj_qkv.weight_scale_inv", 1),
    ],
)
def test_scale_of_another_rank_is_caught(releases, tp2, copy_of, family, name, donor):
    out = copy_of(tp2[family])
    take_from_rank(out, 0, name, donor)
    found = only_the_source_tells(out, releases[family])
    assert any(name in p for p in found), found[:4]


def test_weight_off_a_block_boundary_is_caught(releases, tp2, copy_of):
    """Rank 0's in_proj_qkvz codes taken 64 rows late (half a block off): the bytes, not the checksums, tell."""
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    out = copy_of(tp2[NEXT])
    full = source_tensors(releases[NEXT])[name]
    overwrite_tensor(out, 0, name, full[64 : 64 + full.shape[0] // 2].clone())
    found = only_the_source_tells(out, releases[NEXT])
    assert any(name in p for p in found), found[:4]


def test_swapped_experts_are_caught(releases, tp2, copy_of):
    """Rank 1 holds expert 3's w1 codes and scale in expert 2's place (and 2's in 3's)."""
    out = copy_of(tp2[MM])
    held = tpshard.open_rank(out, 1)
    for suffix in ("weight", "weight_scale_inv"):
        a, b = (f"model.layers.0.block_sparse_moe.experts.{e}.w1.{suffix}" for e in (2, 3))
        ta, tb = held[a].clone(), held[b].clone()
        overwrite_tensor(out, 1, a, tb)
        overwrite_tensor(out, 1, b, ta)
    found = only_the_source_tells(out, releases[MM])
    assert any("experts.2.w1" in p for p in found) and any("experts.3.w1" in p for p in found), found[:4]


def test_verify_layers_qwen3_5_segmented_fp8(releases, tp2):
    """The only proof that the segmented FP8 in_proj_qkv loads into its MergedColumnParallelLinear
    (dequantized per rank, its q | k | v slices in place) and computes the source's rows."""
    (r,) = verify_many([tp2[Q35]], [releases[Q35]])
    assert r.ok, r.failures()
    layers = {x.layer: x for x in r.layers}
    assert layers["model.layers.0.linear_attn.in_proj_qkvz"].quant == "fp8_block"


@pytest.mark.slow
def test_verify_model_every_family(releases, tp2, tmp_path, copy_of):
    """Every release at tp 2, layers and logits against transformers on the dequantized source, in
    one launch; a copy with another rank's scale fails."""
    broken = copy_of(tp2[MM])
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv"
    overwrite_tensor(broken, 0, name, tpshard.open_rank(broken, 1)[name].clone() * 2)
    rewrite_checksums(broken)
    outs = [tp2[f] for f in (MM, NEXT, Q35)] + [broken]
    reports = verify_many(outs, [releases[f] for f in (MM, NEXT, Q35, MM)], model=True)
    for r in reports[:3]:
        assert r.ok and r.model.top1 == 1.0 and r.model.max_rel < 1e-4, r.failures()
    assert not reports[3].ok


def test_reshard_matches_a_split(releases, tp2, tmp_path):
    """Qwen3.5's segmented FP8 in_proj_qkv and its scale read back from a tp 2 output and re-cut for tp 8 / ep 4."""
    from tpshard.reshard import reshard

    topo = Topology(tp=8, ep=4)
    reshard(tp2[Q35], tmp_path / "re", topo)
    tpshard.split(releases[Q35], tmp_path / "split", topo)
    assert tpshard.check(tmp_path / "re", releases[Q35]).ok
    for r in (0, 5):
        a, b = tpshard.open_rank(tmp_path / "re", r), tpshard.open_rank(tmp_path / "split", r)
        assert sorted(a) == sorted(b) and all(torch.equal(raw(a[n]), raw(b[n])) for n in a)


@pytest.mark.parametrize("family", [NEXT, Q35])
def test_experts_only_release_with_conv1d_unlisted(tmp_path, family):
    """An experts-only compressed-tensors release (W4A16 group 32, packed by compressed-tensors'
    own compressor, tests/quant_moe.py) whose ignore list covers the linear attention's projections
    but not conv1d: SGLang builds conv1d with quant_config=None, so it is bf16 and splits as such
    (tpshard used to refuse it as a quantized ColumnParallelLinear)."""
    from quant_moe import quantize_linears

    src = make_checkpoint(tmp_path / "src", "qwen3_next" if family == NEXT else "qwen3_5_moe", max_shard_size="100KB")
    quantize_linears(src, "w4a16_g32")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["ignore"].append(r"re:.*linear_attn\.(in_proj_\w+|out_proj)$")
    (src / "config.json").write_text(json.dumps(config))
    topo = Topology(tp=4, ep=2)
    tpshard.split(src, tmp_path / "out", topo)
    assert tpshard.check(tmp_path / "out", src).ok
    name = "model.layers.0.linear_attn.conv1d.weight"
    full = source_tensors(src)[name]
    k, v = (8 * 4, 16 * 4)  # tests/checkpoints.py's hybrid linear attention: K 32, V 64
    held = tpshard.open_rank(tmp_path / "out", 1)[name]
    assert torch.equal(held, torch.cat([chunk(x, 1, 4) for x in full.split((k, k, v))]))
    assert "model.layers.0.mlp.experts.0.gate_proj.weight_packed" in tpshard.open_rank(tmp_path / "out", 0)


def test_qwen3_5_wrapper_release(tmp_path):
    """The published form, Qwen3_5MoeForConditionalGeneration (model.language_model.*, the vision tower
    bf16 and not written): each rank holds the text class's FP8 split under the wrapper's names."""
    from checkpoints import make_qwen3_5_wrapper

    wrapper, text = make_qwen3_5_wrapper(tmp_path / "wrapper", tmp_path / "text", max_shard_size="2MB", **HYBRID)
    quantize_release(wrapper, "qwen3_5")
    quantize_release(text, "qwen3_5")
    skip = json.loads((wrapper / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in skip and "model.visual" in skip
    topo = Topology(tp=4, ep=2)
    tpshard.split(wrapper, tmp_path / "w", topo)
    tpshard.split(text, tmp_path / "t", topo)
    assert tpshard.check(tmp_path / "w", wrapper).ok
    for r in (0, 3):
        w, t = tpshard.open_rank(tmp_path / "w", r), tpshard.open_rank(tmp_path / "t", r)
        renamed = {n.replace("model.language_model.", "model.", 1): x for n, x in w.items()}
        assert sorted(renamed) == sorted(t) and all(torch.equal(raw(renamed[n]), raw(t[n])) for n in t)
        assert "model.layers.0.linear_attn.in_proj_qkv.weight_scale_inv" in t
