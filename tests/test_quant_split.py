"""Plan / split / check / layer-level verify of quantized checkpoints (issue 4).

What is compared with what:
- per rank, `dequantize(spec, rank's on-disk tensors)` == the rank's logical slice of the source
  layer's float weight (computed from the fixture's logical codes, = dequantize(source)), bit-exact,
  and zero in padding; for every format and tp in {2, 4, 8} where alignment allows (attn-dp 2 too);
- `check` with the source passes, and fails on a packed offset moved by one word (in the manifest:
  the logical-vs-physical check; in the bytes: reassembly);
- layer level (what `verify` runs, simulated rank by rank on one CPU process): engine-style TP
  layers with `ReferenceQuantMethod` loaded from each rank's files; concatenated column outputs /
  summed row partials equal `x @ dequantize(source).T`;
- refusals (misaligned FP8 block, Marlin shard below 64 columns, group not dividing K per rank)
  raise a PlanError naming the tensor, ranks and numbers, and leave nothing on disk;
- quantization_config resolution per module (GPTQModel dynamic, compressed-tensors targets/ignore).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
import torch
from quant_fixtures import DEFAULT_SPECS, TINY, TinyLlama, write_quant_checkpoint

from tpshard.check import check, check_plan, CheckReport
from tpshard.checkpoint import open_checkpoint
from tpshard.errors import PlanError
from tpshard.manifest import Options, read_manifest
from tpshard.plan import make_plan
from tpshard.quant.config import read_quant_config
from tpshard.quant.formats import QuantSpec, dequantize
from tpshard.rank import open_rank
from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.layers import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tpshard.runtime.reference_quant import ReferenceQuantMethod, quant_spec_of
from tpshard.safetensors_format import read_header
from tpshard.topology import Topology
from tpshard.writer import split

# Every projection's N and K per rank is a multiple of 128 at tp 8 (Marlin, FP8 block, group 128).
WIDE = TinyLlama(hidden=1024, intermediate=1024, heads=8, kv_heads=2, head_dim=128, layers=1, vocab=300)
# Intermediate 1536: 192 per rank at tp 8, not a multiple of the FP8 128-block.
FP8_ODD = TinyLlama(hidden=1024, intermediate=1536, heads=8, kv_heads=2, head_dim=128, layers=1, vocab=300)
# 8 heads of 32: q is 32 columns per rank at tp 8.
NARROW = TinyLlama(hidden=256, intermediate=512, heads=8, kv_heads=2, head_dim=32, layers=1, vocab=300)

DONE = ("gptq", "gptq_act_order", "awq", "marlin", "fp8_block", "ct_w4a16")  # the "done when" set
OTHERS = tuple(n for n in DEFAULT_SPECS if n not in DONE)
TOPOLOGIES = {"tp2": Topology(tp=2), "tp4": Topology(tp=4), "tp8": Topology(tp=8),
              "tp4-dp2": Topology(tp=4, attn_dp=2), "tp8-dp2": Topology(tp=8, attn_dp=2)}  # fmt: skip

CASES = (
    [pytest.param(n, t, id=f"{n}-{t}") for n in DONE for t in ("tp2", "tp4", "tp8")]
    + [pytest.param("gptq_act_order", "tp8-dp2", id="gptq_act_order-tp8-dp2")]
    + [pytest.param(n, "tp8-dp2", id=f"{n}-tp8-dp2", marks=pytest.mark.slow) for n in ("fp8_block", "ct_w4a16")]
    + [pytest.param(n, "tp4", id=f"{n}-tp4") for n in OTHERS]
    + [pytest.param(n, t, id=f"{n}-{t}", marks=pytest.mark.slow) for n in OTHERS for t in ("tp2", "tp8", "tp4-dp2")]
    + [pytest.param(n, t, id=f"{n}-{t}", marks=pytest.mark.slow) for n in DONE for t in ("tp4-dp2",)]
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (folder, expected float weights); written once per module, on first use."""
    made: dict[tuple, tuple[Path, dict]] = {}

    def get(name: str, shape: TinyLlama = WIDE, spec: QuantSpec | None = None):
        key = (name, shape)
        if key not in made:
            folder = tmp_path_factory.mktemp(name) / "model"
            made[key] = (folder, write_quant_checkpoint(folder, spec or DEFAULT_SPECS[name], shape=shape))
        return made[key]

    return get


