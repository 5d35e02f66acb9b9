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
- DeepSeek-V4's release (`quant_method: fp8` in a `model_type: deepseek_v4` config): every linear
  dsv4_fp8 (`<module>.scale`), the routed experts dsv4_fp4 per the config's `expert_dtype`.
- auto-round (`quant_method: auto-round`): `packing_format` auto_round:auto_gptq (GPTQ v1) or
  auto_round:auto_awq (AWQ GEMM), `extra_config` per module, `block_name_to_quantize`; others refused.
- compressed-tensors: `config_groups[*].targets` (a class name such as `Linear`, `re:<regex>`, or
  an exact module name) minus `ignore` (same forms); the group's (or top-level) `format` picks
  pack-quantized / int-quantized (W8A8 int8) / float-quantized / nvfp4-pack-quantized.
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
    if not isinstance(raw, dict):
        raise CheckpointError(f"quantization_config is {type(raw).__name__}, not an object")
    method = str(raw.get("quant_method", "")).lower()
    v4 = method == "fp8" and config.get("model_type") == "deepseek_v4"
    if v4:  # its scales are `<module>.scale`, its experts FP4 per config.json's top-level expert_dtype
        raw = {**raw, "expert_dtype": config.get("expert_dtype")}
    if method in _REFUSED:
        raise CheckpointError(f"quantization_config ({method}): {_REFUSED[method]}")
    try:
        parser = _deepseek_v4 if v4 else _PARSERS[method]
    except KeyError:
        said = f"quant_method {method!r} is not supported" if raw.get("quant_method") is not None else "names no quant_method"
        raise CheckpointError(f"quantization_config {said}; supported: {', '.join(sorted(_PARSERS))}") from None
    try:
        return QuantConfig(method, raw, parser(raw))
    except (ValueError, TypeError, AttributeError, KeyError, IndexError, re.error) as e:
        # A field of the wrong JSON type (a list for bits, a string for dynamic, a bad regex).
        raise CheckpointError(f"quantization_config ({method}): {e}") from None


def _int(raw: dict, *keys: str, default: int, lo: int = -1, hi: int = 1 << 20) -> int:
    """The first of `keys` present in `raw`, as an integer in [lo, hi] (JSON ints only: 4.5, "4"
    and true are refused, not rounded)."""
    for key in keys:
        if raw.get(key) is not None:
            value = raw[key]
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"{key} = {value!r} is not an integer in [{lo}, {hi}]")
            return value
    return default


def _bool(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key} = {value!r} is not true or false")
    return value


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
        bits=_int(raw, "bits", default=4, lo=1, hi=32),
        group_size=_int(raw, "group_size", "groupsize", default=-1) or -1,
        desc_act=_bool(raw, "desc_act", False),
        sym=_bool(raw, "sym", True),
    )
    dynamic: list[tuple[re.Pattern, bool, dict]] = []
    if not isinstance(raw.get("dynamic") or {}, dict):
        raise ValueError("dynamic is not an object of pattern -> overrides")
    for key, override in (raw.get("dynamic") or {}).items():
        skip = key.startswith("-:")
        pattern = key[2:] if key[:2] in ("+:", "-:") else key
        override = override or {}
        if not isinstance(override, dict):
            raise ValueError(f"dynamic[{key!r}] is not an object")
        fields: dict = {}
        for k in ("bits", "group_size"):
            if k in override:
                fields[k] = _int(override, k, default=-1, lo=-1 if k == "group_size" else 1, hi=1 << 20 if k == "group_size" else 32)
        for k in ("desc_act", "sym"):
            if k in override:
                fields[k] = _bool(override, k, False)
        dynamic.append((re.compile(pattern), skip, fields))
    quantize_lm_head = _bool(raw, "lm_head", False)

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
        bits=_int(raw, "bits", "w_bit", default=4, lo=1, hi=32),
        group_size=_int(raw, "group_size", "q_group_size", default=128),
        sym=not _bool(raw, "zero_point", True),
    )
    return _all_but(spec, _strings(raw.get("modules_to_not_convert"), "modules_to_not_convert"))


def _all_but(spec: QuantSpec, skip: list[str]):
    """The resolver of a format one spec covers: `spec` for every module but lm_head and those
    whose name holds one of `skip`."""

    def resolve(module: str) -> QuantSpec | None:
        if module == "lm_head" or any(s in module for s in skip):
            return None
        return spec

    return resolve


def _strings(value: object, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key} = {value!r} is not a list of strings")
    return list(value)


# ---- FP8 (DeepSeek-V3 block, AutoFP8 per-tensor) ------------------------------------------------


def _block(raw: dict) -> tuple[int, int] | None:
    block = raw.get("weight_block_size")
    if not block:
        return None
    if not (isinstance(block, list) and len(block) == 2):
        raise ValueError(f"weight_block_size = {block!r} is not [block_n, block_k]")
    bn, bk = (_int({"weight_block_size": b}, "weight_block_size", default=128, lo=1) for b in block)
    return bn, bk


