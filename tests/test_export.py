"""Engine exports (tpshard export / split --format): names, shapes and dtypes per rank against worked
tables for every dense architecture and both engines, bytes against slices cut here with torch from
the source, refusals, and check catching broken exports."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

import tpshard
from tpshard.check import check
from tpshard.digest import file_digest, hash_range
from tpshard.errors import OutputError, TpshardError
from tpshard.export import ExportError, export, export_layout
from tpshard.export.manifest import EXPORT_MANIFEST_NAME, encode_export_manifest, read_export_manifest
from tpshard.manifest import rank_dir
from tpshard.plan import file_header

VLLM_BUFFERS = {f"self_attn.attn.{b}": ("F32", ()) for b in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")}

# Per rank at tp 2 (hidden 64, 8 heads / 2 kv heads, vocab 250 padded to 256, intermediate 96),
# worked by hand: qkv rows = 4 q heads + 1 k head + 1 v head (head_dim 8 -> 48, Qwen3's 32 -> 192),
# gate_up rows = 2 x intermediate / 2, embedding and lm_head rows = 256 / 2.
LAYER_TP2 = {
    "llama": {
        "input_layernorm.weight": ("BF16", (64,)), "post_attention_layernorm.weight": ("BF16", (64,)),
        "self_attn.qkv_proj.weight": ("BF16", (48, 64)), "self_attn.o_proj.weight": ("BF16", (64, 32)),
        "mlp.gate_up_proj.weight": ("BF16", (96, 64)), "mlp.down_proj.weight": ("BF16", (64, 48)),
    },
    "mistral": {  # intermediate 100
        "input_layernorm.weight": ("BF16", (64,)), "post_attention_layernorm.weight": ("BF16", (64,)),
        "self_attn.qkv_proj.weight": ("BF16", (48, 64)), "self_attn.o_proj.weight": ("BF16", (64, 32)),
        "mlp.gate_up_proj.weight": ("BF16", (100, 64)), "mlp.down_proj.weight": ("BF16", (64, 50)),
    },
    "qwen2_tied": {  # q/k/v biases
        "input_layernorm.weight": ("BF16", (64,)), "post_attention_layernorm.weight": ("BF16", (64,)),
        "self_attn.qkv_proj.weight": ("BF16", (48, 64)), "self_attn.qkv_proj.bias": ("BF16", (48,)),
        "self_attn.o_proj.weight": ("BF16", (64, 32)),
        "mlp.gate_up_proj.weight": ("BF16", (96, 64)), "mlp.down_proj.weight": ("BF16", (64, 48)),
    },
    "qwen3": {  # head_dim 32, q/k norms
        "input_layernorm.weight": ("BF16", (64,)), "post_attention_layernorm.weight": ("BF16", (64,)),
        "self_attn.qkv_proj.weight": ("BF16", (192, 64)), "self_attn.o_proj.weight": ("BF16", (64, 128)),
        "self_attn.q_norm.weight": ("BF16", (32,)), "self_attn.k_norm.weight": ("BF16", (32,)),
        "mlp.gate_up_proj.weight": ("BF16", (96, 64)), "mlp.down_proj.weight": ("BF16", (64, 48)),
    },
}  # fmt: skip
GLOBAL_TP2 = {
    "untied": {"model.embed_tokens.weight": ("BF16", (128, 64)), "lm_head.weight": ("BF16", (128, 64)), "model.norm.weight": ("BF16", (64,))},
    "tied": {"lm_head.weight": ("BF16", (128, 64)), "model.norm.weight": ("BF16", (64,))},  # one table, under lm_head
}


def worked_table(arch: str, engine: str, layers: int = 2) -> dict[str, tuple[str, tuple]]:
    table = dict(GLOBAL_TP2["tied" if arch == "qwen2_tied" else "untied"])
    per_layer = dict(LAYER_TP2[arch], **(VLLM_BUFFERS if engine == "vllm" else {}))
    for i in range(layers):
        table.update({f"model.layers.{i}.{k}": v for k, v in per_layer.items()})
    return table


def headers(folder: Path, rank: int) -> dict[str, tuple[str, tuple]]:
    """Every key of a rank's part files with (dtype, shape), read from the safetensors headers."""
    out = {}
    for path in sorted(folder.glob(f"model-rank-{rank}-part-*.safetensors")):
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        for k, v in json.loads(raw[8 : 8 + n]).items():
            if k != "__metadata__":
                assert k not in out, f"{k} twice in rank {rank}"
                out[k] = (v["dtype"], tuple(v["shape"]))
    return out


