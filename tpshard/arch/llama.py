"""Llama and Mistral (SGLang models/llama.py; MistralForCausalLM subclasses LlamaForCausalLM).

LlamaAttention sizes itself by the full tp group and LlamaModel builds a plain
VocabParallelEmbedding: attention DP changes neither, only lm_head follows --dp-lm-head.

Pipeline stages: LlamaForCausalLM builds its ParallelLMHead on every stage and the loader fills it
there; tied, lm_head is model.embed_tokens, which only the first stage has, so SGLang cannot serve a
tied Llama/Mistral at pp > 1 (reference/PIPELINE.md §3).
"""

from tpshard.arch.base import DENSE_MLP, NORMS, QKV_ATTENTION, VOCAB, Arch

RULES = VOCAB + NORMS + QKV_ATTENTION + DENSE_MLP

ARCHS = (
    Arch("LlamaForCausalLM", RULES, "llama.py", attn_group="tp", embed_group="tp", pp_head="every", pp_vllm_tied=True),
    Arch("MistralForCausalLM", RULES, "llama.py (MistralForCausalLM)", attn_group="tp", embed_group="tp", pp_head="every", pp_vllm_tied=True),
)
