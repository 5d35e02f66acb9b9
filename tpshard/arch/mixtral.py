"""Mixtral (SGLang models/mixtral.py): attention, embedding and lm_head over the full tp group,
no attention-DP or DP-lm_head layout; experts `block_sparse_moe.experts.<e>.w1/w3/w2` in a FusedMoE.

Router: softmax over the experts, the top-k weights renormalised (transformers' MixtralTopKRouter).
Export: vLLM only; vLLM's Mixtral keeps its checkpoint's block name (models/mixtral.py), so the
router stays `block_sparse_moe.gate`.
"""

from tpshard.arch.base import NORMS, QKV_ATTENTION, VOCAB, Arch, EngineNames, EngineTable, L, Piece, routed_experts, router
from tpshard.arch.engine_names import NO_MLP, VLLM_MOE, vllm_experts
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import attention_tensors, decoder_tensors, expert_tensors
from tpshard.manifest import ModelInfo

RULES = VOCAB + NORMS + QKV_ATTENTION + router("block_sparse_moe") + routed_experts("block_sparse_moe", "w1", "w3", "w2")


def expected(model: ModelInfo, config: dict):
    """Every layer: q/k/v/o, the router and every expert's w1, w2, w3."""
    return decoder_tensors(
        model, config, lambda p: attention_tensors(p, config),
        lambda p, i: expert_tensors(f"{p}.block_sparse_moe", model, ("w1", "w2", "w3")),
    )  # fmt: skip


VLLM_PIECES = NO_MLP + (
    (L + r"\.block_sparse_moe\.gate\.weight", Piece(r"\1.block_sparse_moe.gate.weight", 0, 1)),
) + vllm_experts("block_sparse_moe", "w1", "w3", "w2", "block_sparse_moe.experts.routed_experts")

ARCHS = (
    Arch(
        "MixtralForCausalLM", RULES, "mixtral.py", attn_group="tp", embed_group="tp", model_type="mixtral",
        expected=expected, exports=EngineNames(vllm=EngineTable(VLLM_PIECES, **VLLM_MOE), sglang=None), verify="moe",
        router=lambda config, e, k: RouterConfig(num_experts=e, top_k=k, renormalize=True),
        dp_lm_head=False, attn_dp=False, sparse=lambda model, layer: True,
    ),
)  # fmt: skip
