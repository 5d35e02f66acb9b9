"""`check OUT --source OTHER` and `verify OUT --source OTHER`, where OTHER is not the checkpoint OUT
was split from: one line naming the first file that differs, exit 2 (docs/reliability.md), not a
list of findings blaming the output.

Compared with what: the manifest's record of the source files (their sizes and checksums,
tpshard.source_identity). OTHER is the same model with other values (same names, shapes and file
sizes), another model, or the right checkpoint with one byte flipped after the split.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from checkpoints import make_checkpoint

import tpshard
from tpshard.errors import TpshardError


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip


@pytest.fixture(scope="module")
def other_values(tmp_path_factory):
    """The llama fixture's model with another seed: the same files, names, shapes and sizes."""
    return make_checkpoint(tmp_path_factory.mktemp("other") / "model", "llama", max_shard_size="100KB", seed=1)


def one_line_exit_2(result: subprocess.CompletedProcess, source, out) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines[:20]
    assert f"{source} is not the checkpoint {out} was split from" in lines[0], lines[0]
    assert "None" not in lines[0] and "failing" not in lines[0]
    return lines[0]


def test_check_names_the_first_file_of_a_checkpoint_with_other_values(llama, llama_tp2, other_values):
    assert [p.stat().st_size for p in sorted(llama.glob("*.safetensors"))] == [
        p.stat().st_size for p in sorted(other_values.glob("*.safetensors"))
    ]  # nothing but the bytes differ
    line = one_line_exit_2(run("check", llama_tp2, "--source", other_values), other_values, llama_tp2)
    assert "model-00001-of-00002.safetensors differs" in line, line


def test_check_another_model_is_one_line_not_findings(llama_tp2, qwen3):
    line = one_line_exit_2(run("check", llama_tp2, "--source", qwen3), qwen3, llama_tp2)
    assert "model.safetensors" in line, line


def test_a_byte_flipped_in_the_source_after_the_split_names_its_file(llama, llama_tp2, copy_of):
    source = copy_of(llama)
    second = source / "model-00002-of-00002.safetensors"
    data = bytearray(second.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's bytes: the size and header stay
    second.write_bytes(bytes(data))
    with pytest.raises(TpshardError, match="model-00002-of-00002.safetensors differs") as info:
        tpshard.check(llama_tp2, source)
    assert info.value.exit_code == 2
    assert tpshard.check(llama_tp2, llama).ok  # the right source still passes


def test_verify_refuses_the_wrong_source_before_any_rank_starts(llama_tp2, other_values):
    line = one_line_exit_2(run("verify", llama_tp2, "--source", other_values), other_values, llama_tp2)
    assert "model-00001-of-00002.safetensors differs" in line, line


def test_check_source_reads_the_source_once(llama, tmp_path, monkeypatch):
    """The source's identity comes from the tensors the reassembly read (one read of the source,
    docs/performance.md); only tensors no written rank holds are read again for it."""
    import tpshard.source_identity as identity

    read_again = []
    real = identity.range_digests

    def counting(fd, offsets, sizes, algorithm):
        read_again.append(sum(sizes))
        return real(fd, offsets, sizes, algorithm)

    monkeypatch.setattr(identity, "range_digests", counting)
    tpshard.split(llama, tmp_path / "all", tpshard.Topology(tp=2))
    report = tpshard.check(tmp_path / "all", source=llama)
    assert report.ok and sum(read_again) == 0, (report.problems, read_again)
    tpshard.split(llama, tmp_path / "rank1", tpshard.Topology(tp=2), ranks=[1])
    report = tpshard.check(tmp_path / "rank1", source=llama)
    assert report.ok, report.problems  # rank 0's own shards are not there, its shared tensors are
    assert sum(read_again) == 0  # every tensor has a piece in rank 1's files


def test_a_flipped_source_byte_is_one_line_even_with_findings(llama, tmp_path, copy_of):
    """A byte of the source flipped after the split: the reassembly finds a tensor that differs, and
    check says the one line about the source, exit 2, not the finding."""
    source = copy_of(llama)
    out = tmp_path / "out"
    tpshard.split(source, out, tpshard.Topology(tp=2))
    first = sorted(source.glob("*.safetensors"))[0]
    with open(first, "r+b") as f:
        f.seek(first.stat().st_size - 1)
        byte = f.read(1)
        f.seek(first.stat().st_size - 1)
        f.write(bytes([byte[0] ^ 1]))
    line = one_line_exit_2(run("check", out, "--source", source), source, out)
    assert first.name in line, line
