"""DeepSeek-V4's released quantized form, made with torch from the bf16 tiny V4 (tests/v4_checkpoint.py).

The release's config.json quantization_config {quant_method fp8, fmt e4m3, scale_fmt ue8m0,
weight_block_size [128, 128], activation_scheme dynamic} and its top-level expert_dtype "fp4":
- FP8 linears: `<module>.weight` float8_e4m3fn [N, K] and `<module>.scale` float8_e8m0fnu
  [ceil(N/128), ceil(K/128)], one power-of-two scale per 128x128 block (partial blocks at the end);
  here wq_a, wkv, wq_b, wo_a, wo_b, the indexer's wq_b, the shared experts and the MTP e_proj / h_proj.
- FP4 routed experts: `weight` int8 [N, K/2], two e2m1 codes a byte (low nibble = even k), and
  `scale` float8_e8m0fnu [N, K/32] (SGLang fp8.py's DSV4_DEQUANT_FP4_TABLE reads them so).
- bf16 as before: the embedding, head, router, norms, the compressors and the indexer's weights_proj.

Written here, independently of tpshard.quant: the quantizers and `dequant_fp8` / `dequant_fp4`
(SGLang deepseek_v4.py _dequant_fp8, fp8.py's FP4 table) that the tests compare ranks with.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from test_moe_split import source_tensors
from v4_checkpoint import make_v4, save_native

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
# Dims whose cuts sit on 128-blocks at tp 2/4/8: wq_b 8 heads x 128, wo_a 8 groups x 128 rows,
# the shared expert's 1024 over tp 8 and the routed experts' over moe_tp up to 8.
ALIGNED = dict(hidden_size=256, head_dim=128, o_groups=8, o_lora_rank=128, moe_intermediate_size=1024, q_lora_rank=128)
FP8 = re.compile(r"\.attn\.(wq_a|wkv|wq_b|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$|^mtp\.0\.[eh]_proj\.weight$")
FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
TABLE = torch.cat([E2M1, -E2M1])  # code = sign << 3 | magnitude index


def pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(x.clamp(min=2.0**-100))))


def quant_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    bn, bk = -(-n // 128), -(-k // 128)
    padded = torch.zeros(bn * 128, bk * 128)
    padded[:n, :k] = w.float()
    blocks = padded.view(bn, 128, bk, 128)
    scale = pow2_at_least(blocks.abs().amax(dim=(1, 3)) / 448.0)  # ue8m0: a power of two
    q = (blocks / scale[:, None, :, None]).view(bn * 128, bk * 128)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    scale = pow2_at_least(groups.abs().amax(dim=2) / 6.0)
    x = groups / scale[:, :, None]
    idx = (x.abs().unsqueeze(-1) - E2M1).abs().argmin(-1)  # nearest e2m1 magnitude
    codes = (idx | ((x < 0).to(torch.int64) << 3)).view(n, k)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequant_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return weight.float() * s[: weight.shape[0], : weight.shape[1]]


def dequant_fp4(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = weight.view(torch.uint8).to(torch.int64)
    values = torch.stack([TABLE[b & 0xF], TABLE[b >> 4]], dim=-1).flatten(1)
    return values * scale.float().repeat_interleave(32, 1)


def quantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        q = quant_fp8 if FP8.search(name) else quant_fp4 if FP4.search(name) else None
        if q is None:
            out[name] = t
            continue
        out[name], out[name.removesuffix("weight") + "scale"] = q(t)
    return out


def make_v4_quant(path: Path, *, aligned: bool = True, **overrides) -> Path:
    """The tiny V4 (with ALIGNED dims, or tests/v4_checkpoint.py's own) in the release's FP8 + FP4 form."""
    bf16 = make_v4(path.with_name(path.name + "-bf16"), **(ALIGNED if aligned else {}), **overrides)
    config = json.loads((bf16 / "config.json").read_text())
    config |= {"quantization_config": QUANT, "expert_dtype": "fp4"}
    return save_native(path, quantize(source_tensors(bf16)), config)
