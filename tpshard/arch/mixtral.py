"""Mixtral (SGLang models/mixtral.py): attention, embedding and lm_head over the full tp group,
no attention-DP or DP-lm_head layout; experts `block_sparse_moe.experts.<e>.w1/w3/w2` in a FusedMoE."""

from tpshard.arch.base import NORMS, QKV_ATTENTION, VOCAB, Arch, router, routed_experts

RULES = VOCAB + NORMS + QKV_ATTENTION + router("block_sparse_moe") + routed_experts("block_sparse_moe", "w1", "w3", "w2")

ARCHS = (
    Arch(
        "MixtralForCausalLM", RULES, "mixtral.py", attn_group="tp", embed_group="tp", dp_lm_head=False,
        attn_dp=False, sparse=lambda model, layer: True,
    ),
)  # fmt: skip
