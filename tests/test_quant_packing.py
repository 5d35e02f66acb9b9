"""Tests of tpshard.quant: packers against independent implementations, dequantize, slicing offsets.

What is compared with what:
- int32 and fp4 packers against compressed-tensors 0.20.1 (`pack_to_int32` / `unpack_from_int32`,
  `pack_fp4_to_uint8` / `unpack_fp4_from_uint8`), both directions, bit for bit;
- the legacy Marlin packer against a literal transcription of the published pack loop (below);
- dequantize(on-disk tensors) against the float weight computed from the logical codes;
- slicing: dequantize(tensors cut at `physical_range` offsets) == dequantize(full)[rank slice],
  bit-exact, for tp 2/4/8, and a ValueError wherever the format's atom forbids the cut; a physical
  offset moved by one word must change the result.
"""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch
from quant_fixtures import DEFAULT_SPECS, TINY, quantization_config, write_quant_checkpoint
from safetensors import safe_open

from tpshard.quant import packing
from tpshard.quant.formats import (
    LAYOUTS,
    QuantSpec,
    alignment,
    dequantize,
    pack_layer,
    physical_range,
    random_layer,
    slice_tensors,
    step_ratio,
)


def _ct(module: str):
    """A compressed-tensors module, or skip: the cross-checks need the test-pinned extra (it pins
    compressed-tensors, which requires torch>=2.10; a GPU machine may keep an older CUDA torch)."""
    pytest.importorskip("compressed_tensors", reason="install the test-pinned extra for the compressed-tensors cross-checks")
    import importlib

    return importlib.import_module(module)


def pack_to_int32(*a, **k):
    return _ct("compressed_tensors.compressors.pack_quantized.helpers").pack_to_int32(*a, **k)


def unpack_from_int32(*a, **k):
    return _ct("compressed_tensors.compressors.pack_quantized.helpers").unpack_from_int32(*a, **k)


def pack_fp4_to_uint8(*a, **k):
    return _ct("compressed_tensors.compressors.nvfp4.helpers").pack_fp4_to_uint8(*a, **k)


def unpack_fp4_from_uint8(*a, **k):
    return _ct("compressed_tensors.compressors.nvfp4.helpers").unpack_fp4_from_uint8(*a, **k)

BITS = (2, 3, 4, 8)
GEN = torch.Generator().manual_seed(1234)


def _codes(bits: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 1 << bits, shape, generator=GEN)


# ---- int32 bitstream ----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("shape", [(64, 96), (37, 50), (3, 7)])
def test_pack_int32_matches_compressed_tensors(bits, dim, shape):
    """pack_int32 == compressed-tensors pack_to_int32 (signed view), and each unpacks the other."""
    codes = _codes(bits, shape)
    signed = (codes - (1 << (bits - 1))).to(torch.int8)
    mine = packing.pack_int32(codes, bits, dim)
    theirs = pack_to_int32(signed, bits, packed_dim=dim)
    assert torch.equal(mine, theirs)
    assert torch.equal(packing.unpack_int32(theirs, bits, dim, shape[dim]).long(), codes)
    assert torch.equal(unpack_from_int32(mine, bits, torch.Size(shape), packed_dim=dim), signed)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dense", [True, False])
def test_round_trip(bits, dense):
    codes = _codes(bits, (3, 100, 5))  # 100 along the packed dim: a partial last word
    words = packing.pack_int32(codes, bits, 1, dense=dense)
    assert words.shape == (3, packing.packed_length(100, bits, dense=dense), 5)
    assert torch.equal(packing.unpack_int32(words, bits, 1, 100, dense=dense).long(), codes)


def test_dense_and_legacy_widths_differ_only_for_3_bit():
    """compressed-tensors <= 0.17 stored 32 // b values per word: 3-bit K=256 is 26 words, not 24."""
    assert packing.packed_length(256, 3) == 24 and packing.packed_length(256, 3, dense=False) == 26
    for bits in (2, 4, 8):
        c = _codes(bits, (4, 256))
        assert torch.equal(packing.pack_int32(c, bits, 1), packing.pack_int32(c, bits, 1, dense=False))