def _rank_layers(manifest, rank: int) -> dict[str, dict]:
    """HF linear prefix -> {suffix: spec} of one rank's quantized tensors."""
    out: dict[str, dict] = defaultdict(dict)
    for s in manifest.plan.rank_shards(rank):
        if s.quant:
            prefix, _, suffix = s.name.rpartition(".")
            out[prefix][suffix] = s
    return out


def _logical(specs: dict) -> tuple[int | None, int, int, int]:
    """(logical dim, start, length, pad) of a layer's cut on this rank (None: whole)."""
    for s in specs.values():
        if s.logical_dim is not None:
            return s.logical_dim, s.logical_start, s.logical_length, s.logical_pad
    return None, 0, 0, 0


def assert_rank_dequant(out: Path, spec: QuantSpec, expected: dict[str, torch.Tensor]) -> None:
    """dequantize(rank's tensors) == rank's logical slice of the source weight; padding is zero."""
    manifest = read_manifest(out)
    for rank in manifest.written_ranks:
        tensors = open_rank(out, rank)
        for prefix, specs in _rank_layers(manifest, rank).items():
            w = dequantize(spec, {suffix: tensors[s.name] for suffix, s in specs.items()})
            dim, start, length, pad = _logical(specs)
            want = expected[prefix] if dim is None else expected[prefix].narrow(dim, min(start, expected[prefix].shape[dim]), length)
            got = w if dim is None else w.narrow(dim, 0, length)
            assert torch.equal(got, want), f"rank {rank} {prefix}: dequantized shard != source slice"
            if pad:
                assert not w.narrow(dim, length, pad).any(), f"rank {rank} {prefix}: padding is not zero"


