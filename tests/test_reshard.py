"""tpshard reshard: a new output from an old one, without the source, byte-identical to a direct
split (every rank file, index, copied file and the manifest); check --from proves it; what cannot
be rebuilt exactly is refused in one line with nothing left behind."""

from __future__ import annotations

import filecmp
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from safetensors.torch import load_file, save_file

import tpshard
from broken import file_specs, rewrite_checksums
from checkpoints import make_checkpoint
from quant_fixtures import DEFAULT_SPECS, write_quant_checkpoint
from tpshard.check.output_source import open_output_source
from tpshard.errors import OutputError, PlanError
from tpshard.manifest import MANIFEST_NAME, Options, encode_manifest, rank_dir, read_manifest
from tpshard.reshard import reshard
from tpshard.topology import Topology as T


def run(*args) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def assert_identical(a: Path, b: Path) -> None:
    """Same folders, same names, same bytes (manifest included)."""
    cmp = filecmp.dircmp(a, b)
    assert not cmp.left_only and not cmp.right_only, (cmp.left_only, cmp.right_only)
    assert (a / MANIFEST_NAME).read_bytes() == (b / MANIFEST_NAME).read_bytes()
    for sub in sorted(cmp.common_dirs):
        names = sorted(os.listdir(a / sub))
        assert names == sorted(os.listdir(b / sub)), sub
        for name in names:
            assert (a / sub / name).read_bytes() == (b / sub / name).read_bytes(), f"{sub}/{name} differs"


def roundtrip(model: Path, tmp: Path, old_topo: T, new_topo: T, options: Options | None = None, new_options: Options | None = None) -> Path:
    """split old -> reshard new; the reshard equals split new; check --from and --source pass."""
    tag = f"{old_topo.describe()}->{new_topo.describe()}".replace(" ", "_")
    old, direct, new = tmp / f"old-{tag}", tmp / f"direct-{tag}", tmp / f"new-{tag}"
    if not old.exists():
        tpshard.split(model, old, old_topo, options)
    tpshard.split(model, direct, new_topo, new_options or options)
    reshard(old, new, new_topo, new_options or options)
    assert_identical(direct, new)
    report = tpshard.check(new, from_output=old)
    assert report.ok and report.tensors_reassembled > 0, report.problems
    assert tpshard.check(new, model).ok
    return new


def leftovers(parent: Path, name: str) -> list[str]:
    return [e for e in os.listdir(parent) if e == name or e.startswith(f".{name}.tpshard-")]


def test_llama_chain_with_kv_replicas_vocab_padding_and_stages(llama, tmp_path):
    """tp 2 -> tp 8 (kv replicas, vocab pad) -> tp 4 x pp 2 -> tp 8 again: every step equals a split
    from the source, and the last is byte-identical to the first tp 8."""
    tpshard.split(llama, tmp_path / "tp2", T(tp=2))
    reshard(tmp_path / "tp2", tmp_path / "tp8", T(tp=8))
    tpshard.split(llama, tmp_path / "tp8-direct", T(tp=8))
    assert_identical(tmp_path / "tp8-direct", tmp_path / "tp8")
    kv = [t for t in read_manifest(tmp_path / "tp8").tensors if t.name.endswith("k_proj.weight")][0]
    assert kv.factor == 4  # 2 kv heads over 8 ranks: each stored for 4 ranks, read once
    reshard(tmp_path / "tp8", tmp_path / "pp2", T(tp=4, pp_layers=(1, 1)))
    tpshard.split(llama, tmp_path / "pp2-direct", T(tp=4, pp_layers=(1, 1)))
    assert_identical(tmp_path / "pp2-direct", tmp_path / "pp2")
    reshard(tmp_path / "pp2", tmp_path / "tp8-again", T(tp=8))
    assert_identical(tmp_path / "tp8", tmp_path / "tp8-again")
    for new, old in (("tp8", "tp2"), ("pp2", "tp8"), ("tp8-again", "pp2")):
        assert tpshard.check(tmp_path / new, from_output=tmp_path / old).ok
        assert tpshard.check(tmp_path / new, llama).ok


def test_intermediate_padding_and_attention_dp(mistral, tmp_path):
    """mistral: intermediate 100, zero-padded at tp 8 and not at tp 4; attention DP replicas."""
    roundtrip(mistral, tmp_path, T(tp=8), T(tp=4))
    roundtrip(mistral, tmp_path, T(tp=4), T(tp=8, attn_dp=2))
    roundtrip(mistral, tmp_path, T(tp=8, attn_dp=2), T(tp=2))
    assert any("zero-padded" in w for w in read_manifest(tmp_path / "old-tp=8_attn_dp=1_attn_cp=1_(attn_tp=8)->tp=4_attn_dp=1_attn_cp=1_(attn_tp=4)").warnings)