def test_3_bit_values_straddle_words():
    """Value 10 sits at bits 30..32 (words 0/1), value 21 at bits 63..65 (words 1/2)."""
    codes = torch.zeros(32, 1, dtype=torch.int64)
    codes[10] = 7
    words = packing.pack_int32(codes, 3, 0).flatten().tolist()
    assert [w & 0xFFFFFFFF for w in words] == [0xC0000000, 0x1, 0x0]
    codes[10], codes[21] = 0, 5  # 0b101: bit 63 in word 1, bits 64..65 = 0b10 in word 2
    words = packing.pack_int32(codes, 3, 0).flatten().tolist()
    assert [w & 0xFFFFFFFF for w in words] == [0x0, 0x80000000, 0x2]


@pytest.mark.parametrize("bits, word", [(4, 0x77777777), (8, 0x7F7F7F7F), (2, 0x55555555)])
def test_gptq_v1_symmetric_qzeros_constant(bits, word):
    spec = QuantSpec(format="gptq", bits=bits, group_size=64)
    tensors, _ = random_layer(spec, 64, 128)
    assert set((tensors["qzeros"].flatten() & 0xFFFFFFFF).tolist()) == {word}


def test_gptq_v1_masks_zero_point_zero():
    """(z - 1) & maxq per field: z = 0 is stored as 0xF without spilling into the neighbours."""
    spec = QuantSpec(format="gptq", bits=4, group_size=-1, sym=False)
    zeros = torch.tensor([[0], [3], [0], [15], [1], [0], [0], [2]])  # [N=8, 1 group]
    codes = torch.zeros(8, 8, dtype=torch.int64)
    tensors = pack_layer(spec, codes, torch.ones(8, 1, dtype=torch.float16), zeros=zeros)
    assert tensors["qzeros"].item() & 0xFFFFFFFF == 0x1FF0EF2F
    assert torch.equal(dequantize(spec, tensors), -zeros.float().expand(8, 8))


def test_gptq_matches_compressed_tensors_layouts():
    """GPTQ sym qweight.T == CT weight_packed; GPTQ v2 qzeros == CT weight_zero_point.T (docs/quantization.md)."""
    codes = _codes(4, (64, 128))  # [N, K]
    gptq = QuantSpec(format="gptq_v2", bits=4, group_size=32, sym=False)
    zeros = _codes(4, (64, 4))
    t = pack_layer(gptq, codes, torch.ones(64, 4, dtype=torch.float16), zeros=zeros)
    ct_packed = pack_to_int32((codes - 8).to(torch.int8), 4, packed_dim=1)
    ct_zp = pack_to_int32((zeros - 8).to(torch.int8), 4, packed_dim=0)
    assert torch.equal(t["qweight"].T, ct_packed)
    assert torch.equal(t["qzeros"], ct_zp.T)


# ---- AWQ ----------------------------------------------------------------------------------------


def test_awq_interleave():
    assert packing.pack_awq(torch.arange(8).view(1, 8)).item() == 0x75316420
    codes = _codes(4, (16, 64))
    assert torch.equal(packing.unpack_awq(packing.pack_awq(codes)).long(), codes)


# ---- legacy Marlin ------------------------------------------------------------------------------


