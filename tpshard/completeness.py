"""Which tensors a checkpoint must hold, by architecture and config.json: a refusal names what is missing.

A split of a checkpoint that lacks a layer's weight would write an output that `check` proves
"bit-exact" to an incomplete source, and the engine would then load random or missing weights. So
every architecture states what its config implies (`EXPECTED`, one function per family: layer
count, norms, biases the config asks for, lm_head when untied) and `check_complete` refuses a
checkpoint that lacks any of it, or that has layers past `num_hidden_layers`.

A quantized linear counts as present when any of its tensors is (its full set of tensors is the
quantized format's business: tpshard.plan refuses a partial one). Families added elsewhere (MoE,
MLA) register their function in EXPECTED under their architecture names.
"""

from __future__ import annotations

import re
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
    attn_bias = bool(_get(config, "attention_bias", False))
    mlp_bias = bool(_get(config, "mlp_bias", False))
    for i in range(model.num_layers):
        p = f"model.layers.{i}"
        yield from (f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight")
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            yield f"{p}.self_attn.{proj}.weight"
            if attn_bias or (qkv_bias and proj != "o_proj"):
                yield f"{p}.self_attn.{proj}.bias"
        if qk_norm:
            yield from (f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            yield f"{p}.mlp.{proj}.weight"
            if mlp_bias:
                yield f"{p}.mlp.{proj}.bias"


Expected = Callable[[ModelInfo, dict], Iterable[str]]

EXPECTED: dict[str, Expected] = {
    "LlamaForCausalLM": dense_decoder,
    "MistralForCausalLM": dense_decoder,
    "Qwen2ForCausalLM": lambda m, c: dense_decoder(m, c, qkv_bias=True),  # Qwen2 attention always has q/k/v biases
    "Qwen3ForCausalLM": lambda m, c: dense_decoder(m, c, qk_norm=True),
}

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_complete(model: ModelInfo, config: dict, names: Iterable[str], quantized: Callable[[str], bool]) -> None:
    """Refuse a checkpoint missing a tensor its architecture and config imply, or holding layers past
    num_hidden_layers. `quantized(module)` says whether the quantization config quantizes a module."""
    names = set(names)
    beyond = sorted({int(m.group(1)) for n in names if (m := _LAYER.match(n)) and int(m.group(1)) >= model.num_layers})
    if beyond:
        raise CheckpointError(
            f"the checkpoint has tensors of layer {beyond[0]}"
            + (f" (and {len(beyond) - 1} more layers)" if len(beyond) > 1 else "")
            + f", but config.json says num_hidden_layers {model.num_layers}"
        )
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