def test_tied_lm_head_copy_at_pp(qwen2_tied, tmp_path):
    """A tied model at pp 2 holds its own lm_head (a copy of the embedding, never read back); vLLM's
    placement (its last stage holds the embedding) too."""
    roundtrip(qwen2_tied, tmp_path, T(tp=2), T(tp=2, pp_layers=(1, 1)))
    roundtrip(qwen2_tied, tmp_path, T(tp=2, pp_layers=(1, 1)), T(tp=4))
    roundtrip(qwen2_tied, tmp_path, T(tp=2, pp_layers=(1, 1)), T(tp=1, pp_layers=(1, 1), engine="vllm"))
    roundtrip(qwen2_tied, tmp_path, T(tp=1, pp_layers=(1, 1), engine="vllm"), T(tp=2))


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ds") / "model", "deepseek_v3", mtp=True)


def test_deepseek_experts_and_mtp(deepseek_mtp, tmp_path):
    roundtrip(deepseek_mtp, tmp_path, T(tp=4, ep=4), T(tp=8, ep=2))
    roundtrip(deepseek_mtp, tmp_path, T(tp=8, ep=8), T(tp=2, pp_layers=(2, 1)))


@pytest.mark.parametrize("fmt", ["gptq_act_order", "ct_w4a16"])
def test_quantized(fmt, tmp_path):
    """GPTQ with act-order (g_idx travels with the rows) and compressed-tensors (weight_shape held
    as planned values, never read)."""
    model = tmp_path / "model"
    write_quant_checkpoint(model, DEFAULT_SPECS[fmt], num_files=2)
    roundtrip(model, tmp_path, T(tp=2), T(tp=1))
    roundtrip(model, tmp_path, T(tp=1), T(tp=2))


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gptq", "awq", "marlin", "fp8_tensor", "ct_nvfp4", "ct_w4a16_asym_actorder"])
def test_quantized_more(fmt, tmp_path):
    model = tmp_path / "model"
    write_quant_checkpoint(model, DEFAULT_SPECS[fmt])
    roundtrip(model, tmp_path, T(tp=2), T(tp=1))
    roundtrip(model, tmp_path, T(tp=1), T(tp=2))


@pytest.mark.slow
def test_fp8_block_deepseek(tmp_path):
    """DeepSeek-V3 in its FP8 128 x 128 block format: weight_scale_inv cut in whole blocks."""
    from moe_configs import make_fp8_deepseek

    model = make_fp8_deepseek(tmp_path / "model")
    roundtrip(model, tmp_path, T(tp=2), T(tp=1))
    roundtrip(model, tmp_path, T(tp=1), T(tp=2, ep=2))


def test_dropped_tensor_keeps_its_warning(llama, tmp_path):
    """A tensor split drops (rotary inv_freq) is not in the output; its warning brings it back in order."""
    model = tmp_path / "model"
    shutil.copytree(llama, model)
    index = json.loads((model / "model.safetensors.index.json").read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(model / first)
    import torch

    for i in (1, 0):
        name = f"model.layers.{i}.self_attn.rotary_emb.inv_freq"
        tensors[name] = torch.arange(8, dtype=torch.float32)
        index["weight_map"][name] = first
    save_file(tensors, model / first, metadata={"format": "pt"})
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    new = roundtrip(model, tmp_path, T(tp=2), T(tp=4))
    assert sum("dropped" in w for w in read_manifest(new).warnings) == 2


def test_reshard_with_ranks_and_sha256(llama, tmp_path):
    """The options as split has them: --ranks writes part of the new output, --checksum sha256."""
    opts = Options(checksum="sha256")
    tpshard.split(llama, tmp_path / "old", T(tp=2), opts)  # its shards read back by their sha256
    reshard(tmp_path / "old", tmp_path / "new", T(tp=4), opts, ranks=[1, 2])
    tpshard.split(llama, tmp_path / "direct", T(tp=4), opts, ranks=[1, 2])
    assert_identical(tmp_path / "direct", tmp_path / "new")
    reshard(tmp_path / "old", tmp_path / "new-crc", T(tp=4))
    tpshard.split(llama, tmp_path / "direct-crc", T(tp=4))
    assert_identical(tmp_path / "direct-crc", tmp_path / "new-crc")
    assert tpshard.check(tmp_path / "new", from_output=tmp_path / "old").ok


@pytest.fixture(scope="module")
def pair(llama, tmp_path_factory) -> tuple[Path, Path]:
    """(old tp 2, new tp 8 resharded from it); tests break copies."""
    root = tmp_path_factory.mktemp("pair")
    tpshard.split(llama, root / "old", T(tp=2))
    reshard(root / "old", root / "new", T(tp=8))
    return root / "old", root / "new"


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))


