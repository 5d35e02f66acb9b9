"""The tensor-parallel dense decoder `verify --model` runs, built from the shards (tpshard.verify.build).

The decoder of the dense architectures (`Arch.verify == "dense"`: Llama, Mistral, Qwen2, Qwen3):
RMSNorm, RoPE (default, or Llama 3.1/3.2/3.3's rope_type llama3 frequency scaling), causal GQA
attention (Qwen3: per-head q/k RMSNorm before RoPE), SwiGLU MLP. Its linear and vocab layers are
the runtime's, built from the manifest; the reductions sit at the layer boundary as in the engines:
o_proj all-reduces over attn_tp, down_proj over tp, the embedding all-reduces over its group,
lm_head all-gathers its vocab slice. Norm weights are replicated tensors read from the rank's own
files. Everything runs in float32.

Attention DP: each DP replica embeds and attends to its own batch. Before a layer over a larger
group (the MLP over tp), the replicas' tokens are gathered (every rank then runs the MLP on all
tokens, as SGLang's dp gather does) and afterwards each replica keeps its own rows again. The
gather takes one member's copy per replica; the other members' copies (made with *their* norms)
must be the same, and any that differs is recorded (`disagree`), so every rank's post-attention
and final norm is exercised. Context parallel attention (attn_cp > 1) is not modelled.

tpshard.verify.moe_model's MoEDecoder extends it with the MoE and MLA layer kinds. Not here: what
--model supports, the reference and the verdict (tpshard.verify.model).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tpshard.manifest import Plan
from tpshard.runtime import LogicalGroup, recv_forward, send_forward
from tpshard.stages import layer_of, stage_ranges
from tpshard.verify.layer_specs import Built, run_row

# Members of one attention-DP replica hold the same activations (they come out of one all-reduce):
# a copy further than this from the one used (relative to its max) is a rank's own wrong norm.
REPLICA_TOLERANCE = 1e-6

# HF module names of the dense decoder (the engine layer names the rule tables give).
EMBED, NORM, LM_HEAD = "model.embed_tokens", "model.norm.weight", "lm_head"
LAYER = "model.layers.{i}"
QKV, O_PROJ, GATE_UP, DOWN = "self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"
INPUT_NORM, POST_NORM = "input_layernorm.weight", "post_attention_layernorm.weight"
Q_NORM, K_NORM = "self_attn.q_norm.weight", "self_attn.k_norm.weight"
Q_NORM_TP, K_NORM_TP = "self_attn.q_norm", "self_attn.k_norm"  # engine layers (RMSNormTP) where cut by heads


def rope_config(config: dict) -> dict:
    """The RoPE parameters of an HF config, whichever transformers wrote it: `rope_parameters`
    (v5: rope_type, rope_theta and the scaling fields) or `rope_scaling` (v4: `type` or `rope_type`)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    rope["rope_type"] = kind
    return rope