@pytest.fixture(scope="module")
def split_tp2(tmp_path_factory, llama, mistral, qwen2_tied, qwen3):
    root = tmp_path_factory.mktemp("splits")
    sources = {"llama": llama, "mistral": mistral, "qwen2_tied": qwen2_tied, "qwen3": qwen3}
    return {a: (src, tpshard.split(src, root / a, tpshard.Topology(tp=2)) and root / a) for a, src in sources.items()}


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2_tied", "qwen3"])
def test_names_shapes_dtypes_per_rank_match_worked_tables(split_tp2, tmp_path, arch, engine):
    src, out = split_tp2[arch]
    dest = tmp_path / "export"
    export(out, dest, engine)
    want = worked_table(arch, engine)
    for rank in (0, 1):
        assert headers(dest, rank) == want, f"rank {rank}"
    for extra in ("config.json", "generation_config.json"):
        assert (dest / extra).read_bytes() == (src / extra).read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == sorted(
        ["config.json", "generation_config.json", EXPORT_MANIFEST_NAME, "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    )
    report = check(dest, src)
    assert report.ok, report.problems
    assert report.tensors_reassembled == len(tpshard.open_checkpoint(src).tensors)


def _source(src: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_llama_tp8_bytes_are_the_engine_slices(tmp_path, llama):
    """tp 8 > 2 kv heads: rank r holds q head r and kv head r // 4; every tensor equals what vLLM's
    weight loaders would cut from the source, computed here with torch, not from the plan."""
    dest = tmp_path / "v8"
    tpshard.split(llama, tmp_path / "out", tpshard.Topology(tp=8))
    export(tmp_path / "out", dest, "vllm")
    w = _source(llama)
    for r in range(8):
        got = load_file(dest / f"model-rank-{r}-part-0.safetensors")
        L = "model.layers.1."
        q = w[L + "self_attn.q_proj.weight"][8 * r : 8 * r + 8]
        k = w[L + "self_attn.k_proj.weight"][8 * (r // 4) : 8 * (r // 4) + 8]
        v = w[L + "self_attn.v_proj.weight"][8 * (r // 4) : 8 * (r // 4) + 8]
        assert torch.equal(got[L + "self_attn.qkv_proj.weight"], torch.cat([q, k, v]))
        gate, up = (w[L + f"mlp.{p}_proj.weight"][12 * r : 12 * r + 12] for p in ("gate", "up"))
        assert torch.equal(got[L + "mlp.gate_up_proj.weight"], torch.cat([gate, up]))
        assert torch.equal(got[L + "mlp.down_proj.weight"], w[L + "mlp.down_proj.weight"][:, 12 * r : 12 * r + 12])
        assert torch.equal(got[L + "self_attn.o_proj.weight"], w[L + "self_attn.o_proj.weight"][:, 8 * r : 8 * r + 8])
        table = torch.cat([w["lm_head.weight"], torch.zeros(6, 64, dtype=torch.bfloat16)])  # 250 -> 256 rows
        assert torch.equal(got["lm_head.weight"], table[32 * r : 32 * r + 32])
        assert torch.equal(got[L + "self_attn.attn._prob_scale"], torch.tensor(1.0))
        assert got[L + "self_attn.attn._k_scale"].dtype == torch.float32
    assert check(dest, llama).ok


def test_tied_qwen2_with_vocab_padding_sglang(tmp_path, qwen2_tied):
    """The tied table is written once, as lm_head.weight, with the zero rows of the 64-padding on the
    last rank; biases fused like their weights; no attention buffers for SGLang."""
    dest = tmp_path / "sg"
    tpshard.split(qwen2_tied, tmp_path / "out", tpshard.Topology(tp=2))
    export(tmp_path / "out", dest, "sglang")
    w = _source(qwen2_tied)
    assert "lm_head.weight" not in w
    r1 = load_file(dest / "model-rank-1-part-0.safetensors")
    assert "model.embed_tokens.weight" not in r1
    assert torch.equal(r1["lm_head.weight"][:122], w["model.embed_tokens.weight"][128:])
    assert not r1["lm_head.weight"][122:].any()  # rows 250..255
    L = "model.layers.0.self_attn."
    bias = torch.cat([w[L + "q_proj.bias"][32:], w[L + "k_proj.bias"][8:], w[L + "v_proj.bias"][8:]])
    assert torch.equal(r1[L + "qkv_proj.bias"], bias)
    assert not any("_scale" in k for k in r1)


def test_sglang_qwen3_attn_dp_follows_attn_tp(tmp_path, qwen3):
    """SGLang's Qwen3 shards attention and the embedding over attn_tp under DP attention: at tp 4,
    attn-dp 2 ranks r and r + 2 hold the same attention slice; the MLP is over all 4."""
    dest = tmp_path / "sg"
    tpshard.split(qwen3, tmp_path / "out", tpshard.Topology(tp=4, attn_dp=2))
    export(tmp_path / "out", dest, "sglang")
    h = headers(dest, 0)
    assert h["model.layers.0.self_attn.qkv_proj.weight"] == ("BF16", (192, 64))  # 4 q heads + 1 + 1 of 32
    assert h["model.layers.0.mlp.gate_up_proj.weight"] == ("BF16", (48, 64))
    assert h["model.embed_tokens.weight"] == ("BF16", (128, 64))
    r0, r2 = (load_file(dest / f"model-rank-{r}-part-0.safetensors") for r in (0, 2))
    assert torch.equal(r0["model.layers.0.self_attn.qkv_proj.weight"], r2["model.layers.0.self_attn.qkv_proj.weight"])
    assert not torch.equal(r0["model.layers.0.mlp.down_proj.weight"], r2["model.layers.0.mlp.down_proj.weight"])
    assert check(dest, qwen3).ok


def test_parts_respect_the_size_limit(tmp_path, llama):
    tpshard.split(llama, tmp_path / "out", tpshard.Topology(tp=2))
    dest = tmp_path / "parts"
    m = export(tmp_path / "out", dest, "vllm", max_part_bytes=10_000)
    per_rank = {}
    for f in m.files:
        per_rank.setdefault(f.rank, []).append(f.name)
        data = os.path.getsize(dest / f.name) - len(file_header([(t.name, t.dtype, t.shape) for t in f.tensors])[0])
        assert f.tensors and (data <= 10_000 or len(f.tensors) == 1)  # a bigger tensor gets a part of its own
    assert sorted(per_rank[0]) == sorted(f"model-rank-0-part-{p}.safetensors" for p in range(len(per_rank[0])))
    assert len(per_rank[0]) > 3
    assert headers(dest, 0) == worked_table("llama", "vllm")
    assert check(dest, llama).ok


# --- refusals ------------------------------------------------------------------------------------


def test_refusals_one_clear_line(tmp_path, llama, mistral, qwen3):
    split = lambda src, name, **topo: tpshard.split(src, tmp_path / name, tpshard.Topology(**topo)) and tmp_path / name  # noqa: E731
    padded = split(mistral, "pad", tp=8)  # intermediate 100 padded to 104
    for engine in ("vllm", "sglang"):
        with pytest.raises(ExportError, match=r"zero-padded to divide.*asserts that the dim divides"):
            export(padded, tmp_path / "x", engine)
    dp = split(llama, "dp", tp=4, attn_dp=2)
    with pytest.raises(ExportError, match="--format vllm: split with --attn-dp 2, but vLLM"):
        export(dp, tmp_path / "x", "vllm")
    with pytest.raises(ExportError, match="SGLang's LlamaForCausalLM splits attention heads over the full tp"):
        export(dp, tmp_path / "x", "sglang")
    with pytest.raises(ExportError, match="--format vllm: split with --attn-dp 2"):
        export(split(qwen3, "q3dp", tp=4, attn_dp=2), tmp_path / "x", "vllm")
    with pytest.raises(ExportError, match="choose one of vllm, sglang"):
        export(dp, tmp_path / "x", "trtllm")
    part = tpshard.split(llama, tmp_path / "part", tpshard.Topology(tp=2), ranks=[0]) and tmp_path / "part"
    with pytest.raises(OutputError, match=r"an export needs every rank \(missing \[1\]\)"):
        export(part, tmp_path / "x", "vllm")
    assert not (tmp_path / "x").exists() and not list(tmp_path.glob(".x*"))

    plan = tpshard.make_plan(tpshard.open_checkpoint(llama), tpshard.Topology(tp=2))
    other = msgspec.structs.replace(plan, model=msgspec.structs.replace(plan.model, architecture="DeepseekV4ForCausalLM"))
    with pytest.raises(ExportError, match="no vllm name table for DeepseekV4ForCausalLM.*no name it has not mapped exactly"):
        export_layout(other, "vllm", False)
    with pytest.raises(ExportError, match="config.json says tie_word_embeddings=true but the checkpoint has an lm_head.weight"):
        export_layout(plan, "sglang", True)
    odd = msgspec.structs.replace(plan, options=msgspec.structs.replace(plan.options, vocab_multiple=128))
    with pytest.raises(ExportError, match="multiple of 128; the engines pad it to 64"):
        export_layout(odd, "vllm", False)


def test_quantized_input_refused_with_the_reason(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from quant_fixtures import DEFAULT_SPECS, write_quant_checkpoint

    src = tmp_path / "gptq"
    write_quant_checkpoint(src, DEFAULT_SPECS["gptq"])
    tpshard.split(src, tmp_path / "out", tpshard.Topology(tp=2))
    with pytest.raises(ExportError, match=r"sglang: the checkpoint is quantized \(gptq\); SGLang's sharded_state loads files after"):
        export(tmp_path / "out", tmp_path / "x", "sglang")
    # vLLM: the formats it loads are exported (tests/test_export_quant.py); legacy Marlin is not
    write_quant_checkpoint(tmp_path / "marlin", DEFAULT_SPECS["marlin"])
    tpshard.split(tmp_path / "marlin", tmp_path / "m", tpshard.Topology(tp=2))
    with pytest.raises(ExportError, match=r"vllm: the checkpoint is quantized: legacy Marlin \(B, s\): vLLM 0.33.0 has no parameter"):
        export(tmp_path / "m", tmp_path / "x", "vllm")


def test_damaged_tpshard_output_is_caught_by_check_of_the_export(tmp_path, llama):
    """The export's digests come from the tpshard manifest, not from the bytes it copies: a shard
    damaged since the split keeps the digest it should have, and check on the export names it."""
    tpshard.split(llama, tmp_path / "out", tpshard.Topology(tp=2))
    out = tmp_path / "out"
    victim = sorted((out / rank_dir(1)).glob("model-tp-001*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x10
    victim.write_bytes(bytes(data))
    export(out, tmp_path / "x", "vllm")
    report = check(tmp_path / "x")
    assert "[checksum] model-rank-1-part-0.safetensors: tensor" in _messages(report)
    assert "model-rank-0" not in _messages(report)


@pytest.mark.parametrize("checksum", ["crc32", "sha256"])
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "kernel-copied"])
def test_both_copy_paths_are_bit_exact_and_refuse_a_truncated_shard(tmp_path, llama, monkeypatch, checksum, gathered):
    """Small tensors are gathered run by run in memory, large ones copied inside the kernel
    (writer.SMALL_BYTES; 0 sends every tensor the kernel way): either way the export is bit-exact
    against the source, its digests (combined crc32s, or sha256 of a fused tensor's bytes) are what
    check computes, and a shard file cut short stops the export in one line, leaving nothing."""
    import tpshard.export.writer as export_writer

    if not gathered:
        monkeypatch.setattr(export_writer, "SMALL_BYTES", 0)
    out = tmp_path / "out"
    tpshard.split(llama, out, tpshard.Topology(tp=2), tpshard.Options(checksum=checksum))
    export(out, tmp_path / "x", "vllm")
    report = check(tmp_path / "x", llama)
    assert report.ok, _messages(report)
    victim = sorted((out / rank_dir(1)).glob("model-tp-001*.safetensors"))[0]
    os.truncate(victim, victim.stat().st_size - 7)
    with pytest.raises(OutputError, match="ends early"):
        export(out, tmp_path / "y", "vllm")
    assert not (tmp_path / "y").exists()


# --- check catches broken exports ------------------------------------------------------------------


def rewrite_export_checksums(dest: Path) -> None:
    """Make the manifest agree with the files as they are: only --source can then tell."""
    m = read_export_manifest(dest)
    files = []
    for f in m.files:
        header, offsets = file_header([(t.name, t.dtype, t.shape) for t in f.tensors])
        fd = os.open(dest / f.name, os.O_RDONLY)
        ends = offsets[1:] + [os.path.getsize(dest / f.name)]
        digests = [hash_range(fd, a, b - a, m.from_.options.checksum) for a, b in zip(offsets, ends)]
        os.close(fd)
        files.append(msgspec.structs.replace(f, digests=b"".join(digests).hex(), checksum=file_digest(header, digests)))
    (dest / EXPORT_MANIFEST_NAME).write_bytes(encode_export_manifest(msgspec.structs.replace(m, files=tuple(files))))


@pytest.fixture(scope="module")
def export_tp2(tmp_path_factory, llama):
    root = tmp_path_factory.mktemp("exp")
    tpshard.split(llama, root / "out", tpshard.Topology(tp=2))
    export(root / "out", root / "vllm", "vllm")
    return root / "vllm"


def _messages(report) -> str:
    return "\n".join(f"[{p.check}] {p.message}" for p in report.problems)


def test_check_catches_a_flipped_byte(export_tp2, copy_of, llama):
    dest = copy_of(export_tp2)
    path = dest / "model-rank-1-part-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x01
    path.write_bytes(bytes(data))
    report = check(dest)
    assert not report.ok and "does not match its crc32" in _messages(report)
    rewrite_export_checksums(dest)
    assert check(dest).ok  # consistent manifest: only the source can tell
    report = check(dest, llama)
    assert "[reassembly]" in _messages(report) and "differs from the source first at element" in _messages(report)


def test_the_rules_decide_the_reassembly_of_an_export_even_when_no_finding_is_listed(export_tp2, copy_of, llama, monkeypatch):
    """Every finding past the list (MAX_PROBLEMS 0): the rules still stop the reassembly by what
    they found (a source file of another size than the one exported), and let it run when they
    found nothing."""
    monkeypatch.setattr(importlib.import_module("tpshard.check.report"), "MAX_PROBLEMS", 0)
    proven = check(export_tp2, llama)
    assert proven.ok and proven.tensors_reassembled == len(tpshard.read_manifest(export_tp2.parent / "out").tensors)
    dest = copy_of(export_tp2)
    data = json.loads((dest / EXPORT_MANIFEST_NAME).read_bytes())
    data["source"]["files"][0]["size"] += 1
    (dest / EXPORT_MANIFEST_NAME).write_text(json.dumps(data))
    refused = check(dest, llama)
    assert not refused.ok and not refused.problems and refused.tensors_reassembled == 0


def test_check_catches_a_part_from_another_rank(export_tp2, copy_of, llama):
    dest = copy_of(export_tp2)
    shutil.copyfile(dest / "model-rank-0-part-0.safetensors", dest / "model-rank-1-part-0.safetensors")
    report = check(dest)
    assert not report.ok and "model-rank-1-part-0.safetensors: tensor" in _messages(report)
    rewrite_export_checksums(dest)
    report = check(dest, llama)
    assert "holds the slice of group rank 0" in _messages(report), _messages(report)


def test_check_catches_trimmed_padding_stray_files_and_edited_names(export_tp2, copy_of, llama):
    dest = copy_of(export_tp2)
    # vocab padding rows cut off: engines would load it with a warning; the header check refuses it
    path = dest / "model-rank-1-part-0.safetensors"
    tensors = load_file(path)
    tensors["lm_head.weight"] = tensors["lm_head.weight"][:122].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    assert "header differs" in _messages(check(dest)) or "bytes, the manifest says" in _messages(check(dest))

    dest = copy_of(export_tp2)
    shutil.copyfile(dest / "model-rank-1-part-0.safetensors", dest / "model-rank-2-part-0.safetensors")
    assert "model-rank-2-part-0.safetensors: not in the export manifest, but the engine's glob reads it" in _messages(check(dest))

    dest = copy_of(export_tp2)  # the manifest renamed a key consistently (and the file with it): the table says no
    m = read_export_manifest(dest)
    f0 = m.files[0]
    renamed = tuple(msgspec.structs.replace(t, name=t.name.replace("qkv_proj", "qkv")) for t in f0.tensors)
    for f in m.files:
        t = load_file(dest / f.name)
        save_file({k.replace("qkv_proj", "qkv"): v for k, v in t.items()}, dest / f.name, metadata={"format": "pt"})
    (dest / EXPORT_MANIFEST_NAME).write_bytes(encode_export_manifest(msgspec.structs.replace(m, files=(msgspec.structs.replace(f0, tensors=renamed),) + m.files[1:])))
    report = check(dest, llama)
    assert "[rules] model-rank-0-part-0.safetensors: manifest differs from the vllm name table" in _messages(report)


def test_check_refuses_a_manifest_with_a_path_outside(export_tp2, copy_of):
    dest = copy_of(export_tp2)
    raw = json.loads((dest / EXPORT_MANIFEST_NAME).read_text())
    raw["files"][0]["name"] = "../model-rank-0-part-0.safetensors"
    (dest / EXPORT_MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(TpshardError, match="is not a unique model-rank-0-part-N.safetensors name"):
        check(dest)


def test_manifest_lists_a_stages_tensors_once_and_no_shards(export_tp2):
    """Version 3: rank 1's file leaves out the tensors rank 0's lists (the reader shares the tuple),
    digests are one hex string per file, and no tensor records the shards the rules derive."""
    raw = json.loads((export_tp2 / EXPORT_MANIFEST_NAME).read_text())
    first, second = raw["files"]
    assert raw["version"] == 3 and "tensors" not in second and first["tensors"]
    assert all(set(t) <= {"name", "dtype", "shape", "value"} for t in first["tensors"])
    m = read_export_manifest(export_tp2)
    assert m.files[1].tensors is m.files[0].tensors
    for f in m.files:
        assert len(f.digests) == 8 * len(f.tensors)


def test_a_rank_whose_tensors_differ_is_listed_in_full_and_caught(export_tp2, copy_of):
    dest = copy_of(export_tp2)
    m = read_export_manifest(dest)
    f1 = m.files[1]
    renamed = tuple(msgspec.structs.replace(t, name=t.name.replace("o_proj", "out_proj")) for t in f1.tensors)
    path = dest / f1.name
    save_file({k.replace("o_proj", "out_proj"): v for k, v in load_file(path).items()}, path, metadata={"format": "pt"})
    (dest / EXPORT_MANIFEST_NAME).write_bytes(encode_export_manifest(msgspec.structs.replace(m, files=(m.files[0], msgspec.structs.replace(f1, tensors=renamed)))))
    rewrite_export_checksums(dest)
    assert json.loads((dest / EXPORT_MANIFEST_NAME).read_text())["files"][1]["tensors"]
    assert "[files] rank 1: tensors differ from rank 0's in name, dtype or shape" in _messages(check(dest))


def test_check_refuses_an_older_manifest_and_broken_digests(export_tp2, copy_of):
    dest = copy_of(export_tp2)
    path = dest / EXPORT_MANIFEST_NAME
    raw = json.loads(path.read_text())
    path.write_text(json.dumps(raw | {"version": 2}))
    with pytest.raises(OutputError, match=r"version 2, this tpshard reads version 3; written by an older tpshard, re-export$"):
        check(dest)
    r = run_cli("check", str(dest))
    assert r.returncode == 2 and "re-export" in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr
    for digests, why in ((raw["files"][1]["digests"][:-8], "hex digits for the"), ("", "missing for the"), (raw["files"][1]["digests"].upper(), "not lower-case hex")):
        raw["files"][1]["digests"] = digests
        path.write_text(json.dumps(raw))
        with pytest.raises(OutputError, match=f"files\\[1\\].digests: .*{why}"):
            check(dest)


def _digests_as_list(d: dict) -> None:  # version 2's one digest string per tensor: fails version 3's schema
    for f in d["files"]:
        f["digests"] = [f["digests"][:8]]


# A document edited in its JSON (or not JSON), and the end of the message read_export_manifest
# refuses it with: another version or format is named as such even where the schema fails too.
_BROKEN_EXPORT_MANIFESTS = {
    "older, schema fails": (lambda d: [d.update(version=2), _digests_as_list(d)], "version 2, this tpshard reads version 3; written by an older tpshard, re-export"),
    "newer, schema fails": (lambda d: [d.update(version=4), d.pop("files")], "version 4, this tpshard reads version 3; written by a newer tpshard, upgrade it"),
    "another format": (lambda d: [d.update(format="tpshard-manifest"), d.pop("engine")], "format 'tpshard-manifest' is not 'tpshard-export'; not a tpshard export manifest"),
    "no version": (lambda d: d.pop("version"), "no version; not a tpshard export manifest this tpshard can read"),
    "schema fails": (lambda d: d["files"][0].update(size="12"), "not a valid tpshard export manifest (Expected `int`, got `str` - at `$.files[0].size`)"),
    "a value refused": (lambda d: d["files"][0].update(name="model.safetensors"), "files: 'model.safetensors' is not a unique model-rank-0-part-N.safetensors name"),
    "not JSON": (None, "not a valid tpshard export manifest (JSON is malformed: trailing characters (byte 3))"),
    "not an object": ([], "not a valid tpshard export manifest (Expected `object`, got `array`)"),
}


@pytest.mark.parametrize("case", sorted(_BROKEN_EXPORT_MANIFESTS))
def test_a_broken_export_manifest_is_refused_with_what_is_wrong(export_tp2, copy_of, case):
    """The schema is decoded first, the envelope only where it fails: the message is the one of
    the version or format where those are wrong, else the schema's or the field check's."""
    edit, message = _BROKEN_EXPORT_MANIFESTS[case]
    dest = copy_of(export_tp2)
    path = dest / EXPORT_MANIFEST_NAME
    if edit is None:
        path.write_text("{}x")
    elif isinstance(edit, list):
        path.write_text(json.dumps(edit))
    else:
        raw = json.loads(path.read_text())
        edit(raw)
        path.write_text(json.dumps(raw))
    with pytest.raises(OutputError) as e:
        read_export_manifest(dest)
    assert str(e.value).endswith(message), str(e.value)


def test_check_of_an_export_without_the_source_imports_neither_numpy_nor_the_writer(export_tp2):
    """As for a tpshard output (tests/test_imports.py): only --source reads with them."""
    code = f"import sys, tpshard, tpshard.cli\nassert tpshard.check({str(export_tp2)!r}).ok\nprint(' '.join(sys.modules))"
    loaded = set(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout.split())
    assert not loaded & {"numpy", "torch", "tpshard.writer", "tpshard.export.writer", "tpshard.plan", "tpshard.pieces", "tpshard.checkpoint"}, loaded


# --- CLI ------------------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *args], capture_output=True, text=True)


def test_cli_split_format_export_and_check(tmp_path, mistral, llama):
    dest = tmp_path / "sg"
    r = run_cli("split", str(llama), "-o", str(dest), "--tp", "4", "--format", "sglang", "--max-part-size", "20KB", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["files"] > 4 and not list(tmp_path.glob(".sg*"))
    assert run_cli("check", str(dest), "--source", str(llama)).returncode == 0
    r = run_cli("split", str(mistral), "-o", str(tmp_path / "m"), "--tp", "8", "--format", "vllm")
    assert r.returncode == 2 and "zero-padded to divide" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "m").exists() and not list(tmp_path.glob(".m*"))
    r = run_cli("export", str(tmp_path / "nothing"), "-o", str(tmp_path / "e"), "--format", "vllm")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    r = run_cli("split", str(llama), "-o", str(tmp_path / "v"), "--tp", "2", "--format", "vllm", "--max-part-size", "lots")
    assert r.returncode == 2 and "--max-part-size 'lots'" in r.stderr
    r = run_cli("split", str(llama), "-o", str(tmp_path / "v"), "--tp", "2", "--format", "vllm", "--ranks", "0")
    assert r.returncode == 2 and "an engine export needs every rank" in r.stderr and not (tmp_path / "v").exists()
    path = dest / "model-rank-3-part-0.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    r = run_cli("check", str(dest))
    assert r.returncode == 1 and "FAIL [checksum]" in r.stdout


def test_parse_size():
    from tpshard.options import parse_size

    assert parse_size("5GiB") == 5 << 30 and parse_size("500MB") == 500_000_000 and parse_size("4096") == 4096
    assert parse_size("1.5KiB") == 1536 and parse_size("20kb") == 20_000
    for bad in ("lots", "0", "-1GiB", "5TB"):
        with pytest.raises(TpshardError, match="--max-part-size"):
            parse_size(bad)


def test_sglang_export_is_the_vllm_export_without_attention_buffers(split_tp2, tmp_path):
    """docs/deploy.md leans on this: vLLM loads its export bit-exactly (checked by hand), and the
    SGLang export holds the same tensors, byte for byte, less vLLM's four buffers per layer."""
    _, out = split_tp2["qwen2_tied"]
    export(out, tmp_path / "v", "vllm")
    export(out, tmp_path / "s", "sglang")
    for rank in (0, 1):
        v = load_file(tmp_path / "v" / f"model-rank-{rank}-part-0.safetensors")
        s = load_file(tmp_path / "s" / f"model-rank-{rank}-part-0.safetensors")
        buffers = {k for k in v if k.split(".")[-1] in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")}
        assert len(buffers) == 8 and set(s) == set(v) - buffers
        assert all(torch.equal(s[k], v[k]) for k in s)


def test_export_replaces_only_its_own_output(tmp_path, llama):
    out = tmp_path / "tp2"
    tpshard.split(llama, out, tpshard.Topology(tp=2))
    dest = tmp_path / "e"
    export(out, dest, "vllm")
    with pytest.raises(OutputError, match="already exists; pass --force"):
        export(out, dest, "vllm")
    first = read_export_manifest(dest)
    export(out, dest, "sglang", force=True)  # an export is a tpshard output: --force replaces it whole
    assert read_export_manifest(dest).engine == "sglang" != first.engine
    assert check(dest, llama).ok and not list(tmp_path.glob(".e.*"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(OutputError, match="is not a tpshard output"):
        export(out, mine, "vllm", force=True)
    assert (mine / "notes.txt").read_text() == "keep"
    with pytest.raises(OutputError, match="is the input"):
        export(out, out, "vllm", force=True)
    assert check(out, llama).ok
    (dest / "stray.bin").mkdir()  # no longer only the files an export holds: not ours to replace
    with pytest.raises(OutputError, match="is not a tpshard output"):
        export(out, dest, "vllm", force=True)
