"""split then check on real transformers checkpoints; every rank held to the contract in
tests/contract.py; check shown failing on outputs broken on purpose."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from contract import expected_rank_tensor
from tpshard.digest import file_digest
from tpshard.errors import OutputError
from tpshard.manifest import MANIFEST_NAME, encode_manifest, rank_dir, read_manifest
from tpshard.topology import Topology


def source_tensors(model: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in model.glob("*.safetensors"):
        out |= load_file(f)
    return out


def split(model: Path, out: Path, **topo) -> Path:
    tpshard.split(model, out, Topology(**topo))
    return out


def assert_contract(model: Path, out: Path, tp: int, attn_dp: int = 1):
    config = json.loads((model / "config.json").read_text())
    full = source_tensors(model)
    for rank in range(tp):
        tensors = tpshard.open_rank(out, rank)
        assert set(tensors) == set(full), f"rank {rank} holds other tensor names than the source"
        for name, t in tensors.items():
            want = expected_rank_tensor(name, full[name], rank, tp=tp, attn_dp=attn_dp, config=config)
            assert t.dtype == want.dtype and torch.equal(t, want), f"rank {rank}: {name} {list(t.shape)} vs {list(want.shape)}"


@pytest.mark.parametrize("tp, attn_dp", [(8, 2), (8, 1), (4, 1), (2, 2), (1, 1)])
def test_llama_every_rank_matches_the_contract(llama, tmp_path, tp, attn_dp):
    out = split(llama, tmp_path / "out", tp=tp, attn_dp=attn_dp)
    assert tpshard.check(out, llama).ok
    assert_contract(llama, out, tp, attn_dp)


def test_qwen3_tp8_attn_dp2_shapes(qwen3, tmp_path):
    """The 'done when' of the first issue, on a model whose engine class cuts attention over attn_tp:
    q 2 heads, k/v 1 head shared by 2 ranks, MLP 1/8, embedding over attn_tp, lm_head over tp."""
    out = split(qwen3, tmp_path / "out", tp=8, attn_dp=2)
    for rank in range(8):
        t = tpshard.open_rank(out, rank)
        assert t["model.layers.0.self_attn.q_proj.weight"].shape == (2 * 32, 64)  # head_dim 32
        assert t["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
        assert t["model.layers.0.mlp.gate_proj.weight"].shape == (12, 64)
        assert t["model.layers.0.mlp.down_proj.weight"].shape == (64, 12)
        assert t["model.embed_tokens.weight"].shape == (64, 64)  # 256 padded rows / attn_tp 4
        assert t["lm_head.weight"].shape == (32, 64)  # 256 / tp 8
    k = [tpshard.open_rank(out, r)["model.layers.1.self_attn.k_proj.weight"] for r in range(8)]
    assert torch.equal(k[0], k[1]) and torch.equal(k[0], k[4]) and not torch.equal(k[0], k[2])


def test_llama_attention_dp_keeps_the_tp_layout(llama, tmp_path):
    """SGLang's LlamaForCausalLM cuts attention and the embedding over tp under attention DP too:
    --attn-dp 2 writes the bytes of --attn-dp 1, and the plan says so."""
    dp = split(llama, tmp_path / "dp", tp=8, attn_dp=2)
    plain = split(llama, tmp_path / "plain", tp=8)
    assert any("gives the layout of --attn-dp 1" in w for w in read_manifest(dp).plan.warnings)
    for rank in range(8):
        a, b = tpshard.open_rank(dp, rank), tpshard.open_rank(plain, rank)
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        assert a["model.layers.0.self_attn.q_proj.weight"].shape == (8, 64)  # 8 heads / tp 8


@pytest.mark.parametrize("fixture, tp, attn_dp", [("qwen2_tied", 4, 1), ("qwen2_tied", 8, 2), ("qwen3", 4, 2), ("mistral", 8, 1), ("mistral", 4, 2)])
def test_other_architectures(request, tmp_path, fixture, tp, attn_dp):
    model = request.getfixturevalue(fixture)
    out = split(model, tmp_path / "out", tp=tp, attn_dp=attn_dp)
    assert tpshard.check(out, model).ok
    assert_contract(model, out, tp, attn_dp)


def test_tied_embeddings_write_no_lm_head(qwen2_tied, tmp_path):
    out = split(qwen2_tied, tmp_path / "out", tp=2)
    assert "lm_head.weight" not in tpshard.open_rank(out, 0)
    assert any("tied" in w for w in read_manifest(out).plan.warnings)


def test_mistral_intermediate_100_at_tp8_is_zero_padded(mistral, tmp_path):
    out = split(mistral, tmp_path / "out", tp=8)
    last = tpshard.open_rank(out, 7)["model.layers.0.mlp.down_proj.weight"]
    assert last.shape == (64, 13) and torch.count_nonzero(last[:, 9:]) == 0  # 100 = 7*13 + 9


def test_rank_folder_reads_like_an_hf_checkpoint(llama, tmp_path):
    out = split(llama, tmp_path / "out", tp=4)
    folder = out / rank_dir(2)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert (folder / "config.json").read_text() == (llama / "config.json").read_text()
    for name, file in index["weight_map"].items():
        with safe_open(folder / file, "pt") as f:
            assert name in f.keys()
    # shared files are hard links, written once
    common = [os.stat(out / rank_dir(r) / "model-common.safetensors").st_ino for r in range(4)]
    assert len(set(common)) == 1


def test_output_is_identical_whatever_the_worker_count(llama, tmp_path):
    a = tmp_path / "a"
    b = tmp_path / "b"
    tpshard.split(llama, a, Topology(tp=8, attn_dp=2), workers=1)
    tpshard.split(llama, b, Topology(tp=8, attn_dp=2), workers=5)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


@pytest.mark.parametrize("small, run_tensors, short_writes", [(0, 4096, False), (1 << 30, 3, False), (1 << 30, 4096, True)])
def test_output_is_identical_whatever_the_copy_jobs(llama, tmp_path, monkeypatch, small, run_tensors, short_writes):
    """Small tensors are copied in runs (one read, one gathering write per output file); the bytes
    are those of a copy tensor by tensor, whatever the run length, also when the kernel writes
    only part of a gathering write. Source crc32s combined from the shards' (COMBINE_BYTES 1) equal
    those computed over the source bytes."""
    import tpshard.writer as writer

    a = split(llama, tmp_path / "a", tp=8, attn_dp=2)
    monkeypatch.setattr(writer, "SMALL_BYTES", small)
    monkeypatch.setattr(writer, "COMBINE_BYTES", 1)
    monkeypatch.setattr(writer, "RUN_TENSORS", run_tensors)
    if short_writes:
        real = os.pwritev
        monkeypatch.setattr(os, "pwritev", lambda fd, views, offset: real(fd, views[:1], offset) if len(views) > 1 else real(fd, views, offset))
    b = split(llama, tmp_path / "b", tp=8, attn_dp=2)
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files_a == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for rel in files_a:
        assert (a / rel).read_bytes() == (b / rel).read_bytes(), rel


def test_existing_output_needs_force(llama, tmp_path):
    out = split(llama, tmp_path / "out", tp=2)
    with pytest.raises(OutputError, match="already exists; pass --force"):
        split(llama, out, tp=2)
    tpshard.split(llama, out, Topology(tp=4), force=True)
    assert read_manifest(out).plan.topology.tp == 4
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old copy left behind


def test_a_failed_split_leaves_nothing(llama, tmp_path, monkeypatch):
    import tpshard.writer

    def boom(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(tpshard.writer, "_copy_small", boom)
    with pytest.raises(RuntimeError):
        split(llama, tmp_path / "out", tp=2)
    assert list(tmp_path.iterdir()) == []


def test_ranks_subset_writes_only_those_ranks(llama, tmp_path):
    out = tmp_path / "out"
    tpshard.split(llama, out, Topology(tp=8, attn_dp=2), ranks=[4, 5])
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["rank-00004", "rank-00005"]
    assert tpshard.check(out, llama).ok
    assert_rank = tpshard.open_rank(out, 5)["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(assert_rank, tpshard.open_rank(split(llama, tmp_path / "full", tp=8, attn_dp=2), 5)["model.layers.0.self_attn.q_proj.weight"])


# ---- check must fail on outputs broken on purpose -------------------------------------------


@pytest.fixture(scope="module")
def good(qwen3, tmp_path_factory) -> Path:
    """Qwen3 at tp 8 / attn-dp 2: attention over attn_tp, kv heads shared by 2 ranks and both DP replicas."""
    out = tmp_path_factory.mktemp("good") / "out"
    tpshard.split(qwen3, out, Topology(tp=8, attn_dp=2))
    return out


def problems(out, source):
    report = tpshard.check(out, source)
    return [f"[{p.check}] {p.message}" for p in report.problems]


def test_kv_heads_swapped_between_ranks_with_checksums_rewritten(good, qwen3, copy_of):
    out = copy_of(good)
    name = "model.layers.1.self_attn.k_proj.weight"
    k0, k2 = (tpshard.open_rank(out, r)[name].clone() for r in (0, 2))
    overwrite_tensor(out, 0, name, k2)
    overwrite_tensor(out, 2, name, k0)
    rewrite_checksums(out)
    assert not problems(out, None), "with consistent checksums only the source can tell"
    found = problems(out, qwen3)
    assert any(name in p and "holds the slice of group rank 1" in p for p in found), found
    assert any(name in p and "holds the slice of group rank 0" in p for p in found), found


def test_flipped_byte_is_caught_by_checksums(good, copy_of):
    out = copy_of(good)
    path = out / rank_dir(3) / "model-tp-003-of-008.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01
    path.write_bytes(data)
    found = problems(out, None)
    assert any("model-tp-003-of-008" in p and "does not match its crc32" in p for p in found), found


def test_with_the_source_the_checksums_come_from_the_reassembly_reads(good, qwen3, copy_of, monkeypatch):
    """check --source reads each output byte once: the reassembly hashes what it compares, and the
    checksum findings are the ones check without the source makes, reported before the source's."""
    import importlib

    files_module = importlib.import_module("tpshard.check.files")  # where check_output hashes the files
    out = copy_of(good)
    path = out / rank_dir(3) / "model-tp-003-of-008.safetensors"
    with open(path, "r+b") as f:  # the middle of a tensor, not its padding
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    without = problems(out, None)
    assert len(without) == 2 and "does not match its crc32" in without[0] and "file checksum differs" in without[1], without
    read = []
    monkeypatch.setattr(files_module, "range_digests", lambda *a: read.append(a) or [])
    found = problems(out, qwen3)
    assert not read, "the output's files were read a second time to hash them"
    assert found[:2] == without and len(found) == 3 and found[2].startswith("[reassembly]") and "model-tp-003" not in found[2], found
    assert tpshard.check(good, qwen3).ok


