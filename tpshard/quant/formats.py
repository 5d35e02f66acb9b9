"""Quantized linear-layer formats: the tensor layout table, logical->physical offsets, dequantize, pack.

What this file is:
- `QuantSpec`: the numbers that fix one linear layer's layout (format, bits, group size, act order,
  symmetry, block size) — resolved per module by the caller from `quantization_config`.
- `LAYOUTS`: per format, one frozen `TensorRole` per tensor suffix saying which physical dim is the
  output (N) dim and which the input (K) dim, and how a logical index maps onto it (`Step`).
- `physical_range`: the one function that turns a logical [start, start+length) along N or K into
  the physical range of one tensor, or refuses with the numbers that do not align.
- `dequantize(spec, tensors)` -> float32 weight [N, K]; `pack_layer(spec, ...)` -> on-disk tensors
  from logical codes (for test fixtures); `random_layer(spec, n, k)` -> both, from random codes.

What it is not: no config parsing or per-module resolution (dynamic / ignore / targets), no file
I/O, no sharding policy (which projection is column- or row-parallel). All torch, CPU.

Logical convention of `pack_layer` (everything output-major, like nn.Linear.weight [N, K]):
  int formats   codes [N, K] unsigned in [0, 2**bits); scales [N, n_groups]; zeros [N, n_groups]
                unsigned (None = symmetric: 2**(bits-1)); g_idx [K] group of each k.
  fp8           codes float8_e4m3fn [N, K]; scales per layout (scalar, [N, 1], [ceil(N/bn), ceil(K/bk)]).
  int8 (W8A8)   codes int8 [N, K] (signed, no zero point); scales [N, 1] or [1], as fp8's.
  nvfp4         codes e2m1 [N, K] (uint8, sign << 3 | idx); scales e4m3 [N, K/16]; global_scale [1].
Dequantization: W[n, k] = (code - zero[n, g[k]]) * scale[n, g[k]] for int formats, computed in
float32; with act order (desc_act), g[k] = g_idx[k] (global ids, full scales); otherwise
g[k] = k // G counted from the tensor's own first k (so a row-sliced rank dequantizes alone).
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Literal, Mapping

import msgspec

from tpshard.quant.units import MARLIN_TILE, SUPPORTED_BITS

# torch (and tpshard.quant.packing, which needs it) is imported inside the functions that compute:
# planning reads only the layout table, and the CLI should not pay torch's import for it.
if TYPE_CHECKING:
    import torch

FormatName = Literal[
    "gptq",  # AutoGPTQ / GPTQModel checkpoint_format "gptq" (v1: qzeros store z - 1)
    "gptq_v2",  # GPTQModel checkpoint_format "gptq_v2" (qzeros store z)
    "awq",  # AutoAWQ version "gemm"
    "marlin",  # legacy IST-DASLab Marlin (gptq checkpoint_format "marlin")
    "fp8_block",  # quant_method "fp8" with weight_block_size (DeepSeek-V3): weight_scale_inv
    "fp8_tensor",  # quant_method "fp8" per-tensor (AutoFP8): weight_scale, input_scale
    "ct_int",  # compressed-tensors "pack-quantized"
    "ct_fp8_tensor",  # compressed-tensors "float-quantized", strategy tensor
    "ct_fp8_channel",  # ... strategy channel
    "ct_fp8_block",  # ... strategy block
    "ct_nvfp4",  # compressed-tensors "nvfp4-pack-quantized"
    "ct_int8_channel",  # compressed-tensors "int-quantized" (W8A8 int8), strategy channel: weight_scale [N, 1]
    "ct_int8_tensor",  # ... strategy tensor: weight_scale [1]
    "dsv4_fp8",  # DeepSeek-V4's release: FP8 weight + `scale` [ceil(N/128), ceil(K/128)] (ue8m0: F8_E8M0)
    "dsv4_fp4",  # DeepSeek-V4's routed experts: I8 [N, K/2] e2m1 pairs + `scale` E8M0 [N, K/32]
]

# How one logical index along N or K maps onto a physical dim (physical = logical * ratio):
#   value    one physical index per logical value (ratio 1, atom 1)
#   packed   bits/word_bits values per word (word_bits from the tensor dtype: I32 32, U8 8);
#            atom word_bits / gcd(word_bits, bits) (8 for 4-bit int32, 32 for 3-bit, 2 for fp4)
#   group    one physical index per group of G = spec.group_size values; atom G
#   block_n  one per spec.block[0] values, ceil at the tensor end; atom block[0]
#   block_k  one per spec.block[1] values; atom block[1]
#   tile     Marlin B rows: one per 16 K values; atom 16
#   marlin_n Marlin B columns: 2 int32 per output column (8 per word, 16x16 tiles); atom 64
#   perm64   Marlin s columns: ratio 1, but permuted inside 64-column chunks; atom 64
Step = Literal["value", "packed", "group", "block_n", "block_k", "tile", "marlin_n", "perm64"]
Present = Literal["always", "asym", "act_order", "static"]  # when the tensor exists


class Axis(msgspec.Struct, frozen=True):
    dim: int  # physical dim of the tensor
    step: Step


class TensorRole(msgspec.Struct, frozen=True, kw_only=True):
    """One tensor of a quantized linear `<prefix>.<suffix>` and how its physical dims map to N and K."""

    suffix: str
    dtype: str | None  # safetensors dtype; None = as on disk (model or observer dtype)
    output: Axis | None  # the dim indexing N; None = not indexed by N (replicated under column split)
    input: Axis | None  # the dim indexing K; None = not indexed by K (replicated under row split)
    present: Present = "always"
    global_values: bool = False  # g_idx: values are global group ids, never rebased
    rewrite_shape: bool = False  # weight_shape: holds [N, K]; write the per-rank shape instead


class FormatLayout(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    roles: tuple[TensorRole, ...]
    int_bits: bool  # codes are unsigned ints of spec.bits (GPTQ/AWQ/Marlin/CT int)


def _r(suffix: str, dtype: str | None, output: Axis | None, input: Axis | None, **kw) -> TensorRole:
    return TensorRole(suffix=suffix, dtype=dtype, output=output, input=input, **kw)


_GPTQ = (
    _r("qweight", "I32", Axis(1, "value"), Axis(0, "packed")),  # [K*b/32, N]
    _r("qzeros", "I32", Axis(1, "packed"), Axis(0, "group")),  # [ceil(K/G), N*b/32]
    _r("scales", None, Axis(1, "value"), Axis(0, "group")),  # [ceil(K/G), N]
    _r("g_idx", "I32", None, Axis(0, "value"), global_values=True),  # [K]
)
_FP8_BLOCK_SCALE = (Axis(0, "block_n"), Axis(1, "block_k"))  # [ceil(N/bn), ceil(K/bk)]
_FP8_WEIGHT = _r("weight", "F8_E4M3", Axis(0, "value"), Axis(1, "value"))  # [N, K]
_INT8_WEIGHT = _r("weight", "I8", Axis(0, "value"), Axis(1, "value"))  # [N, K], signed codes
_STATIC_INPUT = _r("input_scale", None, None, None, present="static")  # [1]

LAYOUTS: dict[str, FormatLayout] = {
    "gptq": FormatLayout(name="gptq", int_bits=True, roles=_GPTQ),
    "gptq_v2": FormatLayout(name="gptq_v2", int_bits=True, roles=_GPTQ),
    "awq": FormatLayout(name="awq", int_bits=True, roles=(
        _r("qweight", "I32", Axis(1, "packed"), Axis(0, "value")),  # [K, N/8], interleaved
        _r("qzeros", "I32", Axis(1, "packed"), Axis(0, "group")),  # [K/G, N/8], interleaved
        _r("scales", None, Axis(1, "value"), Axis(0, "group")),  # [K/G, N]
    )),
    "marlin": FormatLayout(name="marlin", int_bits=True, roles=(
        _r("B", "I32", Axis(1, "marlin_n"), Axis(0, "tile")),  # [K/16, 2N]
        _r("s", None, Axis(1, "perm64"), Axis(0, "group")),  # [K/G, N] or [1, N]
    )),
    "fp8_block": FormatLayout(name="fp8_block", int_bits=False, roles=(
        _FP8_WEIGHT,
        _r("weight_scale_inv", None, *_FP8_BLOCK_SCALE),
    )),
    "fp8_tensor": FormatLayout(name="fp8_tensor", int_bits=False, roles=(
        _FP8_WEIGHT,
        _r("weight_scale", "F32", None, None),  # [] or [1]
        _r("input_scale", "F32", None, None, present="static"),
    )),
    "ct_int": FormatLayout(name="ct_int", int_bits=True, roles=(
        _r("weight_packed", "I32", Axis(0, "value"), Axis(1, "packed")),  # [N, ceil(K*b/32)]
        _r("weight_scale", None, Axis(0, "value"), Axis(1, "group")),  # [N, K/G] or [N, 1]
        _r("weight_zero_point", "I32", Axis(0, "packed"), Axis(1, "group"), present="asym"),
        _r("weight_shape", "I64", None, None, rewrite_shape=True),  # [2] = [N, K]
        _r("weight_g_idx", "I32", None, Axis(0, "value"), present="act_order", global_values=True),
    )),
    "ct_fp8_tensor": FormatLayout(name="ct_fp8_tensor", int_bits=False, roles=(
        _FP8_WEIGHT,
        _r("weight_scale", None, None, None),  # [1]
        _r("input_scale", None, None, None, present="static"),
    )),
    "ct_fp8_channel": FormatLayout(name="ct_fp8_channel", int_bits=False, roles=(
        _FP8_WEIGHT,
        _r("weight_scale", None, Axis(0, "value"), None),  # [N, 1]
    )),
    "ct_fp8_block": FormatLayout(name="ct_fp8_block", int_bits=False, roles=(
        _FP8_WEIGHT,
        _r("weight_scale", None, *_FP8_BLOCK_SCALE),
    )),
    "ct_nvfp4": FormatLayout(name="ct_nvfp4", int_bits=False, roles=(
        _r("weight_packed", "U8", Axis(0, "value"), Axis(1, "packed")),  # [N, K/2]
        _r("weight_scale", "F8_E4M3", Axis(0, "value"), Axis(1, "group")),  # [N, K/16]
        _r("weight_global_scale", "F32", None, None),  # [1]
        _r("input_global_scale", "F32", None, None, present="static"),  # [1]
    )),
    "ct_int8_channel": FormatLayout(name="ct_int8_channel", int_bits=False, roles=(
        _INT8_WEIGHT,
        _r("weight_scale", None, Axis(0, "value"), None),  # [N, 1]
        _STATIC_INPUT,
    )),
    "ct_int8_tensor": FormatLayout(name="ct_int8_tensor", int_bits=False, roles=(
        _INT8_WEIGHT,
        _r("weight_scale", None, None, None),  # [1]
        _STATIC_INPUT,
    )),
    # DeepSeek-V4: `<module>.scale` (SGLang's deepseek_v4.py reads it as weight_scale_inv), F8_E8M0 or F32
    "dsv4_fp8": FormatLayout(name="dsv4_fp8", int_bits=False, roles=(
        _FP8_WEIGHT,
        _r("scale", None, *_FP8_BLOCK_SCALE),
    )),
    # Routed experts: two e2m1 codes a byte (low nibble = even k) stored as I8, one E8M0 scale per 32
    # inputs (SGLang fp8.py Fp8MoEMethod with is_fp4_experts; its DSV4_DEQUANT_FP4_TABLE)
    "dsv4_fp4": FormatLayout(name="dsv4_fp4", int_bits=False, roles=(
        _r("weight", "I8", Axis(0, "value"), Axis(1, "packed")),  # [N, K/2]
        _r("scale", None, Axis(0, "value"), Axis(1, "group")),  # [N, K/32]
    )),
}

# The suffix of the tensor holding a quantized linear's codes in some format (each layout lists it
# first): weight, qweight, B, weight_packed. A routed expert counts as present when it is.
CODES_SUFFIXES = frozenset(layout.roles[0].suffix for layout in LAYOUTS.values())

_WORD_BITS = {"I32": 32, "U8": 8, "I8": 8}
_MARLIN_CHANNELWISE_PERM = 32


class QuantSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What fixes one quantized linear's layout. Resolve per module (GPTQ `dynamic`, CT targets)."""

    format: FormatName
    bits: int = 4  # int formats: 2/3/4/8 (AWQ, Marlin, nvfp4: 4; fp8: 8)
    group_size: int = -1  # -1 = one group over all of K (channelwise); nvfp4: 16
    desc_act: bool = False  # act order: g_idx is a permutation of groups; scales indexed by g_idx
    sym: bool = True  # CT int: no weight_zero_point when True; GPTQ: zeros = 2**(bits-1)
    block: tuple[int, int] = (128, 128)  # fp8 block formats: (block_n, block_k)
    static_input: bool = False  # input_scale / input_global_scale present

    def __post_init__(self) -> None:
        if self.format not in LAYOUTS:
            raise ValueError(f"unknown quantized format {self.format!r}; known: {sorted(LAYOUTS)}")
        if LAYOUTS[self.format].int_bits and self.bits not in SUPPORTED_BITS:
            raise ValueError(f"{self.format}: bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.format in ("awq", "marlin", "ct_nvfp4") and self.bits != 4:
            raise ValueError(f"{self.format} is 4-bit only, got bits={self.bits}")
        if self.format.startswith("ct_int8_") and self.bits != 8:
            raise ValueError(f"{self.format} is 8-bit only, got bits={self.bits}")
        if self.format == "ct_nvfp4" and self.group_size != 16:
            raise ValueError(f"ct_nvfp4 has group_size 16, got {self.group_size}")
        if self.format == "dsv4_fp4" and (self.bits, self.group_size) != (4, 32):
            raise ValueError(f"dsv4_fp4 is 4-bit with group_size 32, got bits={self.bits} group_size={self.group_size}")
        if self.format == "marlin" and (self.desc_act or not self.sym):
            raise ValueError("legacy Marlin is symmetric without act order (desc_act=False, sym=True)")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 or positive, got {self.group_size}")

    @property
    def layout(self) -> FormatLayout:
        return LAYOUTS[self.format]

    def roles(self) -> tuple[TensorRole, ...]:
        """The tensors this layer has on disk (optional ones filtered by sym/desc_act/static_input)."""
        has = {"always": True, "asym": not self.sym, "act_order": self.desc_act, "static": self.static_input}
        return tuple(r for r in self.layout.roles if has[r.present])

    def role(self, suffix: str) -> TensorRole:
        for r in self.layout.roles:
            if r.suffix == suffix:
                return r
        raise KeyError(f"{self.format} has no tensor {suffix!r}; it has {[r.suffix for r in self.layout.roles]}")


def group_size_of(spec: QuantSpec, k: int) -> int:
    """The effective group size for a layer with `k` input features (-1 -> k)."""
    return k if spec.group_size == -1 else spec.group_size


def step_ratio(spec: QuantSpec, role: TensorRole, step: Step, full: int) -> tuple[Fraction, int]:
    """(physical indices per logical index, logical atom) of `step` for a dim of `full` logical values."""
    if step == "value":
        return Fraction(1), 1
    if step == "packed":
        word = _WORD_BITS[role.dtype or ""]
        return Fraction(spec.bits, word), word // math.gcd(word, spec.bits)
    if step == "group":
        g = group_size_of(spec, full)
        return Fraction(1, g), g
    if step in ("block_n", "block_k"):
        b = spec.block[0 if step == "block_n" else 1]
        return Fraction(1, b), b
    if step == "tile":
        return Fraction(1, MARLIN_TILE), MARLIN_TILE
    if step == "marlin_n":
        return Fraction(2), 64
    if step == "perm64":
        return Fraction(1), 64
    raise ValueError(f"unknown step {step!r}")


def replicated_on(spec: QuantSpec, role: TensorRole, side: Literal["output", "input"], full: int) -> bool:
    """True when a split of the logical `side` dim (N or K, `full` long) leaves this tensor whole.

    No axis on that side (g_idx under a column split, scalars); or, for a K split, group-indexed
    scales/zeros with act order (rows are addressed through g_idx, vLLM replicates them) or a single
    group (channelwise, G = K).
    """
    axis = role.output if side == "output" else role.input
    if axis is None:
        return True
    if side == "input" and axis.step == "group":
        return spec.desc_act or group_size_of(spec, full) >= full
    return False


def physical_range(
    spec: QuantSpec, role: TensorRole, side: Literal["output", "input"], start: int, length: int, full: int
) -> tuple[int, int, int] | None:
    """Map logical [start, start+length) of N (`side="output"`) or K (`"input"`) onto one tensor.

    Args:
        spec: the layer's QuantSpec.
        role: the tensor (`spec.role(suffix)`).
        side: which logical dim is split.
        start, length: the rank's logical range; `full` is the logical size of that dim.

    Returns:
        (physical dim, physical start, physical length), or None when the tensor is replicated
        (see `replicated_on`). A range ending at `full` takes the partial last word/group/block
        (ceil); any other end, and every start, must sit on the step's atom.

    Raises:
        ValueError naming the tensor, the offset and the atom when the range does not align.
    """
    if not (0 <= start and 0 < length and start + length <= full):
        raise ValueError(f"{role.suffix}: range [{start}, {start + length}) is outside [0, {full})")
    if replicated_on(spec, role, side, full):
        return None
    axis = role.output if side == "output" else role.input
    assert axis is not None
    ratio, atom = step_ratio(spec, role, axis.step, full)
    end = start + length
    if start % atom or (end % atom and end != full):
        raise ValueError(
            f"{spec.format} {role.suffix}: logical {side} range [{start}, {end}) of {full} does not sit on "
            f"the {axis.step} atom {atom} (start % {atom} = {start % atom}, end % {atom} = {end % atom}); "
            f"choose a tp whose per-rank size is a multiple of {atom}"
        )
    p_start = start * ratio
    p_end = math.ceil(end * ratio)
    assert p_start.denominator == 1
    return axis.dim, int(p_start), p_end - int(p_start)


def slice_tensors(
    spec: QuantSpec,
    tensors: Mapping[str, torch.Tensor],
    side: Literal["output", "input"],
    start: int,
    length: int,
    full: int,
) -> dict[str, torch.Tensor]:
    """One rank's tensors for a logical split, by `physical_range` (weight_shape rewritten)."""
    out = {}
    for suffix, t in tensors.items():
        role = spec.role(suffix)
        if role.rewrite_shape:
            shape = t.clone()
            shape[0 if side == "output" else 1] = length
            out[suffix] = shape
            continue
        rng = physical_range(spec, role, side, start, length, full)
        out[suffix] = t if rng is None else t.narrow(*rng).contiguous()
    return out


def alignment(spec: QuantSpec, n: int, k: int) -> tuple[int, int]:
    """(N atom, K atom): the multiples every rank's output/input offset and size must keep."""
    atoms = {"output": 1, "input": 1}
    for role in spec.roles():
        for side, axis, full in (("output", role.output, n), ("input", role.input, k)):
            if axis is None or replicated_on(spec, role, side, full):
                continue
            atoms[side] = math.lcm(atoms[side], step_ratio(spec, role, axis.step, full)[1])
    return atoms["output"], atoms["input"]


# ---- dequantize ---------------------------------------------------------------------------------

_BLOCK_SCALE_SUFFIX = {"fp8_block": "weight_scale_inv", "ct_fp8_block": "weight_scale", "dsv4_fp8": "scale"}


def _group_index(spec: QuantSpec, k: int, g_idx: torch.Tensor | None) -> torch.Tensor:
    """Group of each of the `k` input features: g_idx (act order, global ids) or k // G (local)."""
    import torch

    if spec.desc_act:
        if g_idx is None:
            raise ValueError(f"{spec.format} with act order needs g_idx")
        return g_idx.to(torch.int64)
    if spec.group_size == -1:
        return torch.zeros(k, dtype=torch.int64)
    return torch.arange(k) // spec.group_size


def _int_weight(codes, zeros, scales, groups) -> torch.Tensor:
    """codes [N, K], zeros/scales [N, n_groups], groups [K] -> float32 [N, K]."""
    import torch

    z = zeros.to(torch.float32)[:, groups]
    return (codes.to(torch.float32) - z) * scales.to(torch.float32)[:, groups]


def _block_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int]) -> torch.Tensor:
    """[ceil(N/bn), ceil(K/bk)] -> [N, K] (one scale per element)."""
    import torch

    s = scale.to(torch.float32)
    return s.repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]


