"""`verify` (layer level) on quantized checkpoints: the real multi-process verify on CPU with gloo.

Compared with what: every sharded layer's tensor-parallel output -- each rank's quantized shards
loaded as its files hold them, dequantized by ReferenceQuantMethod, run in float32 -- against the
float64 reference rank 0 computes from the *source*: x @ dequantize(spec, source tensors).T (+ bias).
Formats: the issue's "done when" set (GPTQ 4-bit with and without desc_act, AWQ, Marlin, FP8 block
incl. the misaligned case split with --pad-blocks, compressed-tensors W4A16) at tp 2 / 4 / 8 and
attention-DP 2; every other format (GPTQ 3/8-bit, FP8 per-tensor, compressed-tensors int / fp8 /
nvfp4) at tp 2. Outputs of one world size are verified in one launch (verify_many): the default run
keeps one output per format and world size, the rest of the matrix is marked slow.

Broken on purpose, checksums kept consistent (only the source can tell): rank 1's gate_proj scales
replaced by group rank 0's, and rank 0's down_proj qweight replaced by rank 1's; and a manifest
that files rank 1's down_proj scales under group rank 0 (the alignment check against shard_info).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from broken import overwrite_tensor, rewrite_checksums
from quant_fixtures import DEFAULT_SPECS, TinyLlama, write_quant_checkpoint

import tpshard
from tpshard.errors import TpshardError
from tpshard.manifest import MANIFEST_NAME, Options, encode_manifest, read_manifest
from tpshard.topology import Topology
from tpshard.verify import verify_many

# Every projection's N and K per rank is a multiple of 128 at tp 8 (Marlin, FP8 block, group 128).
WIDE = TinyLlama(hidden=1024, intermediate=1024, heads=8, kv_heads=2, head_dim=128, layers=1, vocab=300)
# Intermediate 1536: 192 per rank at tp 8, not a multiple of the FP8 128-block (split with --pad-blocks).
FP8_ODD = TinyLlama(hidden=1024, intermediate=1536, heads=8, kv_heads=2, head_dim=128, layers=1, vocab=300)

FORMATS = ("gptq", "gptq_act_order", "awq", "marlin", "fp8_block", "ct_w4a16")
# Every other format the planner knows, verified once at tp 2 in the same launch.
OTHER_FORMATS = tuple(f for f in DEFAULT_SPECS if f not in FORMATS)
PADDED = "fp8_block_padded"  # FP8_ODD at tp 8 with --pad-blocks
TOPOLOGIES = {
    "tp2": Topology(tp=2), "tp2-dp2": Topology(tp=2, attn_dp=2), "tp4": Topology(tp=4),
    "tp4-dp2": Topology(tp=4, attn_dp=2), "tp8": Topology(tp=8), "tp8-dp2": Topology(tp=8, attn_dp=2),
}  # fmt: skip
WORLDS = {2: ("tp2", "tp2-dp2"), 4: ("tp4", "tp4-dp2"), 8: ("tp8", "tp8-dp2")}

# Default: every format once per world size (alternating plain tp and attn-dp 2), plus the padded FP8.
DEFAULT = {
    2: [(f, "tp2") for f in FORMATS + OTHER_FORMATS] + [("gptq_act_order", "tp2-dp2")],
    4: [(f, "tp4" if i % 2 else "tp4-dp2") for i, f in enumerate(FORMATS)],
    8: [(f, "tp8-dp2" if i % 2 else "tp8") for i, f in enumerate(FORMATS)] + [(PADDED, "tp8")],
}
# The rest of the matrix: formats x {tp, tp + attn-dp 2} at every world size.
REST = {w: [(f, t) for t in WORLDS[w] for f in FORMATS if (f, t) not in DEFAULT[w]] for w in WORLDS}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """(checkpoint name, topology name) -> (source, output); each checkpoint and split made once."""
    sources: dict[str, Path] = {}
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(name: str, topo: str) -> tuple[Path, Path]:
        if name not in sources:
            shape, spec = (FP8_ODD, DEFAULT_SPECS["fp8_block"]) if name == PADDED else (WIDE, DEFAULT_SPECS[name])
            sources[name] = tmp_path_factory.mktemp(name) / "model"
            write_quant_checkpoint(sources[name], spec, shape=shape)
        if (name, topo) not in made:
            out = tmp_path_factory.mktemp(f"{name}-{topo}") / "out"
            tpshard.split(sources[name], out, TOPOLOGIES[topo], Options(pad_blocks=name == PADDED))
            made[(name, topo)] = (sources[name], out)
        return made[(name, topo)]

    return get


def assert_passes(cases: list[tuple[str, str]], outputs, extra: list[tuple[Path, Path]] = ()) -> list:
    """verify_many over `cases` (+ extra outputs) in one launch; every case passes, each quantized layer by name."""
    pairs = [outputs(name, topo) for name, topo in cases] + list(extra)
    reports = verify_many([o for _, o in pairs], [s for s, _ in pairs])
    for (name, topo), r in zip(cases, reports):
        assert r.ok, f"{name} {topo}: {r.failures()}"
        fmt = DEFAULT_SPECS["fp8_block" if name == PADDED else name].format
        quant = {x.layer: x.quant for x in r.layers}
        for layer in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            assert quant[f"model.layers.0.{layer}"] == fmt, (name, topo, quant)
        assert quant["model.embed_tokens"] == quant["lm_head"] == ""  # dense, on the dense path
        assert max(x.max_rel for x in r.layers) < 1e-5
    return reports[len(cases) :]


def broken_copy(good: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    return dst


def test_tp2_formats_pass_and_wrong_group_rank_scales_fail(outputs, tmp_path):
    """tp 2 (and attn-dp 2) for every format in one launch, plus two GPTQ breakages: rank 1's
    gate_proj scales replaced by group rank 0's (consistent checksums, so only verify can tell,
    naming gate_up_proj), and a manifest recording rank 1's down_proj scales as group rank 0's."""
    src, good = outputs("gptq", "tp2")
    bad = broken_copy(good, tmp_path / "scales")
    name = "model.layers.0.mlp.gate_proj.scales"
    overwrite_tensor(bad, 1, name, tpshard.open_rank(bad, 0)[name].clone())
    rewrite_checksums(bad)
    assert tpshard.check(bad).ok, "checksums and alignment are consistent: only the source can tell"
    misfiled = broken_copy(good, tmp_path / "misfiled")
    m = read_manifest(misfiled)
    shards = tuple(
        msgspec.structs.replace(s, group_rank=0) if s.name == "model.layers.0.mlp.down_proj.scales" and s.ranks == (1,) else s
        for s in m.plan.shards
    )  # fmt: skip
    (misfiled / MANIFEST_NAME).write_bytes(encode_manifest(m.with_plan(m.plan.with_shards(shards))))

    r, wrong_rank = assert_passes(DEFAULT[2], outputs, extra=[(src, bad), (src, misfiled)])
    problems = {x.layer: "; ".join(x.problems) for x in wrong_rank.layers if not x.ok}
    assert list(problems) == ["model.layers.0.mlp.down_proj"], problems
    assert (
        "model.layers.0.mlp.down_proj.scales (gptq, logical) on rank 1: manifest says group tp x1 rank 0/2 shape"
        " [1024, 512]; the RowParallelLinear expects group tp x1 rank 1/2 shape [1024, 512]"
    ) in problems["model.layers.0.mlp.down_proj"]

    assert not r.ok
    failing = {x.layer: "; ".join(x.problems) for x in r.layers if not x.ok}
    assert list(failing) == ["model.layers.0.mlp.gate_up_proj"], failing
    assert "piece gate of group rank 1/2 differs (rel error" in failing["model.layers.0.mlp.gate_up_proj"]
    assert "on world ranks [1]" in failing["model.layers.0.mlp.gate_up_proj"]
    assert any(line.startswith("model.layers.0.mlp.gate_up_proj (MergedColumnParallelLinear, gptq)") for line in r.failures())


def test_cli_exits_1_on_a_qweight_shard_from_another_rank(outputs, tmp_path):
    """Rank 0's down_proj qweight replaced by rank 1's (row-parallel K rows): exit 1, FAIL names down_proj."""
    src, good = outputs("gptq", "tp2")
    bad = broken_copy(good, tmp_path / "qweight")
    name = "model.layers.0.mlp.down_proj.qweight"
    overwrite_tensor(bad, 0, name, tpshard.open_rank(bad, 1)[name].clone())
    rewrite_checksums(bad)
    p = subprocess.run(
        [sys.executable, "-m", "tpshard", "verify", str(bad), "--source", str(src)], capture_output=True, text=True,
        timeout=300, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert "Traceback" not in p.stderr, p.stderr
    assert p.returncode == 1, p.stderr
    assert [line for line in p.stdout.splitlines() if line.startswith("FAIL ")] == [
        "FAIL model.layers.0.mlp.down_proj (RowParallelLinear, gptq): output differs from the reference"
        " (rel error up to 1) on world ranks [0, 1]"
    ], p.stderr


def test_model_level_refuses_gptq(outputs):
    """--model needs a dequantizer of the source other than tpshard's (tests/test_verify_model_quant.py);
    GPTQ has none: refused before any rank starts, naming the format."""
    src, out = outputs("gptq", "tp2")
    with pytest.raises(TpshardError, match="--model: model-level verify .* no such dequantizer for gptq checkpoints"):
        verify_many([out], [src], model=True)


@pytest.mark.parametrize("world", [4, 8])
def test_formats_pass(outputs, world):
    """Every format at tp 4 / tp 8 (some with attn-dp 2), and FP8 block misaligned at tp 8 with --pad-blocks."""
    assert_passes(DEFAULT[world], outputs)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])
def test_formats_pass_rest_of_matrix(outputs, world):
    assert_passes(REST[world], outputs)