def test_flipped_padding_byte_is_caught_by_reassembly(good, qwen3, copy_of):
    out = copy_of(good)
    lm = tpshard.open_rank(out, 7)["lm_head.weight"].clone()
    lm[-1, 0] = 1.0  # a padding row must be zero
    overwrite_tensor(out, 7, "lm_head.weight", lm)
    rewrite_checksums(out)
    found = problems(out, qwen3)
    assert any("lm_head.weight" in p and "(padding (must be zero))" in p for p in found), found


def test_truncated_file_is_caught(good, copy_of):
    out = copy_of(good)
    path = out / rank_dir(0) / "model-common.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    found = problems(out, None)
    assert any("model-common.safetensors" in p and "truncated" in p for p in found), found


def test_shard_from_another_rank_is_caught(good, qwen3, copy_of):
    out = copy_of(good)
    # rank 1's tp file replaced by rank 0's bytes (a broken copy, not a link), manifest untouched
    dst = out / rank_dir(1) / "model-tp-001-of-008.safetensors"
    dst.unlink()
    shutil.copyfile(out / rank_dir(0) / "model-tp-000-of-008.safetensors", dst)
    found = problems(out, qwen3)
    assert any("model-tp-001-of-008" in p and "crc32" in p for p in found), found


def test_replica_copy_that_differs_is_caught(good, copy_of):
    """A kv file shared by ranks 0, 1, 4, 5 whose copy in rank 4 stopped being the same bytes."""
    out = copy_of(good)
    name = "model-attn_tp-x2-000-of-002.safetensors"
    dst = out / rank_dir(4) / name
    data = bytearray(dst.read_bytes())
    dst.unlink()
    data[-1] ^= 0xFF
    dst.write_bytes(data)
    found = problems(out, None)
    assert any(name in p and "[4]" in p for p in found), found


