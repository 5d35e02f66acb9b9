"""DeepSeek V2 / V3 with MLA attention (SGLang models/deepseek_v2.py, deepseek_nextn.py).

- MLA: q_a_proj and kv_a_proj_with_mqa are one ReplicatedLinear in the engine
  (fused_qkv_a_proj_with_mqa), kept whole and separate on disk; q_b_proj (or q_proj without
  q_lora_rank) and kv_b_proj are column-parallel by heads, o_proj row-parallel, all over attn_tp.
- Layers below first_k_dense_replace (and off moe_layer_freq) have a dense MLP over tp, or whole
  with --moe-dense-tp 1; the others a router, routed experts and shared experts over the full tp.
- The MTP module is decoder layer num_hidden_layers: a MoE layer plus enorm, hnorm, eh_proj,
  shared_head.norm (whole), and its own embed_tokens / shared_head.head, cut like the model's
  (SGLang never reads them: the draft shares the target's; cut anyway so every tensor is checked).
- Pipeline stages: lm_head and norm on the last stage, which also runs the MTP layer and, with it,
  holds a second copy of model.embed_tokens (reference/PIPELINE.md §3, §4).
"""

from tpshard.arch.base import NORMS, VOCAB, Arch, L, Rule, gated_mlp, router, routed_experts
from tpshard.manifest import ModelInfo

MLA: tuple[Rule, ...] = (
    Rule(L + r"\.self_attn\.q_a_proj", "ReplicatedLinear", "replicated", r"\1.self_attn.fused_qkv_a_proj_with_mqa", "q_a", "mla_q_a"),
    Rule(L + r"\.self_attn\.(q_a_layernorm|kv_a_layernorm)", "Replicated", "replicated", r"\1.self_attn.\2"),
    Rule(L + r"\.self_attn\.q_b_proj", "ColumnParallelLinear", "attn", r"\1.self_attn.q_b_proj", shape="mla_q_b", heads=True),
    Rule(L + r"\.self_attn\.q_proj", "ColumnParallelLinear", "attn", r"\1.self_attn.q_proj", shape="mla_q", heads=True),
    Rule(L + r"\.self_attn\.kv_b_proj", "ColumnParallelLinear", "attn", r"\1.self_attn.kv_b_proj", shape="mla_kv_b", heads=True),
    Rule(L + r"\.self_attn\.o_proj", "RowParallelLinear", "attn", r"\1.self_attn.o_proj", shape="mla_o", heads=True),
)  # fmt: skip
# With q_lora_rank the engine fuses kv_a_proj_with_mqa with q_a_proj; without, it stands alone.
KV_A_FUSED = Rule(L + r"\.self_attn\.kv_a_proj_with_mqa", "ReplicatedLinear", "replicated", r"\1.self_attn.fused_qkv_a_proj_with_mqa", "kv_a", "mla_kv_a")
KV_A_ALONE = KV_A_FUSED._replace(layer=r"\1.self_attn.kv_a_proj_with_mqa", piece="")

MOE = (
    router("mlp")
    + routed_experts("mlp", "gate_proj", "up_proj", "down_proj")
    + gated_mlp("mlp.shared_experts", "shared_expert", "shared_up", "shared_down", moe=True)
)
DENSE = gated_mlp("mlp", "dense_mlp", "mlp_up", "mlp_down", moe=False)

MTP: tuple[Rule, ...] = (
    Rule(L + r"\.(enorm|hnorm)", "Replicated", "replicated", r"\1.\2"),
    Rule(L + r"\.shared_head\.norm", "Replicated", "replicated", r"\1.shared_head.norm"),
    Rule(L + r"\.eh_proj", "ReplicatedLinear", "replicated", r"\1.eh_proj", shape="eh_proj"),
    Rule(L + r"\.embed_tokens", "VocabParallelEmbedding", "embed", r"\1.embed_tokens", shape="vocab"),
    Rule(L + r"\.shared_head\.head", "ParallelLMHead", "lm_head", r"\1.shared_head.head", shape="vocab"),
)  # fmt: skip

BASE = VOCAB + NORMS + MLA + MOE + DENSE + MTP


def sparse(model: ModelInfo, layer: int) -> bool:
    """DeepseekV2DecoderLayer._is_layer_sparse; the MTP decoder (layer >= num_layers) always is."""
    if layer >= model.num_layers:
        return True
    return model.num_experts > 0 and layer >= model.first_k_dense_replace and layer % model.moe_layer_freq == 0


def kv_a(model: ModelInfo) -> tuple[Rule, ...]:
    return (KV_A_FUSED,) if model.q_lora_rank else (KV_A_ALONE,)


ARCHS = tuple(
    Arch(
        name, BASE, "deepseek_v2.py", attn_group="attn_tp", embed_group="attn_tp", sparse=sparse,
        experts_limit="tp", variant=kv_a, pp_head="last", pp_tied_head=True,
    )
    for name in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
)  # fmt: skip
