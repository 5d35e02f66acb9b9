"""Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE (SGLang models/qwen2.py, qwen3.py, qwen2_moe.py, qwen3_moe.py).

- Qwen2Attention sizes itself by tp; Qwen2Model cuts the embedding over attn_tp under attention
  DP (`use_attn_tp_group=is_dp_attention_enabled()`); Qwen2ForCausalLM's lm_head ignores
  --enable-dp-lm-head. q/k/v biases are sliced with their weights.
- Qwen3Attention is built with parallel_group="attn_tp"; Qwen3Model is a Qwen2Model.
- The MoE models cut attention over attn_tp and build every decoder layer sparse
  (stage_facts: is_layer_sparse = True), so a checkpoint with dense layers has no home.
- Pipeline stages (Qwen2, Qwen3): lm_head on the last stage; tied, the last stage builds its own
  lm_head filled from the embedding (docs/pipeline.md). The MoE models have no pipeline
  layout on record, so tpshard refuses them at pp > 1.
- Router (transformers' Qwen2MoeTopKRouter, Qwen3MoeTopKRouter): softmax over the experts, the
  top-k weights renormalised when config.json's norm_topk_prob says so.
- Export: vLLM for all four; SGLang for Qwen2 and Qwen3 (its dense classes). SGLang 0.5.23 splits
  attention heads over attn_tp only in the classes written for DP attention (Qwen3Attention);
  Qwen2 splits over the full tp even under --attn-dp-size, which tpshard's attn-dp plan does
  not match (docs/deploy.md, measured). vLLM's Qwen3-MoE router is kept as
  `mlp.experts.gate.weight` (passed to the FusedMoE, models/qwen3_moe.py L170-205), Qwen2-MoE's as
  `mlp.gate.weight`.
- Under an all-to-all MoE backend (--moe-a2a-backend) Qwen2MoeSparseMoeBlock.__init__ builds the
  shared expert "replicated" for deepep, deepep_v2, mori, megamoe, flashinfer, flashinfer_megamoe and
  ascend_fuseep only (qwen2_moe.py L362-382): whole on every rank; under mooncake, nixl and pplx it
  stays over tp. Qwen3-MoE has no shared expert: a backend only sets ep = tp.
"""

from tpshard.arch.base import DENSE_MLP, NORMS, QK_NORM, QKV_ATTENTION, VOCAB, Arch, EngineNames, EngineTable, L, Piece, Rule, gated_mlp, routed_experts, router
from tpshard.arch.engine_names import NO_MLP, ROUTED, SGLANG_DENSE, VLLM_DENSE, VLLM_MOE, vllm_mlp
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import attention_tensors, decoder_tensors, dense_decoder, expert_tensors, mlp_tensors
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

QWEN2 = VOCAB + NORMS + QKV_ATTENTION + DENSE_MLP
QWEN3 = QWEN2 + QK_NORM
EXPERTS = router("mlp") + routed_experts("mlp", "gate_proj", "up_proj", "down_proj")
QWEN3_MOE = VOCAB + NORMS + QKV_ATTENTION + QK_NORM + EXPERTS
# Qwen2MoeSparseMoeBlock's shared expert (over the full tp) and its [1, H] gate (whole), as
# Qwen3.5-MoE and Qwen3-Next reuse it (tpshard/arch/qwen_next.py).
SHARED_EXPERT = (
    gated_mlp("mlp.shared_expert", "shared_expert", "shared_up", "shared_down", moe=True)
    + (Rule(L + r"\.mlp\.shared_expert_gate", "ReplicatedLinear", "replicated", r"\1.mlp.shared_expert_gate", shape="shared_gate", moe=True),)
)  # fmt: skip
QWEN2_MOE = VOCAB + NORMS + QKV_ATTENTION + EXPERTS + SHARED_EXPERT
# Qwen2MoeSparseMoeBlock.__init__ (qwen2_moe.py L362-382) builds the shared expert with
# parallel_group="replicated" under these --moe-a2a-backend choices (whole on every rank), over tp
# under the others; Qwen3.5-MoE and Qwen3-Next build the same block (qwen3_5.py L1148, L1382;
# qwen3_next.py L549, L706).
A2A_SHARED = frozenset(("deepep", "mori", "deepep_v2", "flashinfer", "flashinfer_megamoe", "megamoe", "ascend_fuseep"))


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