def test_manifest_that_disagrees_with_the_rules_is_caught(good, qwen3, copy_of):
    import msgspec

    out = copy_of(good)
    m = read_manifest(out)
    first = next(s for s in m.plan.shards if s.name.endswith("o_proj.weight")).name
    # o_proj sliced over the wrong group
    plan = m.plan.with_shards(msgspec.structs.replace(s, group="tp") if s.name == first else s for s in m.plan.shards)
    (out / MANIFEST_NAME).write_bytes(encode_manifest(m.with_plan(plan)))
    found = problems(out, qwen3)
    assert any("[group]" in p and "o_proj" in p for p in found), found
    assert any("[rules]" in p and "group='tp'" in p for p in found), found


@pytest.mark.parametrize("agrees", [True, False])
def test_rules_decide_the_reassembly_past_the_listed_problems(good, qwen3, copy_of, agrees):
    """More findings than a report lists (60 files the source has and the output lacks) before the
    rules' check: the rules still decide whether the source is reassembled, by what they found."""
    import msgspec

    source, out = copy_of(qwen3), copy_of(good)
    for k in range(60):
        (source / f"notes-{k:02d}.txt").write_text("not copied")
    if not agrees:  # o_proj sliced over the wrong group
        m = read_manifest(out)
        first = next(s for s in m.plan.shards if s.name.endswith("o_proj.weight")).name
        plan = m.plan.with_shards(msgspec.structs.replace(s, group="tp") if s.name == first else s for s in m.plan.shards)
        (out / MANIFEST_NAME).write_bytes(encode_manifest(m.with_plan(plan)))
    report = tpshard.check(out, source)
    assert report.omitted > 0 and not report.ok
    assert report.tensors_reassembled == (len(read_manifest(good).tensors) if agrees else 0)