def _fp8(raw: dict):
    block = _block(raw)
    static = raw.get("activation_scheme", "dynamic") == "static"
    if block:
        spec = _spec(format="fp8_block", bits=8, block=block, static_input=static)
    else:
        spec = _spec(format="fp8_tensor", bits=8, static_input=static)
    skip = _strings(raw.get("modules_to_not_convert"), "modules_to_not_convert") + _strings(raw.get("ignored_layers"), "ignored_layers")
    return _all_but(spec, skip)


_V4_EXPERT = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]")


def _deepseek_v4(raw: dict):
    """DeepSeek-V4's release (quant_method fp8, 128x128 blocks, scale_fmt ue8m0): every linear FP8
    with its block scale in `<module>.scale`, the routed experts FP4 (config.json expert_dtype "fp4",
    SGLang's and vLLM's default; "fp8": FP8 blocks like the rest). A replicated linear the checkpoint
    keeps in bf16 (no .scale) stays dense (tpshard.plan.make); so do the router and the embedding."""
    block = _block(raw)
    if block is None or raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError("DeepSeek-V4's FP8 release has weight_block_size and a dynamic activation_scheme")
    expert = raw.get("expert_dtype") or "fp4"
    if expert not in ("fp4", "fp8"):
        raise ValueError(f"expert_dtype {expert!r}: DeepSeek-V4's routed experts are fp4 or fp8")
    dense = _spec(format="dsv4_fp8", bits=8, block=block)
    experts = _spec(format="dsv4_fp4", bits=4, group_size=32, block=block) if expert == "fp4" else dense
    skip = _strings(raw.get("modules_to_not_convert"), "modules_to_not_convert")
    return lambda module: None if any(s in module for s in skip) else experts if _V4_EXPERT.fullmatch(module) else dense


# ---- auto-round --------------------------------------------------------------------------------

# packing_format -> the layout it writes (SGLang's AutoRoundConfig.SUPPORTED_FORMATS: GPTQ v1 or AWQ GEMM).
_AUTO_ROUND_LAYOUTS = {"auto_round:auto_gptq": "gptq", "auto_round:auto_awq": "awq"}
_REGEX_CHARS = set("*+?^$()[]{}|\\")


def _auto_round(raw: dict):
    """quant_method auto-round, as SGLang's AutoRoundConfig reads it: packing_format picks the GPTQ
    (desc_act off) or AWQ layout; `extra_config` overrides bits / group_size / sym per module (its
    exact name first, then patterns with regex characters by re.fullmatch; bits >= 16 = dense);
    `block_name_to_quantize` (or `to_quant_block_names`) limits quantization to modules under those
    prefixes; lm_head stays dense."""
    packing = raw.get("packing_format") or "auto_round:auto_gptq"
    if packing not in _AUTO_ROUND_LAYOUTS:
        raise ValueError(f"packing_format {packing!r}: tpshard (as SGLang) reads {', '.join(sorted(_AUTO_ROUND_LAYOUTS))}")
    if (raw.get("data_type") or "int") != "int":
        raise ValueError(f"data_type {raw.get('data_type')!r}: only int auto-round checkpoints are supported")
    fmt = _AUTO_ROUND_LAYOUTS[packing]
    base = (_int(raw, "bits", default=4, lo=1, hi=32), _int(raw, "group_size", default=128), _bool(raw, "sym", True))
    blocks = raw.get("block_name_to_quantize") or raw.get("to_quant_block_names")
    blocks = blocks.split(",") if isinstance(blocks, str) else _strings(blocks, "block_name_to_quantize")
    extra = raw.get("extra_config") or {}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise ValueError("extra_config is not an object of module -> {bits, group_size, sym}")
    patterns = [(re.compile(k), v) for k, v in extra.items() if any(c in _REGEX_CHARS for c in k)]

    def resolve(module: str) -> QuantSpec | None:
        override = extra.get(module)  # an exact name counts as quantized (SGLang: get_config(name) defaults)
        quantized = override is not None or (module != "lm_head" and (not blocks or any(module.startswith(b) for b in blocks)))
        if override is None:
            override = next((v for p, v in patterns if p.fullmatch(module)), None)
        if override is None and not quantized:
            return None
        bits, group, sym = base if quantized else (16, -1, True)
        override = override or {}
        bits = _int(override, "bits", default=bits, lo=1, hi=32)
        if bits >= 16:
            return None
        group = _int(override, "group_size", default=group)
        return _spec(format=fmt, bits=bits, group_size=group, sym=_bool(override, "sym", sym))  # type: ignore[arg-type]

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
    if not isinstance(weights, dict):
        raise ValueError("weights is not an object")
    bits, kind = _int(weights, "num_bits", default=4, lo=1, hi=32), weights.get("type", "int")
    strategy = weights.get("strategy") or "tensor"
    gs = weights.get("group_size")
    static = acts is not None and acts.get("dynamic") is not True
    if fmt == "pack-quantized":
        if kind != "int":
            raise ValueError(f"pack-quantized with weight type {kind!r}")
        actorder = weights.get("actorder")
        return _spec(
            format="ct_int", bits=bits, group_size=_int(weights, "group_size", default=-1) if strategy == "group" and gs else -1,
            sym=bool(weights.get("symmetric", True)), desc_act=actorder in ("group", True),
        )  # fmt: skip
    if fmt == "float-quantized":
        if strategy == "block":
            structure = weights.get("block_structure") or [128, 128]
            if not (isinstance(structure, (list, tuple)) and len(structure) == 2):
                raise ValueError(f"block_structure = {structure!r} is not [block_n, block_k]")
            bn, bk = (_int({"block_structure": b}, "block_structure", default=128, lo=1) for b in structure)
            return _spec(format="ct_fp8_block", bits=8, block=(bn, bk), static_input=static)
        if strategy in ("tensor", "channel"):
            return _spec(format=f"ct_fp8_{strategy}", bits=8, static_input=static and strategy == "tensor")  # type: ignore[arg-type]
        raise ValueError(f"float-quantized strategy {strategy!r} is not supported (tensor, channel, block)")
    if fmt == "int-quantized":  # W8A8 int8 (SGLang CompressedTensorsW8A8Int8)
        if kind != "int" or bits != 8 or strategy not in ("tensor", "channel") or not weights.get("symmetric", True):
            raise ValueError(
                f"int-quantized with {'symmetric' if weights.get('symmetric', True) else 'asymmetric'} {bits}-bit"
                f" {kind} weights, strategy {strategy!r}: tpshard reads symmetric 8-bit int weights, tensor or channel"
            )
        if acts is not None and (acts.get("type", "int") != "int" or acts.get("symmetric", True) is False):
            raise ValueError("int-quantized with asymmetric or non-int input activations (input_zero_point) is not supported")
        static = static and (acts or {}).get("strategy", "tensor") == "tensor"
        return _spec(format=f"ct_int8_{strategy}", bits=8, static_input=static)  # type: ignore[arg-type]
    if fmt == "nvfp4-pack-quantized":
        return _spec(format="ct_nvfp4", bits=4, group_size=16, static_input=acts is not None)
    raise ValueError(f"compressed-tensors format {fmt!r} is not supported (pack-quantized, int-quantized, float-quantized, nvfp4-pack-quantized)")


