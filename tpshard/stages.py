"""Pipeline stages: which decoder layers each stage holds, as SGLang and vLLM partition them.

World rank = pp_rank * tp + tp_rank in both engines (TP fastest); a stage holds the contiguous
layers [first, end) of its partition, with global layer indices. The engines' default partitions
differ whenever the layer count does not divide (reference/PIPELINE.md §2): SGLang gives the extra
layers to the last stages, vLLM to the stages before the last, never the last. So an output made
for pipeline stages records its partition explicitly, and the server must be given the same one
(SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION).

Which stages hold the pieces outside the decoder layers follows SGLang 0.5.23 (PIPELINE.md §3, §4):
the embedding on the first stage, the final norm on the last, lm_head on the last stage, or on
every stage for the Llama family (`Arch.pp_head`); DeepSeek's MTP layer (stored as layer
num_layers) and, with it, a second copy of the embedding on the last stage.

Pure functions on plain numbers and names; nothing here reads a checkpoint.
"""

from __future__ import annotations

import re
from typing import Literal

from tpshard.errors import TopologyError

Engine = Literal["sglang", "vllm"]
Head = Literal["last", "every"]  # the stages an lm_head is built on (tpshard.arch.base.Arch.pp_head)

PARTITION_ENV = {"sglang": "SGLANG_PP_LAYER_PARTITION", "vllm": "VLLM_PP_LAYER_PARTITION"}


def default_partition(num_layers: int, pp: int, engine: Engine) -> tuple[int, ...]:
    """Layers per stage that `engine` builds for `pp` stages when no partition is given."""
    if pp < 1:
        raise TopologyError(f"--pp must be a positive integer, got {pp}")
    if num_layers < pp:
        raise TopologyError(f"{num_layers} layers cannot fill {pp} pipeline stages (each stage needs a layer)")
    base, extra = divmod(num_layers, pp)
    counts = [base] * pp
    if engine == "sglang":  # the last `extra` stages (get_pp_indices, remainder branch)
        for s in range(pp - extra, pp):
            counts[s] += 1
    elif engine == "vllm":  # stages pp-2, pp-3, ...: the last stage never takes one
        for i in range(extra):
            counts[pp - 2 - i] += 1
    else:
        raise TopologyError(f"engine {engine!r}: choose sglang or vllm")
    return tuple(counts)


def parse_partition(text: str, num_layers: int, pp: int) -> tuple[int, ...]:
    """`--pp-layers 26,27,27`: checked as both engines check their partition variable."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise TopologyError(f"--pp-layers {text!r}: give layer counts per stage, e.g. 26,27,27") from None
    if len(counts) != pp:
        raise TopologyError(f"--pp-layers {text!r} names {len(counts)} stages, but --pp is {pp}")
    if any(c < 1 for c in counts):
        raise TopologyError(f"--pp-layers {text!r}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise TopologyError(f"--pp-layers {text!r} adds up to {sum(counts)} layers; the model has {num_layers}")
    return counts


def stage_ranges(counts: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """[first, end) layer range of every stage."""
    ranges, first = [], 0
    for c in counts:
        ranges.append((first, first + c))
        first += c
    return tuple(ranges)


def stage_of_layer(counts: tuple[int, ...], layer: int) -> int:
    """The stage holding decoder layer `layer` (global index)."""
    for stage, (first, end) in enumerate(stage_ranges(counts)):
        if first <= layer < end:
            return stage
    raise TopologyError(f"layer {layer} lies outside the {sum(counts)} layers of the partition {list(counts)}")


def partition_value(counts: tuple[int, ...]) -> str:
    """What to set the engine's partition variable to, for a server that must match this output."""
    return ",".join(map(str, counts))


def resolve_partition(num_layers: int, pp: int | None, text: str | None) -> tuple[int, ...]:
    """Layers per stage for `--pp` and `--pp-layers`: the explicit partition when given (its
    length is pp when --pp is not), else SGLang's default for pp stages."""
    if text is not None:
        count = len(text.split(","))
        return parse_partition(text, num_layers, count if pp is None else pp)
    return default_partition(num_layers, 1 if pp is None else pp, "sglang")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The global decoder layer index in a tensor name (None: not in a decoder layer)."""
    found = _LAYER.match(name)
    return int(found.group(1)) if found else None


def tensor_stages(name: str, counts: tuple[int, ...], *, head: Head, mtp: bool) -> tuple[int, ...] | None:
    """The stages whose ranks hold tensor `name` (None: no stage is known to hold it).

    counts: layers per stage; their sum is the model's num_layers, and a layer index at or past it
    is DeepSeek's MTP layer, which runs on the last stage. mtp: the output holds the MTP layer, so
    the last stage also holds an embedding for it."""
    last = len(counts) - 1
    layer = layer_of(name)
    if layer is not None:
        return (last,) if layer >= sum(counts) else (stage_of_layer(counts, layer),)
    module = name.rpartition(".")[0]
    if module == "model.embed_tokens":
        return (0, last) if mtp and last > 0 else (0,)
    if module == "model.norm":
        return (last,)
    if module == "lm_head":
        return tuple(range(last + 1)) if head == "every" else (last,)
    return None