def rope_inv_freq(head_dim: int, theta: float, rope: dict) -> torch.Tensor:
    """Inverse frequencies [hd/2], float32, with Llama 3's scaling for rope_type llama3: wavelengths
    beyond original_max_position_embeddings / low_freq_factor are stretched by `factor`, those
    below ... / high_freq_factor are kept, and the band between is interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))
    if rope.get("rope_type", "default") != "llama3":
        return inv_freq
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def stage_layers(plan: Plan) -> tuple[tuple[int, int], ...]:
    """[first, end) decoder layers of every pipeline stage (one stage: all layers)."""
    topo = plan.topology
    return stage_ranges(topo.pp_layers) if topo.pp > 1 else ((0, plan.model.num_layers),)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (neox rotate_half) on the first cos.shape[-1] dims of each head; the rest pass through
    (GLM's partial_rotary_factor, transformers' Glm4Moe apply_rotary_pos_emb)."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    head, rest = x[..., :d], x[..., d:]
    return torch.cat((head * cos + rotate_half(head) * sin, rest), dim=-1)


class TPDecoder:
    """One rank's part of the decoder. `layers`: engine layer name -> Built (float32, loaded).

    With pipeline stages the rank runs its stage's layers only: the first stage embeds, every other
    stage receives the hidden states from the rank with its tp_rank on the stage before
    (tpshard.runtime.recv_forward), and every stage but the last sends its own on; the last
    applies the final norm and lm_head."""

    prefix = ""  # of every module name: Llama-4 nests the text model under language_model.

    def __init__(
        self, plan: Plan, rank: int, layers: dict[str, Built], norms: dict[str, torch.Tensor], device,
        rope: dict | None = None,
    ):  # fmt: skip
        self.plan, self.rank, self.layers, self.norms, self.device = plan, rank, layers, norms, device
        m, topo = plan.model, plan.topology
        self.eps, self.head_dim = m.rms_norm_eps, m.head_dim
        self.stage, self.last = topo.pp_rank(rank), topo.pp_rank(rank) == topo.pp - 1
        self.first_layer, self.end_layer = stage_layers(plan)[self.stage]
        self.lm_head = layers.get(self.prefix + LM_HEAD) if self.last else None  # a tied head is named lm_head too
        # The attention-DP replica of the token batch: the embedding's group (held on the first stage
        # only, but every stage's replicas are laid out alike).
        embed_group = next(t.group for t in plan.tensors if t.layer == self.prefix + EMBED)
        self.replica = LogicalGroup.of(topo, embed_group, rank)
        self.inv_freq = rope_inv_freq(m.head_dim, m.rope_theta, rope or {}).to(device)  # [hd/2]
        self.disagree: dict[int, float] = {}  # world rank -> rel difference of its copy from the one used
        self._where = ""

    def missing(self) -> list[str]:
        """What this rank's stage needs and the rank does not hold: the embedding (first stage), each
        of its layers' engine layers and norms as the plan names them, the final norm and lm_head
        (last stage). The forward would fail half-way (between collectives) without them."""
        topo = self.plan.topology
        want = {self.prefix + EMBED} if self.stage == 0 else set()
        if self.last:
            want |= {self.prefix + LM_HEAD, self.prefix + NORM}
        for t in self.plan.tensors:
            i = layer_of(t.name)
            if i is not None and self.first_layer <= i < self.end_layer:
                want.add(t.name if t.layer_class == "Replicated" else t.layer)
        held = self._held()
        return [f"stage {self.stage} (world rank {self.rank}, tp rank {topo.tp_rank(self.rank)}) lacks {name}" for name in sorted(want - held)]

    def _held(self) -> set[str]:
        """The engine layers and norms this rank holds (a decoder with layers of its own adds theirs)."""
        return set(self.layers) | set(self.norms)

    # -- gathering attention-DP replicas' tokens for a layer over a larger group, and back

    def _gather(self, x: torch.Tensor, small: LogicalGroup, big: LogicalGroup) -> torch.Tensor:
        """This instance's x [B, ...] -> every `small` instance's x inside `big`, [n*B, ...]."""
        topo = self.plan.topology
        step = topo.span(small.name)
        if step == topo.span(big.name):
            return x
        everyone = big.all_gather(x.unsqueeze(0), dim=0)  # [span(big), B, ...], member order
        used = everyone[::step].repeat_interleave(step, 0)  # the copy each member's instance contributes
        rel = (everyone - used).flatten(1).abs().amax(1) / used.abs().amax().clamp_min(1e-30)  # [span(big)]
        for member, r in zip(big.members, rel.tolist()):
            if r > REPLICA_TOLERANCE:
                self.disagree[member] = max(self.disagree.get(member, 0.0), r)
        return everyone[::step].flatten(0, 1)  # one member per small instance

    def _scatter(self, x: torch.Tensor, small: LogicalGroup, big: LogicalGroup, b: int) -> torch.Tensor:
        topo = self.plan.topology
        step = topo.span(small.name)
        if step == topo.span(big.name):
            return x
        mine = (self.rank % topo.span(big.name)) // step
        return x.unflatten(0, (-1, b))[mine]  # [n, B, ...] -> this instance's [B, ...]

    def _big(self, group: LogicalGroup) -> LogicalGroup:
        return LogicalGroup.of(self.plan.topology, group.name, self.rank)

    def forward(self, ids: torch.Tensor) -> torch.Tensor | None:
        """ids [B, S] of this rank's attention-DP replica -> logits [B, S, V] (full vocab) on the last
        stage; None on the others (they send their hidden states on)."""
        b, s = ids.shape
        h = self._enter(ids)  # [B, S, H]
        cos, sin = self._rope(s)
        for i in range(self.first_layer, self.end_layer):
            h = self._layer(self.prefix + LAYER.format(i=i), h, cos, sin, b)
        return self._leave(h, b)

    def _enter(self, ids: torch.Tensor) -> torch.Tensor:
        """The hidden states [B, S, H] this stage starts from: embedded, or received from the stage before."""
        if self.stage == 0:
            return self.layers[self.prefix + EMBED].module(ids.to(self.device))  # reduced over the embedding's group
        shape = (*ids.shape, self.plan.model.hidden_size)
        return recv_forward(shape, torch.float32, self.rank - self.plan.topology.tp, self.device)

    def _leave(self, h: torch.Tensor, b: int) -> torch.Tensor | None:
        if not self.last:
            send_forward(h, self.rank + self.plan.topology.tp)
            return None
        h = rms_norm(h, self.norms[self.prefix + NORM], self.eps)
        x = self._gather(h, self.replica, self.lm_head.group)
        logits = self.lm_head.module(x)  # [n*B, S, V]
        return self._scatter(logits, self.replica, self.lm_head.group, b)

    def _rope(self, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(s, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # [S, hd/2]
        return torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()  # [S, hd]

    def _layer(self, p: str, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, b: int) -> torch.Tensor:
        """One decoder layer on the residual stream h [B, S, H]."""
        x = rms_norm(h, self.norms[f"{p}.{INPUT_NORM}"], self.eps)
        h = h + self._attention(p, x, cos, sin)
        x = rms_norm(h, self.norms[f"{p}.{POST_NORM}"], self.eps)
        gate_up, down = self.layers[f"{p}.{GATE_UP}"], self.layers[f"{p}.{DOWN}"]
        attn_group = self.layers[f"{p}.{QKV}"].group
        x = self._gather(x, attn_group, gate_up.group)  # [n*B, S, H]
        g, u = gate_up.module.split(gate_up.module(x))  # [n*B, S, I_r] each
        down.module.input_is_parallel = True
        y = run_row(down, F.silu(g) * u)  # [n*B, S, H], reduced over tp
        return h + self._scatter(y, attn_group, gate_up.group, b)

    def _attention(self, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv, o = self.layers[f"{p}.{QKV}"], self.layers[f"{p}.{O_PROJ}"]
        b, s, _ = x.shape
        q, k, v = qkv.module.split(qkv.module(x))  # [B, S, nh*hd], [B, S, nkv*hd] x2: this rank's heads
        if f"{p}.{Q_NORM_TP}" in self.layers:  # MiniMax-M2: RMS over all heads, reduced over attn_tp
            q, k = self.layers[f"{p}.{Q_NORM_TP}"].module(q), self.layers[f"{p}.{K_NORM_TP}"].module(k)
        q = q.unflatten(-1, (-1, self.head_dim))  # [B, S, nh, hd]
        k = k.unflatten(-1, (-1, self.head_dim))  # [B, S, nkv, hd]
        v = v.unflatten(-1, (-1, v.shape[-1] // k.shape[-2]))  # [B, S, nkv, v_hd]
        if f"{p}.{Q_NORM}" in self.norms:  # Qwen3: RMSNorm per head before RoPE
            q = rms_norm(q, self.norms[f"{p}.{Q_NORM}"], self.eps)
            k = rms_norm(k, self.norms[f"{p}.{K_NORM}"], self.eps)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, S, hd]
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = q.shape[1] // k.shape[1]  # query heads per kv head on this rank
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.head_dim**-0.5)  # [B, nh, S, v_hd]
        out = out.transpose(1, 2).flatten(2)  # [B, S, nh*v_hd]
        o.module.input_is_parallel = True
        return run_row(o, out)  # [B, S, H], reduced over attn_tp
