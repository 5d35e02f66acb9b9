"""Issue 10 item 4: `check` proves every file under every name. Links the plan did not make, stray
files, a copy that differs from the source behind a forged crc32, config and tokenizer files that
differ from the source's: each is a finding, and the summary never says bit-exact beside a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import tpshard
from broken import file_specs
from tpshard.manifest import read_manifest
from tpshard.plan import spec_layout
from tpshard.safetensors_format import nbytes_of
from tpshard.topology import Topology


@pytest.fixture(scope="module")
def out_tp2(llama_tp2) -> Path:
    return llama_tp2


@pytest.fixture
def broken(out_tp2, tmp_path):
    dst = tmp_path / "broken"
    subprocess.run(["cp", "-a", str(out_tp2), str(dst)], check=True)  # hard links kept
    return dst


def findings(out: Path, source: Path | None = None) -> list[str]:
    report = tpshard.check(out, source)
    return [f"[{p.check}] {p.message}" for p in report.problems]


def test_the_good_output_passes(out_tp2, llama):
    assert findings(out_tp2, llama) == []


def test_a_symlink_in_place_of_a_file_is_a_finding(broken, llama, tmp_path):
    # The content is right, but it lives outside the output: shipping the rank folder loses it.
    common = broken / "rank-00001" / "model-common.safetensors"
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copyfile(common, outside)
    common.unlink()
    common.symlink_to(outside)
    for source in (None, llama):
        assert any("model-common.safetensors is a symbolic link" in f for f in findings(broken, source))


def test_a_hard_link_under_another_name_is_checked_under_both(broken):
    # rank 1's tp file replaced by a hard link to rank 0's: same inode, two names.
    mine = broken / "rank-00001" / "model-tp-001-of-002.safetensors"
    mine.unlink()
    os.link(broken / "rank-00000" / "model-tp-000-of-002.safetensors", mine)
    found = findings(broken)  # caught without the source
    assert any("model-tp-001-of-002.safetensors of ranks [1]" in f for f in found), found


def test_symlinked_index_and_config_are_findings(broken, tmp_path):
    for name in ("model.safetensors.index.json", "config.json"):
        path = broken / "rank-00001" / name
        outside = tmp_path / name
        shutil.copyfile(path, outside)
        path.unlink()
        path.symlink_to(outside)
    found = findings(broken)
    assert any("index.json is a symbolic link" in f for f in found) and any("config.json is a symbolic link" in f for f in found)


def test_stray_files_and_folders_are_reported(llama, tmp_path):
    part = tmp_path / "part"
    tpshard.split(llama, part, Topology(tp=2), ranks=[0])
    (part / "rank-00000" / "extra.safetensors").write_bytes(b"x")
    (part / "rank-00001").mkdir()  # a rank the manifest does not list
    (part / "notes.txt").write_text("x")
    found = findings(part)
    assert any("[stray] rank-00000/extra.safetensors" in f for f in found), found
    assert any("[stray] rank-00001" in f for f in found) and any("[stray] notes.txt" in f for f in found)


def forge_crc32(data: bytearray, target: int, at: int) -> None:
    """Change data[at:at+4] so that zlib.crc32(data) == target (crc32 is affine over GF(2))."""
    base = zlib.crc32(bytes(data[:at]) + b"\0\0\0\0" + bytes(data[at + 4 :]))
    zero = zlib.crc32(bytes(len(data)))
    columns = []
    for bit in range(32):
        probe = bytearray(len(data))
        probe[at + bit // 8] = 1 << (bit % 8)
        columns.append(zlib.crc32(bytes(probe)) ^ zero)
    want = base ^ target
    # Solve columns x = want over GF(2) by elimination.
    rows = [(c, 1 << i) for i, c in enumerate(columns)]
    basis: dict[int, tuple[int, int]] = {}
    for c, combo in rows:
        for top in sorted(basis, reverse=True):
            if c >> top & 1:
                c, combo = c ^ basis[top][0], combo ^ basis[top][1]
        if c:
            basis[c.bit_length() - 1] = (c, combo)
    x = 0
    for top in sorted(basis, reverse=True):
        if want >> top & 1:
            want ^= basis[top][0]
            x ^= basis[top][1]
    assert want == 0
    data[at : at + 4] = x.to_bytes(4, "little")
    assert zlib.crc32(bytes(data)) == target


def break_one_copy_behind_its_crc32(out: Path, rank: int, tensor: str) -> None:
    """Un-share rank `rank`'s copy of the file holding `tensor` and change that tensor there, keeping
    its crc32 (so the manifest's digests still match)."""
    m = read_manifest(out)
    spec = next(s for s in m.plan.shards if s.name == tensor and rank in s.ranks)
    specs = file_specs(m.plan, spec.file)
    offset = spec_layout(specs)[1][specs.index(spec)]
    n = nbytes_of(spec.dtype, spec.shape)
    path = out / f"rank-{rank:05d}" / spec.file
    data = bytearray(path.read_bytes())
    path.unlink()  # a copy of its own instead of the hard link
    region = data[offset : offset + n]
    target = zlib.crc32(bytes(region))
    region[0] ^= 0x40
    forge_crc32(region, target, 8)
    data[offset : offset + n] = region
    path.write_bytes(bytes(data))


def test_every_copy_is_compared_with_the_source(broken, llama):
    """A copy that replaced a hard link and was changed behind a forged crc32: checksums cannot see
    it (crc32 is no defence against someone who edits files); --source compares every copy."""
    break_one_copy_behind_its_crc32(broken, 1, "model.norm.weight")
    assert findings(broken) == []  # what crc32 digests cannot prove (docs/reliability.md)
    found = findings(broken, llama)
    assert any("model.norm.weight" in f and "copy of ranks [1]" in f for f in found), found


def test_sha256_digests_catch_the_forged_copy_without_the_source(llama, tmp_path):
    out = tmp_path / "sha"
    tpshard.split(llama, out, Topology(tp=2), tpshard.Options(checksum="sha256"))
    break_one_copy_behind_its_crc32(out, 1, "model.norm.weight")
    assert any("model.norm.weight does not match its sha256" in f for f in findings(out))


def test_config_and_tokenizer_are_compared_with_the_source(broken, llama, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(llama, src)
    (src / "generation_config.json").write_text("{}")
    (src / "tokenizer.json").write_text("{}")
    found = findings(broken, src)
    assert any("generation_config.json: differs from the source's" in f for f in found), found
    assert any("tokenizer.json: in the source, but not copied" in f for f in found), found


def test_the_summary_never_says_bit_exact_beside_a_failure(broken, out_tp2, llama):
    path = broken / "rank-00001" / "model-tp-001-of-002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.unlink()
    path.write_bytes(bytes(data))
    p = subprocess.run([sys.executable, "-m", "tpshard", "check", str(broken), "--source", str(llama)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "bit-exact" not in p.stdout and "NOT verified" in p.stdout, p.stdout
    good, bad = tpshard.check(out_tp2, llama), tpshard.check(broken, llama)
    assert good.ok and not bad.ok
    failed = {p.message.split(" ")[0] for p in bad.problems if p.check == "reassembly"}
    assert failed and bad.tensors_reassembled == good.tensors_reassembled - len(failed)  # only exact tensors count


def test_an_index_is_checked_byte_for_byte(broken):
    """Found by the fuzz test: a flipped byte in the index's metadata left the weight_map equal."""
    path = broken / "rank-00000" / "model.safetensors.index.json"
    text = path.read_text()
    path.unlink()
    path.write_text(text.replace('"metadata"', '"letadata"'))
    assert any("index.json differs from the one the plan gives" in f for f in findings(broken))
    path.write_text("[1]")
    assert any("index.json differs" in f for f in findings(broken))
    # compared a piece at a time: a byte more or less at the end, or in the middle, is still seen
    for edited in (text + " ", text[:-1], text[: len(text) // 2] + "x" + text[len(text) // 2 + 1 :], ""):
        path.write_text(edited)
        assert any("index.json differs" in f for f in findings(broken)), repr(edited[-20:])
    path.write_text(text)
    assert not any("index.json" in f for f in findings(broken))


@pytest.mark.parametrize("cut", [1, 100])
def test_a_truncated_file_is_a_finding_with_the_source_too(broken, llama, cut):
    """A file shorter than planned is a finding (exit 1) with --source as without: the reassembly
    reads it tensor by tensor and names what it cannot read, it does not stop the check (exit 2)."""
    path = min((broken / "rank-00000").glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = path.read_bytes()
    path.unlink()  # its hard-linked copies keep the whole file
    path.write_bytes(data[:-cut])
    p = subprocess.run([sys.executable, "-m", "tpshard", "check", str(broken), "--source", str(llama)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "truncated or extended" in p.stdout and "error:" not in p.stderr, p.stdout
