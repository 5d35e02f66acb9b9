"""Pipeline stages: which decoder layers each stage holds, as SGLang and vLLM partition them.

World rank = pp_rank * tp + tp_rank in both engines (TP fastest); a stage holds the contiguous
layers [first, end) of its partition, with global layer indices. The engines' default partitions
differ whenever the layer count does not divide (docs/pipeline.md; SGLang's get_pp_indices, vLLM's get_pp_indices in distributed/utils.py): SGLang gives the extra
layers to the last stages, vLLM to the stages before the last, never the last. So an output made
for pipeline stages records its partition explicitly, and the server must be given the same one
(SGLANG_PP_LAYER_PARTITION / VLLM_PP_LAYER_PARTITION).

Which stages hold the pieces outside the decoder layers depends on the engine (`placement`,
docs/pipeline.md, read from SGLang 0.5.23's and vLLM 0.33.0's model classes):
- both: the embedding on the first stage, the final norm on the last; DeepSeek's MTP layer (stored
  as layer num_layers) on the last stage and, with it, a second copy of the embedding there for
  the draft;
- SGLang 0.5.23: lm_head on the last stage, or on every stage for the Llama family (`Arch.pp_head`);
  a tied model's last stage builds its own lm_head.weight, filled from the embedding
  (`Arch.pp_tied_head`; SGLang's Llama cannot, so a tied Llama is refused);
- vLLM 0.33.0: lm_head on the last stage for every architecture (`LlamaForCausalLM.__init__`,
  `DeepseekV2ForCausalLM.__init__`: `if get_pp_group().is_last_rank`); a tied model's last stage
  builds the embedding itself and ties the head to it (`LlamaModel.__init__`, `Qwen2Model.__init__`:
  `tie_word_embeddings and is_last_rank`), so the stage holds model.embed_tokens.weight cut exactly
  as the first stage's; DeepSeek's vLLM class never ties (`Arch.pp_vllm_tied`).

Pure functions on plain numbers and names; nothing here reads a checkpoint.
"""

from __future__ import annotations

import re
from typing import Literal, NamedTuple

from tpshard.errors import TopologyError

Engine = Literal["sglang", "vllm"]
Head = Literal["last", "every"]  # the stages an lm_head is built on (tpshard.arch.base.Arch.pp_head)

PARTITION_ENV = {"sglang": "SGLANG_PP_LAYER_PARTITION", "vllm": "VLLM_PP_LAYER_PARTITION"}
ENGINE_NAME = {"sglang": "SGLang", "vllm": "vLLM"}


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


def resolve_partition(num_layers: int, pp: int | None, text: str | None, engine: Engine = "sglang") -> tuple[int, ...]:
    """Layers per stage for `--pp` and `--pp-layers`: the explicit partition when given (its
    length is pp when --pp is not), else `engine`'s default for pp stages."""
    if text is not None:
        count = len(text.split(","))
        return parse_partition(text, num_layers, count if pp is None else pp)
    return default_partition(num_layers, 1 if pp is None else pp, engine)


def launch_hint(engine: Engine, counts: tuple[int, ...]) -> str:
    """How the server must be started to build these stages."""
    flag = "--pp-size" if engine == "sglang" else "--pipeline-parallel-size"
    return f"start {ENGINE_NAME[engine]} with {flag} {len(counts)} and {PARTITION_ENV[engine]}={partition_value(counts)}"


class Placement(NamedTuple):
    """Where one engine builds the pieces outside the decoder layers, for one model at pp > 1."""

    engine: Engine
    head: Head  # the stages an (untied) lm_head is built on
    embed_last: bool  # the last stage holds model.embed_tokens too (vLLM's tied head; not the MTP copy)
    head_copy: bool  # tied: the last stage holds its own lm_head.weight, cut from the embedding (SGLang)


