"""open_rank and load_rank verify what they hand back against the manifest by default: another
rank's file, a reordered header, a flipped byte, a truncated file or a link out of the output is an
OutputError naming the file and the tensor; verify=False is the documented opt-out."""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import tpshard
from broken import file_specs
from tpshard.errors import OutputError, TpshardError, UsageError
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
    first = file_specs(read_manifest(out).plan, name1)[0].name  # the first tensor read differs
    refused(out, 1, name1, f"tensor {first} does not match")


def test_reordered_header_is_refused(out):
    """k_proj and v_proj swapped in the header (same shapes and name lengths): the bytes stay put."""
    m = read_manifest(out)
    f = next(f for f in m.files if 0 in f.ranks and any(s.name.endswith("k_proj.weight") for s in file_specs(m.plan, f.name)))
    path = out / rank_dir(0) / f.name
    data = path.read_bytes()
    head = len(spec_layout(file_specs(m.plan, f.name))[0])
    swapped = data[:head].replace(b"k_proj", b"KPROJ_").replace(b"v_proj", b"k_proj").replace(b"KPROJ_", b"v_proj")
    assert swapped != data[:head]
    path.unlink()  # it is a hard link shared with other ranks: break only this copy
    path.write_bytes(swapped + data[head:])
    refused(out, 0, f.name, "header differs from the plan at tensor model.layers.0.self_attn.")


def test_flipped_byte_is_refused_and_verify_false_is_the_opt_out(out):
    m = read_manifest(out)
    spec = next(s for s in m.plan.rank_shards(2) if s.name == "model.layers.1.mlp.down_proj.weight")
    specs = file_specs(m.plan, spec.file)
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



# ---- the Python API: a context manager, a repr, arguments refused up front ----


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_open_rank_is_a_context_manager_that_closes_its_files(good):
    before = _open_fds()
    with tpshard.open_rank(good, 1) as tensors:
        assert isinstance(tensors, tpshard.rank.RankTensors)
        read = {k: tensors[k] for k in tensors}
        assert _open_fds() - before  # reading opened the rank's files
    assert _open_fds() == before
    assert read.keys() == tpshard.load_rank(good, 1).keys()
    with pytest.raises(KeyError):  # an error inside the block is not swallowed, and the files close
        with tpshard.open_rank(good, 1) as tensors:
            tensors[next(iter(tensors))]
            tensors["no such tensor"]
    assert _open_fds() == before


def test_rank_tensors_repr_names_the_output_rank_and_count(good):
    tensors = tpshard.open_rank(str(good), 2)
    assert repr(tensors) == f"<RankTensors out={str(good)!r} rank=2 tensors={len(tensors)}>"
    assert len(tensors) == len(read_manifest(good).plan.rank_shards(2))


BAD_ARGUMENTS = [
    (dict(rank="1"), "rank must be an integer from 0 to 65535, got '1'"),
    (dict(rank=True), "rank must be an integer from 0 to 65535, got True"),
    (dict(rank=1.0), "rank must be an integer from 0 to 65535, got 1.0"),
    (dict(rank=-1), "rank must be an integer from 0 to 65535, got -1"),
    (dict(rank=1 << 16), "rank must be an integer from 0 to 65535, got 65536"),
    (dict(out_dir=None), "out_dir must be a folder path (str or os.PathLike), got None"),
    (dict(out_dir=7), "out_dir must be a folder path (str or os.PathLike), got 7"),
    (dict(out_dir=b"out"), "out_dir must be a folder path (str or os.PathLike), got b'out'"),
    (dict(verify="no"), "verify must be True or False, got 'no'"),
    (dict(verify=0), "verify must be True or False, got 0"),
]  # fmt: skip


@pytest.mark.parametrize("loader", ["open_rank", "load_rank"])
@pytest.mark.parametrize("bad, message", BAD_ARGUMENTS, ids=[f"{k}={v!r}" for b, _ in BAD_ARGUMENTS for k, v in b.items()])
def test_bad_arguments_are_refused_up_front_without_del_noise(good, loader, bad, message):
    """One UsageError naming the argument, before any file is read; no "Exception ignored in
    RankTensors.__del__" from the half-made mapping."""
    args = dict(out_dir=good, rank=1, verify=True) | bad
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with pytest.raises(UsageError) as e:
            getattr(tpshard, loader)(args.pop("out_dir"), args.pop("rank"), **args)
        assert str(e.value) == f"{loader}: {message}"
        del e
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not unraisable, [u.exc_value for u in unraisable]


def test_refused_outputs_leave_no_del_noise_either(good, tmp_path):
    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        for out, rank in ((good, 9), (tmp_path / "nothing", 0), (Path(good) / rank_dir(0), 0)):
            with pytest.raises(TpshardError):
                tpshard.open_rank(out, rank)
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert not unraisable, [u.exc_value for u in unraisable]

# ---- one rank's records: read_rank_records decodes only what places the rank's bytes ----


def _manifest_only(plan, tmp_path):
    """An output folder holding only a manifest of `plan` (every rank written), each file with one
    made-up digest per tensor: the rank records need no tensor data."""
    import msgspec

    from tpshard.manifest import MANIFEST_NAME, Manifest, Source, encode_manifest

    counts = {f.name: len(plan.members(i)) for i, f in enumerate(plan.files)}
    files = tuple(
        msgspec.structs.replace(f, checksum="0" * 64, digests="".join(f"{i:08x}" for i in range(counts[f.name])))
        for f in plan.files
    )
    m = Manifest.of(plan, tool_version="test", source=Source(path="model", files=()), written_ranks=tuple(range(plan.topology.world_size)), files=files)
    out = tmp_path / "out"
    out.mkdir()
    (out / MANIFEST_NAME).write_bytes(encode_manifest(m))
    return out