def _marlin_reference(w: torch.Tensor, s: torch.Tensor, channelwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A literal transcription of docs/quantization.md with Python loops (codes [K, N], s [K/G, N])."""
    perm = []
    for i in range(32):
        base = []
        for beta in (0, 1):
            for row in (2 * (i % 4), 2 * (i % 4) + 1, 2 * (i % 4) + 8, 2 * (i % 4) + 9):
                base.append(16 * row + i // 4 + 8 * beta)
        for j in range(4):
            perm.extend(p + 256 * j for p in base)
    perm = [chunk[t] for chunk in (perm[c : c + 8] for c in range(0, 1024, 8)) for t in (0, 2, 4, 6, 1, 3, 5, 7)]
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    k, n = w.shape
    tiles = w.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3).reshape(k // 16, 16 * n)
    flat = tiles.reshape(-1, 1024)[:, perm].reshape(k // 16, 16 * n).tolist()
    b = torch.zeros(k // 16, 2 * n, dtype=torch.int64)
    for r, row in enumerate(flat):
        for c in range(2 * n):
            b[r, c] = sum(row[8 * c + i] << (4 * i) for i in range(8))
    b = torch.where(b >= 1 << 31, b - (1 << 32), b).to(torch.int32)
    sp = single if channelwise else scale_perm
    return b, s.reshape(-1, len(sp))[:, sp].reshape(s.shape)


@pytest.mark.parametrize("channelwise", [False, True])
def test_marlin_matches_literal_reference(channelwise):
    w = _codes(4, (32, 128))
    s = torch.rand(1 if channelwise else 2, 128, generator=GEN).half()
    ref_b, ref_s = _marlin_reference(w, s, channelwise)
    assert torch.equal(packing.pack_marlin(w), ref_b)
    assert torch.equal(packing.permute_marlin_scales(s, channelwise=channelwise), ref_s)
    assert torch.equal(packing.unpack_marlin(ref_b).long(), w)
    assert torch.equal(packing.unpermute_marlin_scales(ref_s, channelwise=channelwise), s)


def test_marlin_column_slices_commute_at_64_only():
    """pack(W[:, n0:n0+64]) == B[:, 2n0 : 2n0+128] at n0 % 64 == 0; not at 32 (docs/quantization.md)."""
    w = _codes(4, (32, 256))
    b = packing.pack_marlin(w)
    for n0 in (0, 64, 128):
        assert torch.equal(packing.pack_marlin(w[:, n0 : n0 + 64]), b[:, 2 * n0 : 2 * n0 + 128])
    assert not torch.equal(packing.pack_marlin(w[:, 32:96]), b[:, 64:192])


# ---- fp4 ----------------------------------------------------------------------------------------


def test_fp4_matches_compressed_tensors():
    codes = _codes(4, (8, 64))
    values = packing.fp4_to_float(codes)
    assert torch.equal(packing.pack_fp4(codes), pack_fp4_to_uint8(values))
    ct_values = unpack_fp4_from_uint8(packing.pack_fp4(codes), 8, 64, dtype=torch.float32)
    assert torch.equal(ct_values, values)
    assert torch.equal(packing.unpack_fp4(packing.pack_fp4(codes)).long(), codes)
    nonzero = values != 0  # +0 and -0 both decode to zero
    assert torch.equal(packing.float_to_fp4(values)[nonzero].long(), codes[nonzero])
    with pytest.raises(ValueError, match="not e2m1"):
        packing.float_to_fp4(torch.tensor([0.75]))


# ---- formats: the layout table, dequantize ------------------------------------------------------

SPECS = {
    **{f"gptq_b{b}_g{g}_act{int(a)}_sym{int(s)}": QuantSpec(format="gptq", bits=b, group_size=g, desc_act=a, sym=s)
       for b in BITS for g in (-1, 64) for a in (False, True) for s in (True, False)},
    **{f"gptq_v2_b{b}": QuantSpec(format="gptq_v2", bits=b, group_size=64, sym=False) for b in BITS},
    **{f"ct_int_b{b}_g{g}_act{int(a)}_sym{int(s)}": QuantSpec(format="ct_int", bits=b, group_size=g, desc_act=a, sym=s)
       for b in BITS for g in (-1, 64) for a in (False, True) for s in (True, False)},
    "awq": QuantSpec(format="awq", group_size=64, sym=False),
    "marlin_g128": QuantSpec(format="marlin", group_size=128),
    "marlin_channel": QuantSpec(format="marlin", group_size=-1),
    "fp8_block": QuantSpec(format="fp8_block", bits=8),
    "fp8_tensor": QuantSpec(format="fp8_tensor", bits=8, static_input=True),
    "ct_fp8_tensor": QuantSpec(format="ct_fp8_tensor", bits=8, static_input=True),
    "ct_fp8_channel": QuantSpec(format="ct_fp8_channel", bits=8),
    "ct_fp8_block": QuantSpec(format="ct_fp8_block", bits=8),
    "ct_nvfp4": QuantSpec(format="ct_nvfp4", group_size=16, static_input=True),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(SPECS))
def test_dequantize_equals_expected_and_table_matches_tensors(name):
    """dequantize(packed) == weight from logical codes; every tensor's shape/dtype follows its role."""
    spec = SPECS[name]
    n, k = 320, 256
    tensors, expected = random_layer(spec, n, k, seed=7)
    assert torch.equal(dequantize(spec, tensors), expected)
    assert set(tensors) == {r.suffix for r in spec.roles()} | ({"g_idx"} if spec.format.startswith("gptq") else set())
    for suffix, t in tensors.items():
        role = spec.role(suffix)
        if role.dtype is not None:
            assert str(t.dtype) == {"I32": "torch.int32", "I64": "torch.int64", "U8": "torch.uint8",
                                    "F32": "torch.float32", "F8_E4M3": "torch.float8_e4m3fn"}[role.dtype]  # fmt: skip
        for side, axis, full in (("output", role.output, n), ("input", role.input, k)):
            if axis is not None:
                ratio, _ = step_ratio(spec, role, axis.step, full)
                assert t.shape[axis.dim] == -(-full * ratio.numerator // ratio.denominator), (suffix, side)


def test_ct_int_dequantize_matches_compressed_tensors():
    """Our CT int dequantize == compressed-tensors' own dequantize on its own unpacked codes."""
    QuantizationArgs = _ct("compressed_tensors.quantization").QuantizationArgs
    ct_dequantize = _ct("compressed_tensors.quantization.lifecycle.forward").dequantize

    spec = QuantSpec(format="ct_int", bits=4, group_size=64, sym=False)
    tensors, _ = random_layer(spec, 128, 256, seed=3, scale_dtype=torch.float32)
    x_q = unpack_from_int32(tensors["weight_packed"], 4, torch.Size([128, 256]))
    zp = unpack_from_int32(tensors["weight_zero_point"], 4, torch.Size([128, 4]), packed_dim=0)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=64)
    theirs = ct_dequantize(x_q, tensors["weight_scale"], zp, args, dtype=torch.float32)
    torch.testing.assert_close(dequantize(spec, tensors), theirs, rtol=0, atol=1e-6)


# ---- slicing ------------------------------------------------------------------------------------

SLICE_N, SLICE_K = 512, 512


def _rank_slices(side: str, tp: int):
    """(rank, size, start, full) of each rank's even share of N or K."""
    full = SLICE_N if side == "output" else SLICE_K
    size = full // tp
    for rank in range(tp):
        yield rank, size, rank * size, full


# Every format, every bits value, act order and channelwise; symmetric int variants only where the
# zero-point tensor does not change the slicing (it is always present in GPTQ).
SLICE_SPECS = sorted(
    name for name, spec in SPECS.items()
    if not (spec.format in ("gptq", "ct_int") and spec.sym and (spec.group_size != -1 or spec.format == "gptq"))
    or name in ("gptq_b4_g64_act0_sym1", "ct_int_b4_g64_act0_sym1", "ct_int_b4_g64_act1_sym1")
)  # fmt: skip


@functools.lru_cache(maxsize=None)
def _full_layer(name: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    spec = SPECS[name]
    tensors, _ = random_layer(spec, SLICE_N, SLICE_K, seed=11)
    return tensors, dequantize(spec, tensors)


@pytest.mark.parametrize("tp", [2, 4, 8])
@pytest.mark.parametrize("side", ["output", "input"])
@pytest.mark.parametrize("name", SLICE_SPECS)
def test_slice_at_physical_offsets_equals_slice_of_dequant(name, side, tp):
    """dequantize(tensors cut at physical_range) == dequantize(full)[rank slice], bit-exact; or refused."""
    spec = SPECS[name]
    tensors, full_w = _full_layer(name)
    n_atom, k_atom = alignment(spec, SLICE_N, SLICE_K)
    atom = n_atom if side == "output" else k_atom
    for rank, size, start, full in _rank_slices(side, tp):
        if size % atom:
            with pytest.raises(ValueError, match="does not sit on the"):
                slice_tensors(spec, tensors, side, start, size, full)
            continue
        part = slice_tensors(spec, tensors, side, start, size, full)
        want = full_w[start : start + size] if side == "output" else full_w[:, start : start + size]
        assert torch.equal(dequantize(spec, part), want), (name, side, tp, rank)


# (spec, side, tensor shifted): each cut moved by one physical index must change the result.
OFF_BY_ONE = [
    ("gptq_b4_g64_act0_sym1", "input", "qweight"),
    ("gptq_b3_g64_act0_sym0", "input", "qweight"),
    ("gptq_b4_g64_act0_sym0", "output", "qzeros"),
    ("awq", "output", "qweight"),
    ("ct_int_b4_g64_act0_sym0", "input", "weight_packed"),
    ("ct_int_b2_g64_act0_sym0", "output", "weight_zero_point"),
    ("marlin_g128", "output", "B"),
    ("fp8_block", "input", "weight_scale_inv"),
    ("ct_nvfp4", "input", "weight_packed"),
]


@pytest.mark.parametrize("name, side, suffix", OFF_BY_ONE)
def test_off_by_one_physical_offset_is_detected(name, side, suffix):
    """Rank 1 of tp 2 with one tensor cut one word (or row/column) early: dequantize must differ."""
    spec = SPECS[name]
    tensors, _ = _full_layer(name)
    full = SLICE_N if side == "output" else SLICE_K
    want = dequantize(spec, slice_tensors(spec, tensors, side, full // 2, full // 2, full))
    part = slice_tensors(spec, tensors, side, full // 2, full // 2, full)
    dim, start, length = physical_range(spec, spec.role(suffix), side, full // 2, full // 2, full)
    part[suffix] = tensors[suffix].narrow(dim, start - 1, length).contiguous()
    assert not torch.equal(dequantize(spec, part), want)


@pytest.mark.parametrize(
    "name, suffix, side, start, length, full, expect",
    [
        ("gptq_b4_g64_act0_sym1", "qweight", "input", 256, 256, 512, (0, 32, 32)),
        ("gptq_b3_g64_act0_sym1", "qweight", "input", 256, 256, 512, (0, 24, 24)),
        ("gptq_b3_g64_act0_sym1", "qzeros", "output", 64, 64, 512, (1, 6, 6)),
        ("gptq_b4_g64_act0_sym1", "scales", "input", 128, 128, 512, (0, 2, 2)),
        ("gptq_b4_g64_act1_sym1", "scales", "input", 128, 128, 512, None),  # act order: replicated
        ("gptq_b4_g-1_act0_sym1", "qzeros", "input", 128, 128, 512, None),  # channelwise: replicated
        ("gptq_b4_g64_act1_sym1", "g_idx", "input", 128, 128, 512, (0, 128, 128)),
        ("gptq_b4_g64_act1_sym1", "g_idx", "output", 128, 128, 512, None),
        ("awq", "qweight", "output", 64, 64, 512, (1, 8, 8)),
        ("marlin_g128", "B", "output", 128, 64, 512, (1, 256, 128)),
        ("marlin_g128", "B", "input", 128, 128, 512, (0, 8, 8)),
        ("fp8_block", "weight_scale_inv", "output", 256, 64, 320, (0, 2, 1)),  # tensor end: ceil
        ("ct_int_b3_g64_act0_sym0", "weight_packed", "input", 224, 32, 256, (1, 21, 3)),
        ("ct_int_b4_g64_act0_sym0", "weight_zero_point", "output", 8, 8, 64, (0, 1, 1)),
        ("ct_int_b4_g64_act0_sym0", "weight_shape", "output", 8, 8, 64, None),
        ("ct_nvfp4", "weight_scale", "input", 32, 16, 64, (1, 2, 1)),
        ("ct_fp8_tensor", "weight_scale", "output", 32, 16, 64, None),
    ],
)  # fmt: skip
def test_physical_range_examples(name, suffix, side, start, length, full, expect):
    spec = SPECS[name]
    assert physical_range(spec, spec.role(suffix), side, start, length, full) == expect


@pytest.mark.parametrize(
    "name, suffix, side, start, length, full, atom",
    [
        ("marlin_g128", "B", "output", 32, 64, 512, 64),
        ("marlin_g128", "s", "output", 32, 64, 512, 64),
        ("fp8_block", "weight_scale_inv", "output", 64, 64, 1152, 128),  # 1152 rows at tp 18
        ("fp8_block", "weight_scale_inv", "output", 576, 576, 1152, 128),  # docs/quantization.md rank 1
        ("gptq_b3_g64_act0_sym1", "qweight", "input", 8, 24, 512, 32),
        ("gptq_b4_g64_act0_sym1", "qweight", "input", 4, 8, 512, 8),
        ("gptq_b4_g64_act0_sym1", "scales", "input", 32, 64, 512, 64),
        ("awq", "qzeros", "output", 4, 8, 512, 8),
        ("ct_nvfp4", "weight_scale", "input", 8, 16, 64, 16),
    ],
)  # fmt: skip
def test_physical_range_refuses_misaligned(name, suffix, side, start, length, full, atom):
    spec = SPECS[name]
    with pytest.raises(ValueError, match=f"atom {atom} "):
        physical_range(spec, spec.role(suffix), side, start, length, full)


def test_alignment_table():
    assert alignment(SPECS["gptq_b3_g64_act0_sym1"], 512, 512) == (32, 64)
    assert alignment(SPECS["gptq_b4_g64_act1_sym1"], 512, 512) == (8, 8)  # act order: scales whole
    assert alignment(SPECS["marlin_g128"], 512, 512) == (64, 128)
    assert alignment(SPECS["fp8_block"], 512, 512) == (128, 128)
    assert alignment(SPECS["ct_nvfp4"], 512, 512) == (1, 16)
    assert alignment(SPECS["ct_int_b4_g-1_act0_sym1"], 512, 512) == (1, 8)


def test_layout_table_is_data():
    """Every role of every format names a dim for N and/or K, or is a scalar / shape / g_idx."""
    for layout in LAYOUTS.values():
        suffixes = [r.suffix for r in layout.roles]
        assert len(suffixes) == len(set(suffixes)), layout.name
        for r in layout.roles:
            dims = [a.dim for a in (r.output, r.input) if a is not None]
            assert len(dims) == len(set(dims)), (layout.name, r.suffix)


# ---- fixture checkpoints ------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(DEFAULT_SPECS))
def test_fixture_checkpoint(tmp_path, name):
    """The tiny checkpoint has real config keys, the layout's tensors, and dequantizes to `expected`."""
    from transformers.quantizers.auto import AutoQuantizationConfig

    spec = DEFAULT_SPECS[name]
    t0 = time.perf_counter()
    expected = write_quant_checkpoint(tmp_path, spec, num_files=2 if name == "gptq" else 1)
    assert time.perf_counter() - t0 < 5.0  # ~0.1-0.2 s on an idle core; slack for loaded CI machines
    config = json.loads((tmp_path / "config.json").read_text())
    qcfg = config["quantization_config"]
    assert qcfg == quantization_config(spec)
    # transformers (through compressed-tensors 0.20.1 for CT configs) parses it; compressed-tensors
    # 0.20 rejects actorder "group" (weight_g_idx checkpoints of older releases), so that one is skipped.
    if not (qcfg["quant_method"] == "compressed-tensors" and spec.desc_act):
        AutoQuantizationConfig.from_dict(dict(qcfg))
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == (2 if name == "gptq" else 1)
    tensors = {}
    for f in files:
        with safe_open(f, "pt") as fh:
            tensors.update({key: fh.get_tensor(key) for key in fh.keys()})
    assert tensors["lm_head.weight"].shape == (TINY.vocab, TINY.hidden)
    assert "model.norm.weight" in tensors and "model.embed_tokens.weight" in tensors
    assert len(expected) == 7 * TINY.layers
    for prefix, weight in expected.items():
        layer = {key.removeprefix(prefix + "."): t for key, t in tensors.items() if key.startswith(prefix + ".")}
        assert torch.equal(dequantize(spec, layer), weight), prefix
