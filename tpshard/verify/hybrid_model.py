"""The hybrid decoders' `verify --model`: Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5-MoE
(Qwen3_5MoeForCausalLM), each rank on its own shards, against transformers' forward on the source.

tpshard.verify.moe_model's MoEDecoder (embedding, MoE with the shared expert and its sigmoid gate,
lm_head, the attention-DP gather and scatter) with the two token mixers config.json's layer_types
names, as SGLang 0.5.23 runs them (models/qwen3_next.py, qwen3_5.py) and transformers computes them
(models/qwen3_next/modeling_qwen3_next.py, qwen3_5_moe/modeling_qwen3_5_moe.py):

- linear_attention: tpshard.runtime.deltanet's GatedDeltaNet over the attention group, from the
  rank's in_proj_qkvz / in_proj_ba / out_proj layers and its own conv1d, A_log and dt_bias (read
  from the rank's files; tpshard.verify.tensors_check proves their bytes, this proves their use);
- full_attention: the gated q (q_proj holds per head [q_h | gate_h], one QKVParallelLinear piece
  cut by whole heads), q/k RMSNorm per head, RoPE on the first partial_rotary_factor of each head
  (Qwen3.5's multimodal rope is the same for text: its three position streams are equal), causal
  attention, the output times sigmoid(gate), o_proj all-reduced over the attention group;
- the decoder's RMSNorms (input, post-attention, final, q/k) are zero-centred, x * (1 + w)
  (Qwen3NextRMSNorm, SGLang's GemmaRMSNorm); the DeltaNet's gated norm is plain, w * x * silu(z).

Not here: what --model supports and the verdict (tpshard.verify.model).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import tpshard.verify.moe_model as moe_model
from tpshard.manifest import Plan
from tpshard.runtime import LogicalGroup
from tpshard.runtime.deltanet import DeltaNetConfig, GatedDeltaNet
from tpshard.verify.decoder import INPUT_NORM, K_NORM, LAYER, NORM, POST_NORM, Q_NORM, rms_norm, rotate
from tpshard.verify.layer_specs import run_row
from tpshard.verify.moe_layers import hf_config

LINEAR = "linear_attn"
# The zero-centred norms (weight 1 + w): every RMSNorm of the decoder but the DeltaNet's gated one.
ZERO_CENTRED = (INPUT_NORM, POST_NORM, Q_NORM, K_NORM)


def unsupported_reason(plan: Plan, config: dict, tokens: int | None = None) -> str | None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        return f"the gated DeltaNet decoder runs SiLU (the conv and the output gate), not hidden_act {act!r}"
    return moe_model.unsupported_reason(plan, config, tokens)


def zero_centred(name: str) -> bool:
    return name == NORM or name.endswith(tuple("." + n for n in ZERO_CENTRED))


class HybridDecoder(moe_model.MoEDecoder):
    """One rank's part of a Qwen3-Next / Qwen3.5-MoE decoder."""

    def __init__(self, plan: Plan, rank: int, layers: dict, norms: dict[str, torch.Tensor], device, tensors):
        config = hf_config(tensors)
        norms = {n: (1.0 + w if zero_centred(n) else w) for n, w in norms.items()}
        super().__init__(plan, rank, layers, norms, device, tensors.folder, config)
        self.delta_cfg = DeltaNetConfig.from_hf(config)
        self.problems: list[str] = []  # this rank's conv1d / A_log / dt_bias that would not load
        self.linear: dict[str, GatedDeltaNet] = {}  # decoder layer prefix -> its DeltaNet
        held = {s.name: s for s in plan.rank_shards(rank)}
        for i in range(self.first_layer, self.end_layer):
            p = LAYER.format(i=i)
            if f"{p}.{LINEAR}.in_proj_qkvz" in layers:
                self._deltanet(p, tensors, held)

    def _deltanet(self, p: str, tensors, held: dict) -> None:
        la = f"{p}.{LINEAR}"
        names = [f"{la}.{n}" for n in ("in_proj_qkvz", "in_proj_ba", "out_proj")]
        if any(n not in self.layers for n in names) or f"{la}.norm.weight" not in self.norms:
            return  # missing() names what is absent
        qkvz, ba, out = (self.layers[n] for n in names)
        net = GatedDeltaNet(
            self.delta_cfg, group=qkvz.group, in_proj_qkvz=qkvz.module, in_proj_ba=ba.module, out_proj=out.module,
            norm=self.norms[f"{la}.norm.weight"], name=la,
        ).to(self.device)  # fmt: skip
        for param, name in (("conv1d", f"{la}.conv1d.weight"), ("A_log", f"{la}.A_log"), ("dt_bias", f"{la}.dt_bias")):
            spec = held.get(name)
            if spec is None:
                self.problems.append(f"{name}: rank {self.rank} holds no such tensor")
                continue
            info = net.shard_info(param)
            got = (spec.group, spec.factor, spec.group_rank, spec.group_size, tuple(spec.shape))
            want = (info.group, info.factor, info.group_rank, info.group_size, info.shape)
            if got != want:
                self.problems.append(f"{name} on rank {self.rank}: the manifest says {got}, the GatedDeltaNet expects {want}")
                continue
            net.load_shard(param, tensors[name].to(device=self.device, dtype=torch.float32))
        if not net.missing_shards():
            self.linear[p] = net

    def _held(self) -> set[str]:
        """The runtime layers and norms, plus each loaded DeltaNet's conv1d and head parameters."""
        return super()._held() | {f"{p}.{LINEAR}{s}" for p in self.linear for s in ("", ".conv1d")}

    def missing(self) -> list[str]:
        return self.problems + super().missing()

    def _attn_group(self, p: str) -> LogicalGroup:
        if f"{p}.{LINEAR}.in_proj_qkvz" in self.layers:
            return self.layers[f"{p}.{LINEAR}.in_proj_qkvz"].group
        return super()._attn_group(p)

    def _layer(self, p: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int) -> torch.Tensor:
        x = rms_norm(h, self.norms[f"{p}.{INPUT_NORM}"], self.eps)
        h = h + (self.linear[p](x) if p in self.linear else self._gated_attention(p, x, cos, sin))
        x = rms_norm(h, self.norms[f"{p}.{POST_NORM}"], self.eps)
        return h + self._mlp(p, x, b)

    def _gated_attention(self, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv, o = self.layers[f"{p}.self_attn.qkv_proj"], self.layers[f"{p}.self_attn.o_proj"]
        hd = self.head_dim
        q_gate, k, v = qkv.module.split(qkv.module(x))  # this rank's heads
        q, gate = q_gate.unflatten(-1, (-1, 2 * hd)).chunk(2, -1)  # [B, S, nh_r, hd] each: per head [q_h | gate_h]
        q = rms_norm(q, self.norms[f"{p}.{Q_NORM}"], self.eps)
        k = rms_norm(k.unflatten(-1, (-1, hd)), self.norms[f"{p}.{K_NORM}"], self.eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v.unflatten(-1, (-1, hd))))  # [B, heads, S, hd]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)  # the first rope dims of each head
        rep = q.shape[1] // k.shape[1]
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True, scale=hd**-0.5)
        out = out.transpose(1, 2) * torch.sigmoid(gate)  # [B, S, nh_r, hd]
        o.module.input_is_parallel = True
        return run_row(o, out.flatten(2))  # [B, S, H], reduced over the attention group
