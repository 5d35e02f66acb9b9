"""The routed experts of a MoE checkpoint: each expert's EP slot, and every MoE layer's expert set complete.

What this file is: `Experts`, fed every matched tensor by the plan: it refuses layer indexes and
expert ids config.json has no place for, dense tensors in MoE layers and the other way round, and
(in `finish`) a MoE layer missing any routed expert weight.

What it is not: no cut of an expert's weights (tpshard.plan.dense: FusedMoE over moe_tp).
"""

from __future__ import annotations

import re

from tpshard.arch import Rule
from tpshard.errors import PlanError
from tpshard.plan.dense import Layout
from tpshard.quant.formats import CODES_SUFFIXES

# model.layers.N (HF names; Llama-4 nests the text model under language_model., Qwen3.5's wrapper under
# model.language_model.); DeepSeek-V4's native
# layers.N, and its MTP layers mtp.K, which SGLang's NextN loader reads as layer num_hidden_layers + K
# (deepseek_v4.py remap_weight_name_to_dpsk_hf_format); Qwen3.5's and Qwen3-Next's MTP layer
# mtp.layers.K, which their draft classes load as the draft's own layer K (one: refused past it by the family)
_LAYER_INDEX = re.compile(r"(?:language_model\.)?(model\.)?(?:language_model\.)?(layers|mtp|mtp\.layers)\.(\d+)\.")


class Experts:
    """Per-tensor facts of MoE models: layer index bounds, dense vs MoE layers, EP slots, and the
    expert set of every MoE layer complete."""

    def __init__(self, ctx: Layout):
        self.ctx = ctx
        self.seen: dict[int, set[tuple[int, str]]] = {}
        self.fused: set[int] = set()  # layers whose experts are stored fused [E, ...] (Arch.fused_experts)

    def place(self, name: str, rule: Rule, expert: int | None) -> int | None:
        """The EP slot of `name` (None: not a routed expert); refuses tensors the config has no home for."""
        m, a, t = self.ctx.model, self.ctx.arch, self.ctx.topology
        found = _LAYER_INDEX.match(name)
        if found is None:
            return None
        kind, index = found.group(2), int(found.group(3))
        # DeepSeek-V4's native names keep the MTP layers apart (mtp.K): its layers.N stop at num_hidden_layers
        apart = kind == "mtp" or found.group(1) is None
        if kind == "mtp.layers":  # Qwen's draft layer: the family refuses any but mtp.layers.0 by name
            index += m.num_layers
        elif kind == "mtp":
            if index >= m.num_nextn_predict_layers:
                raise PlanError(f"{name}: MTP layer {index}, but config.json has {m.num_nextn_predict_layers} MTP layer(s)")
            index += m.num_layers
        elif index >= m.num_layers + (0 if apart else m.num_nextn_predict_layers):
            mtp = f" and {m.num_nextn_predict_layers} MTP layer(s)" if m.num_nextn_predict_layers and not apart else ""
            raise PlanError(f"{name}: layer {index}, but config.json has {m.num_layers} layers{mtp}")
        if a.sparse is not None and rule.moe is not None and a.sparse(m, index) != rule.moe:
            raise PlanError(
                f"{name}: {'an expert' if rule.moe else 'a dense'} MLP tensor in layer {index}, which config.json makes a"
                f" {'dense' if rule.moe else 'MoE'} layer (first_k_dense_replace {m.first_k_dense_replace},"
                f" moe_layer_freq {m.moe_layer_freq})"
            )
        if rule.layer_class == "FusedExperts":
            self.fused.add(index)
        if expert is None:
            return None
        if expert >= m.num_experts:
            raise PlanError(f"{name}: expert {expert}, but config.json has {m.num_experts} routed experts")
        if name.rpartition(".")[2] in CODES_SUFFIXES:  # its weight, dense or quantized (a scale or bias is not)
            self.seen.setdefault(index, set()).add((expert, rule.piece))
        return expert // (m.num_experts // t.ep)

    def finish(self) -> None:
        m, a = self.ctx.model, self.ctx.arch
        if a.sparse is None or not m.num_experts or (a.fused_experts is not None and not a.fused_experts.per_expert):
            return  # fused [E, ...] tensors: Arch.expected names them (tpshard.completeness)
        # a layer stored fused is complete when its fused tensors are (tpshard.completeness)
        layers = ({i for i in range(m.num_layers) if a.sparse(m, i)} | set(self.seen)) - self.fused
        for index in sorted(layers):
            have = self.seen.get(index, set())
            missing = sorted({(e, p) for e in range(m.num_experts) for p in ("w1", "w3", "w2")} - have)
            if missing:
                e, p = missing[0]
                raise PlanError(
                    f"model.layers.{index}: {len(missing)} of {3 * m.num_experts} routed expert weights are missing"
                    f" from the checkpoint (first: expert {e} {p}); a MoE layer needs every expert"
                )
