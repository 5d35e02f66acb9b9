"""Which quantized format each module of a checkpoint is in: `quantization_config` resolved per module.

What this file is: `read_quant_config(folder, config)` finds the quantization config (config.json
`quantization_config`, else `quantize_config.json`) and returns a `QuantConfig` whose
`spec_for(module, is_linear)` gives the module's `QuantSpec`, or None when the module stays in the
model dtype. Resolution follows the producing tools and the engines:

- GPTQ (AutoGPTQ / GPTQModel / transformers): every linear of the decoder; lm_head only with
  `lm_head: true`; GPTQModel `dynamic` regexes (`re.match`, first match wins) override bits,
  group_size, desc_act and sym (`+:` or no prefix) or leave the module unquantized (`-:`);
  `checkpoint_format` gptq / gptq_v2 / marlin (or the legacy `is_marlin_format`).
- AWQ (`version: gemm` only): every decoder linear except `modules_to_not_convert` (substrings).
- FP8 (`quant_method: fp8`): block (`weight_block_size`) or per-tensor; every decoder linear except
  lm_head and `modules_to_not_convert` / `ignored_layers` (substrings).
- compressed-tensors: `config_groups[*].targets` (a class name such as `Linear`, `re:<regex>`, or
  an exact module name) minus `ignore` (same forms); the group's (or top-level) `format` picks
  pack-quantized / float-quantized / nvfp4-pack-quantized.
- MoE router gates (`mlp.gate`, `block_sparse_moe.gate`) are never quantized.

What it is not: no layouts (tpshard.quant.formats), no sharding; `is_linear` comes from the rule
table (the caller knows which modules are nn.Linear).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tpshard.errors import CheckpointError
from tpshard.quant.formats import QuantSpec

_ROUTER = re.compile(r".*\.(mlp|block_sparse_moe)\.gate")


class QuantConfig:
    """A parsed quantization config: `spec_for(module, is_linear)` -> QuantSpec | None."""

    def __init__(self, method: str, raw: dict, resolve):
        self.method = method  # quant_method as written
        self.raw = raw
        self._resolve = resolve

    def spec_for(self, module: str, is_linear: bool) -> QuantSpec | None:
        if not is_linear or _ROUTER.fullmatch(module):
            return None
        return self._resolve(module)


def read_quant_config(folder: str | Path, config: dict) -> QuantConfig | None:
    """The checkpoint's quantization config, or None for a dense checkpoint."""
    raw = config.get("quantization_config")
    if raw is None:
        path = Path(folder) / "quantize_config.json"
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except ValueError as e:
                raise CheckpointError(f"{path}: not valid JSON ({e})") from None
            raw.setdefault("quant_method", "gptq")  # AutoGPTQ files may omit it
    if raw is None:
        return None
    method = str(raw.get("quant_method", "")).lower()
    try:
        parser = _PARSERS[method]
    except KeyError:
        raise CheckpointError(
            f"quantization_config quant_method {method!r} is not supported; supported: {', '.join(sorted(_PARSERS))}"
        ) from None
    try:
        return QuantConfig(method, raw, parser(raw))
    except ValueError as e:
        raise CheckpointError(f"quantization_config ({method}): {e}") from None


def _spec(**kw) -> QuantSpec:
    try:
        return QuantSpec(**kw)
    except ValueError as e:
        raise CheckpointError(f"quantization_config: {e}") from None


# ---- GPTQ / Marlin ------------------------------------------------------------------------------


def _gptq(raw: dict):
    fmt = raw.get("checkpoint_format") or raw.get("format") or "gptq"
    if raw.get("is_marlin_format") or raw.get("quant_method") == "marlin":
        fmt = "marlin"
    if fmt not in ("gptq", "gptq_v2", "marlin"):
        raise ValueError(f"checkpoint_format {fmt!r}: tpshard knows gptq, gptq_v2 and marlin")
    base = dict(
        bits=int(raw.get("bits", 4)),
        group_size=int(raw.get("group_size", raw.get("groupsize", -1)) or -1),
        desc_act=bool(raw.get("desc_act", False)),
        sym=bool(raw.get("sym", True)),
    )
    dynamic: list[tuple[re.Pattern, bool, dict]] = []
    for key, override in (raw.get("dynamic") or {}).items():
        skip = key.startswith("-:")
        pattern = key[2:] if key[:2] in ("+:", "-:") else key
        fields = {k: override[k] for k in ("bits", "group_size", "desc_act", "sym") if k in (override or {})}
        dynamic.append((re.compile(pattern), skip, fields))
    quantize_lm_head = bool(raw.get("lm_head", False))

    def resolve(module: str) -> QuantSpec | None:
        if module == "lm_head" and not quantize_lm_head:
            return None
        params = dict(base)
        for pattern, skip, fields in dynamic:
            if pattern.match(module):
                if skip:
                    return None
                params.update(fields)
                break
        return _spec(format=fmt, **params)  # type: ignore[arg-type]

    return resolve