def test_row_bias_marked_sliced_is_caught(tmp_path):
    """Check 5 on a Llama with attention_bias: o_proj.bias must stay whole, added once."""
    import msgspec
    from checkpoints import make_checkpoint

    model = make_checkpoint(tmp_path / "m", "llama", attention_bias=True)
    out = split(model, tmp_path / "out", tp=4)
    assert tpshard.check(out, model).ok
    m = read_manifest(out)
    shards = [msgspec.structs.replace(s, kind="replicated") if s.name.endswith("o_proj.bias") else s for s in m.plan.shards]
    (out / MANIFEST_NAME).write_bytes(encode_manifest(m.with_plan(m.plan.with_shards(shards))))
    found = problems(out, None)
    assert any("[reduction]" in p and "o_proj.bias" in p for p in found), found


def test_parts_split_on_different_nodes_merge_into_one_output(llama, tmp_path):
    from tpshard.merge import merge

    topo = Topology(tp=8, attn_dp=2)
    tpshard.split(llama, tmp_path / "a", topo, ranks=range(0, 4))
    tpshard.split(llama, tmp_path / "b", topo, ranks=range(4, 8))
    merged = merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert merged.written_ranks == tuple(range(8))
    assert tpshard.check(tmp_path / "out", llama).ok
    whole = split(llama, tmp_path / "whole", tp=8, attn_dp=2)
    assert (tmp_path / "out" / MANIFEST_NAME).read_bytes() == (whole / MANIFEST_NAME).read_bytes()


