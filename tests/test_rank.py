"""open_rank and load_rank verify what they hand back against the manifest by default: another
rank's file, a reordered header, a flipped byte, a truncated file or a link out of the output is an
OutputError naming the file and the tensor; verify=False is the documented opt-out."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import tpshard
from tpshard.errors import OutputError
from tpshard.manifest import rank_dir, read_manifest
from tpshard.plan import spec_layout
from tpshard.topology import Topology


@pytest.fixture(scope="module")
def good(llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("rank") / "out"
    tpshard.split(llama, out, Topology(tp=4, attn_dp=2))
    return out


@pytest.fixture
def out(good, tmp_path):
    dst = tmp_path / "out"
    shutil.copytree(good, dst)  # every file its own copy: breaking one breaks no other rank
    return dst


def loaders(out, rank, verify=True):
    """Both loaders, reading every tensor."""
    lazy = tpshard.open_rank(out, rank, verify=verify)
    return {k: lazy[k] for k in lazy}, tpshard.load_rank(out, rank, verify=verify)


def refused(out, rank, *needles):
    for load in (lambda: dict(tpshard.open_rank(out, rank).items()), lambda: tpshard.load_rank(out, rank)):
        with pytest.raises(OutputError) as e:
            load()
        assert all(n in str(e.value) for n in needles), str(e.value)


def test_good_output_loads_the_same_both_ways(good):
    m = read_manifest(good)
    for rank in m.written_ranks:
        lazy, eager = loaders(good, rank)
        assert set(lazy) == set(eager) == {s.name for s in m.plan.rank_shards(rank)}
        for k in lazy:
            assert lazy[k].dtype == eager[k].dtype and torch.equal(lazy[k], eager[k])


def _single_rank_files(out):
    m = read_manifest(out)
    return {f.ranks: f.name for f in m.files if len(f.ranks) == 1}


def test_another_ranks_file_is_refused(out):
    files = _single_rank_files(out)
    name0, name1 = files[(0,)], files[(1,)]
    shutil.copyfile(out / rank_dir(0) / name0, out / rank_dir(1) / name1)  # same header, rank 0's bytes
    first = read_manifest(out).plan.specs_by_file()[name1][0].name  # the first tensor read differs
    refused(out, 1, name1, f"tensor {first} does not match")


def test_reordered_header_is_refused(out):
    """k_proj and v_proj swapped in the header (same shapes and name lengths): the bytes stay put."""
    m = read_manifest(out)
    f = next(f for f in m.files if 0 in f.ranks and any(s.name.endswith("k_proj.weight") for s in m.plan.specs_by_file()[f.name]))
    path = out / rank_dir(0) / f.name
    data = path.read_bytes()
    head = len(spec_layout(m.plan.specs_by_file()[f.name])[0])
    swapped = data[:head].replace(b"k_proj", b"KPROJ_").replace(b"v_proj", b"k_proj").replace(b"KPROJ_", b"v_proj")
    assert swapped != data[:head]
    path.unlink()  # it is a hard link shared with other ranks: break only this copy
    path.write_bytes(swapped + data[head:])
    refused(out, 0, f.name, "header differs from the plan at tensor model.layers.0.self_attn.")


def test_flipped_byte_is_refused_and_verify_false_is_the_opt_out(out):
    m = read_manifest(out)
    spec = next(s for s in m.plan.rank_shards(2) if s.name == "model.layers.1.mlp.down_proj.weight")
    specs = m.plan.specs_by_file()[spec.file]
    offset = spec_layout(specs)[1][specs.index(spec)]
    path = out / rank_dir(2) / spec.file
    with open(path, "r+b") as fh:
        fh.seek(offset + 5)
        byte = fh.read(1)
        fh.seek(offset + 5)
        fh.write(bytes([byte[0] ^ 0x10]))
    refused(out, 2, spec.file, "tensor model.layers.1.mlp.down_proj.weight", "crc32")
    lazy, eager = loaders(out, 2, verify=False)  # what verification protects from: wrong bytes, no error
    assert torch.equal(lazy[spec.name], eager[spec.name])


def test_truncated_file_and_link_out_of_the_output_are_refused(out, tmp_path):
    files = _single_rank_files(out)
    path = out / rank_dir(3) / files[(3,)]
    os.truncate(path, path.stat().st_size - 4)
    refused(out, 3, files[(3,)], "bytes, the manifest says")

    outside = tmp_path / "elsewhere.safetensors"
    path = out / rank_dir(1) / files[(1,)]
    shutil.copyfile(path, outside)  # identical bytes, but outside the output folder
    path.unlink()
    path.symlink_to(outside)
    refused(out, 1, files[(1,)], "plain file")
