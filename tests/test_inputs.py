"""Issue 10 item 3: inputs are validated as strictly as the safetensors library, config.json and
quantization configs by type and range, completeness by architecture, and nothing is read or copied
from outside the checkpoint folder."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
from pathlib import Path

import pytest

import tpshard
from tpshard.checkpoint import open_checkpoint
from tpshard.errors import CheckpointError, PlanError, TpshardError
from tpshard.plan import make_plan
from tpshard.safetensors_format import HeaderError, read_header
from tpshard.topology import Topology


def raw_file(path: Path, header: dict | bytes, data: bytes = b"", *, n: int | None = None) -> Path:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body) if n is None else n) + body + data)
    return path


GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "U8", "shape": [2, 2], "data_offsets": [8, 12]}}


def test_a_valid_header_reads(tmp_path):
    tensors, meta = read_header(raw_file(tmp_path / "f", {"__metadata__": {"format": "pt"}, **GOOD}, bytes(12)))
    assert meta == {"format": "pt"} and tensors["b"].shape == (2, 2) and tensors["b"].nbytes == 4


@pytest.mark.parametrize(
    "header, data, n, message",
    [
        (GOOD, bytes(12), 200_000_000, "over the 100000000 bytes"),
        (GOOD, bytes(12), 10_000, "does not fit the file"),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', bytes(8), None, "appears twice"),
        (b'{"__metadata__": {}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "__metadata__": {}}', bytes(8), None, "appears twice"),
        (b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "data_offsets": [0, 8]}}', bytes(8), None, "appears twice"),
        (b'{"a": {"dtype": "U8", "shape": [2], "data_offsets": [0, 8], "dtype": "F32"}}', bytes(8), None, "appears twice"),
        (b'{"a": {"shape": [8], "dtype": "U8", "shape": [2], "data_offsets": [0, 8], "dtype": "F32"}}', bytes(8), None, "appears twice"),
        (b'{"__metadata__": {"dtype": "a"}, "a": {"dtype": "F32", "shape": [2], "shape": [2], "data_offsets": [0, 8]}}', bytes(8), None, "appears twice"),
        (b"\xff\xfe", b"", None, "not UTF-8 JSON"),
        (b"[1, 2]", b"", None, "not a JSON object"),
        (b'"a"', b"", None, "not a JSON object"),
        ({"a": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}, bytes(1), None, "unsupported dtype 'F4'"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), None, "not a list of non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4), None, "not a list of non-negative integers"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8), None, "is not [begin, end]"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), None, "needs 12 bytes"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}, bytes(8), None, "needs 8 bytes"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), None, "overlaps"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), None, "leaves a gap"),
        (GOOD, bytes(16), None, "truncated or extended"),
        (GOOD, bytes(10), None, "truncated or corrupt"),
        ({"__metadata__": {"format": 1}, **GOOD}, bytes(12), None, "__metadata__ must map strings"),
        ({"a": [1, 2]}, b"", None, "entry is not an object"),
        ({"a": {"dtype": "F32", "shape": [2 ** 40, 2 ** 40], "data_offsets": [0, 8]}}, bytes(8), None, "needs"),
    ],
)
def test_malformed_headers_are_refused_like_the_safetensors_library(tmp_path, header, data, n, message):
    path = raw_file(tmp_path / "f.safetensors", header, data, n=n)
    with pytest.raises(HeaderError, match=re.escape(message)):
        read_header(path)
    assert not safetensors_accepts(path) or "F4" in message or "twice" in message  # stricter only by design


def safetensors_accepts(path: Path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(path, framework="numpy") as f:
            for k in f.keys():
                f.get_slice(k)
        return True
    except BaseException:  # the library's own errors (and panics) are its refusal
        return False


def copy_ckpt(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def edit_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is ...:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(hidden_size="64"), "hidden_size = '64' is not a int"),
        (dict(hidden_size=64.0), "hidden_size = 64.0 is not a int"),
        (dict(num_hidden_layers=0), "num_hidden_layers = 0 is out of range"),
        (dict(num_hidden_layers=10**9), "num_hidden_layers = 1000000000 is out of range"),
        (dict(num_attention_heads=True), "num_attention_heads = True is not a int"),
        (dict(num_key_value_heads=3), "num_key_value_heads 3 does not divide num_attention_heads 8"),
        (dict(vocab_size=-1), "vocab_size = -1 is out of range"),
        (dict(rms_norm_eps=0), "rms_norm_eps = 0 is out of range"),
        (dict(rms_norm_eps="tiny"), "rms_norm_eps = 'tiny' is not a finite number"),
        (dict(tie_word_embeddings="no"), "tie_word_embeddings = 'no' is not a bool"),
        (dict(architectures="LlamaForCausalLM"), "architectures = 'LlamaForCausalLM' is not a list"),
        (dict(architectures=[]), "is not a list[str]"),
        (dict(text_config=[1]), "text_config is not an object"),
        (dict(intermediate_size=...), "lacks intermediate_size"),
        (dict(quantization_config=[1]), "quantization_config = [1] is not a dict"),
        (dict(rope_parameters={"rope_theta": "big"}), "rope_parameters.rope_theta = 'big' is not a finite number"),
        (dict(num_experts="8"), "num_experts = '8' is not a int"),
        # found by the long fuzz test: an MLA key without its head dims reached int(None)
        (dict(kv_lora_rank=1), "kv_lora_rank is set for MLA attention, but qk_nope_head_dim, qk_rope_head_dim, v_head_dim is not"),
    ],
)
def test_config_types_and_ranges(llama, tmp_path, changes, message):
    bad = edit_config(copy_ckpt(llama, tmp_path / "bad"), **changes)
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(")):
        make_plan(open_checkpoint(bad), Topology(tp=2))


def test_null_fields_count_as_absent(llama, tmp_path):
    """Found by the fuzz test: rms_norm_eps: null reached float(None)."""
    ok = edit_config(copy_ckpt(llama, tmp_path / "ok"), rms_norm_eps=None, head_dim=None)
    assert make_plan(open_checkpoint(ok), Topology(tp=2)).model.rms_norm_eps == 1e-6


def test_config_that_is_not_an_object(llama, tmp_path):
    bad = copy_ckpt(llama, tmp_path / "bad")
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="not a JSON object"):
        open_checkpoint(bad)


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq", "bits": "4"}, "bits = '4' is not an integer"),
        ({"quant_method": "gptq", "bits": 4.5}, "bits = 4.5 is not an integer"),
        ({"quant_method": "gptq", "bits": 4, "group_size": [128]}, "group_size = \\[128\\] is not an integer"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": "yes"}, "desc_act = 'yes' is not true or false"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": ["x"]}, "dynamic is not an object"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"(": {"bits": 8}}}, "quantization_config \\(gptq\\)"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"x": {"bits": "8"}}}, "bits = '8' is not an integer"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size = \\[128\\] is not"),
        ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "is not an integer in \\[1,"),
        ({"quant_method": "awq", "bits": 4, "modules_to_not_convert": "lm_head"}, "modules_to_not_convert = 'lm_head' is not a list of strings"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["re:("], "weights": {"num_bits": 4, "type": "int", "strategy": "channel"}, "format": "pack-quantized"}}}, "quantization_config \\(compressed-tensors\\)"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": "Linear", "weights": {"num_bits": 4}, "format": "pack-quantized"}}}, "targets = 'Linear' is not a list of strings"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": [4]}, "format": "pack-quantized"}}}, "num_bits = \\[4\\] is not an integer"),
        ({"quant_method": "compressed-tensors", "config_groups": [1]}, "config_groups is not an object"),
    ],
)
def test_quantization_config_types_and_ranges(llama, tmp_path, qc, message):
    bad = edit_config(copy_ckpt(llama, tmp_path / "bad"), quantization_config=qc)
    with pytest.raises(CheckpointError, match=message):
        make_plan(open_checkpoint(bad), Topology(tp=2))


def drop_tensor(ckpt: Path, name: str) -> None:
    """Rewrite the file holding `name` without it (and the index without it)."""
    from safetensors.torch import load_file, save_file

    index_path = ckpt / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    file = index["weight_map"].pop(name)
    tensors = load_file(ckpt / file)
    del tensors[name]
    save_file(tensors, ckpt / file, metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.post_attention_layernorm.weight", "model.norm.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"],
)
def test_a_missing_tensor_is_named(llama, tmp_path, name):
    bad = copy_ckpt(llama, tmp_path / "bad")
    drop_tensor(bad, name)
    with pytest.raises(TpshardError, match=f"lacks {name.replace('.', '[.]')}"):
        make_plan(open_checkpoint(bad), Topology(tp=2))
    with pytest.raises(TpshardError, match="lacks"):
        tpshard.split(bad, tmp_path / "out", Topology(tp=2))
    assert not (tmp_path / "out").exists()


def test_layer_count_and_biases(llama, qwen2_tied, tmp_path):
    fewer = edit_config(copy_ckpt(llama, tmp_path / "fewer"), num_hidden_layers=1)
    with pytest.raises(PlanError, match="layer 1, but config.json has 1 layers"):
        make_plan(open_checkpoint(fewer), Topology(tp=2))
    more = edit_config(copy_ckpt(llama, tmp_path / "more"), num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="lacks model.layers.2.input_layernorm.weight"):
        make_plan(open_checkpoint(more), Topology(tp=2))
    biased = edit_config(copy_ckpt(llama, tmp_path / "biased"), attention_bias=True)
    with pytest.raises(CheckpointError, match="lacks model.layers.0.self_attn.q_proj.bias"):
        make_plan(open_checkpoint(biased), Topology(tp=2))
    qwen = copy_ckpt(qwen2_tied, tmp_path / "qwen")  # Qwen2 always has q/k/v biases
    from safetensors.torch import load_file, save_file

    tensors = load_file(qwen / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, qwen / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks model.layers.0.self_attn.k_proj.bias"):
        make_plan(open_checkpoint(qwen), Topology(tp=2))
    untied = edit_config(copy_ckpt(qwen2_tied, tmp_path / "untied"), tie_word_embeddings=False)
    with pytest.raises(CheckpointError, match="lacks lm_head.weight"):
        make_plan(open_checkpoint(untied), Topology(tp=2))


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors", ".hidden.safetensors", ""])
def test_index_entries_stay_inside_the_folder(llama, tmp_path, target):
    bad = copy_ckpt(llama, tmp_path / "bad")
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = target
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="is not a plain file name inside the checkpoint folder"):
        open_checkpoint(bad)


def test_links_out_of_the_folder_are_refused(llama, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not copy me")
    bad = copy_ckpt(llama, tmp_path / "bad")
    (bad / "tokenizer.json").symlink_to(secret)
    with pytest.raises(CheckpointError, match="tokenizer.json is a link to .*outside the checkpoint folder"):
        tpshard.split(bad, tmp_path / "out", Topology(tp=2))
    assert not (tmp_path / "out").exists()
    (bad / "tokenizer.json").unlink()
    weights = next(bad.glob("model-0000*.safetensors"))
    moved = tmp_path / weights.name
    os.rename(weights, moved)
    weights.symlink_to(moved)
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        open_checkpoint(bad)


def test_hugging_face_cache_links_and_dotfiles(llama, tmp_path):
    """snapshots/<rev>/NAME -> ../../blobs/<hash> keeps working; dotfiles are not copied."""
    repo = tmp_path / "models--org--tiny"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(llama.iterdir())):
        blob = blobs / f"blob{i}"
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    (snapshot / ".gitattributes").write_text("*.safetensors filter=lfs")
    out = tmp_path / "out"
    tpshard.split(snapshot, out, Topology(tp=2))
    assert tpshard.check(out, snapshot).ok
    assert ".gitattributes" not in os.listdir(out / "rank-00000")
    assert "config.json" in os.listdir(out / "rank-00000")
