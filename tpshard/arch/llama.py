"""Llama and Mistral (SGLang models/llama.py; MistralForCausalLM subclasses LlamaForCausalLM).

LlamaAttention sizes itself by the full tp group and LlamaModel builds a plain
VocabParallelEmbedding: attention DP changes neither, only lm_head follows --dp-lm-head.
"""

from tpshard.arch.base import DENSE_MLP, NORMS, QKV_ATTENTION, VOCAB, Arch

RULES = VOCAB + NORMS + QKV_ATTENTION + DENSE_MLP

ARCHS = (
    Arch("LlamaForCausalLM", RULES, "llama.py", attn_group="tp", embed_group="tp"),
    Arch("MistralForCausalLM", RULES, "llama.py (MistralForCausalLM)", attn_group="tp", embed_group="tp"),
)
