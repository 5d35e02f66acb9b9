"""Bit packing of quantized codes into the words that quantized checkpoints store.

What this file is: pure, vectorised torch functions that turn integer codes into the packed words of
each on-disk layout and back, bit for bit:

- `pack_int32` / `unpack_int32`: the dense little-endian bitstream of GPTQ and compressed-tensors
  (>= 0.18): value j along the packed dim starts at global bit b*j (word b*j // 32, bit b*j % 32),
  and 3-bit values straddle word boundaries. `dense=False` gives the pre-0.18 compressed-tensors
  layout (32 // b values per word, unused high bits).
- `pack_awq` / `unpack_awq`: AutoAWQ GEMM, 4-bit along N, nibble i of word c holds column
  8c + AWQ_ORDER[i].
- `pack_marlin` / `unpack_marlin`, `permute_marlin_scales` / `unpermute_marlin_scales`: the legacy
  IST-DASLab Marlin layout (B [K/16, 2N], 16x16 tiles, 1024-element permutation, scale permutations).
- `pack_fp4` / `unpack_fp4`, `fp4_to_float` / `float_to_fp4`: e2m1 codes two per byte (low nibble =
  even index), as nvfp4/mxfp4 store them.

What it is not: no scales, zero points or dequantization (tpshard.quant.formats), no file I/O, no
slicing rules. Codes are unsigned integers in [0, 2**bits); the signed view of compressed-tensors'
helpers is `code - 2**(bits - 1)`.
"""

from __future__ import annotations

import functools

import torch

from tpshard.quant.units import MARLIN_TILE, SUPPORTED_BITS

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # inverse permutation of AWQ_ORDER
MARLIN_PERM_LEN = 1024  # the weight permutation acts on 1024-element chunks = 64 output columns
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of e2m1 code idx; bit 3 = sign

