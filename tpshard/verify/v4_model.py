"""DeepSeek-V4's decoder for `verify --model`: every rank runs its own shards as SGLang 0.5.23's
DeepseekV4ForCausalLM cuts them (sglang/srt/models/deepseek_v4.py), and its logits are compared
with transformers' DeepseekV4ForCausalLM (eager, float32) on the source checkpoint.

The forward is transformers' modeling_deepseek_v4.py without a cache (one prefill of the whole
sequence): the embedding copied into hc_mult streams; per layer mHC -> attn_norm -> attention
(tpshard.runtime.v4_attention: the sliding window, the compressor, the indexer, the sinks, wo_a's
groups) -> mHC -> ffn_norm -> MoE (tpshard.runtime.v4_moe: sqrtsoftplus top-k with the correction
bias, or hash routing by tid2eid, the clamped experts and shared expert); then the hc_head
collapse, the final norm and the head.

Attention DP: each attention-DP replica embeds and attends to its own batch (the embedding whole
on every rank, SGLang's VocabParallelEmbedding(enable_tp=not dp_attention)); the MoE runs every
replica's tokens (and their ids, for the hash layers) over tp; the head gathers them, as
tpshard.verify.decoder does for the other families.

What --tokens must reach so that nothing is idle: more tokens than the sliding window, at least
one closed window of every compressor (128 tokens for a ratio-128 layer), and more ratio-4 entries
than index_topk, so the indexer chooses (`tokens_needed`); fewer is refused in one line. Not run:
the MTP layer (transformers' forward skips mtp.*; its weights are verified at layer level) and the
decode path's cached compressor state (buffers and the overlap carried between calls).

The release's FP8 + FP4 form: the ranks' layers are built dequantized (tpshard.quant, as at layer
level) and the reference is transformers on the source dequantized by transformers' own
Fp8Dequantize (`dequantized_logits`), not by tpshard's code.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from tpshard.runtime import LogicalGroup
from tpshard.runtime.v4_attention import Compressor, V4Attention, V4AttentionConfig, hyper_head, hyper_post, hyper_pre, rms
from tpshard.runtime.v4_moe import SCORING, V4MoEConfig, v4_moe
from tpshard.verify.decoder import EMBED, LM_HEAD, TPDecoder

RELEASE = ("dsv4_fp8", "dsv4_fp4")  # tpshard.quant's formats of the release (FP8 linears, FP4 routed experts)
P, N = "model.layers.{i}", "layers.{i}"  # engine layer prefix, native tensor prefix
HC = ("fn", "base", "scale")


def hf_v4_config(config: dict):
    """transformers' DeepseekV4Config of a native config.json (compress_ratios -> layer_types, defaults)."""
    from transformers import DeepseekV4Config

    keep = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "quantization_config")}
    return DeepseekV4Config(**keep)


def tokens_needed(c) -> dict[str, int]:
    """What each piece needs of --tokens to act (piece -> tokens)."""
    need = {"sliding window": c.sliding_window + 1}
    for kind, ratio in c.compress_rates.items():
        if kind in c.layer_types:
            need[f"ratio-{ratio} compressor"] = ratio
            if kind == "compressed_sparse_attention":  # the indexer chooses among more entries than its top-k
                need["indexer's top-k"] = ratio * (c.index_topk + 1)
    return need


def unsupported_reason(plan, config: dict, tokens: int | None) -> str | None:
    """Why --model cannot run on this V4 output, or None."""
    if importlib.util.find_spec("transformers.models.deepseek_v4") is None:
        return "model-level verify of DeepSeek-V4 needs transformers with DeepseekV4ForCausalLM (5.x; pip install -U transformers)"
    if plan.topology.attn_cp > 1:
        return "model-level verify does not model context-parallel attention (attn_cp > 1); use layer-level verify"
    formats = sorted({str(q.get("format")) for q in plan.quant_layers.values()} - set(RELEASE))
    if formats:
        return f"model-level verify of DeepSeek-V4 runs bf16 or the release's FP8 + FP4 form, not {', '.join(formats)}"
    if plan.quant_layers and importlib.util.find_spec("transformers.integrations.finegrained_fp8") is None:
        return "model-level verify of DeepSeek-V4's FP8 + FP4 release needs transformers' Fp8Dequantize (transformers 5.x)"
    try:
        c = hf_v4_config(config)
    except (TypeError, ValueError) as e:
        return f"transformers cannot read this DeepSeek-V4 config.json: {e}"
    if c.index_head_dim < c.qk_rope_head_dim and "compressed_sparse_attention" in c.layer_types:
        return (
            f"index_head_dim {c.index_head_dim} is smaller than the {c.qk_rope_head_dim} rope dims: transformers'"
            " DeepseekV4Indexer cannot rotate its heads, so there is no reference forward"
        )
    if c.scoring_func not in SCORING:
        return f"the DeepSeek-V4 decoder implements router scoring {', '.join(SCORING)}, not {c.scoring_func!r}"
    short = [f"{piece} (acts from {n} tokens)" for piece, n in tokens_needed(c).items() if tokens is not None and tokens < n]
    if short:
        return (
            f"--tokens {tokens} leaves DeepSeek-V4's {', '.join(short)} idle;"
            f" run verify --model with --tokens {max(tokens_needed(c).values())} or more"
        )
    return None


