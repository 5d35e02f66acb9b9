"""Pipeline stages (--pp, --pp-layers) on real transformers checkpoints, against the tables of
docs/pipeline.md (SGLang 0.5.23): which stage's ranks hold which tensors, every tensor of a
stage cut exactly as at pp 1 with tp_rank in place of the world rank, refusals in one line, and
`check` catching a layer or a norm on the wrong stage."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

import tpshard
from checkpoints import make_checkpoint
from pipeline_tools import cli, held_stages
from tpshard.checkpoint import open_checkpoint
from tpshard.errors import OutputError, TpshardError
from tpshard.manifest import MANIFEST_NAME, encode_manifest, rank_dir, read_manifest
from tpshard.topology import Topology

# SGLang's default partition of 7 layers (docs/pipeline.md: the last L % pp stages get one more).
SGLANG_7 = {2: (3, 4), 3: (2, 2, 3), 4: (1, 2, 2, 2)}


@pytest.fixture(scope="module")
def llama7(tmp_path_factory) -> Path:
    """Untied Llama with 7 layers: no pp of 2, 3 or 4 divides it."""
    return make_checkpoint(tmp_path_factory.mktemp("llama7") / "model", "llama", num_hidden_layers=7, max_shard_size="100KB")


@pytest.fixture(scope="module")
def qwen3_7_tied(tmp_path_factory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("qwen3t") / "model", "qwen3", num_hidden_layers=7, tie_word_embeddings=True, head_dim=32
    )


@pytest.fixture(scope="module")
def llama_tied(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llamat") / "model", "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def llama7_pp2(llama7, tmp_path_factory) -> Path:
    """llama7 split at pp 2 x tp 2 (layers 3 + 4); tests that break it work on a copy."""
    out = tmp_path_factory.mktemp("llama7pp2") / "out"
    tpshard.split(llama7, out, Topology(tp=2, pp_layers=(3, 4)))
    return out


def expected_stages(name: str, counts: tuple[int, ...], lm_head_everywhere: bool) -> set[int]:
    """docs/pipeline.md written out: layer i on the stage whose range holds it; the embedding on
    the first stage, the final norm on the last, lm_head on the last (every stage for Llama)."""
    last = len(counts) - 1
    found = re.match(r"model\.layers\.(\d+)\.", name)
    if found:
        layer, end = int(found.group(1)), 0
        for stage, n in enumerate(counts):
            end += n
            if layer < end:
                return {stage}
        return {last}  # the MTP layer
    if name.startswith("model.embed_tokens."):
        return {0}
    if name.startswith("model.norm."):
        return {last}
    assert name.startswith("lm_head."), name
    return set(range(len(counts))) if lm_head_everywhere else {last}


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("which", ["llama7", "qwen3_7_tied"])
def test_stage_tables_of_an_uneven_layer_count(request, which, pp):
    """Every tensor on the stages docs/pipeline.md names, cut as at pp 1 on each of them (ranks offset by
    pp_rank x tp); a tied Qwen3's last stage holds lm_head.weight cut from the embedding."""
    model = request.getfixturevalue(which)
    ckpt = open_checkpoint(model)
    tp, counts = 2, SGLANG_7[pp]
    flat_plan = tpshard.make_plan(ckpt, Topology(tp=tp))
    flat = {t.name: t for t in flat_plan.tensors}
    plan = tpshard.make_plan(ckpt, Topology(tp=tp, pp_layers=counts))
    assert plan.topology.pp == pp and plan.topology.world_size == pp * tp
    tied = which == "qwen3_7_tied"
    assert {t.name for t in plan.tensors} == set(flat) | ({"lm_head.weight"} if tied else set())
    for t in plan.tensors:
        stages = expected_stages(t.name, counts, lm_head_everywhere=which == "llama7")
        assert held_stages(plan, t) == stages, t.name
        base = flat["model.embed_tokens.weight" if t.name == "lm_head.weight" and tied else t.name]
        assert [(c.group_rank, c.start, c.length, c.pad) for c in t.cuts] == [(c.group_rank, c.start, c.length, c.pad) for c in base.cuts]
        for c, b in zip(t.cuts, base.cuts):
            want = tuple(s * tp + r for s in sorted(stages) for r in flat_plan.files[b.file].ranks)
            assert plan.files[c.file].ranks == want, t.name
    if tied:
        head = next(t for t in plan.tensors if t.name == "lm_head.weight")
        assert head.source == "model.embed_tokens.weight" and head.layer_class == "ParallelLMHead"
        assert any("the last stage holds its own lm_head.weight" in w for w in plan.warnings)