def dequantize(spec: QuantSpec, tensors: Mapping[str, torch.Tensor], *, k: int | None = None) -> torch.Tensor:
    """Dequantize one linear layer's on-disk tensors (keyed by suffix) into a float32 weight [N, K].

    Works on a whole layer or on one rank's slice of it (as `slice_tensors` cuts it). `k` is needed
    only where the tensors cannot tell it: GPTQ without g_idx and K not a multiple of 32.
    """
    import torch

    import tpshard.quant.packing as packing

    t = dict(tensors)
    missing = sorted({r.suffix for r in spec.roles()} - set(t) - {"g_idx"})
    if missing:
        raise KeyError(f"{spec.format}: missing tensors {missing}; got {sorted(t)}")
    b, maxq = spec.bits, (1 << spec.bits) - 1
    f = spec.format
    if f in ("gptq", "gptq_v2"):
        n = t["scales"].shape[1]
        if k is None:
            k = t["g_idx"].shape[0] if "g_idx" in t else t["qweight"].shape[0] * 32 // b
        codes = packing.unpack_int32(t["qweight"], b, dim=0, length=k).T  # [N, K]
        zeros = packing.unpack_int32(t["qzeros"], b, dim=1, length=n).to(torch.int64)  # [K/G, N]
        if f == "gptq":
            zeros = (zeros + 1) & maxq  # v1 stores z - 1
        return _int_weight(codes, zeros.T, t["scales"].T, _group_index(spec, k, t.get("g_idx")))
    if f == "awq":
        codes = packing.unpack_awq(t["qweight"], dim=1).T  # [N, K]
        zeros = packing.unpack_awq(t["qzeros"], dim=1).T  # [N, K/G]
        return _int_weight(codes, zeros, t["scales"].T, _group_index(spec, codes.shape[1], None))
    if f == "marlin":
        codes = packing.unpack_marlin(t["B"]).T  # [N, K]
        channelwise = spec.group_size == -1
        scales = packing.unpermute_marlin_scales(t["s"], channelwise=channelwise).T  # [N, K/G]
        zeros = torch.full_like(scales, 1 << (b - 1), dtype=torch.int64)
        return _int_weight(codes, zeros, scales, _group_index(spec, codes.shape[1], None))
    if f == "ct_int":
        n, k = (int(v) for v in t["weight_shape"])
        codes = packing.unpack_int32(t["weight_packed"], b, dim=1, length=k)  # [N, K]
        scales = t["weight_scale"]  # [N, K/G]
        if spec.sym:
            zeros = torch.full(scales.shape, 1 << (b - 1), dtype=torch.int64)
        else:
            zeros = packing.unpack_int32(t["weight_zero_point"], b, dim=0, length=n)  # [N, K/G]
        return _int_weight(codes, zeros, scales, _group_index(spec, k, t.get("weight_g_idx")))
    if f in ("fp8_block", "ct_fp8_block", "dsv4_fp8"):
        w = t["weight"]
        scale = t[_BLOCK_SCALE_SUFFIX[f]]
        return w.to(torch.float32) * _block_scale(scale, *w.shape, spec.block)
    if f == "dsv4_fp4":
        values = packing.fp4_to_float(packing.unpack_fp4(t["weight"].view(torch.uint8), dim=1))  # [N, K]
        return values * t["scale"].to(torch.float32).repeat_interleave(32, 1)[:, : values.shape[1]]
    if f in ("fp8_tensor", "ct_fp8_tensor", "ct_fp8_channel", "ct_int8_channel", "ct_int8_tensor"):
        scale = t["weight_scale"].to(torch.float32)  # [], [1] or [N, 1]
        return t["weight"].to(torch.float32) * (scale.reshape(-1, 1) if scale.ndim == 2 else scale.reshape(()))
    if f == "ct_nvfp4":
        values = packing.fp4_to_float(packing.unpack_fp4(t["weight_packed"], dim=1))  # [N, K]
        scale = t["weight_scale"].to(torch.float32) / t["weight_global_scale"].to(torch.float32)  # [N, K/16]
        return values * scale.repeat_interleave(16, 1)
    raise ValueError(f"no dequantizer for {f!r}")