def verify_layers(out: Path, spec: QuantSpec, expected: dict[str, torch.Tensor], shape: TinyLlama, src: Path) -> None:
    """Layer-level parity, rank by rank: TP layers + ReferenceQuantMethod vs x @ W_source^T."""
    from tpshard.verify.layers_check import SourceTensors

    source = SourceTensors(src)
    manifest = read_manifest(out)
    topo = manifest.plan.topology
    gen = torch.Generator().manual_seed(7)
    h = shape.hidden
    for layer in range(shape.layers):
        p = f"model.layers.{layer}"
        x = torch.randn(3, h, generator=gen)
        for name, kind, pieces in (
            ("self_attn.qkv_proj", "qkv", ("q", "k", "v")),
            ("mlp.gate_up_proj", "merged", ("gate", "up")),
            ("self_attn.o_proj", "row", (None,)),
            ("mlp.down_proj", "row", (None,)),
        ):
            # the architecture decides the group (a Llama keeps attention over tp under attention DP)
            group = next(s.group for s in manifest.plan.shards if s.layer == f"{p}.{name}" and s.dim is not None)
            hf = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj"}
            sources = [f"{p}.{hf[pc]}" if pc else f"{p}.{name}" for pc in pieces]
            k_in = expected[sources[0]].shape[1]
            xin = torch.randn(3, k_in, generator=gen) if kind == "row" else x
            # Static activation scales: the method quantizes each piece's input with its own scale,
            # so the reference does the same with the source's (tpshard.runtime.reference_quant).
            reference = torch.cat([_act(spec, source, s, xin) @ expected[s].T for s in sources], dim=-1)
            partial_sum, per_rank_out = None, {}
            for rank in range(topo.span(group)):  # one instance of the group (attention-DP replicas repeat it)
                g = LogicalGroup.of(topo, group, rank)
                specs = {s.name: s for s in manifest.plan.rank_shards(rank) if s.layer == f"{p}.{name}" and s.quant}
                per = next(s.logical_length + s.logical_pad for s in specs.values() if s.logical_dim is not None)
                method = ReferenceQuantMethod(spec)
                if kind == "qkv":
                    lin = QKVParallelLinear(h, shape.head_dim, shape.heads, shape.kv_heads, group=g, quant_method=method)
                elif kind == "merged":
                    lin = MergedColumnParallelLinear(h, [per * g.size] * 2, group=g, quant_method=method)
                else:
                    lin = RowParallelLinear(per * g.size, expected[sources[0]].shape[0], group=g, quant_method=method)
                tensors = open_rank(out, rank)
                for s in specs.values():
                    method.load_quant(lin, s.piece or None, s.name.rpartition(".")[2], tensors[s.name])
                lin.process_weights_after_loading()
                assert not lin.missing_shards(), lin.missing_shards()
                if kind == "row":
                    xr = torch.nn.functional.pad(xin, (0, per * g.size - k_in)).narrow(-1, g.rank * per, per)
                    y = lin.quant_method.apply(lin, xr)
                    partial_sum = y if partial_sum is None else partial_sum + y
                else:
                    outs = lin.split(lin.quant_method.apply(lin, x))
                    for j, piece in enumerate(pieces):  # kv replicas: one output per distinct piece shard
                        shard = next(s.group_rank for s in specs.values() if s.piece == piece and s.logical_dim is not None)
                        per_rank_out[(j, shard)] = outs[j]
            if kind == "row":
                got = partial_sum  # the all-reduce, done by hand
            else:
                got = torch.cat([
                    torch.cat([per_rank_out[key] for key in sorted(per_rank_out) if key[0] == j], -1)[..., : expected[src].shape[0]]
                    for j, src in enumerate(sources)
                ], -1)  # column pieces gathered in shard order, trailing padding dropped  # fmt: skip
            tol = 1e-5 * float(reference.abs().max())  # float32 sums in another order: relative to the output scale
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=tol, msg=lambda m: f"{p}.{name}: {m}")


def _act(spec, source, module: str, x: torch.Tensor) -> torch.Tensor:
    """x as the module's static activation quantization leaves it (unchanged without one)."""
    from tpshard.runtime.reference_quant import INPUT_SCALES, quantize_input

    if not spec.static_input:
        return x
    scale = next(source.raw(f"{module}.{n}") for n in INPUT_SCALES if f"{module}.{n}" in source)
    return quantize_input(spec, x, scale)


@pytest.mark.parametrize("name,topo", CASES)
def test_split_check_dequant_verify(checkpoints, tmp_path, name, topo):
    """Split, check against the source, per-rank dequant bit-exact, layer-level verify."""
    src, expected = checkpoints(name)
    spec = DEFAULT_SPECS[name]
    out = tmp_path / "out"
    manifest = split(src, out, TOPOLOGIES[topo])
    report = check(out, src)
    assert report.ok, report.problems
    assert any(s.quant == spec.format for s in manifest.plan.shards)
    assert_rank_dequant(out, spec, expected)
    verify_layers(out, spec, expected, WIDE, src)


def test_ct_weight_shape_is_the_ranks_shape(checkpoints, tmp_path):
    """compressed-tensors weight_shape is rewritten to [N_r, K] / [N, K_r], and check reads it back."""
    src, _ = checkpoints("ct_w4a16")
    out = tmp_path / "out"
    split(src, out, Topology(tp=4))
    assert quant_spec_of(read_manifest(out).plan, "model.layers.0.mlp.down_proj") == DEFAULT_SPECS["ct_w4a16"]
    t0 = open_rank(out, 1)
    assert t0["model.layers.0.self_attn.q_proj.weight_shape"].tolist() == [256, 1024]
    assert t0["model.layers.0.mlp.down_proj.weight_shape"].tolist() == [1024, 256]
    # A wrong value in the file is a reassembly failure.
    spec = next(s for s in read_manifest(out).plan.shards if s.name.endswith("down_proj.weight_shape") and 1 in s.ranks)
    _overwrite(out, 1, spec.file, spec.name, torch.tensor([1024, 1024], dtype=torch.int64).numpy().tobytes())
    report = check(out, src)
    assert any(p.check == "reassembly" and "weight_shape" in p.message for p in report.problems), report.problems