def _data_offset(out: Path, rank: int, file: str) -> int:
    m = read_manifest(out)
    return m.plan.offsets(file)[-1] + 3  # inside the file's last tensor


def test_check_from_catches_a_flipped_byte_in_new(pair, copy_of):
    old, new = pair[0], copy_of(pair[1])
    f = "model-tp-003-of-008.safetensors"
    _flip(new / rank_dir(3) / f, _data_offset(new, 3, f))
    rewrite_checksums(new)  # the manifest agrees: only the reassembly can tell
    assert tpshard.check(new).ok
    report = tpshard.check(new, from_output=old)
    assert not report.ok and any(p.check == "reassembly" for p in report.problems), report.problems


def test_check_from_catches_another_ranks_shard(pair, copy_of):
    old, new = pair[0], copy_of(pair[1])
    shutil.copyfile(new / rank_dir(1) / "model-tp-001-of-008.safetensors", new / rank_dir(0) / "model-tp-000-of-008.safetensors")
    rewrite_checksums(new)
    report = tpshard.check(new, from_output=old)
    assert not report.ok
    assert any("holds the slice of group rank 1" in p.message for p in report.problems), report.problems


def test_check_from_and_reshard_catch_a_flipped_byte_in_old(pair, copy_of, tmp_path):
    old, new = copy_of(pair[0]), pair[1]
    f = "model-tp-001-of-002.safetensors"
    _flip(old / rank_dir(1) / f, _data_offset(old, 1, f))
    report = tpshard.check(new, from_output=old)
    assert not report.ok and all(p.check == "from" for p in report.problems)
    p = run("reshard", old, "-o", tmp_path / "x", "--tp", 4)
    assert p.returncode == 2 and "does not match its crc32" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not leftovers(tmp_path, "x")


def test_a_broken_old_output_stops_check_from_and_reshard_with_nothing_listed(pair, copy_of, tmp_path, monkeypatch):
    """Every finding past the list (MAX_PROBLEMS 0): old's findings still fail check --from, and
    reshard still refuses old in one line."""
    monkeypatch.setattr(importlib.import_module("tpshard.check.report"), "MAX_PROBLEMS", 0)
    old, new = copy_of(pair[0]), pair[1]
    f = "model-tp-001-of-002.safetensors"
    _flip(old / rank_dir(1) / f, _data_offset(old, 1, f))
    report = tpshard.check(new, from_output=old)
    assert not report.ok and not report.problems and report.tensors_reassembled == 0
    short = tmp_path / "short"  # a file one byte short: found by old's own check, before any read
    shutil.copytree(pair[0], short)
    os.truncate(short / rank_dir(1) / f, (short / rank_dir(1) / f).stat().st_size - 1)
    with pytest.raises(OutputError, match="fails its own check, so it cannot be resharded: see tpshard check") as e:
        reshard(short, tmp_path / "x", T(tp=4))
    assert "\n" not in str(e.value)


def test_every_byte_of_old_is_compared(pair, copy_of, tmp_path):
    """Bytes no new tensor needs (a replica file that is a copy, not a hard link; a header) stop it too."""
    old = copy_of(pair[0])
    f = "model-tp-001-of-002.safetensors"
    (old / rank_dir(1) / f).write_bytes((old / rank_dir(1) / f).read_bytes()[:-1] + b"\0")  # the last byte of the last tensor
    with pytest.raises(OutputError, match="does not match"):
        reshard(old, tmp_path / "x", T(tp=4), ranks=[0])  # hashed as it is read, or at the end if no new rank needs it
    assert not leftovers(tmp_path, "x")
    old = copy_of(pair[1])  # tp 8: kv-replica files shared by 4 ranks; make one rank's a copy, then damage it
    name = next(n for n in os.listdir(old / rank_dir(1)) if "x" in n.split("-tp-")[-1])
    data = bytearray((old / rank_dir(1) / name).read_bytes())
    (old / rank_dir(1) / name).unlink()
    data[-1] ^= 1
    (old / rank_dir(1) / name).write_bytes(bytes(data))
    p = run("reshard", old, "-o", tmp_path / "y", "--tp", 2)
    assert p.returncode == 2 and "fails its own check" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not leftovers(tmp_path, "y")


def test_old_output_changed_while_read(pair, copy_of, tmp_path):
    """A shard that changes after the old output was checked: the digest taken while reading stops it."""
    old = copy_of(pair[0])
    src = open_output_source(old)
    f = "model-tp-000-of-002.safetensors"
    _flip(old / rank_dir(0) / f, _data_offset(old, 0, f))
    with pytest.raises(OutputError, match="does not match its crc32"):
        reshard(src, tmp_path / "x", T(tp=4))
    assert not leftovers(tmp_path, "x")


