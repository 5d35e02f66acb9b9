"""Pipeline stages placed as vLLM 0.33.0 builds them (`--engine vllm`), and their export as vLLM's
pp x tp sharded_state files (`model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors`).

Expected tables come from the rules written out here independently of tpshard.stages (docs/pipeline.md
§2-§3, checked against vLLM's get_pp_indices, LlamaModel / Qwen2Model / LlamaForCausalLM.__init__):
vLLM's extra layers go to stages pp-2, pp-3, ... (never the last); lm_head on the last stage for
every architecture; a tied model's last stage builds the embedding and ties the head to it.
SGLang's: extra layers to the last stages; Llama's lm_head on every stage; a tied Qwen's last stage
holds its own lm_head.weight; a tied Llama refused. The export's files are checked key by key and
byte by byte against the pp 1 export (which vLLM's own loader loads bit-exactly, docs/deploy.md).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import msgspec
import pytest
from safetensors import safe_open

import tpshard
from checkpoints import make_checkpoint
from pipeline_tools import cli, held_stages
from tpshard.check.export import check_export
from tpshard.checkpoint import open_checkpoint
from tpshard.digest import Crc32, file_digest
from tpshard.errors import TopologyError, TpshardError
from tpshard.export import export
from tpshard.export.manifest import EXPORT_MANIFEST_NAME, ExportFile, ExportTensor, encode_export_manifest, read_export_manifest
from tpshard.manifest import MANIFEST_NAME, encode_manifest, read_manifest
from tpshard.plan import file_header
from tpshard.topology import Topology


def partition(layers: int, pp: int, engine: str) -> tuple[int, ...]:
    """The engines' default partitions, written out from their get_pp_indices."""
    counts = [layers // pp] * pp
    extra = layers % pp
    # SGLang: the last `extra` stages; vLLM: partitions[-i] for i in 2 .. extra + 1
    for i in range(pp - extra, pp) if engine == "sglang" else [pp - i for i in range(2, extra + 2)]:
        counts[i] += 1
    return tuple(counts)


def test_partition_written_out_agrees_with_the_reference_examples():
    assert partition(7, 4, "sglang") == (1, 2, 2, 2) and partition(7, 4, "vllm") == (2, 2, 2, 1)
    assert partition(80, 3, "vllm") == (27, 27, 26) and partition(61, 4, "vllm") == (15, 15, 16, 15)
    assert partition(61, 2, "sglang") == (30, 31) and partition(61, 2, "vllm") == (31, 30)


def expected_stages(name: str, counts: tuple[int, ...], engine: str, family: str, tied: bool) -> set[int]:
    last = len(counts) - 1
    found = re.match(r"model\.layers\.(\d+)\.", name)
    if found:
        layer, end = int(found.group(1)), 0
        for stage, n in enumerate(counts):
            end += n
            if layer < end:
                return {stage}
        raise AssertionError(name)
    if name == "model.embed_tokens.weight":
        return {0, last} if tied and engine == "vllm" else {0}
    if name == "model.norm.weight":
        return {last}
    assert name == "lm_head.weight", name
    assert not (tied and engine == "vllm"), "vLLM's tied stages hold no lm_head.weight of their own"
    return set(range(last + 1)) if engine == "sglang" and family == "llama" and not tied else {last}


@pytest.fixture(scope="module")
def llama7(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama7") / "model", "llama", num_hidden_layers=7, max_shard_size="100KB")


@pytest.fixture(scope="module")
def llama7_tied(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama7t") / "model", "llama", num_hidden_layers=7, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def qwen3_7_tied(tmp_path_factory) -> Path:
    return make_checkpoint(
        tmp_path_factory.mktemp("qwen3t") / "model", "qwen3", num_hidden_layers=7, tie_word_embeddings=True, head_dim=32
    )


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
@pytest.mark.parametrize("which", ["llama7", "llama7_tied", "qwen3_7_tied"])
def test_stage_tables_of_both_engines(request, which, engine, pp):
    """Every tensor on the stages the engine builds it on, cut as at pp 1 (ranks offset by pp_rank x tp)."""
    ckpt = open_checkpoint(request.getfixturevalue(which))
    family, tied = which.split("7")[0], which.endswith("tied")
    counts = partition(7, pp, engine)
    topology = Topology(tp=2, pp_layers=counts, engine=engine)
    if engine == "sglang" and family == "llama" and tied:
        with pytest.raises(TopologyError, match="cannot serve a tied LlamaForCausalLM with pipeline stages.*--engine vllm"):
            tpshard.make_plan(ckpt, topology)
        return
    flat_plan = tpshard.make_plan(ckpt, Topology(tp=2))
    flat = {t.name: t for t in flat_plan.tensors}
    plan = tpshard.make_plan(ckpt, topology)
    assert plan.topology.pp_layers == counts and plan.topology.placed_for == engine
    head_copy = tied and engine == "sglang"
    assert {t.name for t in plan.tensors} == set(flat) | ({"lm_head.weight"} if head_copy else set())
    for t in plan.tensors:
        stages = expected_stages(t.name, counts, engine, family, tied)
        assert held_stages(plan, t) == stages, t.name
        base = flat["model.embed_tokens.weight" if head_copy and t.name == "lm_head.weight" else t.name]
        assert [(c.group_rank, c.start, c.length, c.pad) for c in t.cuts] == [(c.group_rank, c.start, c.length, c.pad) for c in base.cuts]
        for c, b in zip(t.cuts, base.cuts):
            assert plan.files[c.file].ranks == tuple(s * 2 + r for s in sorted(stages) for r in flat_plan.files[b.file].ranks), t.name


def test_engine_is_recorded_only_for_a_vllm_pipeline():
    assert Topology(tp=2, pp_layers=(3, 4), engine="sglang") == Topology(tp=2, pp_layers=(3, 4))
    assert Topology(tp=2, engine="vllm") == Topology(tp=2)  # one stage: both engines place every tensor alike
    vllm = Topology(tp=2, pp_layers=(4, 3), engine="vllm")
    assert vllm != Topology(tp=2, pp_layers=(4, 3)) and vllm.placed_for == "vllm"
    assert b"engine" not in msgspec.json.encode(Topology(tp=2, pp_layers=(3, 4), engine="sglang"))
    assert msgspec.json.decode(msgspec.json.encode(vllm), type=Topology) == vllm
    with pytest.raises(TopologyError, match="choose sglang or vllm"):
        Topology(tp=2, pp_layers=(3, 4), engine="trt")


def test_tied_llama_at_pp2_for_vllm_split_check_and_manifest(llama7_tied, tmp_path, capsys, monkeypatch):
    """SGLang cannot serve it; vLLM can: the embedding on both stages, no lm_head anywhere."""
    code, _, err = cli(capsys, monkeypatch, "plan", llama7_tied, "--tp", 2, "--pp", 2)
    assert code == 2 and "cannot serve a tied LlamaForCausalLM" in err and err.strip().count("\n") == 0
    out = tmp_path / "out"
    code, stdout, _ = cli(capsys, monkeypatch, "split", llama7_tied, "-o", out, "--tp", 2, "--pp", 2, "--engine", "vllm")
    assert code == 0 and "start vLLM with --pipeline-parallel-size 2 and VLLM_PP_LAYER_PARTITION=4,3" in stdout
    assert tpshard.check(out, llama7_tied).ok
    assert json.loads((out / MANIFEST_NAME).read_bytes())["topology"]["engine"] == "vllm"
    for rank in range(4):
        held = set(tpshard.open_rank(out, rank))
        assert "model.embed_tokens.weight" in held and "lm_head.weight" not in held
        assert ("model.norm.weight" in held) == (rank >= 2)
    first, last = tpshard.open_rank(out, 0), tpshard.open_rank(out, 2)
    assert first["model.embed_tokens.weight"].equal(last["model.embed_tokens.weight"])


def test_plan_and_explain_print_the_engines_partition(llama7, capsys, monkeypatch):
    code, out, _ = cli(capsys, monkeypatch, "plan", llama7, "--tp", 2, "--pp", 4, "--engine", "vllm", "--json")
    data = json.loads(out)
    assert code == 0 and data["partition_env"] == {"VLLM_PP_LAYER_PARTITION": "2,2,2,1"}
    assert [(r["layers"], r["also"]) for r in data["stages"]] == [
        ("0-1", "model.embed_tokens"), ("2-3", "-"), ("4-5", "-"), ("6", "model.norm, lm_head")
    ]  # fmt: skip
    code, stdout, _ = cli(capsys, monkeypatch, "plan", llama7, "--tp", 2, "--pp", 4, "--engine", "vllm")
    assert code == 0 and "Pipeline stages (vLLM placement)" in stdout and "VLLM_PP_LAYER_PARTITION=2,2,2,1" in stdout
    code, stdout, _ = cli(capsys, monkeypatch, "explain", llama7, "--tp", 2, "--pp", 4, "--engine", "vllm", "--layer", 6)
    assert code == 0 and "pipeline stage 3 (ranks 6-7)" in stdout
    code, _, err = cli(capsys, monkeypatch, "plan", llama7, "--tp", 2, "--pp", 2, "--engine", "trt")
    assert code == 2 and "--engine trt: choose sglang or vllm" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--attn-dp", 2], "--engine vllm: --attn-dp 2: vLLM has no such layout"),
        (["--attn-dp", 2, "--dp-lm-head"], "--engine vllm: --attn-dp 2, --dp-lm-head: vLLM has no such layout"),
    ],
)
def test_vllm_refuses_layouts_it_has_not(qwen3_7_tied, args, message, tmp_path, capsys, monkeypatch):
    code, out, err = cli(capsys, monkeypatch, "split", qwen3_7_tied, "-o", tmp_path / "o", "--tp", 4, "--pp", 2, "--engine", "vllm", *args)
    assert code == 2 and out == "" and message in err and err.strip().count("\n") == 0
    assert list(tmp_path.iterdir()) == []


# ---- export --format vllm of pipeline stages -------------------------------------------------


@pytest.fixture(scope="module")
def exports(llama7, tmp_path_factory) -> dict[str, Path]:
    """llama7 at tp 2: the pp 1 export, and pp 3 (vLLM's default 2,3,2) split and exported."""
    root = tmp_path_factory.mktemp("exports")
    tpshard.split(llama7, root / "flat", Topology(tp=2))
    export(root / "flat", root / "flat-export", "vllm")
    tpshard.split(llama7, root / "pp3", Topology(tp=2, pp_layers=partition(7, 3, "vllm"), engine="vllm"))
    export(root / "pp3", root / "pp3-export", "vllm")
    return {"flat": root / "flat-export", "pp3": root / "pp3-export", "pp3-out": root / "pp3"}


def read_files(folder: Path) -> dict[str, dict]:
    out = {}
    for f in sorted(folder.glob("model-*.safetensors")):
        with safe_open(f, "pt") as h:
            out[f.name] = {k: h.get_tensor(k) for k in h.keys()}
    return out


def stage_of_key(key: str, counts: tuple[int, ...]) -> int:
    found = re.match(r"model\.layers\.(\d+)\.", key)
    if found:
        return expected_stages(key, counts, "vllm", "llama", False).pop()
    return 0 if key == "model.embed_tokens.weight" else len(counts) - 1


def test_pp_export_files_hold_exactly_each_stages_keys_bit_equal_to_pp1(exports):
    counts = partition(7, 3, "vllm")
    assert counts == (2, 3, 2)
    flat, staged = read_files(exports["flat"]), read_files(exports["pp3"])
    assert sorted(staged) == sorted(f"model-pp-{s}-tp-{t}-part-0.safetensors" for s in range(3) for t in range(2))
    for s in range(3):
        for t in range(2):
            want = {k: v for k, v in flat[f"model-rank-{t}-part-0.safetensors"].items() if stage_of_key(k, counts) == s}
            got = staged[f"model-pp-{s}-tp-{t}-part-0.safetensors"]
            assert set(got) == set(want), (s, t)
            assert all(got[k].dtype == want[k].dtype and got[k].equal(want[k]) for k in want)
    layer_keys = {k for k in staged["model-pp-1-tp-0-part-0.safetensors"]}
    assert {int(k.split(".")[2]) for k in layer_keys} == {2, 3, 4}  # global indices, never renumbered
    assert "model.layers.3.self_attn.attn._k_scale" in layer_keys
    m = read_export_manifest(exports["pp3"])
    assert m.env == {"VLLM_PP_LAYER_PARTITION": "2,3,2"} and [f.rank for f in m.files] == list(range(6))
    assert check_export(exports["pp3"]).ok


def test_tied_pp_export_names_the_last_stages_embedding_lm_head(llama7_tied, qwen3_7_tied, tmp_path):
    """vLLM's last stage ties lm_head to its own embedding; _filter_subtensors keeps the smaller
    name, lm_head.weight (measured with vLLM's loader, docs/pipeline.md); the first stage has no
    head, so its file names the table model.embed_tokens.weight."""
    for model in (llama7_tied, qwen3_7_tied):
        out, dest = tmp_path / f"{model.parent.name}-out", tmp_path / f"{model.parent.name}-export"
        tpshard.split(model, out, Topology(tp=2, pp_layers=(4, 3), engine="vllm"))
        export(out, dest, "vllm")
        files = read_files(dest)
        first, last = files["model-pp-0-tp-1-part-0.safetensors"], files["model-pp-1-tp-1-part-0.safetensors"]
        assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
        assert "lm_head.weight" in last and "model.embed_tokens.weight" not in last and "model.norm.weight" in last
        assert first["model.embed_tokens.weight"].equal(last["lm_head.weight"])
        report = tpshard.check(dest, model)
        assert report.ok, report.problems


def test_export_of_an_sglang_placed_split_is_refused_with_the_way_out(llama7, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    tpshard.split(llama7, out, Topology(tp=2, pp_layers=partition(7, 2, "sglang")))
    code, stdout, err = cli(capsys, monkeypatch, "export", out, "--format", "vllm", "-o", tmp_path / "e")
    assert code == 2 and stdout == "" and err.strip().count("\n") == 0
    for part in ("placed as SGLang builds them (layers 3,4", "--engine vllm (vLLM's default partition 4,3)",
                 "--engine vllm --pp-layers 3,4", "VLLM_PP_LAYER_PARTITION=3,4"):  # fmt: skip
        assert part in err, err
    code, _, err = cli(capsys, monkeypatch, "export", out, "--format", "sglang", "-o", tmp_path / "e")
    assert code == 2 and "names files by TP rank only" in err and "SGLANG_PP_LAYER_PARTITION=3,4" in err
    assert not (tmp_path / "e").exists()


def test_explicit_partition_is_exported_with_the_env_the_server_needs(llama7, tmp_path, capsys, monkeypatch):
    dest = tmp_path / "deploy"
    code, stdout, err = cli(capsys, monkeypatch, "split", llama7, "-o", dest, "--tp", 2, "--pp-layers", "1,1,5", "--format", "vllm")
    assert code == 0, err
    assert "started with VLLM_PP_LAYER_PARTITION=1,1,5" in stdout and "--pipeline-parallel-size 3" in stdout
    m = read_export_manifest(dest)
    assert m.env == {"VLLM_PP_LAYER_PARTITION": "1,1,5"} and m.from_.topology.placed_for == "vllm"
    assert sorted(p.name for p in dest.iterdir() if p.name.startswith("model-")) == [
        f"model-pp-{s}-tp-{t}-part-0.safetensors" for s in range(3) for t in range(2)
    ]
    report = tpshard.check(dest, llama7)
    assert report.ok, report.problems
    assert not [p for p in tmp_path.iterdir() if p.name != "deploy"]  # the hidden tpshard output is gone


def test_check_pp_of_a_vllm_output_compares_with_vllms_default(exports, tmp_path, llama7):
    assert tpshard.check(exports["pp3-out"], pp=3).ok
    out = tmp_path / "out"
    tpshard.split(llama7, out, Topology(tp=2, pp_layers=(2, 2, 3), engine="vllm"))
    found = [p.message for p in tpshard.check(out, pp=3).problems]
    assert found == [
        "the output was split for pp 3 (layers 2,2,3), but vLLM at --pp 3 builds layers 2,3,2 unless started with"
        " VLLM_PP_LAYER_PARTITION=2,2,3 (then check with --pp-layers 2,2,3)"
    ]
    assert tpshard.check(out, pp_layers="2,2,3").ok


def test_check_catches_a_vllm_output_whose_last_stage_lost_the_tied_embedding(llama7_tied, tmp_path):
    out = tmp_path / "out"
    tpshard.split(llama7_tied, out, Topology(tp=2, pp_layers=(4, 3), engine="vllm"))

    def drop_last(m):
        tensors = []
        for t in m.tensors:
            if t.name == "model.embed_tokens.weight":
                # the cuts' files hold ranks of both stages; point them at stage 0's only
                stage0 = {f.name: i for i, f in enumerate(m.files) if all(r < 2 for r in f.ranks)}
                cuts = []
                for c in t.cuts:
                    name = "model-pp-000-of-002-" + m.files[c.file].name.removeprefix("model-")  # model-tp-...: every stage
                    cuts.append(msgspec.structs.replace(c, file=stage0.get(name, c.file)))
                t = msgspec.structs.replace(t, cuts=tuple(cuts))
            tensors.append(t)
        return msgspec.structs.replace(m, tensors=tuple(tensors), files=tuple(msgspec.structs.replace(f, digests="") for f in m.files))

    (out / MANIFEST_NAME).write_bytes(encode_manifest(drop_last(read_manifest(out))))
    found = [p.message for p in tpshard.check(out).problems if p.check == "stages"]
    assert "stage 1 (ranks 2-3) lacks model.embed_tokens, which vLLM builds on that stage" in found, found


# ---- broken exports, caught ------------------------------------------------------------------


def rewrite_export(folder: Path, change) -> None:
    """Rewrite the export's files and manifest consistently (sizes, headers, digests), as a buggy
    exporter would: `change(files)` edits {file name: {key: (ExportTensor, bytes)}} in place."""
    m = read_export_manifest(folder)
    files: dict[str, dict] = {}
    for f in m.files:
        _, offsets = file_header([(t.name, t.dtype, t.shape) for t in f.tensors])
        data = (folder / f.name).read_bytes()
        files[f.name] = {t.name: (t, data[o : o + _nbytes(t)]) for t, o in zip(f.tensors, offsets)}
    change(files)
    rank_of = {f.name: f.rank for f in m.files}
    new = []
    for name, tensors in files.items():
        entries = list(tensors.values())
        header, offsets = file_header([(t.name, t.dtype, t.shape) for t, _ in entries])
        blob = bytearray(header)
        digests = []
        for (t, raw), offset in zip(entries, offsets):
            blob[len(blob):] = b"\0" * (offset - len(blob)) + raw
            h = Crc32()
            h.update(raw)
            digests.append(h.digest())
        (folder / name).write_bytes(bytes(blob))
        new.append(ExportFile(
            name=name, rank=rank_of[name], size=len(blob), checksum=file_digest(header, digests),
            digests=b"".join(digests).hex(), tensors=tuple(t for t, _ in entries),
        ))  # fmt: skip
    (folder / EXPORT_MANIFEST_NAME).write_bytes(encode_export_manifest(msgspec.structs.replace(m, files=tuple(new))))


def _nbytes(t: ExportTensor) -> int:
    from tpshard.safetensors_format import nbytes_of

    return nbytes_of(t.dtype, t.shape)


def test_export_check_catches_a_layer_in_the_wrong_stages_files(exports, llama7, copy_of):
    """Layer 1 (stage 0 of 2,3,2) moved into stage 1's files: consistent checksums, wrong stage."""
    folder = copy_of(exports["pp3"])

    def move(files):
        for t in range(2):
            src, dst = files[f"model-pp-0-tp-{t}-part-0.safetensors"], files[f"model-pp-1-tp-{t}-part-0.safetensors"]
            for key in [k for k in src if k.startswith("model.layers.1.")]:
                dst[key] = src.pop(key)

    rewrite_export(folder, move)
    report = check_export(folder)
    found = [p.message for p in report.problems if p.check == "stages"]
    assert not [p for p in report.problems if p.check in ("checksum", "files")], report.problems
    assert "rank 0 (stage 0): no tensor of layers 1; its layers are 0-1" in found, found
    assert "rank 2 (stage 1): model.layers.1.mlp.down_proj.weight is in its files, but vLLM builds it on stage 0" in found, found
    against = check_export(folder, llama7)
    assert any(p.check == "rules" and "model-pp-0-tp-0-part-0.safetensors" in p.message for p in against.problems)


def test_export_check_catches_a_missing_last_stage_norm_and_a_wrong_env(exports, llama7, copy_of, tmp_path, capsys, monkeypatch):
    folder = copy_of(exports["pp3"])

    def drop_norm(files):
        for t in range(2):
            del files[f"model-pp-2-tp-{t}-part-0.safetensors"]["model.norm.weight"]

    rewrite_export(folder, drop_norm)
    found = [p.message for p in check_export(folder).problems]
    assert found == [f"rank {r} (stage 2): lacks model.norm.weight, which vLLM builds on that stage" for r in (4, 5)]
    code, stdout, _ = cli(capsys, monkeypatch, "check", folder, "--source", llama7)
    assert code == 1 and "FAIL [stages] rank 4 (stage 2): lacks model.norm.weight" in stdout
    folder = tmp_path / "env"  # a second copy: the launch environment tampered with
    shutil.copytree(exports["pp3"], folder)
    path = folder / EXPORT_MANIFEST_NAME
    data = json.loads(path.read_bytes())
    data["env"] = {"VLLM_PP_LAYER_PARTITION": "3,2,2"}
    path.write_text(json.dumps(data))
    found = [(p.check, p.message) for p in check_export(folder).problems]
    assert len(found) == 1 and found[0][0] == "stages" and "VLLM_PP_LAYER_PARTITION" in found[0][1], found


def test_export_refuses_a_pipeline_output_with_a_stage_gap(exports, copy_of, tmp_path):
    """A tpshard manifest that lost layer 4's down_proj on stage 1: refused before writing."""
    out = copy_of(exports["pp3-out"])
    m = read_manifest(out)
    m = msgspec.structs.replace(
        m, tensors=tuple(t for t in m.tensors if not t.name.startswith("model.layers.4.")),
        files=tuple(msgspec.structs.replace(f, digests="") for f in m.files),
    )  # fmt: skip
    (out / MANIFEST_NAME).write_bytes(encode_manifest(m))
    with pytest.raises(TpshardError, match=re.escape("rank 2 (stage 1): no tensor of layers 4; its layers are 2-4")):
        export(out, tmp_path / "e", "vllm")
    assert not (tmp_path / "e").exists()