class V4Decoder(TPDecoder):
    """One rank's part of DeepSeek-V4. `norms`: the rank's replicated tensors by native name (norms,
    mHC, sinks, compressors' ape, the routers), float32."""

    def __init__(self, plan, rank: int, layers: dict, norms: dict, device, config: dict):
        super().__init__(plan, rank, layers, norms, device)
        self.hf = hf_v4_config(config)
        self.acfg, self.mcfg = V4AttentionConfig.from_hf(self.hf), V4MoEConfig.from_hf(self.hf)
        # The replica is the attention group (the embedding may be whole under attention DP).
        self.replica = LogicalGroup.of(plan.topology, "attn_tp", rank)
        self.inv = {kind: self._inv_freq(kind) for kind in ("main", "compress")}

    def _inv_freq(self, kind: str) -> tuple[torch.Tensor, float]:
        """inv_freq [d/2] and the cos/sin scaling of rope `kind` (DeepseekV4RotaryEmbedding)."""
        params = self.hf.rope_parameters[kind]
        if params.get("rope_type", "default") == "default":
            dim = int(self.hf.head_dim * params.get("partial_rotary_factor", 1.0))
            return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv, scaling = ROPE_INIT_FUNCTIONS[params["rope_type"]](self.hf, "cpu", layer_type=kind)
        return inv.float(), float(scaling)

    def rope_at(self, kind: str, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv, scaling = self.inv[kind]
        freqs = positions.to(torch.float32)[None, :, None] * inv.to(self.device)  # [1, S, d/2]
        return freqs.cos() * scaling, freqs.sin() * scaling

    def missing(self) -> list[str]:
        """The engine layers and replicated tensors of the main layers, the embedding and the head
        this rank lacks (mtp.* is not run)."""
        want = {self.prefix + EMBED, self.prefix + LM_HEAD, "norm.weight", *(f"hc_head_{h}" for h in HC)}
        for t in self.plan.tensors:
            if t.name.startswith("layers."):
                want.add(t.name if t.layer_class == "Replicated" else t.layer)
        held = set(self.layers) | set(self.norms)
        return [f"world rank {self.rank} lacks {name}" for name in sorted(want - held)]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        ids = ids.to(self.device)
        x = self.layers[EMBED].module(ids)  # [B, S, H]
        h = x.unsqueeze(2).expand(-1, -1, self.hf.hc_mult, -1).contiguous()  # [B, S, n, H]
        pos = torch.arange(s, device=self.device)
        tables = {kind: self.rope_at(kind, pos) for kind in self.inv}
        for i in range(self.plan.model.num_layers):
            h = self._v4_layer(i, h, ids, tables, b)
        h = hyper_head(h, *(self.norms[f"hc_head_{k}"] for k in HC), self.acfg)
        h = rms(h, self.norms["norm.weight"], self.acfg.eps)
        logits = self.lm_head.module(self._gather(h, self.replica, self.lm_head.group))
        return self._scatter(logits, self.replica, self.lm_head.group, b)

    def _v4_layer(self, i: int, h: torch.Tensor, ids: torch.Tensor, tables: dict, b: int) -> torch.Tensor:
        n, eps = N.format(i=i), self.acfg.eps
        post, comb, x = hyper_pre(h, *(self.norms[f"{n}.hc_attn_{k}"] for k in HC), self.acfg)
        kind = "main" if self.hf.layer_types[i] == "sliding_attention" else "compress"
        cos, sin = tables[kind]
        out = self.attention(i)(rms(x, self.norms[f"{n}.attn_norm.weight"], eps), cos, sin, lambda p: self.rope_at("compress", p))
        h = hyper_post(h, out, post, comb)
        post, comb, x = hyper_pre(h, *(self.norms[f"{n}.hc_ffn_{k}"] for k in HC), self.acfg)
        return hyper_post(h, self._moe(i, rms(x, self.norms[f"{n}.ffn_norm.weight"], eps), ids, b), post, comb)

    def attention(self, i: int) -> V4Attention:
        p, n = P.format(i=i) + ".self_attn", N.format(i=i) + ".attn"
        lay = self.layers
        wq_b, wo_b = lay[f"{p}.wq_b"], lay[f"{p}.wo_b"].module
        wo_b.input_is_parallel = True
        ratio = self.hf.compress_rates.get(self.hf.layer_types[i], 0)
        comp = self._compressor(f"{p}.compressor", f"{n}.compressor", ratio) if ratio else None
        indexer = None
        if self.hf.layer_types[i] == "compressed_sparse_attention":
            indexer = (
                lay[f"{p}.indexer.wq_b"].module, lay[f"{p}.indexer.weights_proj"].module,
                self._compressor(f"{p}.indexer.compressor", f"{n}.indexer.compressor", ratio),
            )  # fmt: skip
        return V4Attention(
            self.acfg, lay[f"{p}.wq_a"].module, self.norms[f"{n}.q_norm.weight"], wq_b.module, lay[f"{p}.wkv"].module,
            self.norms[f"{n}.kv_norm.weight"], lay[f"{p}.wo_a"].module, wo_b, self.norms[f"{n}.attn_sink"],
            wq_b.group.rank, wq_b.group.size, comp, indexer,
        )  # fmt: skip

    def _compressor(self, layer: str, native: str, ratio: int) -> Compressor:
        return Compressor(self.layers[f"{layer}.wkv_gate"].module, self.norms[f"{native}.ape"], self.norms[f"{native}.norm.weight"], ratio)

    def _moe(self, i: int, x: torch.Tensor, ids: torch.Tensor, b: int) -> torch.Tensor:
        """x [B, S, H] of this replica -> [B, S, H]: every replica's tokens through the MoE over tp."""
        p, n = P.format(i=i) + ".mlp", N.format(i=i) + ".ffn"
        experts = self.layers[f"{p}.experts"]
        attn_group = self.layers[P.format(i=i) + ".self_attn.wq_b"].group
        xs = self._gather(x, attn_group, experts.group)  # [n B, S, H]
        flat = xs.reshape(-1, xs.shape[-1])
        if self.hf.mlp_layer_types[i] == "hash_moe":
            every_ids = self._gather(ids.to(torch.float64), attn_group, experts.group)
            route = dict(tid2eid=self.norms[f"{n}.gate.tid2eid"], ids=every_ids.reshape(-1))
        else:
            route = dict(bias=self.norms[f"{n}.gate.bias"])
        shared = None
        if f"{p}.shared_experts.gate_up_proj" in self.layers:
            shared = (self.layers[f"{p}.shared_experts.gate_up_proj"].module, self.layers[f"{p}.shared_experts.down_proj"].module)
        out = v4_moe(self.mcfg, flat, experts.module, self.norms[f"{n}.gate.weight"], shared, **route)
        return self._scatter(out.reshape(xs.shape), attn_group, experts.group, b)


def dequantized_logits(source: str, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """transformers' float32 forward on the release's FP8 + FP4 source, dequantized by transformers'
    own Fp8Dequantize (the op its FP8 loader runs with dequantize=True: FP8 with 128 x 128 ue8m0
    block scales, FP4 e2m1 pairs with per-32 scales), not by tpshard.quant (the code the ranks run):
    logits [B, S, V] per batch, float64."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, DeepseekV4ForCausalLM
    from transformers.utils import logging as hf_logging

    from tpshard.verify.source_dequant import fp8_dequantize

    hf_logging.disable_progress_bar()  # stderr belongs to the report
    full: dict[str, torch.Tensor] = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        full |= load_file(f)
    state = {}
    for name, t in full.items():
        scale = name.removesuffix("weight") + "scale"  # the release's `<module>.scale` beside `<module>.weight`
        if name.endswith(".scale") and name.removesuffix("scale") + "weight" in full:
            continue
        state[name] = fp8_dequantize(t, full[scale]) if name.endswith(".weight") and scale in full else t
    config = AutoConfig.from_pretrained(source)
    del config.quantization_config  # a dense model: the state dict is dequantized already
    model = DeepseekV4ForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return [model(input_ids=ids).logits.double() for ids in batches]