def test_rank_order_puts_tp_fastest():
    t = Topology(tp=4, attn_dp=2, ep=2, pp_layers=(3, 4))
    assert t.world_size == 8 and [t.pp_rank(r) for r in range(8)] == [0] * 4 + [1] * 4
    assert [t.attn_tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert [t.attn_dp_rank(r) for r in range(8)] == [0, 0, 1, 1] * 2
    assert [t.ep_rank(r) for r in range(8)] == [0, 0, 1, 1] * 2
    assert t.ranks_of("attn_tp", 1) == (1, 3, 5, 7) and t.ranks_of("attn_tp", 1, stages=(1,)) == (5, 7)
    assert t.ranks_of("moe_tp", 0, ep_slot=1, stages=(1,)) == (6,)
    assert Topology(tp=2, pp_layers=(7,)) == Topology(tp=2)  # one stage is no pipeline


def test_deepseek_mtp_layer_and_second_embedding_on_the_last_stage(deepseek_v3):
    """3 layers + MTP layer 3 (docs/pipeline.md): pp 2 -> layers 0 | 1-2 + MTP; the last stage
    holds a second copy of the embedding for the draft, the same cut as the first stage's."""
    ckpt = open_checkpoint(deepseek_v3)
    for counts in ((1, 2), (1, 1, 1)):
        plan = tpshard.make_plan(ckpt, Topology(tp=2, ep=2, pp_layers=counts))
        last = len(counts) - 1
        by_name = {t.name: t for t in plan.tensors}
        assert held_stages(plan, by_name["model.embed_tokens.weight"]) == {0, last}
        for name in ("model.norm.weight", "lm_head.weight", "model.layers.3.eh_proj.weight",
                     "model.layers.3.shared_head.head.weight", "model.layers.3.mlp.experts.7.down_proj.weight"):  # fmt: skip
            assert held_stages(plan, by_name[name]) == {last}, name
        assert held_stages(plan, by_name["model.layers.0.mlp.down_proj.weight"]) == {0}
        experts = by_name["model.layers.1.mlp.experts.5.up_proj.weight"]  # EP slot 1 of stage 1
        assert [plan.files[c.file].ranks for c in experts.cuts] == [(3,)]
    assert any(f.name.startswith("model-pp-000+002-of-003-") for f in plan.files)


def test_deepseek_split_and_check_at_pp2(deepseek_v3, tmp_path):
    out = tmp_path / "out"
    tpshard.split(deepseek_v3, out, Topology(tp=2, ep=2, pp_layers=(1, 2)))
    report = tpshard.check(out, deepseek_v3)
    assert report.ok, report.problems
    assert set(tpshard.open_rank(out, 0)) >= {"model.embed_tokens.weight"} and "lm_head.weight" not in set(tpshard.open_rank(out, 0))
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= set(tpshard.open_rank(out, 3))


def test_split_and_check_pp2_tp2_every_rank_is_its_pp1_tp_rank(llama7, llama7_pp2, tmp_path):
    """Bit-exact against the source, and each world rank holds exactly the pp 1 tensors of its
    tp_rank for its stage's layers (Llama: lm_head on every stage, docs/pipeline.md)."""
    report = tpshard.check(llama7_pp2, llama7)
    assert report.ok, report.problems
    flat = tmp_path / "flat"
    tpshard.split(llama7, flat, Topology(tp=2))
    for rank in range(4):
        stage, tp_rank = divmod(rank, 2)
        want = tpshard.open_rank(flat, tp_rank)
        names = {n for n in want if stage in expected_stages(n, (3, 4), lm_head_everywhere=True)}
        held = tpshard.open_rank(llama7_pp2, rank)
        assert set(held) == names, rank
        assert all(torch.equal(held[n], want[n]) for n in names)
        index = json.loads((llama7_pp2 / rank_dir(rank) / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == names
    assert sorted(p.name for p in llama7_pp2.iterdir()) == [rank_dir(r) for r in range(4)] + [MANIFEST_NAME]


def test_qwen3_attn_dp_inside_each_stage(qwen3, qwen3_7_tied, tmp_path):
    """tp 4 x pp 2 with --attn-dp 2: attention and embedding over attn_tp inside each stage's TP
    group; a tied Qwen3's last-stage head is cut over tp (4 pieces), its embedding over attn_tp (2)."""
    out = tmp_path / "out"
    tpshard.split(qwen3, out, Topology(tp=4, attn_dp=2, pp_layers=(1, 1)))
    assert tpshard.check(out, qwen3).ok
    plan = read_manifest(out).plan
    k = next(t for t in plan.tensors if t.name == "model.layers.1.self_attn.k_proj.weight")
    assert [plan.files[c.file].ranks for c in k.cuts] == [(4, 6), (5, 7)]
    tied = tmp_path / "tied"
    tpshard.split(qwen3_7_tied, tied, Topology(tp=4, attn_dp=2, pp_layers=(3, 4)))
    report = tpshard.check(tied, qwen3_7_tied)
    assert report.ok, report.problems
    plan = read_manifest(tied).plan
    head = next(t for t in plan.tensors if t.name == "lm_head.weight")
    embed = next(t for t in plan.tensors if t.name == "model.embed_tokens.weight")
    assert (head.group, head.group_size, embed.group, embed.group_size) == ("tp", 4, "attn_tp", 2)
    assert [plan.files[c.file].ranks for c in head.cuts] == [(4,), (5,), (6,), (7,)]
    assert [plan.files[c.file].ranks for c in embed.cuts] == [(0, 2), (1, 3)]


def test_pp_layers_and_the_partition_to_give_the_engine(llama7, capsys, monkeypatch):
    code, out, _ = cli(capsys, monkeypatch, "plan", llama7, "--tp", 2, "--pp-layers", "1,1,5", "--json")
    data = json.loads(out)
    assert code == 0 and data["partition_env"] == {"SGLANG_PP_LAYER_PARTITION": "1,1,5"}
    assert [(r["stage"], r["ranks"], r["layers"]) for r in data["stages"]] == [(0, "0-1", "0"), (1, "2-3", "1"), (2, "4-5", "2-6")]
    assert data["plan"]["topology"]["pp_layers"] == [1, 1, 5] and len(data["by_rank"]) == 6
    code, out, _ = cli(capsys, monkeypatch, "plan", llama7, "--tp", 2, "--pp", 3)
    assert code == 0 and "SGLANG_PP_LAYER_PARTITION=2,2,3" in out and "Pipeline stages" in out
    code, out, err = cli(capsys, monkeypatch, "explain", llama7, "--tp", 2, "--pp", 2, "--layer", 5)
    assert code == 0 and "pipeline stage 1 (ranks 2-3)" in out
    code, out, _ = cli(capsys, monkeypatch, "explain", llama7, "--tp", 2, "--pp", 2, "--layer", 5, "--json")
    assert {r for row in json.loads(out) for r in row["ranks"]} == {2, 3}


@pytest.mark.parametrize(
    "which, args, message",
    [
        ("llama_tied", ["--pp", 2], "cannot serve a tied LlamaForCausalLM with pipeline stages"),
        ("llama7", ["--pp-layers", "3,3"], "adds up to 6 layers; the model has 7"),
        ("llama7", ["--pp", 2, "--pp-layers", "1,1,5"], "names 3 stages, but --pp is 2"),
        ("llama7", ["--pp", 8], "7 layers cannot fill 8 pipeline stages"),
        ("llama7", ["--pp", 0], "--pp must be a positive integer"),
        ("qwen3_moe", ["--pp", 2], "no pipeline layout of Qwen3MoeForCausalLM is on record"),
        ("llama7", ["--pp", 2, "--format", "sglang"], "SGLang 0.5.23's sharded_state names files by TP rank only"),
        ("llama7", ["--pp", 2, "--format", "vllm", "--engine", "sglang"], "split again with --engine vllm (vLLM's default partition 4,3)"),
        ("llama_tied", ["--pp", 2, "--engine", "vllm", "--attn-dp", 2], "--engine vllm: --attn-dp 2: vLLM has no such layout"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_exit_2_and_write_nothing(request, tmp_path, capsys, monkeypatch, which, args, message):
    model = request.getfixturevalue(which)
    code, out, err = cli(capsys, monkeypatch, "split", model, "-o", tmp_path / "out", "--tp", 2, *args)
    assert code == 2 and out == ""
    assert err.strip().count("\n") == 0 and message in err, err
    assert list(tmp_path.iterdir()) == []  # no output, no staging folder, no lock


def test_refusal_through_the_real_command(llama_tied, tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "tpshard", "split", str(llama_tied), "-o", str(tmp_path / "out"), "--tp", "2", "--pp", "2"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.strip().count("\n") == 0
    assert "docs/pipeline.md" in p.stderr and not (tmp_path / "out").exists()


def test_pp1_output_is_byte_identical(llama7, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    tpshard.split(llama7, a, Topology(tp=2))
    tpshard.split(llama7, b, Topology(tp=2, pp_layers=(7,)))
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert b"pp_layers" not in (a / MANIFEST_NAME).read_bytes()


# ---- check catches outputs broken on purpose -------------------------------------------------


def rewrite(out: Path, change) -> None:
    """Write the manifest `change(manifest)` returns."""
    (out / MANIFEST_NAME).write_bytes(encode_manifest(change(read_manifest(out))))


def stage_findings(report) -> list[str]:
    return [p.message for p in report.problems if p.check == "stages"]


def test_check_catches_a_layer_moved_to_another_stage(llama7_pp2, copy_of, capsys, monkeypatch):
    """Layer 1 belongs to stage 0 (layers 0-2); its down_proj pointed at stage 1's files."""
    out = copy_of(llama7_pp2)
    name = "model.layers.1.mlp.down_proj.weight"

    def move(m):
        index = {f.name: i for i, f in enumerate(m.files)}
        tensors = []
        for t in m.tensors:
            if t.name == name:
                moved = [msgspec.structs.replace(c, file=index[m.files[c.file].name.replace("pp-000-", "pp-001-")]) for c in t.cuts]
                t = msgspec.structs.replace(t, cuts=tuple(moved))
            tensors.append(t)
        return msgspec.structs.replace(m, tensors=tuple(tensors), files=tuple(msgspec.structs.replace(f, digests="") for f in m.files))

    rewrite(out, move)
    found = stage_findings(tpshard.check(out))
    assert any(f.startswith(f"{name}: held by stage 1 (ranks 2-3), but belongs to stage 0 (ranks 0-1): layer 1 is one of layers 0-2") for f in found), found
    code, stdout, _ = cli(capsys, monkeypatch, "check", out)
    assert code == 1 and "FAIL [stages]" in stdout


def test_check_catches_a_stage_without_its_norm(llama7_pp2, copy_of):
    out = copy_of(llama7_pp2)

    def drop_norm(m):
        t = next(t for t in m.tensors if t.name == "model.norm.weight")
        held = m.files[t.cuts[0].file].name
        files = tuple(msgspec.structs.replace(f, digests="") if f.name == held else f for f in m.files)
        return msgspec.structs.replace(m, tensors=tuple(x for x in m.tensors if x is not t), files=files)

    rewrite(out, drop_norm)
    found = stage_findings(tpshard.check(out))
    assert found == ["stage 1 (ranks 2-3) lacks model.norm, which SGLang builds on that stage"]


def test_check_catches_a_stage_missing_a_layer_and_a_stray_norm(llama7_pp2, copy_of):
    """Every tensor of layer 6 dropped from the manifest; model.norm put on stage 0 as well."""
    out = copy_of(llama7_pp2)

    def damage(m):
        both = next(i for i, f in enumerate(m.files) if f.name == "model-tp-000-of-002.safetensors")  # ranks 0 and 2
        tensors = []
        for t in m.tensors:
            if t.name.startswith("model.layers.6."):
                continue
            if t.name == "model.norm.weight":
                t = msgspec.structs.replace(t, cuts=tuple(msgspec.structs.replace(c, file=both) for c in t.cuts))
            tensors.append(t)
        return msgspec.structs.replace(m, tensors=tuple(tensors), files=tuple(msgspec.structs.replace(f, digests="") for f in m.files))

    rewrite(out, damage)
    found = stage_findings(tpshard.check(out))
    assert "stage 1 (ranks 2-3) holds no tensor of layers 6; its layers are 3-6" in found
    assert any(f.startswith("model.norm.weight: held by stage 0 (ranks 0-1), stage 1 (ranks 2-3), but belongs to stage 1") for f in found)


def test_check_pp_request_and_manifest_bounds(llama7_pp2, copy_of, capsys, monkeypatch):
    assert tpshard.check(llama7_pp2, pp=2, pp_layers="3,4").ok
    assert stage_findings(tpshard.check(llama7_pp2, pp=3)) == ["the output was split for pp 2 (layers 3,4), not --pp 3"]
    assert stage_findings(tpshard.check(llama7_pp2, pp_layers="4,3")) == ["the output was split for pp 2 (layers 3,4), not --pp-layers 4,3"]
    code, stdout, _ = cli(capsys, monkeypatch, "check", llama7_pp2, "--pp", 1)
    assert code == 1 and "not --pp 1" in stdout
    out = copy_of(llama7_pp2)
    for layers, message in [((3, 5), "adds up to 8 layers; the model has 7"), ((3, 0, 4), "pp_layers=(3, 0, 4)")]:
        data = json.loads((llama7_pp2 / MANIFEST_NAME).read_bytes())
        data["topology"]["pp_layers"] = list(layers)
        (out / MANIFEST_NAME).write_text(json.dumps(data))
        with pytest.raises(OutputError, match=re.escape(message)):
            read_manifest(out)


def test_export_refuses_a_partition_vllm_would_not_build(llama7, llama7_pp2, tmp_path):
    from tpshard.export import export

    # (verify runs pipeline stages: tests/test_verify_pipeline.py)
    with pytest.raises(TpshardError, match=re.escape("are placed as SGLang builds them (layers 3,4")):
        export(llama7_pp2, tmp_path / "export", "vllm")
    assert not (tmp_path / "export").exists()


def test_stages_split_on_two_nodes_merge(llama7, llama7_pp2, tmp_path):
    """split --ranks one stage per node, then merge: the same output as one split."""
    from tpshard.merge import merge

    parts = [tmp_path / "s0", tmp_path / "s1"]
    for part, ranks in zip(parts, ([0, 1], [2, 3])):
        tpshard.split(llama7, part, Topology(tp=2, pp_layers=(3, 4)), ranks=ranks)
        assert tpshard.check(part, llama7).ok
    merge(parts, tmp_path / "merged")
    assert tpshard.check(tmp_path / "merged", llama7).ok
    assert (tmp_path / "merged" / MANIFEST_NAME).read_bytes() == (llama7_pp2 / MANIFEST_NAME).read_bytes()