def placement(arch, engine: Engine, *, tied: bool, pp: int) -> Placement:
    """`engine`'s placement for a model of `arch` (tpshard.arch.base.Arch), or one line saying
    why that engine cannot build it with `pp` stages."""
    if arch.pp_head is None:
        raise TopologyError(
            f"--pp {pp}: no pipeline layout of {arch.name} is on record (which stages hold its lm_head;"
            " docs/pipeline.md covers Llama, Mistral, Qwen2, Qwen3 and DeepSeek); split it with --pp 1"
        )
    if engine == "sglang":
        if tied and not arch.pp_tied_head:
            raise TopologyError(
                f"--pp {pp}: SGLang {arch.engine} cannot serve a tied {arch.name} with pipeline stages: its lm_head is"
                " model.embed_tokens, which only the first stage builds, so the last stage has no head weight"
                " (docs/pipeline.md); split it with --pp 1, or for vLLM with --engine vllm"
            )
        return Placement("sglang", arch.pp_head, False, tied)
    if engine == "vllm":
        if tied and not arch.pp_vllm_tied:
            raise TopologyError(
                f"--pp {pp} --engine vllm: vLLM's {arch.name} never ties lm_head to the embedding, so a tied checkpoint"
                " leaves its last stage's head unfilled; split it with --pp 1"
            )
        return Placement("vllm", "last", tied, False)
    raise TopologyError(f"--engine {engine!r}: choose sglang or vllm")


def refuse_engine_layout(engine: Engine, topology, dp_lm_head: bool) -> None:
    """A stage cut for a group `engine` does not have: one line. vLLM has no attention DP/CP
    inside its TP group, no dense-MLP group of its own and no DP lm_head (its dense models take
    every width from the TP size), and builds experts over tp or, with --enable-expert-parallel,
    whole over ep = tp (the refusals of `tpshard export --format vllm`, made at the split)."""
    if engine != "vllm":
        return
    asked = [
        f"--{flag} {value}"
        for flag, value, fine in (
            ("attn-dp", topology.attn_dp, 1), ("attn-cp", topology.attn_cp, 1),
            ("moe-dense-tp", topology.moe_dense_tp, None),
        )
        if value != fine
    ]  # fmt: skip
    if dp_lm_head:
        asked.append("--dp-lm-head")
    if topology.ep not in (1, topology.tp):
        asked.append(f"--ep {topology.ep} (vLLM: --ep 1 or --ep {topology.tp})")
    if topology.moe_a2a_backend:  # UNSET is falsy: the default
        asked.append(f"--moe-a2a-backend {topology.moe_a2a_backend} (an SGLang server option)")
    if topology.dcp_replicate_q_proj:  # vLLM's DCPGroupColumnParallelLinear loads the DCP group's heads instead
        asked.append("--dcp-replicate-q-proj (SGLang's: the files keep the attn_tp cut)")
    if asked:
        raise TopologyError(
            f"--engine vllm: {', '.join(asked)}: vLLM has no such layout inside a pipeline stage's TP group;"
            " split without them (or with --engine sglang)"
        )


_LAYER = re.compile(r"(?:language_model\.)?model\.layers\.(\d+)\.")  # Llama-4 nests the text model


def layer_of(name: str) -> int | None:
    """The global decoder layer index in a tensor name (None: not in a decoder layer)."""
    found = _LAYER.match(name)
    return int(found.group(1)) if found else None


def tensor_stages(
    name: str, counts: tuple[int, ...], *, head: Head, mtp: bool, embed_last: bool = False
) -> tuple[int, ...] | None:  # fmt: skip
    """The stages whose ranks hold tensor `name` (None: no stage is known to hold it).

    counts: layers per stage; their sum is the model's num_layers, and a layer index at or past it
    is DeepSeek's MTP layer, which runs on the last stage. mtp: the output holds the MTP layer, so
    the last stage also holds an embedding for it. embed_last: the last stage holds the embedding
    anyway (`Placement.embed_last`)."""
    last = len(counts) - 1
    layer = layer_of(name)
    if layer is not None:
        return (last,) if layer >= sum(counts) else (stage_of_layer(counts, layer),)
    module = name.rpartition(".")[0]
    if module == "model.embed_tokens":
        return (0, last) if (mtp or embed_last) and last > 0 else (0,)
    if module == "model.norm":
        return (last,)
    if module == "lm_head":
        return tuple(range(last + 1)) if head == "every" else (last,)
    return None