def test_merge_refuses_parts_of_different_splits(llama, tmp_path):
    from tpshard.merge import merge

    tpshard.split(llama, tmp_path / "a", Topology(tp=8, attn_dp=2), ranks=[0])
    tpshard.split(llama, tmp_path / "b", Topology(tp=8), ranks=[1])
    with pytest.raises(OutputError, match="different plans"):
        merge([tmp_path / "a", tmp_path / "b"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_consolidated_files_beside_the_hf_files_are_ignored(llama, tmp_path, copy_of):
    model = copy_of(llama)
    shutil.copyfile(model / "model-00001-of-00002.safetensors", model / "consolidated.safetensors")
    out = split(model, tmp_path / "out", tp=2)
    assert not (out / rank_dir(0) / "consolidated.safetensors").exists()
    assert [f.name for f in read_manifest(out).source_files if "consolidated" in f.name] == []
    assert tpshard.check(out, model).ok


def test_load_rank_reads_what_open_rank_reads(llama, tmp_path):
    from tpshard.rank import load_rank

    out = split(llama, tmp_path / "out", tp=8, attn_dp=2)
    for rank in range(8):
        lazy, eager = tpshard.open_rank(out, rank), load_rank(out, rank)
        assert set(lazy) == set(eager)
        for name, t in eager.items():
            assert t.dtype == lazy[name].dtype and torch.equal(t, lazy[name]), (rank, name)


def test_rank_index_is_json_dumps_indent_2(llama, tmp_path):
    """Each rank's model.safetensors.index.json, written line by line, is byte for byte
    json.dumps(indent=2) of its content, names sorted, every tensor of the rank's files listed."""
    out = tmp_path / "out"
    tpshard.split(llama, out, Topology(tp=4, attn_dp=2))
    plan = read_manifest(out).plan
    for r in range(4):
        raw = (out / rank_dir(r) / "model.safetensors.index.json").read_bytes()
        index = json.loads(raw)
        assert raw == (json.dumps(index, indent=2) + "\n").encode()
        assert list(index["weight_map"]) == sorted(index["weight_map"])
        assert index["weight_map"] == {s.name: s.file for s in plan.rank_shards(r)}


def test_sha256_tensor_digests_on_request(llama, tmp_path):
    import msgspec

    from tpshard.manifest import Options

    out = tmp_path / "out"
    tpshard.split(llama, out, Topology(tp=2), Options(checksum="sha256"))
    assert tpshard.check(out, llama).ok
    m = read_manifest(out)
    assert [len(f.digests) for f in m.files] == [64 * len(m.plan.members(i)) for i in range(len(m.files))]
    path = out / rank_dir(0) / "model-tp-000-of-002.safetensors"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x80
    path.write_bytes(data)
    assert any("does not match its sha256" in p for p in problems(out, None))
    with pytest.raises(Exception, match="choose crc32 or sha256"):
        msgspec.structs.replace(Options(), checksum="md5")


def test_missing_and_truncated_files_are_reported_not_raised(good, qwen3, copy_of):
    out = copy_of(good)
    (out / rank_dir(0) / "model-tp-000-of-008.safetensors").unlink()
    (out / rank_dir(1) / "model-tp-001-of-008.safetensors").unlink()
    path = out / rank_dir(2) / "model-tp-002-of-008.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    found = problems(out, qwen3)
    assert any("rank 0: model-tp-000-of-008.safetensors is missing" in p for p in found), found
    assert any("model-tp-002-of-008" in p and "truncated" in p for p in found), found
    assert any("cannot be reassembled" in p for p in found), found


def test_a_changed_config_copy_in_one_rank_is_caught(good, copy_of):
    out = copy_of(good)
    path = out / rank_dir(6) / "config.json"
    text = path.read_text()
    path.unlink()  # break the hard link: rank 6 gets its own, different copy
    path.write_text(text.replace("silu", "gelu"))
    found = problems(out, None)
    assert any("config.json of ranks [6]" in p for p in found), found


@pytest.mark.parametrize("topo, ranks, checksum", [(dict(tp=8, attn_dp=2), None, "crc32"), (dict(tp=8), [3], "crc32"), (dict(tp=4), None, "sha256")])
def test_source_checksums_do_not_depend_on_how_the_split_read_the_source(llama, tmp_path, topo, ranks, checksum):
    """The writer derives a tensor's crc32 from its pieces' when they tile it; the manifest must
    hold what hashing the source directly gives, whatever the topology, rank subset or digest."""
    import zlib

    from tpshard.checkpoint import open_checkpoint
    from tpshard.manifest import Options
    from tpshard.safetensors_format import read_header_bytes

    ckpt = open_checkpoint(llama)
    expected = {}
    for name in ckpt.weight_files:
        data = (llama / name).read_bytes()
        spans = sorted((i.begin, i.end) for i in ckpt.tensors.values() if i.file == name)
        expected[name] = file_digest(read_header_bytes(llama / name), [zlib.crc32(data[b:e]).to_bytes(4, "big") for b, e in spans])
    m = tpshard.split(llama, tmp_path / "out", Topology(**topo), Options(checksum=checksum), ranks=ranks)
    assert {f.name: f.checksum for f in m.source_files if f.name in expected} == expected


def test_check_plan_finds_a_broken_tensor_whose_kind_another_layer_passed(llama):
    """check_plan checks a tensor record (names aside) once when it is clean: the last layer's
    k_proj with two group ranks swapped, otherwise the first layer's twin, is still found, by name;
    a tensor listed twice too."""
    import msgspec

    from tpshard.check import CheckReport, check_plan
    from tpshard.checkpoint import open_checkpoint
    from tpshard.plan import make_plan

    plan = make_plan(open_checkpoint(llama), Topology(tp=4))
    report = CheckReport(out_dir="", source=None)
    check_plan(plan, report)
    assert report.ok, report.problems
    a, b = [s for s in plan.shards if s.name == "model.layers.1.self_attn.k_proj.weight"][:2]
    swapped = {id(a): msgspec.structs.replace(a, group_rank=b.group_rank), id(b): msgspec.structs.replace(b, group_rank=a.group_rank)}
    report = CheckReport(out_dir="", source=None)
    check_plan(plan.with_shards(swapped.get(id(s), s) for s in plan.shards), report)
    assert report.problems and {p.message.split(" ")[0] for p in report.problems} == {a.name}, report.problems
    report = CheckReport(out_dir="", source=None)
    check_plan(msgspec.structs.replace(plan, tensors=plan.tensors + plan.tensors[-1:]), report)
    assert [p.message for p in report.problems] == [f"{plan.tensors[-1].name}: listed more than once in the manifest"]


def test_crc32_combine_equals_crc32_of_the_concatenation():
    """The writer derives a source tensor's crc32 from its shards' (tpshard.digest.crc32_combine)."""
    import random
    import zlib

    from tpshard.digest import crc32_combine

    rng = random.Random(0)
    for n in [0, 1, 2, 7, 8, 255, 256, 4096, *[rng.randrange(1, 100_000) for _ in range(20)]]:
        a, b = rng.randbytes(rng.randrange(0, 300)), rng.randbytes(n)
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), n
