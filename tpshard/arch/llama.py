"""Llama and Mistral (SGLang models/llama.py; MistralForCausalLM subclasses LlamaForCausalLM).

LlamaAttention sizes itself by the full tp group and LlamaModel builds a plain
VocabParallelEmbedding: attention DP changes neither, only lm_head follows --dp-lm-head.

Pipeline stages: LlamaForCausalLM builds its ParallelLMHead on every stage and the loader fills it
there; tied, lm_head is model.embed_tokens, which only the first stage has, so SGLang cannot serve a
tied Llama/Mistral at pp > 1 (docs/pipeline.md).

Export: both engines' Llama class stacks q/k/v and gate/up (`stacked_params_mapping` in
models/llama.py of vLLM and SGLang); vLLM adds its attention's scale buffers. Under attention DP
SGLang's LlamaAttention still splits heads over the full tp, so an attn-dp split is not its layout.
"""

from tpshard.arch.base import DENSE_MLP, NORMS, QKV_ATTENTION, VOCAB, Arch, EngineNames
from tpshard.arch.engine_names import SGLANG_DENSE, VLLM_DENSE
from tpshard.arch.tensors import dense_decoder

RULES = VOCAB + NORMS + QKV_ATTENTION + DENSE_MLP
EXPORTS = EngineNames(vllm=VLLM_DENSE, sglang=SGLANG_DENSE)

ARCHS = tuple(
    Arch(
        name, RULES, engine, attn_group="tp", embed_group="tp", model_type=model_type, expected=dense_decoder,
        exports=EXPORTS, verify="dense", router=None, pp_head="every", pp_vllm_tied=True,
    )
    for name, engine, model_type in (
        ("LlamaForCausalLM", "llama.py", "llama"),
        ("MistralForCausalLM", "llama.py (MistralForCausalLM)", "mistral"),
    )
)  # fmt: skip
