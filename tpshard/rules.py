"""Per-architecture rule tables: which engine layer each checkpoint module loads into.

A rule matches a module path (the tensor name without its last part) and names the engine layer
class, the role that picks its group, and the engine layer it belongs to (q/k/v fuse into one
QKVParallelLinear, gate/up into one MergedColumnParallelLinear). How each parameter of that layer
is cut follows from the layer class alone (tpshard.plan). Adding an architecture is adding a table.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

Role = Literal["attn", "mlp", "embed", "lm_head", "replicated"]
LayerClass = Literal[
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "Replicated",
]


class Rule(NamedTuple):
    module: str  # regex, matched in full against the module path
    layer_class: LayerClass
    role: Role  # attn -> attn_tp, mlp -> tp, embed -> attn_tp, lm_head -> tp (or attn_tp), norms -> replicated
    layer: str  # engine layer name, a template over the regex groups
    piece: str = ""  # q / k / v of a QKV layer; gate / up of a merged layer


L = r"(model\.layers\.\d+)"

LLAMA: tuple[Rule, ...] = (
    Rule(r"model\.embed_tokens", "VocabParallelEmbedding", "embed", "model.embed_tokens"),
    Rule(r"lm_head", "ParallelLMHead", "lm_head", "lm_head"),
    Rule(r"model\.norm", "Replicated", "replicated", "model.norm"),
    Rule(L + r"\.(input_layernorm|post_attention_layernorm)", "Replicated", "replicated", r"\1.\2"),
    Rule(L + r"\.self_attn\.q_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "q"),
    Rule(L + r"\.self_attn\.k_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "k"),
    Rule(L + r"\.self_attn\.v_proj", "QKVParallelLinear", "attn", r"\1.self_attn.qkv_proj", "v"),
    Rule(L + r"\.self_attn\.o_proj", "RowParallelLinear", "attn", r"\1.self_attn.o_proj"),
    Rule(L + r"\.mlp\.gate_proj", "MergedColumnParallelLinear", "mlp", r"\1.mlp.gate_up_proj", "gate"),
    Rule(L + r"\.mlp\.up_proj", "MergedColumnParallelLinear", "mlp", r"\1.mlp.gate_up_proj", "up"),
    Rule(L + r"\.mlp\.down_proj", "RowParallelLinear", "mlp", r"\1.mlp.down_proj"),
)

# Qwen3 normalises q and k per head before RoPE: [head_dim] weights, the same on every rank.
QWEN3 = LLAMA + (Rule(L + r"\.self_attn\.(q_norm|k_norm)", "Replicated", "replicated", r"\1.self_attn.\2"),)

ARCHITECTURES: dict[str, tuple[Rule, ...]] = {
    "LlamaForCausalLM": LLAMA,
    "MistralForCausalLM": LLAMA,
    "Qwen2ForCausalLM": LLAMA,  # q/k/v biases are sliced with their weights
    "Qwen3ForCausalLM": QWEN3,
}

# Buffers some older checkpoints carry that engines recompute; dropped with a warning.
DROPPED = re.compile(r".*\.rotary_emb\.inv_freq")


class Matcher:
    """Compiled rule table: module path -> (rule, engine layer name)."""

    def __init__(self, rules: tuple[Rule, ...]):
        self._rules = [(re.compile(r.module), r) for r in rules]

    def match(self, module: str) -> tuple[Rule, str] | None:
        for pattern, rule in self._rules:
            m = pattern.fullmatch(module)
            if m:
                return rule, m.expand(rule.layer)
        return None
