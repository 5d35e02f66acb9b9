"""Model-level verification of the MoE and MLA architectures: a tensor-parallel decoder vs transformers.

The architectures whose `Arch.verify` is "moe" (tpshard/arch/): DeepseekV3 (and V2), Qwen3-MoE,
Qwen2-MoE, Mixtral, GLM-4.5 (Glm4Moe: partial rotary, q/k/v biases, q/k norms, DeepSeek-V3's router). The decoder is tpshard.verify.decoder's TPDecoder (embedding, norms, GQA attention, lm_head, attention-DP gather and scatter) with two
layer kinds added, both from tpshard.runtime and built from the manifest like every other layer:

- attention: MLA (`MLAAttention` over the attention group: replicated `fused_qkv_a_proj_with_mqa`
  or `kv_a_proj_with_mqa`, `q_b_proj` / `q_proj` / `kv_b_proj` by heads, `o_proj` all-reduced), or
  the dense GQA attention (Qwen3-MoE's q/k norms included);
- MLP: a MoE block (`MoEBlock`: the replicated router with the model's RouterConfig and
  DeepSeek-V3's correction bias, `FusedMoE` over EP x MoE-TP, shared experts over tp with Qwen2-MoE's
  sigmoid gate, one all-reduce over tp), on the tokens of every attention-DP replica as SGLang runs
  it; or DeepSeek's and GLM's dense first layers, over tp (gathered) or whole on every rank with
  `--moe-dense-tp 1` (each rank runs its own tokens, no gather).

RoPE comes from transformers' own rope functions for the checkpoint's config (default, yarn with
DeepSeek's mscale, ...), so the comparison is about the shards and the layer math, not about a
second implementation of rope scaling. The MTP layer of DeepSeek-V3 (layer num_hidden_layers) is
verified at layer level only: transformers' forward does not run it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpshard.arch import ARCHITECTURES, router_config
from tpshard.manifest import Plan
from tpshard.runtime import LogicalGroup
from tpshard.runtime.mla import MLAAttention, MLAConfig
from tpshard.runtime.moe import MoEBlock
import tpshard.verify.sinks_model as sinks_model
from tpshard.verify.decoder import INPUT_NORM, POST_NORM, TPDecoder, rms_norm
from tpshard.verify.layer_specs import Built

# The RoPE tables come from the config's `rope_parameters`, which transformers 5 introduced.
MIN_TRANSFORMERS = (5, 0)
MLA_LAYERS = ("fused_qkv_a_proj_with_mqa", "kv_a_proj_with_mqa", "q_proj", "q_b_proj", "kv_b_proj", "o_proj")
MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")


def unsupported_reason(plan: Plan, config: dict, tokens: int | None = None) -> str | None:
    """Why --model cannot run this MoE / MLA output, or None (quantized and context-parallel outputs
    are refused by tpshard.verify.model.unsupported_reason, for every family)."""
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    sinks = any(t.layer_class == "AttentionSinks" for t in plan.tensors)  # gpt-oss: windows by layer_types, modelled
    if window and tokens is not None and window < tokens and not sinks:
        return f"model-level verify has no sliding-window attention; the model's window {window} is shorter than --tokens {tokens}"
    heads, kv_heads = config.get("num_attention_heads"), config.get("num_key_value_heads")
    if config.get("kv_lora_rank") and kv_heads not in (None, heads):
        # MLA's k and v have every head (SGLang ignores the key); transformers' DeepSeek attention
        # repeats them num_attention_heads / num_key_value_heads times and fails on the shapes.
        return (
            f"transformers' {plan.model.architecture} cannot run config.json's num_key_value_heads {kv_heads} with"
            f" {heads} attention heads (MLA keys and values have every head; the released configs set them equal)"
        )
    try:
        router_config(config)
    except (KeyError, ValueError) as e:
        return f"no router rule for this config: {e}"
    return None


def rope_tables(folder: Path, seq: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [S, rope dim] of positions 0..S-1 for the checkpoint's config, scaling included
    (rope dim < head_dim with GLM's partial_rotary_factor)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(folder).get_text_config()  # a multimodal wrapper's text model (Qwen3.5)
    rope = dict(config.rope_parameters or {})
    kind = rope.get("rope_type", "default")
    if kind == "default":  # as every transformers model computes its default rope
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dim = int(dim * rope.get("partial_rotary_factor", 1.0))  # GLM: only the first part of each head rotates
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq.float())  # [S, d/2]
    emb = torch.cat((freqs, freqs), -1)
    return (emb.cos() * scaling).to(device), (emb.sin() * scaling).to(device)


class MoEDecoder(TPDecoder):
    """One rank's part of a MoE / MLA decoder, from the manifest's layers (engine layer name -> Built)."""

    def __init__(self, plan: Plan, rank: int, layers: dict[str, Built], norms: dict[str, torch.Tensor], device, folder: Path, config: dict):
        super().__init__(plan, rank, layers, norms, device)
        self.folder, self.config = Path(folder), config
        self.router = router_config(config) if plan.model.num_experts or _has_experts(layers) else None
        self.mla = MLAConfig.from_hf(config) if plan.model.kv_lora_rank or "kv_lora_rank" in config else None

    def _rope(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(self.folder, s, self.device)

    def _layer(self, p: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int) -> torch.Tensor:
        """One MoE / MLA decoder layer on the residual stream h [B, S, H] (the stage hand-off, the
        embedding and the head are TPDecoder's)."""
        x = rms_norm(h, self.norms[f"{p}.{INPUT_NORM}"], self.eps)
        if self.mla is not None:
            h = h + self._mla(p, x, cos, sin)
        elif sinks_model.has_sinks(self.layers, p):
            h = h + sinks_model.attention(self, p, x, cos, sin)
        else:
            h = h + self._attention(p, x, cos, sin)
        x = rms_norm(h, self.norms[f"{p}.{POST_NORM}"], self.eps)
        return h + self._mlp(p, x, b)

    def _attn_group(self, p: str) -> LogicalGroup:
        for name in ("self_attn.qkv_proj", "self_attn.q_b_proj", "self_attn.q_proj", "self_attn.kv_b_proj"):
            if f"{p}.{name}" in self.layers:
                return self.layers[f"{p}.{name}"].group
        raise KeyError(f"{p}: the manifest has no attention layer this decoder knows")

    def _mla(self, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        layers = {n: self.layers[f"{p}.self_attn.{n}"].module for n in MLA_LAYERS if f"{p}.self_attn.{n}" in self.layers}
        norms = {n: self.norms[f"{p}.self_attn.{n}.weight"] for n in MLA_NORMS if f"{p}.self_attn.{n}.weight" in self.norms}
        attn = MLAAttention(self.mla, group=self._attn_group(p), layers=layers, norms=norms, name=f"{p}.self_attn")
        return attn(x, cos, sin)  # [B, S, H], reduced over the attention group

    def _mlp(self, p: str, x: torch.Tensor, b: int) -> torch.Tensor:
        attn_group = self._attn_group(p)
        prefix = next((f"{p}.{m}" for m in ("mlp", "block_sparse_moe") if f"{p}.{m}.experts" in self.layers), None)
        if prefix is not None and self.layers[f"{prefix}.experts"].spec.layer_class == "FusedExperts" and f"{prefix}.gate" not in self.layers:
            return sinks_model.moe(self, prefix, x, attn_group, b)  # gpt-oss's router; Qwen3.5's fused experts take _moe_block
        if prefix is not None:
            block = self._moe_block(prefix)
            big = block.experts.group  # tp: every rank runs every replica's tokens
            return self._scatter(block(self._gather(x, attn_group, big)), attn_group, big, b)
        gate_up, down = self.layers[f"{p}.mlp.gate_up_proj"], self.layers[f"{p}.mlp.down_proj"]
        down.module.input_is_parallel = True
        if gate_up.group.size == 1:  # --moe-dense-tp 1: the whole MLP on every rank, its own tokens
            g, u = gate_up.module.split(gate_up.module(x))
            return down.module(torch.nn.functional.silu(g) * u)
        x = self._gather(x, attn_group, gate_up.group)
        g, u = gate_up.module.split(gate_up.module(x))
        return self._scatter(down.module(torch.nn.functional.silu(g) * u), attn_group, gate_up.group, b)

    def _moe_block(self, prefix: str) -> MoEBlock:
        router = self.layers[f"{prefix}.gate"].module
        shared = next((f"{prefix}.{n}" for n in ("shared_experts", "shared_expert") if f"{prefix}.{n}.gate_up_proj" in self.layers), None)
        kw = {}
        if shared is not None:
            kw = dict(shared_gate_up=self.layers[f"{shared}.gate_up_proj"].module, shared_down=self.layers[f"{shared}.down_proj"].module)
            gate = self.layers.get(f"{prefix}.shared_expert_gate")
            kw["shared_gate"] = gate.module.weight if gate is not None else None
        return MoEBlock(
            self.router, self.layers[f"{prefix}.experts"].module, router.weight,
            correction_bias=getattr(router, "correction_bias", None), **kw,
        )  # fmt: skip


def _has_experts(layers: dict) -> bool:
    return any(name.endswith(".experts") for name in layers)


def is_moe(plan: Plan) -> bool:
    """The plan's architecture runs this decoder under --model (`Arch.verify` "moe")."""
    arch = ARCHITECTURES.get(plan.model.architecture)
    return arch is not None and arch.verify == "moe"
