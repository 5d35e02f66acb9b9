"""DeepSeek's multi-head latent attention (MLA) over attention TP: its projection layers and its math.

The cut is SGLang's `DeepseekV2AttentionMLA` (sglang/srt/models/deepseek_v2.py, docs/contracts.md):

- `q_a_proj` [q_lora, H], `kv_a_proj_with_mqa` [kv_lora + rope, H] and the norms `q_a_layernorm`,
  `kv_a_layernorm` are replicated: every rank computes the same latents;
- `q_b_proj` [nh (nope + rope), q_lora] (or `q_proj` [nh (nope + rope), H] when q_lora_rank is
  null) and `kv_b_proj` [nh (nope + v), kv_lora] are column-parallel by heads over attn_tp: group
  rank a holds heads [a nh/attn_tp, (a + 1) nh/attn_tp), a contiguous row range since HF stores
  them head-major;
- `o_proj` [H, nh v] is row-parallel over attn_tp (columns of the same heads), all-reduced there.

There are no kv-head replicas: the single latent kv is replicated, each rank expands it into its
own heads with its rows of kv_b_proj. The attention math is transformers' DeepseekV3Attention:
RoPE on the last `qk_rope_head_dim` of each q head and on the shared k_rot (interleaved pairs when
`rope_interleave`), scores scaled by `softmax_scale` (qk_head_dim^-0.5, times mscale^2 under yarn
rope scaling), causal softmax, values per head.

Not here: the rope tables (the caller passes cos/sin), which tensors a rank holds (the plan).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpshard.runtime.groups import LogicalGroup
from tpshard.runtime.layers import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear, divide


@dataclass(frozen=True)
class MLAConfig:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: q_proj straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    softmax_scale: float = 0.0  # 0: qk_head_dim ** -0.5
    rope_interleave: bool = True
    bias: bool = False  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj biases

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def scale(self) -> float:
        return self.softmax_scale or self.qk_head_dim**-0.5

    @classmethod
    def from_hf(cls, config: dict) -> MLAConfig:
        """From a DeepSeek-V2/V3 config.json, with transformers' softmax scale (yarn_apply_mscale)."""
        qk_head = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
        scale = qk_head**-0.5
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default" and rope.get("mscale_all_dim"):
            m = yarn_mscale(rope["factor"], rope["mscale_all_dim"])
            scale *= m * m
        return cls(
            hidden_size=config["hidden_size"], num_heads=config["num_attention_heads"], q_lora_rank=config.get("q_lora_rank"),
            kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)), softmax_scale=scale,
            # transformers' DeepseekV3 default is interleaved; V2 rotates pairs as complex numbers (the same scores)
            rope_interleave=bool(config.get("rope_interleave", True)), bias=bool(config.get("attention_bias", False)),
        )  # fmt: skip


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight.to(x.dtype) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [B, heads, S, d] rotated by cos/sin [S, d] (= cat(freqs, freqs), already scaled).

    interleave: pairs (x0, x1), (x2, x3), ... each rotated by one frequency, the result laid out
    [rotated evens | rotated odds] (transformers' apply_rotary_pos_emb_interleave); else halves.
    """
    if interleave:
        c, s = cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]  # [S, d/2]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class MLAAttention(nn.Module):
    """One rank's MLA: replicated latent projections, its heads of q_b / kv_b / o over `group` (attn_tp).

    Layers, by their engine names (SGLang fuses q_a_proj and kv_a_proj_with_mqa into one replicated
    layer when q_lora_rank is set):
      fused_qkv_a_proj_with_mqa  replicated, pieces "q_a" [q_lora, H] and "kv_a" [kv_lora + rope, H]
      (q_lora_rank null: q_proj column over `group`, kv_a_proj_with_mqa replicated)
      q_b_proj, kv_b_proj        column over `group`, by heads
      o_proj                     row over `group`, all-reduced there
    plus the replicated norm weights q_a_layernorm [q_lora] and kv_a_layernorm [kv_lora].
    Built empty here (load with `load_shard`), or from `layers` already built and loaded elsewhere
    (verify builds them from the manifest).
    """

    def __init__(
        self,
        cfg: MLAConfig,
        *,
        group: LogicalGroup,
        dtype: torch.dtype | None = None,
        name: str = "self_attn",
        layers: dict[str, nn.Module] | None = None,
        norms: dict[str, torch.Tensor] | None = None,
    ):
        super().__init__()
        self.cfg, self.group, self.name = cfg, group, name
        self.num_local_heads = divide(cfg.num_heads, group.size, f"{name}: attention heads over the {group.name} group")
        dt = dtype if dtype is not None else torch.get_default_dtype()
        self._norms_loaded: set[str] = set()
        if layers is not None:
            missing = sorted(set(self.layer_names()) - set(layers))
            if missing:
                raise ValueError(f"{name}: MLA needs layers {missing}")
            self.mla_layers = nn.ModuleDict({n: layers[n] for n in self.layer_names()})
            self.mla_layers["o_proj"].input_is_parallel = True  # it gets this rank's heads only
            for n in self.norm_names():
                if norms is None or n not in norms:
                    raise ValueError(f"{name}: MLA needs the norm weight {n}")
                self.register_buffer(n, norms[n].to(dt))
                self._norms_loaded.add(n)
            return
        one = LogicalGroup.single(group.world_rank)  # replicated: no cut, no collective
        h, nh = cfg.hidden_size, cfg.num_heads
        built: dict[str, nn.Module] = {}
        if cfg.q_lora_rank is None:
            built["q_proj"] = ColumnParallelLinear(h, nh * cfg.qk_head_dim, group=group, dtype=dt, name=f"{name}.q_proj")
            built["kv_a_proj_with_mqa"] = ColumnParallelLinear(
                h, cfg.kv_lora_rank + cfg.qk_rope_head_dim, group=one, bias=cfg.bias, dtype=dt, name=f"{name}.kv_a_proj_with_mqa"
            )  # fmt: skip
        else:
            built["fused_qkv_a_proj_with_mqa"] = MergedColumnParallelLinear(
                h, [cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim], group=one, bias=cfg.bias,
                piece_names=("q_a", "kv_a"), dtype=dt, name=f"{name}.fused_qkv_a_proj_with_mqa",
            )  # fmt: skip
            built["q_b_proj"] = ColumnParallelLinear(cfg.q_lora_rank, nh * cfg.qk_head_dim, group=group, dtype=dt, name=f"{name}.q_b_proj")
        built["kv_b_proj"] = ColumnParallelLinear(
            cfg.kv_lora_rank, nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), group=group, dtype=dt, name=f"{name}.kv_b_proj"
        )  # fmt: skip
        built["o_proj"] = RowParallelLinear(nh * cfg.v_head_dim, h, group=group, bias=cfg.bias, dtype=dt, name=f"{name}.o_proj")
        self.mla_layers = nn.ModuleDict(built)
        for n in self.norm_names():
            self.register_buffer(n, torch.zeros(cfg.q_lora_rank if n == "q_a_layernorm" else cfg.kv_lora_rank, dtype=dt))

    def layer_names(self) -> tuple[str, ...]:
        if self.cfg.q_lora_rank is None:
            return ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
        return ("fused_qkv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")

    def norm_names(self) -> tuple[str, ...]:
        return ("kv_a_layernorm",) if self.cfg.q_lora_rank is None else ("q_a_layernorm", "kv_a_layernorm")

    # HF module -> (engine layer, piece) where the two differ
    _FUSED = {"q_a_proj": ("fused_qkv_a_proj_with_mqa", "q_a"), "kv_a_proj_with_mqa": ("fused_qkv_a_proj_with_mqa", "kv_a")}

    def load_shard(self, module: str, tensor: torch.Tensor, param: str = "weight") -> None:
        """Load this rank's presharded tensor of HF module `module` (e.g. kv_b_proj) and parameter."""
        if module in self.norm_names():
            dest = getattr(self, module)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ValueError(f"{self.name}.{module}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            self._norms_loaded.add(module)
            return
        layer, piece = module, None
        if self.cfg.q_lora_rank is not None and module in self._FUSED:
            layer, piece = self._FUSED[module]
        if layer not in self.mla_layers:
            raise KeyError(f"{self.name}: no MLA module {module!r}; it has {sorted(self.mla_layers)} and {list(self.norm_names())}")
        self.mla_layers[layer].load_shard(piece, tensor, param=param)

    def missing_shards(self) -> list[str]:
        missing = [f"{n}.{p}" for n, lay in self.mla_layers.items() for p in lay.missing_shards()]
        return missing + [f"{n}.weight" for n in self.norm_names() if n not in self._norms_loaded]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, S, H] (this attention-DP replica's tokens) -> [B, S, H], reduced over attn_tp.

        cos/sin [S, qk_rope_head_dim] for positions 0..S-1, the rope's attention scaling included.
        """
        c = self.cfg
        b, s, _ = x.shape
        lay = self.mla_layers
        if c.q_lora_rank is None:
            q = lay["q_proj"](x)
            latent = lay["kv_a_proj_with_mqa"](x)  # [B, S, kv_lora + rope], the same on every rank
        else:
            fused = lay["fused_qkv_a_proj_with_mqa"]
            parts = dict(zip(fused.piece_names, fused.split(fused(x))))
            q_a, latent = parts["q_a"], parts["kv_a"]  # [B, S, q_lora], [B, S, kv_lora + rope]
            q = lay["q_b_proj"](rms_norm(q_a, self.q_a_layernorm, c.rms_norm_eps))
        q = q.view(b, s, self.num_local_heads, c.qk_head_dim).transpose(1, 2)  # [B, nh_r, S, nope+rope]
        q_pass, q_rot = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv, k_rot = latent.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = rms_norm(kv, self.kv_a_layernorm, c.rms_norm_eps)
        k_rot = k_rot.view(b, 1, s, c.qk_rope_head_dim)  # one rope key shared by every head
        q_rot = apply_rope(q_rot, cos, sin, c.rope_interleave)
        k_rot = apply_rope(k_rot, cos, sin, c.rope_interleave)
        kv = lay["kv_b_proj"](kv).view(b, s, self.num_local_heads, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)  # [B, nh_r, S, nope], [B, nh_r, S, v]
        q = torch.cat((q_pass, q_rot), dim=-1)  # [B, nh_r, S, qk_head]
        k = torch.cat((k_nope, k_rot.expand(-1, self.num_local_heads, -1, -1)), dim=-1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.scale)  # [B, nh_r, S, v]
        out = out.transpose(1, 2).reshape(b, s, self.num_local_heads * c.v_head_dim)
        return lay["o_proj"](out)  # [B, S, H], all-reduced over attn_tp (input_is_parallel)