def test_manifest_that_the_rules_do_not_give_is_refused(pair, copy_of, tmp_path):
    old = copy_of(pair[0])
    m = read_manifest(old)
    (old / MANIFEST_NAME).write_bytes(encode_manifest(msgspec.structs.replace(m, warnings=(*m.warnings, "edited"))))
    assert tpshard.check(old).ok  # nothing a check without the source compares
    with pytest.raises(OutputError, match="warnings are not what"):
        reshard(old, tmp_path / "x", T(tp=4))
    assert not leftovers(tmp_path, "x")


def test_refusals_one_line_exit_2_nothing_left(llama, pair, tmp_path):
    old = pair[0]
    tpshard.split(llama, tmp_path / "part", T(tp=2), ranks=[0])
    cases = [
        (("reshard", tmp_path / "part", "-o", tmp_path / "x", "--tp", 4), "written for ranks 0 of 2 only"),
        (("reshard", old, "-o", tmp_path / "x", "--tp", 3), "8 attention heads do not divide over the tp group of 3 ranks"),
        (("reshard", old, "-o", tmp_path / "x", "--tp", 4, "--pp", 5), ""),
        (("reshard", old, "-o", old, "--tp", 4), "is the input"),
        (("reshard", old, "-o", old / "inner", "--tp", 4), "lies inside the input"),
        (("reshard", tmp_path / "nothing", "-o", tmp_path / "x", "--tp", 4), "no such folder"),
    ]
    before = sorted(os.listdir(old))
    for args, message in cases:
        p = run(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, (args, p.stderr)
        assert not leftovers(tmp_path, "x")
    assert sorted(os.listdir(old)) == before and tpshard.check(old).ok
    with pytest.raises(PlanError):
        reshard(old, tmp_path / "x", T(tp=4), Options(dp_lm_head=True))


def test_cli_reshard_and_check_from(pair, tmp_path):
    old, new = pair
    p = run("reshard", old, "-o", tmp_path / "n", "--tp", 8, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["ranks"] == list(range(8))
    assert_identical(new, tmp_path / "n")
    p = run("check", tmp_path / "n", "--from", old)
    assert p.returncode == 0 and "reassembled from" in p.stdout, p.stdout
    _flip(tmp_path / "n" / rank_dir(0) / "model-tp-000-of-008.safetensors", 4000)
    rewrite_checksums(tmp_path / "n")
    p = run("check", tmp_path / "n", "--from", old)
    assert p.returncode == 1 and "FAIL [reassembly]" in p.stdout and "NOT verified" in p.stdout, p.stdout
    p = run("check", tmp_path / "n", "--from", old, "--source", tmp_path)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_bytes_no_new_tensor_reads_are_compared_at_the_end(qwen2_tied, tmp_path):
    """A tied model at pp 2: the last stage's lm_head is a copy of the embedding, never read to
    rebuild the source; a flipped byte in it still stops the reshard (OutputReader.verify_rest)."""
    old = tmp_path / "old"
    tpshard.split(qwen2_tied, old, T(tp=2, pp_layers=(1, 1)))
    m = read_manifest(old)
    spec = next(s for s in m.plan.shards if s.name == "lm_head.weight")
    offset = m.plan.offsets(spec.file)[file_specs(m.plan, spec.file).index(spec)]
    _flip(old / rank_dir(spec.ranks[0]) / spec.file, offset + 5)
    with pytest.raises(OutputError, match="lm_head.weight does not match its crc32"):
        reshard(old, tmp_path / "x", T(tp=4))
    assert not leftovers(tmp_path, "x")
    assert not tpshard.check(tmp_path / "old").ok


def test_reassembly_buffers_stay_under_the_limit_and_are_reused():
    import threading
    import time

    from tpshard.check.output_source import _Buffers

    pool = _Buffers(100)
    with pool.get(60) as a:
        first = a.base
    with pool.get(50) as b:
        assert b.base is first  # reused, not faulted in again
    peak, lock = [0], threading.Lock()

    def use(n):
        with pool.get(n):
            with lock:
                peak[0] = max(peak[0], pool.used + sum(map(len, pool.free)))
            time.sleep(0.01)

    threads = [threading.Thread(target=use, args=(n,)) for n in (70, 40, 30, 90, 10) * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak[0] <= 100 and pool.used == 0
    with pool.get(150) as big:  # larger than the limit: alone
        assert len(big) == 150 and pool.used == 150
