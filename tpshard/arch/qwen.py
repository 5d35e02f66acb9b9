"""Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE (SGLang models/qwen2.py, qwen3.py, qwen2_moe.py, qwen3_moe.py).

- Qwen2Attention sizes itself by tp; Qwen2Model cuts the embedding over attn_tp under attention
  DP (`use_attn_tp_group=is_dp_attention_enabled()`); Qwen2ForCausalLM's lm_head ignores
  --enable-dp-lm-head. q/k/v biases are sliced with their weights.
- Qwen3Attention is built with parallel_group="attn_tp"; Qwen3Model is a Qwen2Model.
- The MoE models cut attention over attn_tp and build every decoder layer sparse
  (stage_facts: is_layer_sparse = True), so a checkpoint with dense layers has no home.
- Pipeline stages (Qwen2, Qwen3): lm_head on the last stage; tied, the last stage builds its own
  lm_head filled from the embedding (reference/PIPELINE.md §3). The MoE models have no pipeline
  layout on record, so tpshard refuses them at pp > 1.
"""

from tpshard.arch.base import DENSE_MLP, NORMS, QK_NORM, QKV_ATTENTION, VOCAB, Arch, L, Rule, gated_mlp, router, routed_experts
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

QWEN2 = VOCAB + NORMS + QKV_ATTENTION + DENSE_MLP
QWEN3 = QWEN2 + QK_NORM
EXPERTS = router("mlp") + routed_experts("mlp", "gate_proj", "up_proj", "down_proj")
QWEN3_MOE = VOCAB + NORMS + QKV_ATTENTION + QK_NORM + EXPERTS
QWEN2_MOE = (
    VOCAB + NORMS + QKV_ATTENTION + EXPERTS
    + gated_mlp("mlp.shared_expert", "shared_expert", "shared_up", "shared_down", moe=True)
    + (Rule(L + r"\.mlp\.shared_expert_gate", "ReplicatedLinear", "replicated", r"\1.mlp.shared_expert_gate", shape="shared_gate", moe=True),)
)  # fmt: skip


def every_layer_sparse(model: ModelInfo, layer: int) -> bool:
    return True


def refuse_dense_layers(config: dict, model: ModelInfo) -> None:
    text = config.get("text_config", config)
    dense = text.get("mlp_only_layers") or []
    step = text.get("decoder_sparse_step", 1) or 1
    if dense or step > 1:
        raise PlanError(
            f"{model.architecture}: config.json has dense layers (mlp_only_layers {dense}, decoder_sparse_step"
            f" {step}), but SGLang builds every layer of this model with experts; their MLP weights would have no home"
        )


ARCHS = (
    Arch(
        "Qwen2ForCausalLM", QWEN2, "qwen2.py", attn_group="tp", embed_group="attn_tp", dp_lm_head=False,
        pp_head="last", pp_tied_head=True, pp_vllm_tied=True,
    ),
    Arch("Qwen3ForCausalLM", QWEN3, "qwen3.py", attn_group="attn_tp", embed_group="attn_tp", pp_head="last", pp_tied_head=True, pp_vllm_tied=True),
    Arch(
        "Qwen3MoeForCausalLM", QWEN3_MOE, "qwen3_moe.py", attn_group="attn_tp", embed_group="attn_tp",
        sparse=every_layer_sparse, experts_limit="moe_tp", check=refuse_dense_layers,
    ),
    Arch(
        "Qwen2MoeForCausalLM", QWEN2_MOE, "qwen2_moe.py", attn_group="attn_tp", embed_group="attn_tp",
        sparse=every_layer_sparse, experts_limit="tp", check=refuse_dense_layers,
    ),
)  # fmt: skip