def _compressed_tensors(raw: dict):
    if (raw.get("quantization_status") or "compressed") != "compressed":  # null counts as absent
        raise ValueError(f"quantization_status {raw.get('quantization_status')!r}: only compressed checkpoints can be split")
    groups = []
    if not isinstance(raw.get("config_groups") or {}, dict):
        raise ValueError("config_groups is not an object")
    for name, group in (raw.get("config_groups") or {}).items():
        if not isinstance(group, dict):
            raise ValueError(f"config_groups.{name} is not an object")
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
        groups.append((_strings(group.get("targets"), f"config_groups.{name}.targets"), spec))
    ignore = _strings(raw.get("ignore"), "ignore")
    for target in ignore + [t for targets, _ in groups for t in targets]:
        if target.startswith("re:"):
            re.compile(target[3:])  # a bad regex is refused now, not when a module meets it

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


def _mxfp4(raw: dict):
    """MXFP4 (gpt-oss): only the fused routed experts are quantized, stored as *_blocks / *_scales
    beside their bf16 biases, cut by the family's FusedExperts rule in whole 32-blocks
    (tpshard.arch.fused, tpshard.plan.fused); no linear is a tpshard.quant layer."""
    return lambda module: None


# Methods the engine cannot load, refused by name with why (no parser: no layout is read).
# fbgemm_fp8 (Meta's Llama-4 Maverick FP8 release, transformers' FbgemmFp8Config): per-channel FP8
# experts, the fused ones' scales `experts.gate_up_proj_scale` [E, 1, 2I] / `down_proj_scale`
# [E, H, 1]; SGLang 0.5.23 registers no such method, and mllama4.py's loader would skip those scales
# (`experts.w13_scale` is no parameter of its FusedMoE).
_REFUSED = {
    "fbgemm_fp8": (
        "SGLang 0.5.23 registers no fbgemm_fp8 method (layers/quantization/__init__.py L63-91) and refuses this"
        " checkpoint at start-up (configs/model_config.py L2152, 'Unknown quantization method'); its Llama-4"
        " loader would also skip the fused experts' *_proj_scale tensors (models/mllama4.py L847-889): split"
        " the bf16 release instead"
    ),
}


_PARSERS = {
    "mxfp4": _mxfp4,
    "gptq": _gptq,
    "marlin": _gptq,
    "awq": _awq,
    "fp8": _fp8,
    "compressed-tensors": _compressed_tensors,
    "auto-round": _auto_round,
}