def _overwrite(out: Path, rank: int, file: str, tensor: str, data: bytes, at: int = 0) -> None:
    path = out / f"rank-{rank:05d}" / file
    header, _ = read_header(path)
    with open(path, "r+b") as fh:
        fh.seek(header[tensor].begin + at)
        fh.write(data)


def test_check_fails_on_packed_offset_off_by_one_word(checkpoints, tmp_path):
    """A qweight shard cut one int32 word late: the manifest edit fails check 3, the bytes fail reassembly."""
    src, _ = checkpoints("gptq")
    out = tmp_path / "out"
    manifest = split(src, out, Topology(tp=2))
    spec = next(s for s in manifest.plan.shards if s.name == "model.layers.0.mlp.down_proj.qweight" and s.group_rank == 1)
    assert (spec.dim, spec.step, spec.ratio, spec.start) == (0, "packed", (1, 8), 64)

    # Bytes: rank 1 holds source rows [65, 65 + 64) instead of [64, 128).
    from safetensors import safe_open

    with safe_open(src / "model.safetensors", "pt") as f:
        rows = f.get_slice(spec.name)[spec.start + 1 : spec.start + 1 + spec.length]
        rows = torch.cat([rows, torch.zeros(1, rows.shape[1], dtype=rows.dtype)])[: spec.length]
    _overwrite(out, 1, spec.file, spec.name, rows.contiguous().numpy().tobytes())
    report = check(out, src)
    assert any(p.check == "reassembly" and "down_proj.qweight" in p.message for p in report.problems), report.problems

    # Manifest: the recorded physical start moved by one word no longer converts from the logical start.
    plan = manifest.plan
    moved = msgspec.structs.replace(spec, start=spec.start + 1)
    broken = plan.with_shards(moved if s is spec else s for s in plan.shards)
    report = CheckReport(out_dir=str(out), source=None)
    check_plan(broken, report)
    assert any(p.check == "logical" and "physical start 65 != logical start 512 x 1/8" in p.message for p in report.problems), report.problems
    report = CheckReport(out_dir=str(out), source=None)
    check_plan(plan, report)
    assert report.ok, report.problems


def _refused(src: Path, out: Path, topology: Topology, *needles: str, options: Options | None = None) -> str:
    with pytest.raises(PlanError) as e:
        split(src, out, topology, options)
    message = str(e.value)
    for needle in needles:
        assert needle in message, message
    assert not out.exists() and not any(out.parent.glob(f".{out.name}*")), "a refused split wrote something"
    return message


def test_fp8_block_misaligned_is_refused_then_pads(checkpoints, tmp_path):
    """Intermediate 1536 at tp 8 = 192 per rank: refused naming tensor, ranks, 192 % 128; --pad-blocks splits."""
    src, expected = checkpoints("fp8_block", FP8_ODD)
    out = tmp_path / "out"
    _refused(src, out, Topology(tp=8), "mlp.down_proj.weight_scale_inv", "mlp.gate_proj.weight_scale_inv",
             "192 % 128 = 64", "misaligned ranks [0, 1, 2, 3, 4, 5, 6, 7]", "--pad-blocks", "256 (2 blocks)")  # fmt: skip
    manifest = split(src, out, Topology(tp=8), Options(pad_blocks=True))
    assert manifest.plan.options.pad_blocks
    scale = {s.group_rank: s for s in manifest.plan.shards if s.name == "model.layers.0.mlp.down_proj.weight_scale_inv"}
    assert (scale[5].start, scale[5].length, scale[5].pad) == (10, 2, 0)  # K [1280, 1536): blocks 10, 11
    assert (scale[6].length, scale[6].pad, scale[6].logical_pad) == (0, 2, 256)  # all padding
    assert check(out, src).ok
    assert_rank_dequant(out, DEFAULT_SPECS["fp8_block"], expected)
    verify_layers(out, DEFAULT_SPECS["fp8_block"], expected, FP8_ODD, src)