# ---- pack (fixtures) ----------------------------------------------------------------------------


def pack_layer(
    spec: QuantSpec,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    zeros: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
    global_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Lay out logical codes/scales/zeros (see the module docstring) as the format's on-disk tensors.

    Scales keep their dtype. Returns {suffix: tensor} with exactly `spec.roles()` (plus GPTQ g_idx).
    """
    import torch

    import tpshard.quant.packing as packing

    f, b = spec.format, spec.bits
    n, k = codes.shape
    if LAYOUTS[f].int_bits:
        g = group_size_of(spec, k)
        if zeros is None:
            zeros = torch.full(scales.shape, 1 << (b - 1), dtype=torch.int64)
        if g_idx is None:
            g_idx = torch.arange(k, dtype=torch.int32) // g
    if f in ("gptq", "gptq_v2"):
        z = zeros.to(torch.int64).T  # [K/G, N]
        if f == "gptq":
            z = (z - 1) & ((1 << b) - 1)  # v1 stores z - 1, masked per field
        return {
            "qweight": packing.pack_int32(codes.T, b, dim=0),  # [K*b/32, N]
            "qzeros": packing.pack_int32(z, b, dim=1),  # [K/G, N*b/32]
            "scales": scales.T.contiguous(),  # [K/G, N]
            "g_idx": g_idx.to(torch.int32),
        }
    if f == "awq":
        return {
            "qweight": packing.pack_awq(codes.T, dim=1),  # [K, N/8]
            "qzeros": packing.pack_awq(zeros.T, dim=1),  # [K/G, N/8]
            "scales": scales.T.contiguous(),
        }
    if f == "marlin":
        channelwise = spec.group_size == -1
        return {
            "B": packing.pack_marlin(codes.T),  # [K/16, 2N]
            "s": packing.permute_marlin_scales(scales.T.contiguous(), channelwise=channelwise),
        }
    if f == "ct_int":
        out = {
            "weight_packed": packing.pack_int32(codes, b, dim=1),  # [N, ceil(K*b/32)]
            "weight_scale": scales.contiguous(),  # [N, K/G]
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if not spec.sym:
            out["weight_zero_point"] = packing.pack_int32(zeros, b, dim=0)  # [ceil(N*b/32), K/G]
        if spec.desc_act:
            out["weight_g_idx"] = g_idx.to(torch.int32)
        return out
    if f == "dsv4_fp4":
        return {"weight": packing.pack_fp4(codes, dim=1).view(torch.int8), "scale": scales}  # [N, K/2], [N, K/32]
    if f in ("fp8_block", "fp8_tensor", "ct_fp8_tensor", "ct_fp8_channel", "ct_fp8_block", "ct_int8_channel", "ct_int8_tensor", "dsv4_fp8"):
        name = _BLOCK_SCALE_SUFFIX.get(f, "weight_scale")
        out = {"weight": codes.to(torch.int8 if f.startswith("ct_int8_") else torch.float8_e4m3fn), name: scales}
        if spec.static_input:
            out["input_scale"] = input_scale if input_scale is not None else torch.ones(1)
        return out
    if f == "ct_nvfp4":
        out = {
            "weight_packed": packing.pack_fp4(codes, dim=1),  # [N, K/2]
            "weight_scale": scales.to(torch.float8_e4m3fn),  # [N, K/16]
            "weight_global_scale": global_scale if global_scale is not None else torch.ones(1),
        }
        if spec.static_input:
            out["input_global_scale"] = input_scale if input_scale is not None else torch.ones(1)
        return out
    raise ValueError(f"no packer for {f!r}")


def _random_fp8(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random finite float8_e4m3fn values (every bit pattern except the two NaNs)."""
    import torch

    raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.int64)
    raw = torch.where((raw & 0x7F) == 0x7F, raw & 0x80, raw)  # NaN -> +-0
    return raw.to(torch.uint8).view(torch.float8_e4m3fn)