def qwen2_expected(model: ModelInfo, config: dict):
    return dense_decoder(model, config, qkv_bias=True)  # Qwen2 attention always has q/k/v biases


def qwen3_expected(model: ModelInfo, config: dict):
    return dense_decoder(model, config, qk_norm=True)


def moe_expected(model: ModelInfo, config: dict, *, qkv_bias: bool, qk_norm: bool, shared: bool):
    """Per layer: attention (Qwen2-MoE: q/k/v biases; Qwen3-MoE: q/k norms), then the router and
    every routed expert (Qwen2-MoE: and the shared expert with its gate, where the config has one)."""

    def mlp(p: str, i: int):
        if not every_layer_sparse(model, i):
            yield from mlp_tensors(f"{p}.mlp")
            return
        yield from expert_tensors(f"{p}.mlp", model, ("gate_proj", "up_proj", "down_proj"))
        if shared and model.shared_expert_intermediate_size:
            yield from (*mlp_tensors(f"{p}.mlp.shared_expert"), f"{p}.mlp.shared_expert_gate.weight")

    return decoder_tensors(model, config, lambda p: attention_tensors(p, config, qkv_bias=qkv_bias, qk_norm=qk_norm), mlp)


def moe_router(config: dict, e: int, k: int) -> RouterConfig:
    return RouterConfig(num_experts=e, top_k=k, renormalize=bool(config.get("norm_topk_prob", False)))


_QWEN3_MOE_VLLM = NO_MLP + ((L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.experts.gate.weight", 0, 1)),) + ROUTED
_QWEN2_MOE_VLLM = (
    NO_MLP
    + (
        (L + r"\.mlp\.gate\.weight", Piece(r"\1.mlp.gate.weight", 0, 1)),
        (L + r"\.mlp\.shared_expert_gate\.weight", Piece(r"\1.mlp.experts._shared_experts._layer.expert_gate.weight", 0, 1)),
    )
    + ROUTED
    + vllm_mlp("mlp.shared_expert", "mlp.experts._shared_experts._layer")
)
DENSE_EXPORTS = EngineNames(vllm=VLLM_DENSE, sglang=SGLANG_DENSE)
QWEN3_EXPORTS = EngineNames(vllm=VLLM_DENSE, sglang=SGLANG_DENSE._replace(attn_dp=True))  # Qwen3Attention: attn_tp

ARCHS = (
    Arch(
        "Qwen2ForCausalLM", QWEN2, "qwen2.py", attn_group="tp", embed_group="attn_tp", model_type="qwen2",
        expected=qwen2_expected, exports=DENSE_EXPORTS, verify="dense", router=None,
        dp_lm_head=False, pp_head="last", pp_tied_head=True, pp_vllm_tied=True,
    ),
    Arch(
        "Qwen3ForCausalLM", QWEN3, "qwen3.py", attn_group="attn_tp", embed_group="attn_tp", model_type="qwen3",
        expected=qwen3_expected, exports=QWEN3_EXPORTS, verify="dense", router=None,
        pp_head="last", pp_tied_head=True, pp_vllm_tied=True,
    ),
    Arch(
        "Qwen3MoeForCausalLM", QWEN3_MOE, "qwen3_moe.py", attn_group="attn_tp", embed_group="attn_tp", model_type="qwen3_moe",
        expected=lambda m, c: moe_expected(m, c, qkv_bias=False, qk_norm=True, shared=False),
        exports=EngineNames(vllm=EngineTable(_QWEN3_MOE_VLLM, **VLLM_MOE), sglang=None), verify="moe", router=moe_router,
        sparse=every_layer_sparse, experts_limit="moe_tp", check=refuse_dense_layers,
    ),
    Arch(
        "Qwen2MoeForCausalLM", QWEN2_MOE, "qwen2_moe.py", attn_group="attn_tp", embed_group="attn_tp", model_type="qwen2_moe",
        expected=lambda m, c: moe_expected(m, c, qkv_bias=True, qk_norm=False, shared=True),
        exports=EngineNames(vllm=EngineTable(_QWEN2_MOE_VLLM, **VLLM_MOE), sglang=None), verify="moe", router=moe_router,
        sparse=every_layer_sparse, experts_limit="tp", check=refuse_dense_layers,
        a2a_shared=A2A_SHARED,
    ),
)  # fmt: skip
