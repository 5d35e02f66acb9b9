"""What tpshard accepts from a checkpoint folder, beyond the safetensors headers (safetensors_format).

- config.json numbers: the types and ranges of every field the rules read (`CONFIG_FIELDS`, a
  table families with more fields extend), refused by name before any rule uses them;
- file names from an index: plain names inside the folder, never a path;
- files read or copied from the folder (weights, config, tokenizer, ...) must resolve inside it,
  except the Hugging Face cache layout, where `snapshots/<rev>/NAME` is a relative link into the
  repository's `blobs/`; dotfiles (.gitattributes, .DS_Store, ...) are never copied.

What it is not: no sharding rules, no tensor data; completeness (which tensors a config implies)
is tpshard.completeness.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from tpshard.errors import CheckpointError


class Field(NamedTuple):
    key: str
    kind: str  # "int" | "number" | "bool" | "str" | "dict" | "list[str]"
    lo: float = 0  # bounds: ints [lo, hi], numbers (lo, hi]
    hi: float = 0
    required: bool = False


# The config.json fields the dense rules read (top level, or under text_config). Bounds are far
# past any real model and keep every count a plan multiplies bounded.
CONFIG_FIELDS: list[Field] = [
    Field("architectures", "list[str]", required=True),
    Field("model_type", "str"),
    Field("hidden_size", "int", 1, 1 << 20, required=True),
    Field("num_hidden_layers", "int", 1, 100_000, required=True),
    Field("num_attention_heads", "int", 1, 1 << 16, required=True),
    Field("num_key_value_heads", "int", 1, 1 << 16),
    Field("head_dim", "int", 1, 1 << 16),
    Field("intermediate_size", "int", 1, 1 << 24),  # required unless the config names routed experts (check_config)
    Field("vocab_size", "int", 1, 1 << 26, required=True),
    Field("tie_word_embeddings", "bool"),
    Field("attention_bias", "bool"),
    Field("mlp_bias", "bool"),
    Field("rms_norm_eps", "number", 0, 1),
    Field("rope_theta", "number", 0, 1e30),
    Field("rope_parameters", "dict"),
    Field("rope_scaling", "dict"),
    Field("dtype", "str"),
    Field("torch_dtype", "str"),
    Field("rope_parameters.rope_theta", "number", 0, 1e30),
    Field("text_config", "dict"),
    Field("quantization_config", "dict"),
    # MoE and MLA families (DeepSeek, Qwen-MoE, Mixtral): counts and sizes the tables read.
    *(Field(k, "int", 0, 1 << 20) for k in (
        "n_routed_experts", "num_experts", "num_local_experts", "num_experts_per_tok", "n_shared_experts",
        "first_k_dense_replace", "n_group", "topk_group", "num_nextn_predict_layers", "decoder_sparse_step",
        "num_hash_layers",
    )),
    *(Field(k, "int", 1, 1 << 24) for k in (
        "moe_intermediate_size", "shared_expert_intermediate_size", "moe_layer_freq", "q_lora_rank",
        "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "o_groups", "o_lora_rank",
    )),
    # Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next): head counts and sizes, the layers' kinds.
    *(Field(k, "int", 1, 1 << 16) for k in (
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
        "full_attention_interval",
    )),
    Field("layer_types", "list[str]"),
    Field("routed_scaling_factor", "number", 0, 1e6),
    Field("norm_topk_prob", "bool"),
    Field("scoring_func", "str"),
    Field("topk_method", "str"),
]  # fmt: skip


# The config.json keys that name a count of routed experts (one per family's spelling).
EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")


def _lookup(scope: dict, key: str):
    """scope[key], where a dotted key reaches into nested objects (rope_parameters.rope_theta)."""
    for part in key.split("."):
        if not isinstance(scope, dict) or scope.get(part) is None:
            return None
        scope = scope[part]
    return scope


def _type_ok(value: object, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "list[str]":
        return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v for v in value)
    return isinstance(value, {"bool": bool, "str": str, "dict": dict}[kind])


def check_config(config: object, where: str, fields: list[Field] | None = None, known: Callable[[str], None] | None = None) -> None:
    """Refuse a config.json whose fields have the wrong type or an absurd value, by name.

    A field may sit at the top level or under `text_config` (multimodal configs); null counts as absent.
    `known` refuses an architecture tpshard does not support (tpshard.arch.refuse_architecture),
    before a key the config lacks: passed in, as tpshard.arch imports this module's users.
    """
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: not a JSON object")
    text = config.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise CheckpointError(f"{where}: text_config is not an object")
    for f in fields or CONFIG_FIELDS:
        for scope, prefix in ((config, ""), (text or {}, "text_config.")):
            value = _lookup(scope, f.key)
            if value is None:
                continue
            if not _type_ok(value, f.kind):
                raise CheckpointError(f"{where}: {prefix}{f.key} = {value!r} is not a {f.kind.replace('number', 'finite number')}")
            if f.kind in ("int", "number"):
                low_ok = value > f.lo if f.kind == "number" else value >= f.lo  # numbers: lo excluded
                if not (low_ok and value <= f.hi):
                    bounds = f"({f.lo:g}, {f.hi:g}]" if f.kind == "number" else f"[{f.lo:g}, {f.hi:g}]"
                    raise CheckpointError(f"{where}: {prefix}{f.key} = {value!r} is out of range {bounds}")
    if known is not None and config.get("architectures"):  # a model tpshard does not know: say so, not which keys it lacks
        known(config["architectures"][0])
    get = lambda k: config.get(k) if config.get(k) is not None else (text or {}).get(k)  # noqa: E731
    # A MoE model may have no dense MLP at all (Qwen3.5-MoE): intermediate_size is then not needed.
    needed = [f.key for f in fields or CONFIG_FIELDS if f.required] + ([] if any(get(k) for k in EXPERT_COUNTS) else ["intermediate_size"])
    absent = [k for k in needed if get(k) is None]
    if absent:
        raise CheckpointError(f"{where} lacks {', '.join(absent)}")
    heads, kv = get("num_attention_heads"), get("num_key_value_heads")
    if kv is not None and (kv > heads or heads % kv):
        raise CheckpointError(f"{where}: num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    mla = [k for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim") if get(k) is None]
    if get("kv_lora_rank") is not None and mla:  # MLA attention: its head dims are not derived
        raise CheckpointError(f"{where}: kv_lora_rank is set for MLA attention, but {', '.join(mla)} is not")
    if get("head_dim") is None and get("hidden_size") % heads:
        raise CheckpointError(f"{where}: hidden_size {get('hidden_size')} is not a multiple of num_attention_heads {heads}, and head_dim is not given")


def read_config(folder: Path, known: Callable[[str], None] | None = None) -> dict:
    """`folder`/config.json, checked: inside the folder, JSON, and its fields (check_config)."""
    path = folder / "config.json"
    check_inside(path, folder)
    try:
        config = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({str(e)[:100]})") from None
    check_config(config, str(path), known=known)
    return config


def plain_name(name: object) -> bool:
    """A file name that stays inside the folder it is joined to: one path component, no separator,
    no NUL, not hidden (so neither '.' nor '..'). Checkpoint indexes, manifests and exports alike."""
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")


def check_plain_name(name: object, where: str) -> str:
    """A file name an index or a manifest may use: one path component inside the folder."""
    if not plain_name(name):
        raise CheckpointError(f"{where}: {name!r} is not a plain file name inside the checkpoint folder")
    return name


def resolves_inside(path: Path, folder: Path) -> bool:
    """`path` (a name in `folder`, maybe a link) ends inside `folder`, or in the blobs of a Hugging
    Face cache repository when `folder` is one of its snapshots."""
    real, home = path.resolve(), folder.resolve()
    if home in real.parents:
        return True
    # HF cache: <repo>/snapshots/<revision>/NAME -> ../../blobs/<hash>
    return home.parent.name == "snapshots" and real.parent == home.parent.parent / "blobs"


def check_inside(path: Path, folder: Path) -> None:
    if not resolves_inside(path, folder):
        raise CheckpointError(
            f"{folder}: {path.name} is a link to {path.resolve()}, outside the checkpoint folder;"
            " tpshard reads and copies only files inside it (or the Hugging Face cache blobs)"
        )
