"""Reading a Hugging Face checkpoint folder: config, index, and tensor headers — never tensor data.

A checkpoint is a folder with config.json and either model.safetensors or
model.safetensors.index.json naming its shard files. consolidated*.safetensors (Mistral's
original-format copy) is ignored; pickle checkpoints (.bin/.pt) are refused, since loading them
runs arbitrary code and cannot be memory-mapped.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from tpshard.arch import refuse_architecture
from tpshard.collector import paused, release_freed_memory
from tpshard.errors import CheckpointError
from tpshard.inputs import EXPERT_COUNTS, check_inside, check_plain_name, read_config
from tpshard.manifest import ModelInfo
from tpshard.safetensors_format import HeaderError, TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class Checkpoint(msgspec.Struct, frozen=True, kw_only=True):
    path: Path
    config: dict
    weight_files: tuple[str, ...]  # safetensors files holding the weights, sorted
    tensors: dict[str, TensorInfo]  # every weight, in the order of the files and their headers
    index_file: str | None  # model.safetensors.index.json when sharded

    def extra_files(self) -> list[str]:
        """Non-weight files (config, tokenizer, ...) to copy beside each rank's shards: no dotfiles,
        nothing that resolves outside the folder (tpshard.inputs)."""
        skip = set(self.weight_files) | {INDEX_NAME}
        names = sorted(
            p.name
            for p in self.path.iterdir()
            if p.is_file() and p.name not in skip and not p.name.startswith(".") and not _is_weight_file(p.name)
        )
        for name in names:
            check_inside(self.path / name, self.path)
        return names


def _is_weight_file(name: str) -> bool:
    return name.endswith((".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf"))


@paused()
def open_checkpoint(path: str | Path) -> Checkpoint:
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint folder")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json; tpshard needs a Hugging Face checkpoint folder")
    config = read_config(path, known=refuse_architecture)

    index_path = path / INDEX_NAME
    if index_path.is_file():
        check_inside(index_path, path)
        try:
            weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            raise CheckpointError(f"{index_path}: not a safetensors index ({str(e)[:100]!r})") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: weight_map is not a non-empty object")
        for tname, fname in weight_map.items():
            check_plain_name(fname, f"{index_path}: weight_map[{tname!r}]")
        files = sorted(set(weight_map.values()))
        index_file: str | None = INDEX_NAME
    elif (path / SINGLE_NAME).is_file():
        weight_map, files, index_file = {}, [SINGLE_NAME], None
    else:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        if pickles:
            raise CheckpointError(
                f"{path}: only pickle weights ({', '.join(pickles[:3])}); tpshard reads safetensors"
                " only. Convert first, e.g. transformers: model.save_pretrained(dir, safe_serialization=True)"
            )
        raise CheckpointError(f"{path}: no {SINGLE_NAME} or {INDEX_NAME}")

    tensors: dict[str, TensorInfo] = {}
    for name in files:
        file_path = path / name
        if not file_path.is_file():
            raise CheckpointError(f"{path}: {INDEX_NAME} names {name}, which does not exist")
        check_inside(file_path, path)
        try:
            header, _ = read_header(file_path)
        except HeaderError as e:
            raise CheckpointError(str(e)) from None
        except OSError as e:
            raise CheckpointError(f"{file_path}: cannot be read ({e.strerror})") from None
        for tname, info in header.items():
            if index_file and weight_map.get(tname) != name:
                continue  # the index is the source of truth for which file holds a tensor
            tensors[tname] = info
    missing = sorted(t for t, f in weight_map.items() if t not in tensors)
    if missing:
        t = missing[0]
        raise CheckpointError(
            f"{path}: {INDEX_NAME} maps {t} to {weight_map[t]}, but that file has no such tensor"
            + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    release_freed_memory()  # the header texts
    return Checkpoint(path=path, config=config, weight_files=tuple(files), tensors=tensors, index_file=index_file)


def _get(config: dict, key: str, default=None):
    # Multimodal configs nest the decoder under text_config.
    # null counts as absent, as tpshard.inputs.check_config treats it.
    if config.get(key) is not None:
        return config[key]
    value = (config.get("text_config") or {}).get(key)
    return default if value is None else value


def model_info(ckpt: Checkpoint) -> ModelInfo:
    """The config numbers the sharding rules need, checked against the tensors on disk."""
    config = ckpt.config
    archs = config.get("architectures") or []
    if not archs:
        raise CheckpointError(f"{ckpt.path}/config.json has no 'architectures'")
    required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size") + (() if _has_experts(config) else ("intermediate_size",))
    absent = [k for k in required if _get(config, k) is None]
    if absent:
        raise CheckpointError(f"{ckpt.path}/config.json lacks {', '.join(absent)}")
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    rope = _get(config, "rope_parameters") or {}
    dtype = _get(config, "dtype") or _get(config, "torch_dtype") or "bfloat16"
    return ModelInfo(
        architecture=archs[0],
        model_type=config.get("model_type", ""),
        hidden_size=hidden,
        num_layers=_get(config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_get(config, "num_key_value_heads") or heads,
        head_dim=_get(config, "head_dim") or hidden // heads,
        intermediate_size=_get(config, "intermediate_size", 0),  # 0: a MoE model without a dense MLP (Qwen3.5-MoE)
        vocab_size=_get(config, "vocab_size"),
        # What is on disk decides: a checkpoint without its lm_head (DeepSeek-V4's native name:
        # head.weight; Llama-4's language_model.lm_head.weight) is tied whatever config says.
        tie_word_embeddings=not ({"lm_head.weight", "head.weight", "language_model.lm_head.weight"} & ckpt.tensors.keys()),
        rms_norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", _get(config, "rope_theta", 10000.0))),
        dtype={"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(dtype), str(dtype)),
        **_moe_mla_info(config),
    )


def _has_experts(config: dict) -> bool:
    return any(_get(config, k) for k in EXPERT_COUNTS)


def _moe_mla_info(config: dict) -> dict:
    """MoE and MLA numbers under the names each family's config uses; absent keys keep ModelInfo's defaults."""
    g = lambda key, default=None: _get(config, key, default)  # noqa: E731
    experts = next((g(k) for k in EXPERT_COUNTS if g(k)), 0)
    info: dict = {}
    if experts:
        expert_size = g("moe_intermediate_size") or g("intermediate_size")
        shared = g("n_shared_experts") or 0
        info.update(
            num_experts=int(experts),
            num_experts_per_tok=int(g("num_experts_per_tok") or 0),
            moe_intermediate_size=int(expert_size),
            num_shared_experts=int(shared),
            shared_expert_intermediate_size=int(g("shared_expert_intermediate_size") or shared * expert_size),
            first_k_dense_replace=int(g("first_k_dense_replace") or 0),
            moe_layer_freq=int(g("moe_layer_freq") or g("interleave_moe_layer_step") or 1),  # Llama-4: its step
            norm_topk_prob=bool(g("norm_topk_prob", False)),
            # DeepSeek-V3 configs written by transformers omit these; the model always routes so.
            scoring_func=str(g("scoring_func") or ("sigmoid" if config.get("model_type") == "deepseek_v3" else "")),
            topk_method=str(g("topk_method") or ("noaux_tc" if config.get("model_type") == "deepseek_v3" else "")),
            n_group=int(g("n_group") or 0),
            topk_group=int(g("topk_group") or 0),
            routed_scaling_factor=float(g("routed_scaling_factor") or 1.0),
        )
    if g("kv_lora_rank"):
        info.update(
            q_lora_rank=g("q_lora_rank") or None,
            kv_lora_rank=int(g("kv_lora_rank")),
            qk_nope_head_dim=int(g("qk_nope_head_dim")),
            qk_rope_head_dim=int(g("qk_rope_head_dim")),
            v_head_dim=int(g("v_head_dim")),
        )
    if g("o_groups"):  # DeepSeek-V4 (tpshard/arch/deepseek_v4.py): LoRA query, grouped output projection
        info.update(q_lora_rank=int(g("q_lora_rank") or 0), o_groups=int(g("o_groups")), o_lora_rank=int(g("o_lora_rank") or 0))
        info.update(index_n_heads=int(g("index_n_heads") or 0), index_head_dim=int(g("index_head_dim") or 0))
    if experts and str((config.get("quantization_config") or {}).get("quant_method", "")).lower() == "mxfp4":
        info.update(expert_block=32)  # gpt-oss MXFP4: the fused experts in 32-value blocks
    if experts or g("kv_lora_rank"):  # DeepSeek's and GLM's MTP layers, stored as layers num_hidden_layers, ...
        info.update(num_nextn_predict_layers=int(g("num_nextn_predict_layers") or 0))
    if g("linear_num_value_heads"):  # gated DeltaNet linear attention (Qwen3.5, Qwen3-Next)
        info.update({k: int(g(k) or 0) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")})
    return info
