"""Expert parallelism below tp for experts stored fused in one [E, ...] tensor: gpt-oss MXFP4 and
Llama-4 at --ep < --tp, where a rank's piece is cut on two dims (its EP block of experts on dim 0,
its moe_tp slice on an inner dim: a cut with a leading-dim range, manifest version 4).

What each rank holds is written out here from SGLang 0.5.23's loaders, not from tpshard's plan:
tp rank r is EP slot r // moe_tp and MoE-TP rank r % moe_tp (distributed/parallel_state.py's moe_ep
and moe_tp groups, moe_tp = tp / ep);
- gpt-oss MXFP4 (models/gpt_oss.py _load_mxfp4_experts_weights): per-rank intermediate size
  ceil(I / 32 / moe_tp) * 32, start = m * per, end = min(start + per, I), experts
  [slot * E/ep, +E/ep); `*_blocks` viewed [E, rows, bytes] and sliced [experts, 2 start : 2 end]
  (gate/up) or [experts, :, start / 2 : end / 2] (down), the scales [.., start / 32 : end / 32],
  the gate/up bias [experts, 2 start : 2 end], each copied into the front of a zeroed parameter of
  the padded size; the down bias [experts] (tpshard keeps it on every rank of the slot, SGLang
  zeroes it on MoE-TP ranks != 0 after loading);
- Llama-4 (models/mllama4.py _handle_expert_weight_params, FusedMoE.weight_loader): gate_up_proj
  chunked in two on its last dim, each expert e of the rank's EP block given as gate[e].T / up[e].T,
  each narrowed to the MoE-TP rank's I / moe_tp rows and stacked [w1 | w3]; down_proj[e].T narrowed
  on its columns. In the checkpoint's orientation here (the transposes undone).
Then outputs broken on purpose (another slot's experts, another MoE-TP rank's slice, experts
round-robin), which check --source and verify must see; the manifest's version and its refusals.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import msgspec
import pytest
import torch

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from gpt_oss_fixtures import make_gpt_oss, make_gpt_oss_mxfp4
from llama4_fixtures import make_llama4
from test_gpt_oss import tpshard_cli
from test_moe_split import source_tensors
from tpshard.manifest import MANIFEST_NAME
from tpshard.topology import Topology
from tpshard.verify import verify_many

GPT = "model.layers.{i}.mlp.experts."
L4 = "language_model.model.layers.{i}.feed_forward.experts."


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory) -> Path:
    """gpt-oss MXFP4: 8 experts, hidden 64, intermediate 96 (3 blocks: at moe_tp 2 the last rank short)."""
    root = tmp_path_factory.mktemp("fused_ep_mxfp4")
    return make_gpt_oss_mxfp4(root / "mxfp4", make_gpt_oss(root / "bf16"))


@pytest.fixture(scope="module")
def mxfp4_wide(tmp_path_factory) -> Path:
    """The same with intermediate 128 (4 blocks): moe_tp 4 gives every rank one."""
    root = tmp_path_factory.mktemp("fused_ep_mxfp4_wide")
    return make_gpt_oss_mxfp4(root / "mxfp4", make_gpt_oss(root / "bf16", intermediate_size=128))


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> Path:
    """Llama-4: 4 experts, hidden 64, intermediate 32, experts in layers 1 and 3."""
    return make_llama4(tmp_path_factory.mktemp("fused_ep_llama4") / "model")


def slots(topo: Topology, rank: int, e: int) -> tuple[slice, int]:
    """(the experts of the rank's EP slot, its MoE-TP rank): SGLang's moe_ep / moe_tp groups."""
    moe_tp = topo.tp // topo.ep
    tp_rank = rank % topo.tp
    local = e // topo.ep
    return slice(tp_rank // moe_tp * local, (tp_rank // moe_tp + 1) * local), tp_rank % moe_tp


def into_zeros(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """`t` copied into the front of a zeroed tensor `size` long on `dim` (a padded parameter)."""
    shape = list(t.shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=t.dtype)
    out.narrow(dim, 0, t.shape[dim]).copy_(t)
    return out


def sglang_mxfp4(full: dict, config: dict, topo: Topology, rank: int, layer: int) -> dict[str, torch.Tensor]:
    """What _load_mxfp4_experts_weights gives `rank` of one layer, in the checkpoint's names."""
    e, i = config["num_local_experts"], config["intermediate_size"]
    moe_tp = topo.tp // topo.ep
    experts, m = slots(topo, rank, e)
    per = math.ceil(i // 32 / moe_tp) * 32
    start, end = m * per, min((m + 1) * per, i)
    x = GPT.format(i=layer)
    gu = full[x + "gate_up_proj_blocks"]
    gu = gu.view(e, 2 * i, -1)[experts, 2 * start : 2 * end].reshape(-1, 2 * (end - start), *gu.shape[2:])
    down = full[x + "down_proj_blocks"]
    down = down.view(e, down.shape[1], i // 2)[experts, :, start // 2 : end // 2].reshape(-1, down.shape[1], (end - start) // 32, 16)
    return {
        x + "gate_up_proj_blocks": into_zeros(gu, 1, 2 * per),
        x + "gate_up_proj_scales": into_zeros(full[x + "gate_up_proj_scales"][experts, 2 * start : 2 * end], 1, 2 * per),
        x + "gate_up_proj_bias": into_zeros(full[x + "gate_up_proj_bias"][experts, 2 * start : 2 * end], 1, 2 * per),
        x + "down_proj_blocks": into_zeros(down, 2, per // 32),
        x + "down_proj_scales": into_zeros(full[x + "down_proj_scales"][experts, :, start // 32 : end // 32], 2, per // 32),
        x + "down_proj_bias": full[x + "down_proj_bias"][experts],
    }


def sglang_llama4(full: dict, config: dict, topo: Topology, rank: int, layer: int) -> dict[str, torch.Tensor]:
    """What _handle_expert_weight_params and FusedMoE.weight_loader give `rank` of one MoE layer."""
    text = config["text_config"]
    e, i = text["num_local_experts"], text["intermediate_size"]
    moe_tp = topo.tp // topo.ep
    experts, m = slots(topo, rank, e)
    u = i // moe_tp
    x = L4.format(i=layer)
    gate, up = full[x + "gate_up_proj"].chunk(2, dim=-1)
    w13 = [torch.cat((gate[k].T.narrow(0, m * u, u), up[k].T.narrow(0, m * u, u)), 0) for k in range(e)[experts]]  # [2u, H]
    w2 = [full[x + "down_proj"][k].T.narrow(1, m * u, u) for k in range(e)[experts]]  # [H, u]
    return {x + "gate_up_proj": torch.stack([w.T for w in w13]), x + "down_proj": torch.stack([w.T for w in w2])}


CASES = [
    ("mxfp4", Topology(tp=4, ep=2)),
    ("mxfp4", Topology(tp=4, ep=2, attn_dp=2)),
    ("mxfp4", Topology(tp=8, ep=4)),
    ("mxfp4_wide", Topology(tp=8, ep=2, attn_dp=2)),
    ("llama4", Topology(tp=4, ep=2)),
    ("llama4", Topology(tp=8, ep=4)),
    ("llama4", Topology(tp=8, ep=4, attn_dp=2)),
]


@pytest.mark.parametrize("model, topo", CASES, ids=[f"{m}-tp{t.tp}-ep{t.ep}-dp{t.attn_dp}" for m, t in CASES])
def test_per_rank_as_sglang_loads(model, topo, request, tmp_path):
    """Every rank's fused expert tensors are SGLang's for it, bit for bit; check --source proves
    the output; the manifest is version 4 and explain names both ranges."""
    source = request.getfixturevalue(model)
    out = tmp_path / "out"
    tpshard.split(source, out, topo)
    assert tpshard.check(out, source).ok
    full, config = source_tensors(source), json.loads((source / "config.json").read_text())
    expected, layers = (sglang_llama4, (1, 3)) if model == "llama4" else (sglang_mxfp4, (0, 1))
    for r in range(topo.tp):
        held = tpshard.open_rank(out, r)
        for layer in layers:
            for name, want in expected(full, config, topo, r, layer).items():
                assert held[name].shape == want.shape and torch.equal(held[name], want), (r, name)
    assert json.loads((out / MANIFEST_NAME).read_text())["version"] == 4
    p = tpshard_cli("explain", source, "--tp", topo.tp, "--ep", topo.ep, "--attn-dp", topo.attn_dp, "--layer", layers[0])
    assert p.returncode == 0, p.stderr
    e = config.get("num_local_experts") or config["text_config"]["num_local_experts"]
    assert f"dim 0 [{e // topo.ep}, {2 * e // topo.ep}) x dim " in p.stdout, p.stdout


def test_without_leading_ranges_version_3(llama4, tmp_path):
    """An output whose cuts have no leading-dim range (every output tpshard wrote before) is still
    written as version 3, its cuts five numbers: older tpshards read it as they did."""
    out = tmp_path / "out"
    tpshard.split(llama4, out, Topology(tp=2))
    m = json.loads((out / MANIFEST_NAME).read_text())
    assert m["version"] == 3 and all(len(c) <= 9 for t in m["tensors"] for c in t["cuts"])


def test_manifest_versions(llama4, tmp_path):
    """Version 4 reads; a future version is refused as newer; a version 3 manifest holding a
    leading-dim range is refused by name (it cannot hold one)."""
    out = tmp_path / "out"
    tpshard.split(llama4, out, Topology(tp=4, ep=2))
    text = (out / MANIFEST_NAME).read_bytes()
    for version, message in ((5, "manifest version 5, this tpshard reads versions 3, 4; written by a newer tpshard"), (3, "a leading-dim range, which a version 3 manifest cannot hold")):
        (out / MANIFEST_NAME).write_bytes(text.replace(b'"version":4', b'"version":%d' % version))
        p = tpshard_cli("check", out)
        assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    (out / MANIFEST_NAME).write_bytes(text)
    assert tpshard_cli("check", out).returncode == 0


def test_reshard_across_ep(llama4, tmp_path):
    """tp 4 ep 2 resharded to tp 8 ep 4 and back to tp 2 (no EP): each byte-identical to a split,
    and check --from proves the first against the output it came from."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    tpshard.split(llama4, a, Topology(tp=4, ep=2))
    for dst, args in ((b, ("--tp", "8", "--ep", "4")), (c, ("--tp", "2"))):
        p = tpshard_cli("reshard", a, "-o", dst, *args)
        assert p.returncode == 0, p.stderr
    direct = tmp_path / "direct"
    tpshard.split(llama4, direct, Topology(tp=8, ep=4))
    assert (b / MANIFEST_NAME).read_bytes() == (direct / MANIFEST_NAME).read_bytes()
    assert tpshard_cli("check", b, "--from", a).returncode == 0
    assert tpshard.check(c, llama4).ok


def test_streamed_in_small_chunks(mxfp4, llama4, tmp_path, monkeypatch):
    """Every tensor read in chunks of a few rows (writer.SMALL_BYTES 0, pieces.CHUNK_BYTES 700: a
    chunk ends inside an EP block, a block inside a chunk): the output is byte for byte the one
    read whole, and check --source, comparing in the same small chunks, proves it."""
    import tpshard.pieces as pieces
    import tpshard.writer as writer

    for source, topo in ((mxfp4, Topology(tp=4, ep=2)), (llama4, Topology(tp=8, ep=4))):
        a, b = tmp_path / f"{source.name}-a", tmp_path / f"{source.name}-b"
        tpshard.split(source, a, topo)
        with monkeypatch.context() as m:
            m.setattr(writer, "SMALL_BYTES", 0)
            m.setattr(pieces, "CHUNK_BYTES", 700)
            tpshard.split(source, b, topo)
            assert tpshard.check(b, source).ok
        files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
        assert files and all((a / f).read_bytes() == (b / f).read_bytes() for f in files)


def test_plan_with_other_slots(llama4, tmp_path, monkeypatch):
    """A split whose plan gives each EP slot the other slot's experts: check alone sees that the
    leading-dim ranges are not in group-rank order, and check --source that the manifest is not
    what SGLang's loader gives."""
    import tpshard.plan.fused as fused

    real = fused._in_ep_blocks

    def swapped(inner, e, ep):
        cut = real(inner, e, ep)
        per = e // ep
        other = [msgspec.structs.replace(c, lead_start=(ep - 1 - c.lead_start // per) * per) if c.lead_length else c for c in cut.cuts]
        return cut._replace(cuts=other)

    monkeypatch.setattr(fused, "_in_ep_blocks", swapped)
    out = tmp_path / "out"
    tpshard.split(llama4, out, Topology(tp=4, ep=2))
    monkeypatch.undo()
    own = " ".join(p.message for p in tpshard.check(out).problems)
    assert "leading-dim ranges [[2, 4], [0, 2]] do not tile dim 0 of 4 in group-rank order" in own, own
    found = " ".join(p.message for p in tpshard.check(out, llama4).problems)
    assert "lead_start=2 (rules: 0)" in found, found


# ---- broken on purpose ------------------------------------------------------------------------------


def break_copy(good: Path, dst: Path, source: Path, names: str, layers: tuple[int, int], params: tuple[str, ...]) -> Path:
    """A tp 4 ep 2 output (moe_tp 2) broken three ways, checksums rewritten: in layers[0], rank 0
    holds slot 1's experts (rank 2's pieces) and rank 3 MoE-TP rank 0's slice of its experts (rank
    2's too); in layers[1], rank 1 holds its slice of experts round-robin (0, 2, ...) instead of
    its block (0, 1, ...)."""
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    a, b = names.format(i=layers[0]), names.format(i=layers[1])
    for p in params:
        overwrite_tensor(dst, 0, a + p, tpshard.open_rank(dst, 2)[a + p].clone())
        overwrite_tensor(dst, 3, a + p, tpshard.open_rank(dst, 2)[a + p].clone())
    full = source_tensors(source)
    for p in params:
        overwrite_tensor(dst, 1, b + p, _own_cut(good, 1, b + p, full[b + p][0::2]))
    rewrite_checksums(dst)
    return dst


def _own_cut(good: Path, rank: int, name: str, experts: torch.Tensor) -> torch.Tensor:
    """`rank`'s cut of tensor `name` (as its manifest records it) applied to other experts
    [E / ep, ...] than its block's."""
    from tpshard.manifest import read_manifest
    from tpshard.pieces import shard_bytes

    s = next(s for s in read_manifest(good).plan.rank_shards(rank) if s.name == name)
    local = msgspec.structs.replace(s, lead_start=0, lead_length=0)  # the cut inside the block, on `experts`
    data = experts.contiguous().view(torch.uint8).reshape(-1).numpy()
    piece = shard_bytes(data, tuple(experts.shape), s.dim, local, s.segments)
    return torch.frombuffer(bytearray(piece.tobytes()), dtype=experts.dtype).reshape(s.shape)


MX_PARAMS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks", "down_proj_scales", "down_proj_bias")


@pytest.fixture(scope="module")
def outputs(mxfp4, llama4, tmp_path_factory) -> dict[str, Path]:
    """Good and broken tp 4 ep 2 outputs of both families."""
    root = tmp_path_factory.mktemp("fused_ep_outputs")
    got = {}
    for key, source, names, layers, params in (
        ("mxfp4", mxfp4, GPT, (0, 1), MX_PARAMS), ("llama4", llama4, L4, (1, 3), ("gate_up_proj", "down_proj"))
    ):  # fmt: skip
        good = root / key
        tpshard.split(source, good, Topology(tp=4, ep=2))
        got[key] = good
        got[key + "-broken"] = break_copy(good, root / f"{key}-broken", source, names, layers, params)
    return got


@pytest.mark.parametrize("key, names, layers", [("mxfp4", GPT, (0, 1)), ("llama4", L4, (1, 3))])
def test_check_source_sees_each_breakage(outputs, mxfp4, llama4, key, names, layers):
    source = mxfp4 if key == "mxfp4" else llama4
    report = tpshard.check(outputs[key + "-broken"], source)
    found = [p.message for p in report.problems]
    a, b = names.format(i=layers[0]), names.format(i=layers[1])
    weight = a + ("gate_up_proj_blocks" if key == "mxfp4" else "gate_up_proj")
    assert any(f"{weight} (group tp rank 0/4, ranks [0]): holds the slice of group rank 2" in m for m in found), found
    assert any(f"{weight} (group tp rank 3/4, ranks [3]): holds the slice of group rank 2" in m for m in found), found
    assert any(b in m and "group tp rank 1/4" in m for m in found), found


def test_verify_names_each_breakage(outputs, mxfp4):
    """Layer level, one launch: the good MXFP4 output passes every layer; the broken one fails both
    experts layers, naming another slot's experts and the round-robin ones."""
    good, bad = verify_many([outputs["mxfp4"], outputs["mxfp4-broken"]], [mxfp4, mxfp4])
    assert good.ok, [(r.layer, r.problems) for r in good.layers if r.problems]
    failed = {r.layer: " ".join(r.problems) for r in bad.layers if r.problems}
    assert set(failed) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}, failed
    assert "expert 0 on MoE-TP rank 0/2 differs (it holds expert 4)" in failed["model.layers.0.mlp.experts"]
    assert "expert 1 on MoE-TP rank 1/2 differs (it holds expert 2)" in failed["model.layers.1.mlp.experts"]


def test_verify_model_llama4(outputs, llama4):
    """verify --model, one launch: the good Llama-4 tp 4 ep 2 output matches transformers' logits
    (each rank runs its EP block's experts); the broken one fails both experts layers and its logits."""
    good, bad = verify_many([outputs["llama4"], outputs["llama4-broken"]], [llama4, llama4], model=True)
    assert good.ok, [(r.layer, r.problems) for r in good.layers if r.problems] + [good.model.problems if good.model else None]
    assert good.model is not None and good.model.top1 == 1.0 and good.model.max_rel < 1e-5
    failed = {r.layer: " ".join(r.problems) for r in bad.layers if r.problems}
    x1, x3 = L4.format(i=1)[:-1], L4.format(i=3)[:-1]
    assert set(failed) == {x1, x3}, failed
    assert "expert 0 on MoE-TP rank 0/2 differs (it holds expert 2)" in failed[x1]
    assert "on MoE-TP rank 1/2 differs (it holds expert" in failed[x3]
    assert bad.model is not None and not bad.model.ok


@pytest.mark.slow
def test_verify_model_llama4_tp8(llama4, tmp_path):
    """tp 8 ep 4 attn-dp 2: one expert per EP slot, the kv heads replicated."""
    out = tmp_path / "out"
    tpshard.split(llama4, out, Topology(tp=8, ep=4, attn_dp=2))
    (report,) = verify_many([out], [llama4], model=True)
    assert report.ok and report.model.top1 == 1.0