def random_layer(
    spec: QuantSpec, n: int, k: int, *, seed: int = 0, scale_dtype: torch.dtype | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random codes/scales/zeros for an [N, K] layer: (on-disk tensors, expected float32 weight).

    The expected weight is computed from the logical codes directly (no unpacking), so comparing it
    with `dequantize(spec, tensors)` tests the packers and the dequantizer together.
    """
    import torch

    import tpshard.quant.packing as packing

    scale_dtype = scale_dtype or torch.float16
    gen = torch.Generator().manual_seed(seed)
    f, b = spec.format, spec.bits
    if LAYOUTS[f].int_bits:
        g = group_size_of(spec, k)
        ng = -(-k // g)
        codes = torch.randint(0, 1 << b, (n, k), generator=gen)
        scales = (torch.rand(n, ng, generator=gen) * 0.02 + 0.001).to(scale_dtype)
        zeros = None
        if f == "awq" or (f in ("gptq", "gptq_v2", "ct_int") and not spec.sym):
            low = 1 if f == "gptq" else 0  # v1 readers that do not mask cannot read z = 0
            zeros = torch.randint(low, 1 << b, (n, ng), generator=gen)
        g_idx = torch.arange(k, dtype=torch.int32) // g
        if spec.desc_act:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        tensors = pack_layer(spec, codes, scales, zeros=zeros, g_idx=g_idx)
        z = zeros if zeros is not None else torch.full((n, ng), 1 << (b - 1))
        gi = g_idx.to(torch.int64)
        expected = (codes.float() - z.float()[:, gi]) * scales.float()[:, gi]
        return tensors, expected
    if f == "ct_nvfp4":
        codes = torch.randint(0, 16, (n, k), generator=gen)
        scales = (torch.rand(n, k // 16, generator=gen) * 4 + 0.25).to(torch.float8_e4m3fn)
        global_scale = torch.tensor([448.0 * 6.0 / 3.7])
        tensors = pack_layer(spec, codes, scales, global_scale=global_scale,
                             input_scale=torch.tensor([1.5]) if spec.static_input else None)
        expected = packing.fp4_to_float(codes) * (scales.float() / global_scale).repeat_interleave(16, 1)
        return tensors, expected
    if f == "dsv4_fp4":
        codes = torch.randint(0, 16, (n, k), generator=gen)
        scales = (2.0 ** torch.randint(-8, 3, (n, -(-k // 32)), generator=gen).float()).to(torch.float8_e8m0fnu)
        expected = packing.fp4_to_float(codes) * scales.float().repeat_interleave(32, 1)[:, :k]
        return pack_layer(spec, codes, scales), expected
    if f.startswith("ct_int8_"):
        w = torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8)
    else:
        w = _random_fp8((n, k), gen)
    if f in ("fp8_block", "ct_fp8_block", "dsv4_fp8"):
        bn, bk = spec.block
        scale = torch.rand(-(-n // bn), -(-k // bk), generator=gen, dtype=torch.float32) * 1e-3
        scale = scale.to(scale_dtype if f == "ct_fp8_block" else torch.float32)
        if f == "dsv4_fp8":  # ue8m0: powers of two
            scale = torch.exp2(torch.round(torch.log2(scale))).to(torch.float8_e8m0fnu)
        expected = w.float() * scale.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    elif f in ("ct_fp8_channel", "ct_int8_channel"):
        scale = (torch.rand(n, 1, generator=gen) * 1e-3).to(scale_dtype)
        expected = w.float() * scale.float()
    else:
        scale = torch.rand(1, generator=gen) * 1e-3
        if f == "fp8_tensor":
            scale = scale.reshape(())  # AutoFP8 stores a 0-d scalar
        expected = w.float() * scale.float()
    input_scale = torch.tensor([0.02]) if spec.static_input else None
    return pack_layer(spec, w, scale, input_scale=input_scale), expected