# ---- AWQ --------------------------------------------------------------------------------------


def _awq(raw: dict):
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r}: only the GEMM layout is supported")
    spec = _spec(
        format="awq",
        bits=int(raw.get("bits", raw.get("w_bit", 4))),
        group_size=int(raw.get("group_size", raw.get("q_group_size", 128))),
        sym=not raw.get("zero_point", True),
    )
    skip = list(raw.get("modules_to_not_convert") or [])

    def resolve(module: str) -> QuantSpec | None:
        if module == "lm_head" or any(s in module for s in skip):
            return None
        return spec

    return resolve


# ---- FP8 (DeepSeek-V3 block, AutoFP8 per-tensor) ------------------------------------------------


def _fp8(raw: dict):
    block = raw.get("weight_block_size")
    static = raw.get("activation_scheme", "dynamic") == "static"
    if block:
        spec = _spec(format="fp8_block", bits=8, block=(int(block[0]), int(block[1])), static_input=static)
    else:
        spec = _spec(format="fp8_tensor", bits=8, static_input=static)
    skip = list(raw.get("modules_to_not_convert") or []) + list(raw.get("ignored_layers") or [])

    def resolve(module: str) -> QuantSpec | None:
        if module == "lm_head" or any(s in module for s in skip):
            return None
        return spec

    return resolve


# ---- compressed-tensors -----------------------------------------------------------------------


def _ct_matches(target: str, module: str) -> bool:
    """A compressed-tensors target/ignore entry: `re:<regex>`, a class name (`Linear`) or a module name."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    if target == "Linear":
        return True  # callers only ask about nn.Linear modules
    return module == target or module.endswith("." + target)


def _ct_scheme(fmt: str, weights: dict, acts: dict | None) -> QuantSpec:
    bits, kind = int(weights.get("num_bits", 4)), weights.get("type", "int")
    strategy = weights.get("strategy") or "tensor"
    gs = weights.get("group_size")
    static = acts is not None and acts.get("dynamic") is not True
    if fmt == "pack-quantized":
        if kind != "int":
            raise ValueError(f"pack-quantized with weight type {kind!r}")
        actorder = weights.get("actorder")
        return _spec(
            format="ct_int", bits=bits, group_size=int(gs) if strategy == "group" and gs else -1,
            sym=bool(weights.get("symmetric", True)), desc_act=actorder in ("group", True),
        )  # fmt: skip
    if fmt == "float-quantized":
        if strategy == "block":
            bn, bk = weights.get("block_structure") or (128, 128)
            return _spec(format="ct_fp8_block", bits=8, block=(int(bn), int(bk)), static_input=static)
        if strategy in ("tensor", "channel"):
            return _spec(format=f"ct_fp8_{strategy}", bits=8, static_input=static and strategy == "tensor")  # type: ignore[arg-type]
        raise ValueError(f"float-quantized strategy {strategy!r} is not supported (tensor, channel, block)")
    if fmt == "nvfp4-pack-quantized":
        return _spec(format="ct_nvfp4", bits=4, group_size=16, static_input=acts is not None)
    raise ValueError(f"compressed-tensors format {fmt!r} is not supported (pack-quantized, float-quantized, nvfp4-pack-quantized)")


def _compressed_tensors(raw: dict):
    if raw.get("quantization_status", "compressed") != "compressed":
        raise ValueError(f"quantization_status {raw.get('quantization_status')!r}: only compressed checkpoints can be split")
    groups = []
    for name, group in (raw.get("config_groups") or {}).items():
        weights = group.get("weights")
        if not weights:
            continue  # activation-only group: weights stay dense
        fmt = group.get("format") or raw.get("format")
        try:
            spec = _ct_scheme(str(fmt), weights, group.get("input_activations"))
        except CheckpointError as e:
            raise ValueError(f"config_groups.{name}: {e}") from None
        except ValueError as e:
            raise ValueError(f"config_groups.{name}: {e}") from None
        groups.append((list(group.get("targets") or []), spec))
    ignore = list(raw.get("ignore") or [])

    def resolve(module: str) -> QuantSpec | None:
        if any(_ct_matches(t, module) for t in ignore):
            return None
        # compressed-tensors prefers an exact module name over a regex over a class name.
        ranked = sorted(
            ((0 if t == module else 1 if t.startswith("re:") else 2, spec)
             for targets, spec in groups for t in targets if _ct_matches(t, module)),
            key=lambda x: x[0],
        )  # fmt: skip
        return ranked[0][1] if ranked else None

    return resolve


_PARSERS = {
    "gptq": _gptq,
    "marlin": _gptq,
    "awq": _awq,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
}