LAYOUTS = [
    ("llama", dict(tp=4, attn_dp=2)),
    ("llama", dict(tp=8)),  # kv heads replicated over 4 ranks each
    ("llama", dict(tp=2, pp_layers=(1, 1))),
    ("qwen2_tied", dict(tp=2, pp_layers=(1, 1))),  # the last stage's own lm_head, cut from the embedding
    ("deepseek_v3", dict(tp=4, ep=2)),
    ("deepseek_fp8", dict(tp=2)),  # block-quantized: scales cut along with their weights
]


@pytest.mark.parametrize("fixture,topology", LAYOUTS, ids=[f"{f}-{'-'.join(f'{k}{v}' for k, v in t.items())}" for f, t in LAYOUTS])
def test_rank_records_are_the_plans_files(request, tmp_path, fixture, topology):
    """Every rank's files, tensors in data order and digests from read_rank_records equal those of the
    whole plan's ShardSpec views, and so do the headers laid out from them."""
    from tpshard.manifest import read_rank_records
    from tpshard.plan import file_header, make_plan

    plan = make_plan(tpshard.open_checkpoint(request.getfixturevalue(fixture)), Topology(**topology))
    out = _manifest_only(plan, tmp_path)
    full = read_manifest(out)
    for rank in range(plan.topology.world_size):
        records = read_rank_records(out, rank)
        assert records.written_ranks == full.written_ranks and records.checksum == full.options.checksum
        assert [f.record for f in records.files] == [f for f in full.files if rank in f.ranks]
        for f in records.files:
            specs = file_specs(full.plan, f.record.name)
            assert f.members == [(s.name, s.dtype, s.shape) for s in specs]
            assert file_header(f.members) == spec_layout(specs)


def test_rank_records_decode_the_manifests_fields_as_the_manifest_does():
    """The rank records' schema is a subset of the manifest's, field for field (types and defaults),
    the cuts aside (JSON text, decoded as Cut when used)."""
    import msgspec

    from tpshard.manifest import Manifest, OutputFile, TensorPlan
    from tpshard.manifest.rank_records import _FileRecord, _RankManifest, _TensorRecord

    for part, whole in ((_TensorRecord, TensorPlan), (_FileRecord, OutputFile), (_RankManifest, Manifest)):
        fields = {f.name: f for f in msgspec.structs.fields(whole)}
        for f in msgspec.structs.fields(part):
            if f.name in ("cuts", "format", "version", "tensors", "files"):
                continue  # raw text; the envelope is compared with the constants; records above
            assert (f.type, f.default) == (fields[f.name].type, fields[f.name].default), f"{part.__name__}.{f.name}"


def _edit(out, edit):
    from tpshard.manifest import MANIFEST_NAME

    data = json.loads((out / MANIFEST_NAME).read_bytes())
    edit(data)
    (out / MANIFEST_NAME).write_text(json.dumps(data))


def _rank_cut(data, held_by):
    """A tensor and one of its cuts whose file only the ranks `held_by` hold."""
    index = next(i for i, f in enumerate(data["files"]) if f["ranks"] == held_by)
    return next((t, c) for t in data["tensors"] for c in t["cuts"] if c[4] == index)


def test_tampered_rank_records_are_refused_by_that_rank_only(out):
    """A cut of rank 1's own file made one row longer in the manifest: rank 1 refuses it (its planned
    header is no longer the file's), every other rank reads as before."""
    import gc

    def longer(data):
        t, c = _rank_cut(data, [1])
        t["shape"][t["dim"]] += 1  # a cut tensor (a file of one rank holds no whole copy), one row longer
        c[2] += 1  # and the cut one row longer: the rank's shape changes, no other rank's

    _edit(out, longer)
    refused(out, 1, "rank 1")
    assert gc.isenabled()  # load_rank pauses the collector and restores it, refusing or not
    for rank in (0, 2, 3):
        lazy, eager = loaders(out, rank)
        assert lazy.keys() == eager.keys() and lazy


def test_tampered_digest_and_moved_cut_are_refused(out):
    files = _single_rank_files(out)

    def digest(data):
        f = next(f for f in data["files"] if f["ranks"] == [2])
        d = f["digests"]
        f["digests"] = d[:24] + ("00000000" if d[24:32] != "00000000" else "00000001") + d[32:]  # tensor 3's

    _edit(out, digest)
    refused(out, 2, files[(2,)], "does not match its crc32")

    def moved(data):  # a tensor of rank 3's file recorded in rank 0's, a digest moved along
        _, c = _rank_cut(data, [3])
        to, of = (next(f for f in data["files"] if f["ranks"] == [r]) for r in (0, 3))
        c[4] = data["files"].index(to)
        to["digests"], of["digests"] = to["digests"] + of["digests"][-8:], of["digests"][:-8]

    _edit(out, moved)
    refused(out, 0, "rank 0", files[(0,)])
    refused(out, 3, "rank 3", files[(3,)])


@pytest.mark.parametrize("bad,needle", [
    (lambda d: [d[:8]], "$.files["),  # a list (manifest version 2), not one string
    (lambda d: d[:-1], "hex digits"),
    (lambda d: "g" + d[1:], "not lower-case hex"),
    (lambda d: "A" + d[1:], "not lower-case hex"),
])  # fmt: skip
def test_rank_files_digests_are_decoded_against_the_schema(out, bad, needle):
    def edit(data):
        f = next(f for f in data["files"] if f["ranks"] == [0])
        f["digests"] = bad(f["digests"])

    _edit(out, edit)
    refused(out, 0, "not a valid tpshard manifest", needle, ".digests")
