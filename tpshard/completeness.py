"""Which tensors a checkpoint must hold, by architecture and config.json: a refusal names what is missing.

A split of a checkpoint that lacks a layer's weight would write an output that `check` proves
"bit-exact" to an incomplete source, and the engine would then load random or missing weights. So
every architecture states what its config implies (`EXPECTED`, one function per family: layer
count, norms, biases the config asks for, lm_head when untied) and `check_complete` refuses a
checkpoint that lacks any of it (tpshard.plan's rules refuse layers past `num_hidden_layers`).

A quantized linear counts as present when any of its tensors is (its full set of tensors is the
quantized format's business: tpshard.plan refuses a partial one). Families added elsewhere (MoE,
MLA) are listed in EXPECTED too: every routed expert of every sparse layer must be there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tpshard.errors import CheckpointError
from tpshard.manifest import ModelInfo


def _get(config: dict, key: str, default=None):
    if config.get(key) is not None:
        return config[key]
    text = config.get("text_config") or {}
    return text.get(key, default) if text.get(key) is not None else default


def dense_decoder(
    model: ModelInfo, config: dict, *, qkv_bias: bool = False, qk_norm: bool = False
) -> Iterable[str]:
    """Llama-style decoder: embedding, final norm, untied lm_head; per layer two norms, q/k/v/o and a
    gated MLP (biases where config.json asks for them)."""
    yield "model.embed_tokens.weight"
    yield "model.norm.weight"
    if not _get(config, "tie_word_embeddings", False):
        yield "lm_head.weight"
    mlp_bias = bool(_get(config, "mlp_bias", False))
    for i in range(model.num_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        yield from _attention(p, config, qkv_bias=qkv_bias, qk_norm=qk_norm)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{p}.mlp.{proj}.weight"
            if mlp_bias:
                yield f"{p}.mlp.{proj}.bias"


def _attention(p: str, config: dict, *, qkv_bias: bool = False, qk_norm: bool = False) -> Iterable[str]:
    attn_bias = bool(_get(config, "attention_bias", False))
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield f"{p}.self_attn.{proj}.weight"
        if attn_bias or (qkv_bias and proj != "o_proj"):
            yield f"{p}.self_attn.{proj}.bias"
    if qk_norm:
        yield from (f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight")


def _mla(p: str, model: ModelInfo) -> Iterable[str]:
    a = f"{p}.self_attn"
    if model.q_lora_rank:
        yield from (f"{a}.q_a_proj.weight", f"{a}.q_a_layernorm.weight", f"{a}.q_b_proj.weight")
    else:
        yield f"{a}.q_proj.weight"
    yield from (f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_a_layernorm.weight", f"{a}.kv_b_proj.weight", f"{a}.o_proj.weight")


def _experts(block: str, model: ModelInfo, names: tuple[str, str, str]) -> Iterable[str]:
    yield f"{block}.gate.weight"
    for e in range(model.num_experts):
        yield from (f"{block}.experts.{e}.{n}.weight" for n in names)


def _mlp(block: str) -> Iterable[str]:
    yield from (f"{block}.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj"))


def moe_decoder(model: ModelInfo, config: dict, family: str) -> Iterable[str]:
    """The MoE families: attention (q/k/v/o or MLA), and per layer a dense MLP or a router, every
    routed expert and the shared experts the config names. DeepSeek's MTP layers are optional: an
    engine that serves without speculative decoding never reads them."""
    from tpshard.arch import arch_for

    sparse = arch_for(model).sparse
    yield from ("model.embed_tokens.weight", "model.norm.weight")
    if not _get(config, "tie_word_embeddings", False):
        yield "lm_head.weight"
    for i in range(model.num_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        if family == "deepseek":
            yield from _mla(p, model)
        else:
            yield from _attention(p, config, qkv_bias=family == "qwen2_moe", qk_norm=family == "qwen3_moe")
        if family == "mixtral":
            yield from _experts(f"{p}.block_sparse_moe", model, ("w1", "w2", "w3"))
        elif sparse is None or not sparse(model, i):
            yield from _mlp(f"{p}.mlp")
        else:
            yield from _experts(f"{p}.mlp", model, ("gate_proj", "up_proj", "down_proj"))
            if family == "deepseek" and model.topk_method == "noaux_tc":
                yield f"{p}.mlp.gate.e_score_correction_bias"
            if family == "deepseek" and model.num_shared_experts:
                yield from _mlp(f"{p}.mlp.shared_experts")
            if family == "qwen2_moe" and model.shared_expert_intermediate_size:
                yield from (*_mlp(f"{p}.mlp.shared_expert"), f"{p}.mlp.shared_expert_gate.weight")


Expected = Callable[[ModelInfo, dict], Iterable[str]]

EXPECTED: dict[str, Expected] = {
    "LlamaForCausalLM": dense_decoder,
    "MistralForCausalLM": dense_decoder,
    "Qwen2ForCausalLM": lambda m, c: dense_decoder(m, c, qkv_bias=True),  # Qwen2 attention always has q/k/v biases
    "Qwen3ForCausalLM": lambda m, c: dense_decoder(m, c, qk_norm=True),
    "Qwen3MoeForCausalLM": lambda m, c: moe_decoder(m, c, "qwen3_moe"),
    "Qwen2MoeForCausalLM": lambda m, c: moe_decoder(m, c, "qwen2_moe"),
    "MixtralForCausalLM": lambda m, c: moe_decoder(m, c, "mixtral"),
    "DeepseekV3ForCausalLM": lambda m, c: moe_decoder(m, c, "deepseek"),
    "DeepseekV2ForCausalLM": lambda m, c: moe_decoder(m, c, "deepseek"),
}

def check_complete(model: ModelInfo, config: dict, names: Iterable[str], quantized: Callable[[str], bool]) -> None:
    """Refuse a checkpoint missing a tensor its architecture and config imply (layers past
    num_hidden_layers are refused by tpshard.plan's rules). `quantized(module)` says whether the
    quantization config quantizes a module."""
    names = set(names)
    expected = EXPECTED.get(model.architecture)
    if expected is None:
        return  # no table: the rules still refuse every tensor they do not know
    modules = {n.rpartition(".")[0] for n in names}
    missing = []
    for name in expected(model, config):
        if name in names:
            continue
        module, _, param = name.rpartition(".")
        if param == "weight" and module in modules and quantized(module):
            continue  # stored as qweight/scales/...: the quantized format checks its own set
        missing.append(name)
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise CheckpointError(
            f"the checkpoint lacks {', '.join(missing[:6])}{more}, which {model.architecture} with this"
            " config.json needs (incomplete download? a config from another model?)"
        )