_MASK32 = (1 << 32) - 1


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits (two's complement)."""
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def packed_length(length: int, bits: int, *, dense: bool = True) -> int:
    """Number of int32 words that hold `length` values of `bits` bits along the packed dim."""
    _check_bits(bits)
    if dense:
        return -(-length * bits // 32)
    return -(-length // (32 // bits))


@functools.lru_cache(maxsize=None)
def _bit_positions(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the 32 values of one run of `bits` words: (word index, bit offset) of each value."""
    start = torch.arange(32, dtype=torch.int64) * bits
    return start // 32, start % 32


def pack_int32(codes: torch.Tensor, bits: int, dim: int = 0, *, dense: bool = True) -> torch.Tensor:
    """Pack unsigned `bits`-bit codes into int32 words along `dim`.

    Args:
        codes: integer tensor, values in [0, 2**bits).
        bits: 2, 3, 4 or 8.
        dim: the dim to pack (GPTQ qweight: 0; GPTQ qzeros and compressed-tensors weight_packed: 1).
        dense: the GPTQ / compressed-tensors >= 0.18 bitstream (True) or the compressed-tensors
            <= 0.17 layout with 32 // bits values per word and unused high bits (False).

    Returns:
        int32 tensor, `codes.shape` with `dim` replaced by `packed_length(codes.shape[dim], bits)`;
        a partial last word is zero-filled.

    Example:
        >>> pack_int32(torch.tensor([[1], [2], [3], [4], [5], [6], [7], [8]]), 4, dim=0)
        tensor([[-2023406815]], dtype=torch.int32)  # 0x87654321
    """
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"codes must be an integer tensor, got {codes.dtype}")
    x = codes.movedim(dim, -1).to(torch.int64)
    lo, hi = torch.aminmax(x) if x.numel() else (torch.tensor(0), torch.tensor(0))
    if int(lo) < 0 or int(hi) >= (1 << bits):
        raise ValueError(f"{bits}-bit codes must lie in [0, {1 << bits}), got [{int(lo)}, {int(hi)}]")
    length = x.shape[-1]
    n_words = packed_length(length, bits, dense=dense)
    if not dense or 32 % bits == 0:  # no value straddles a word: the two layouts coincide
        per = 32 // bits
        x = torch.nn.functional.pad(x, (0, n_words * per - length))
        x = x.reshape(*x.shape[:-1], n_words, per)  # [..., W, per]
        shifts = torch.arange(per, dtype=torch.int64) * bits
        words = (x << shifts).sum(-1)  # bits are disjoint: sum == or
        return _to_int32(words).movedim(-1, dim).contiguous()
    runs = -(-length // 32)
    x = torch.nn.functional.pad(x, (0, runs * 32 - length))
    x = x.reshape(*x.shape[:-1], runs, 32)  # [..., R, 32]: one run of 32 values fills `bits` words
    word, offset = _bit_positions(bits)
    shifted = x << offset  # < 2**39, exact in int64
    low, high = shifted & _MASK32, shifted >> 32  # high != 0 only for values straddling a word
    parts = []
    for j in range(bits):  # a loop over the `bits` words of a run, not over values
        mine = (word == j).nonzero().flatten()  # values starting in word j: a contiguous run
        w = low[..., int(mine[0]) : int(mine[-1]) + 1].sum(-1)  # bits are disjoint: sum == or
        if j > 0:
            w = w + high[..., int(mine[0]) - 1]  # the value that started in word j - 1 spills here
        parts.append(w)
    words = torch.stack(parts, dim=-1)  # [..., R, bits]
    words = words.reshape(*x.shape[:-2], runs * bits)[..., :n_words]  # [..., W]
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_int32(
    words: torch.Tensor, bits: int, dim: int = 0, length: int | None = None, *, dense: bool = True
) -> torch.Tensor:
    """Unpack int32 words along `dim` into unsigned codes (uint8), the inverse of `pack_int32`.

    Args:
        words: int32 tensor.
        bits: 2, 3, 4 or 8.
        dim: the packed dim.
        length: number of values to return along `dim`; default all that fit
            (`words.shape[dim] * 32 // bits` dense).
        dense: as in `pack_int32`.

    Returns:
        uint8 tensor of codes in [0, 2**bits), `words.shape` with `dim` replaced by `length`.
        Cast before subtracting zero points (uint8 arithmetic wraps).
    """
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise TypeError(f"packed words must be int32, got {words.dtype}")
    w = words.movedim(dim, -1).to(torch.int64) & _MASK32
    n_words = w.shape[-1]
    if not dense or 32 % bits == 0:  # no value straddles a word
        per = 32 // bits
        full = n_words * per
        shifts = torch.arange(per, dtype=torch.int64) * bits
        codes = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., W, per]
        codes = codes.reshape(*w.shape[:-1], full)
    else:
        runs = -(-n_words // bits)
        full = n_words * 32 // bits
        w = torch.nn.functional.pad(w, (0, runs * bits - n_words + 1))  # +1 spare word for spills
        word, offset = _bit_positions(bits)
        base = (torch.arange(runs, dtype=torch.int64) * bits).unsqueeze(-1)  # [R, 1]
        lo = w[..., base + word]  # [..., R, 32]
        hi = w[..., base + word + 1]
        codes = ((lo >> offset) | (hi << (32 - offset))) & ((1 << bits) - 1)
        codes = codes.reshape(*w.shape[:-1], runs * 32)
    if length is None:
        length = full
    if length > full:
        raise ValueError(f"{n_words} words of {bits}-bit codes hold at most {full} values, asked for {length}")
    return codes[..., :length].to(torch.uint8).movedim(-1, dim).contiguous()


# ---- AWQ (GEMM): 4-bit, packed along N, interleaved nibbles -----------------------------------


def pack_awq(codes: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Pack 4-bit codes along `dim` (N; a multiple of 8) in AutoAWQ's interleaved nibble order."""
    x = codes.movedim(dim, -1)
    n = x.shape[-1]
    if n % 8:
        raise ValueError(f"AWQ packs 8 columns per word; the packed dim has {n} columns (n % 8 = {n % 8})")
    x = x.reshape(*x.shape[:-1], n // 8, 8)[..., list(AWQ_ORDER)]  # [..., N/8, 8] nibble order
    return pack_int32(x.reshape(*x.shape[:-2], n), 4, dim=-1).movedim(-1, dim).contiguous()


def unpack_awq(words: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Unpack AutoAWQ words along `dim` into 4-bit codes in column order (uint8)."""
    x = unpack_int32(words, 4, dim=dim).movedim(dim, -1)
    n = x.shape[-1]
    x = x.reshape(*x.shape[:-1], n // 8, 8)[..., list(AWQ_REVERSE_ORDER)]  # [..., N/8, 8] columns
    return x.reshape(*x.shape[:-2], n).movedim(-1, dim).contiguous()


# ---- legacy Marlin (IST-DASLab) -----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def marlin_perms() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight perm [1024], grouped scale perm [64], channelwise scale perm [32]); new[t] = old[perm[t]]."""
    i = torch.arange(32).view(32, 1, 1, 1)  # one i per 32 entries
    j = torch.arange(4).view(1, 4, 1, 1)  # 4 copies, +256 each
    beta = torch.arange(2).view(1, 1, 2, 1)  # outer loop of base(i)
    m = i % 4
    rows = torch.stack([2 * m, 2 * m + 1, 2 * m + 8, 2 * m + 9], dim=-1).view(32, 1, 1, 4)  # inner loop
    perm = 16 * rows + i // 4 + 8 * beta + 256 * j  # [32, 4, 2, 4]
    perm = perm.reshape(-1, 8)[:, list(AWQ_ORDER)].reshape(-1)  # same [0,2,4,6,1,3,5,7] interleave
    a, b = torch.arange(8).view(8, 1), torch.arange(8).view(1, 8)
    scale_perm = (a + 8 * b).reshape(-1)  # scale_perm[8i + j] = i + 8j: an 8x8 transpose
    single = torch.tensor([0, 1, 8, 9, 16, 17, 24, 25])
    scale_perm_single = (2 * torch.arange(4).view(4, 1) + single).reshape(-1)  # [8i + t] = 2i + J[t]
    return perm, scale_perm, scale_perm_single


def pack_marlin(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [K, N] (K % 16 == 0, N % 64 == 0) into the legacy Marlin B [K/16, 2N] int32."""
    k, n = codes.shape
    if k % MARLIN_TILE or n % 64:
        raise ValueError(f"Marlin needs K % 16 == 0 and N % 64 == 0, got K={k}, N={n}")
    perm = marlin_perms()[0]
    t = codes.reshape(k // 16, 16, n // 16, 16).permute(0, 2, 1, 3)  # [K/16, N/16, 16, 16] tiles
    t = t.reshape(-1, MARLIN_PERM_LEN)[:, perm]  # [K*N/1024, 1024] permuted chunks
    return pack_int32(t.reshape(k // 16, 16 * n), 4, dim=1)  # [K/16, 2N]


def unpack_marlin(b: torch.Tensor) -> torch.Tensor:
    """Unpack a legacy Marlin B [K/16, 2N] into 4-bit codes [K, N] (uint8)."""
    rows, cols = b.shape
    k, n = rows * 16, cols // 2
    inverse = torch.argsort(marlin_perms()[0])
    t = unpack_int32(b, 4, dim=1)  # [K/16, 16N]
    t = t.reshape(-1, MARLIN_PERM_LEN)[:, inverse]  # [K*N/1024, 1024] tile order
    t = t.reshape(rows, n // 16, 16, 16).permute(0, 2, 1, 3)  # [K/16, 16, N/16, 16]
    return t.reshape(k, n).contiguous()


def permute_marlin_scales(s: torch.Tensor, *, channelwise: bool) -> torch.Tensor:
    """Scales [K/G or 1, N] -> the on-disk Marlin `s`: 64-column (grouped) or 32-column chunks permuted."""
    _, grouped, single = marlin_perms()
    perm = single if channelwise else grouped
    return s.reshape(-1, perm.numel())[:, perm].reshape(s.shape).contiguous()


def unpermute_marlin_scales(s: torch.Tensor, *, channelwise: bool) -> torch.Tensor:
    """The inverse of `permute_marlin_scales`."""
    _, grouped, single = marlin_perms()
    inverse = torch.argsort(single if channelwise else grouped)
    return s.reshape(-1, inverse.numel())[:, inverse].reshape(s.shape).contiguous()


# ---- FP4 (e2m1) ---------------------------------------------------------------------------------


def pack_fp4(codes: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Pack 4-bit e2m1 codes two per uint8 along `dim` (even length): low nibble = even index."""
    x = codes.movedim(dim, -1).to(torch.uint8)
    if x.shape[-1] % 2:
        raise ValueError(f"fp4 packs pairs; the packed dim has odd length {x.shape[-1]}")
    if x.numel() and int(x.max()) > 15:
        raise ValueError(f"fp4 codes must lie in [0, 16), got max {int(x.max())}")
    x = x.reshape(*x.shape[:-1], -1, 2)  # [..., K/2, 2]
    return (x[..., 0] | (x[..., 1] << 4)).movedim(-1, dim).contiguous()


def unpack_fp4(packed: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Unpack uint8 pairs along `dim` into e2m1 codes (uint8), the inverse of `pack_fp4`."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed fp4 must be uint8, got {packed.dtype}")
    x = packed.movedim(dim, -1)
    x = torch.stack([x & 0xF, x >> 4], dim=-1)  # [..., K/2, 2]
    return x.reshape(*x.shape[:-2], -1).movedim(-1, dim).contiguous()


def fp4_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (sign << 3 | idx) -> float32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    return table[codes.to(torch.int64)]


def float_to_fp4(values: torch.Tensor) -> torch.Tensor:
    """float values exactly representable in e2m1 -> codes (uint8); raises on any other value."""
    v = values.to(torch.float32)
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    idx = (v.abs().unsqueeze(-1) == mags).to(torch.uint8).argmax(-1).to(torch.uint8)
    if not torch.equal(mags[idx.to(torch.int64)], v.abs()):
        bad = v[mags[idx.to(torch.int64)] != v.abs()]
        raise ValueError(f"{bad.numel()} values are not e2m1 (e.g. {bad.flatten()[0].item()})")
    return idx | (torch.signbit(v).to(torch.uint8) << 3)