def test_marlin_below_64_columns_is_refused(checkpoints, tmp_path):
    spec = QuantSpec(format="marlin", bits=4, group_size=-1)
    src, _ = checkpoints("marlin_channel", NARROW, spec)
    _refused(src, tmp_path / "out", Topology(tp=8), "self_attn.q_proj.B", "N 256 over tp of 8 gives 32 per rank",
             "Marlin 64-column permutation unit", "32 % 64 = 32")  # fmt: skip


def test_group_not_dividing_k_per_rank_is_refused(checkpoints, tmp_path):
    src, _ = checkpoints("gptq", TINY)
    _refused(src, tmp_path / "out", Topology(tp=4), "self_attn.o_proj.scales", "K 256 over tp of 4 gives 64 per rank",
             "quantization group of 128", "64 % 128 = 64")  # fmt: skip


def test_engine_kernel_constraints_are_warnings(checkpoints):
    """GPTQ K per rank 64 % 128 with group 64: exact split, but vLLM's Marlin kernels want 128."""
    spec = QuantSpec(format="gptq", bits=4, group_size=64)
    src, _ = checkpoints("gptq_g64", TINY, spec)
    plan = make_plan(open_checkpoint(src), Topology(tp=4))
    assert any("vLLM gptq_marlin needs K per rank % 128 == 0" in w and "o_proj" in w for w in plan.warnings), plan.warnings


def test_plan_cli_shows_preflight(checkpoints):
    from typer.testing import CliRunner

    from tpshard.cli import app

    src, _ = checkpoints("fp8_block", FP8_ODD)
    result = CliRunner().invoke(app, ["plan", str(src), "--tp", "8", "--pad-blocks", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["alignment"]
    assert any(r["tensor"] == "model.layers.N.mlp.down_proj.weight_scale_inv" and r["padded"] for r in rows), rows


# ---- config resolution ------------------------------------------------------------------------


def test_gptq_dynamic_overrides_per_module(tmp_path):
    raw = {
        "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
        "checkpoint_format": "gptq_v2", "lm_head": False,
        "dynamic": {r"-:model\.layers\.0\.mlp\..*": {}, r"+:.*\.self_attn\.(q|k)_proj": {"bits": 8, "group_size": 64}},
    }  # fmt: skip
    q = read_quant_config(tmp_path, {"quantization_config": raw})
    assert q.spec_for("model.layers.0.mlp.down_proj", True) is None
    assert q.spec_for("model.layers.1.self_attn.q_proj", True) == QuantSpec(format="gptq_v2", bits=8, group_size=64)
    assert q.spec_for("model.layers.1.self_attn.v_proj", True) == QuantSpec(format="gptq_v2", bits=4, group_size=128)
    assert q.spec_for("lm_head", True) is None
    assert q.spec_for("model.layers.1.mlp.gate", True) is None  # MoE router
    assert q.spec_for("model.norm", False) is None


def test_quantize_config_json_and_ct_targets(tmp_path):
    (tmp_path / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128, "desc_act": True}))
    q = read_quant_config(tmp_path, {})
    assert q.spec_for("model.layers.0.self_attn.o_proj", True) == QuantSpec(format="gptq", group_size=128, desc_act=True)
    ct = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head", "re:.*\\.mlp\\.down_proj"],
        "config_groups": {
            "g0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True}},
            "g1": {"targets": ["re:.*self_attn\\.o_proj"], "format": "float-quantized",
                   "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}},
        },
    }  # fmt: skip
    q = read_quant_config(tmp_path, {"quantization_config": ct})
    assert q.spec_for("model.layers.0.self_attn.q_proj", True) == QuantSpec(format="ct_int", group_size=128)
    assert q.spec_for("model.layers.0.self_attn.o_proj", True) == QuantSpec(format="ct_fp8_channel", bits=8)
    assert q.spec_for("model.layers.0.mlp.down_proj", True) is None
    assert q.spec_for("lm_head", True) is None


