"""The tensors a complete checkpoint holds: pieces the family modules compose into their `expected`.

A split of a checkpoint that lacks a layer's weight would write an output that `check` proves
"bit-exact" to an incomplete source, and the engine would then load random or missing weights. So
every architecture states what its config implies (`Arch.expected`: layer count, norms, biases the
config asks for, lm_head when untied, every routed expert of every sparse layer) and
tpshard.completeness refuses a checkpoint that lacks any of it. The names come in a fixed order:
a refusal lists the first ones missing.

Not here: the refusal (tpshard.completeness), the slicing rules (tpshard.arch.base).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tpshard.manifest import ModelInfo


def config_value(config: dict, key: str, default=None):
    """`key` of config.json, or of its `text_config` (multimodal wrappers), else `default`."""
    if config.get(key) is not None:
        return config[key]
    text = config.get("text_config") or {}
    return text.get(key, default) if text.get(key) is not None else default


def decoder_tensors(
    model: ModelInfo, config: dict, attention: Callable[[str], Iterable[str]], mlp: Callable[[str, int], Iterable[str]]
) -> Iterable[str]:
    """Embedding, final norm, untied lm_head; per layer `L` (model.layers.i) its two norms,
    `attention(L)` and `mlp(L, i)`."""
    yield "model.embed_tokens.weight"
    yield "model.norm.weight"
    if not config_value(config, "tie_word_embeddings", False):
        yield "lm_head.weight"
    for i in range(model.num_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        yield from attention(p)
        yield from mlp(p, i)


def attention_tensors(p: str, config: dict, *, qkv_bias: bool = False, qk_norm: bool = False) -> Iterable[str]:
    """q/k/v/o of layer `p`, their biases where config.json's attention_bias (or `qkv_bias`) asks,
    and Qwen3's per-head q/k norms."""
    attn_bias = bool(config_value(config, "attention_bias", False))
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        yield f"{p}.self_attn.{proj}.weight"
        if attn_bias or (qkv_bias and proj != "o_proj"):
            yield f"{p}.self_attn.{proj}.bias"
    if qk_norm:
        yield from (f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight")


def mlp_tensors(block: str, *, bias: bool = False) -> Iterable[str]:
    """gate/up/down_proj of a SiLU MLP at `block`, each with its bias when `bias`."""
    for proj in ("gate_proj", "up_proj", "down_proj"):
        yield f"{block}.{proj}.weight"
        if bias:
            yield f"{block}.{proj}.bias"


def expert_tensors(block: str, model: ModelInfo, names: tuple[str, str, str]) -> Iterable[str]:
    """The router `block.gate` and the three projections `names` of every routed expert."""
    yield f"{block}.gate.weight"
    for e in range(model.num_experts):
        yield from (f"{block}.experts.{e}.{n}.weight" for n in names)


def dense_decoder(model: ModelInfo, config: dict, *, qkv_bias: bool = False, qk_norm: bool = False) -> Iterable[str]:
    """Llama-style decoder: embedding, final norm, untied lm_head; per layer two norms, q/k/v/o and a
    gated MLP (biases where config.json asks for them)."""
    mlp_bias = bool(config_value(config, "mlp_bias", False))
    return decoder_tensors(
        model, config, lambda p: attention_tensors(p, config, qkv_bias=qkv_bias, qk_norm=qk_norm),
        lambda p, i: mlp_tensors(f"{p}.mlp", bias=mlp_bias),
    )  # fmt: skip