def test_config_and_disk_disagree(checkpoints, tmp_path):
    """A module the config quantizes but whose tensor set does not match: a clear PlanError."""
    src, _ = checkpoints("gptq", TINY)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in src.iterdir():
        os.link(f, bad / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (bad / "config.json").unlink()
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(PlanError, match=r"qweight: shape \[\d+, \d+\] on disk, but a gptq 8-bit layer \[N=\d+, K=\d+\] \(group 128\) stores qweight as"):
        make_plan(open_checkpoint(bad), Topology(tp=2))


@pytest.mark.parametrize("name", ["fp8_block", "ct_nvfp4", "gptq"])
def test_load_rank_reads_every_dtype_as_open_rank(checkpoints, tmp_path, name):
    """load_rank reinterprets raw bytes per dtype (fp8, uint8, int32, int64 ...); safetensors is the reference."""
    from tpshard.rank import load_rank

    src, _ = checkpoints(name)
    out = tmp_path / "out"
    split(src, out, Topology(tp=2))
    for rank in range(2):
        lazy, eager = open_rank(out, rank), load_rank(out, rank)
        assert set(lazy) == set(eager)
        for key, t in eager.items():
            assert t.dtype == lazy[key].dtype and t.shape == lazy[key].shape, key
            assert torch.equal(t.view(torch.uint8), lazy[key].view(torch.uint8)), key


def test_a_readers_quant_specs_are_decoded_once_each_and_shared(checkpoints, tmp_path):
    """Every reader of a manifest decodes each distinct spec once and shares it between the modules
    that have it, as make_plan does; check --source finds an edited spec; a spec that is not a JSON
    object is refused in one line."""
    from tpshard.errors import OutputError
    from tpshard.manifest import MANIFEST_NAME

    src, _ = checkpoints("fp8_block")
    out = tmp_path / "out"
    made = split(src, out, TOPOLOGIES["tp4"])
    read = read_manifest(out).quant_layers
    assert msgspec.json.encode(read, order="sorted") == msgspec.json.encode(made.quant_layers, order="sorted")
    assert len(read) > 1 and len({id(spec) for spec in read.values()}) == len({json.dumps(spec, sort_keys=True) for spec in read.values()})
    data = json.loads((out / MANIFEST_NAME).read_bytes())
    module = sorted(data["quant_layers"])[-1]
    data["quant_layers"][module] = {**data["quant_layers"][module], "block": [64, 64]}  # what verify would dequantize with
    (out / MANIFEST_NAME).write_bytes(msgspec.json.encode(data, order="sorted"))
    report = check(out, src)
    assert any(p.check == "rules" and "quant_layers" in p.message for p in report.problems) and report.tensors_reassembled == 0
    data["quant_layers"][module] = 5
    (out / MANIFEST_NAME).write_bytes(msgspec.json.encode(data, order="sorted"))
    for call in (read_manifest, check, lambda o: check(o, src)):
        with pytest.raises(OutputError) as e:
            call(out)
        assert f"$.quant_layers['{module}']" in str(e.value) and "\n" not in str(e.value), e.value


@pytest.mark.parametrize("name", sorted(DEFAULT_SPECS))
def test_the_rules_quantized_tensors_are_what_their_manifest_text_decodes_to(checkpoints, name):
    """check --source takes the rules' tensors for the manifest's when the two texts are the same:
    that text must decode to those tensors (packed, scales, logical cuts), for every format."""
    from tpshard.manifest import Manifest, Source, decode_manifest, encode_manifest

    src, _ = checkpoints(name)
    plan = make_plan(open_checkpoint(src), TOPOLOGIES["tp2"])
    m = Manifest.of(plan, tool_version="test", source=Source(path="x", files=()), written_ranks=(), files=plan.files)
    assert decode_manifest(encode_manifest(m), "test").tensors == plan.tensors
