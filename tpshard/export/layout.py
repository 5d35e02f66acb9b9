"""What an engine export holds, rank by rank, computed from a tpshard plan: no tensor data.

Each engine tensor is the rank's shards concatenated along dim 0 in the table's order (one shard
for an unfused tensor) or a constant buffer. Everything the engine cannot build from such files is
refused here, before a byte is written: padded dims, topologies the engine model does not shard
the same way, quantized checkpoints, architectures without a name table.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from tpshard.errors import PlanError
from tpshard.export.names import ENGINES, TABLES, NameMap
from tpshard.manifest import Plan, ShardSpec
from tpshard.safetensors_format import nbytes_of

ENGINE_VOCAB_MULTIPLE = 64  # vLLM and SGLang DEFAULT_VOCAB_PADDING_SIZE
DEFAULT_MAX_PART_BYTES = 5 << 30  # vLLM's save_sharded_state example's default


class ExportError(PlanError):
    """The tpshard output cannot become files this engine loads as they are."""


class EngineTensor(NamedTuple):
    name: str  # engine key
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[ShardSpec, ...]  # concatenated along dim 0; () for a constant
    value: float | None = None  # constant content of a buffer

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


class PartFile(NamedTuple):
    name: str
    rank: int
    tensors: tuple[EngineTensor, ...]


def part_name(rank: int, part: int) -> str:
    """The file name both engines' `sharded_state` loaders glob for (TP only, no PP)."""
    return f"model-rank-{rank}-part-{part}.safetensors"


PART_NAME = re.compile(r"model-rank-(\d+)-part-(\d+)\.safetensors")


def refuse_unexportable(plan: Plan, engine: str, config_tied: bool) -> NameMap:
    """The engine's name table for this plan, or one line saying why the engine cannot load it."""
    if engine not in TABLES:
        raise ExportError(f"--format {engine}: choose one of {', '.join(ENGINES)}")
    arch = plan.model.architecture
    if engine == "sglang" and plan.model.num_experts:
        raise ExportError(
            f"--format sglang: {arch} has routed experts; SGLang's sharded_state loads files after"
            " process_weights_after_loading, and its MoE expert layout then is backend- and platform-specific"
            " (transposed for the Triton-kernels runner, shuffled for AITER, repacked on CPU), which an offline"
            " export cannot know; use --format vllm or load the tpshard output"
        )
    table = TABLES[engine].get(arch)
    if table is None:
        raise ExportError(
            f"--format {engine}: no {engine} name table for {arch} yet (mapped: {', '.join(sorted(TABLES[engine]))});"
            " tpshard writes no name it has not mapped exactly"
        )
    quant = sorted({s.quant for s in plan.shards if s.quant}) or sorted({q.get("format", "?") for q in plan.quant_layers.values()})
    if quant:
        if engine == "sglang":
            raise ExportError(
                f"--format sglang: the checkpoint is quantized ({', '.join(quant)}); SGLang's sharded_state loads"
                " files after its quant methods' process_weights_after_loading, so it expects kernel- and"
                " platform-specific layouts that an offline export cannot know; load the tpshard output or the"
                " checkpoint instead"
            )
        raise ExportError(
            f"--format vllm: the checkpoint is quantized ({', '.join(quant)}); vLLM's quant-method parameter names"
            " are not mapped for export yet, and tpshard writes no name it has not mapped exactly"
        )
    topo = plan.topology
    if table.ep == "vllm" and topo.ep not in (1, topo.tp):
        # vLLM 0.33.0 FusedMoEParallelConfig.make (layers/fused_moe/config.py L1198-1246): without
        # --enable-expert-parallel every rank holds all experts cut over tp; with it EP size = tp
        # (dp 1) and the experts' own tp is 1. Nothing in between.
        raise ExportError(
            f"--format vllm: split with --ep {topo.ep} (moe_tp {topo.moe_tp}) at tp {topo.tp}; vLLM builds either every"
            f" expert cut over tp {topo.tp} (--ep 1) or, with --enable-expert-parallel, {plan.model.num_experts // topo.tp}"
            f" whole experts per rank (--ep {topo.tp}); split again with --ep 1 or --ep {topo.tp}"
        )
    if table.ep == "vllm" and topo.dense_tp != topo.tp:
        raise ExportError(
            f"--format vllm: split with --moe-dense-tp {topo.moe_dense_tp}; vLLM has no such option and cuts the"
            f" dense layers' MLP over tp {topo.tp} (models/deepseek_v2.py L1339, DeepseekV2MLP); split again without it"
        )
    if topo.attn_cp > 1:
        raise ExportError(f"--format {engine}: {topo.describe()}: neither engine has a sharded_state layout for attention context parallelism")
    if topo.attn_dp > 1 and not table.attn_dp:
        why = (
            "vLLM's dense models take attention and MLP widths from the same TP size, so no vLLM rank holds"
            " attention sharded over attn_tp"
            if engine == "vllm"
            else f"SGLang's {arch} splits attention heads over the full tp even with --enable-dp-attention,"
            " so its ranks hold other slices than this split"
        )
        raise ExportError(f"--format {engine}: split with --attn-dp {topo.attn_dp}, but {why}; split again without --attn-dp")
    if plan.options.vocab_multiple != ENGINE_VOCAB_MULTIPLE:
        raise ExportError(
            f"--format {engine}: the vocabulary was padded to a multiple of {plan.options.vocab_multiple};"
            f" the engines pad it to {ENGINE_VOCAB_MULTIPLE}"
        )
    padded = sorted({s.source for s in plan.shards if s.pad and s.kind != "vocab"})
    if padded:
        more = f" and {len(padded) - 3} more" if len(padded) > 3 else ""
        raise ExportError(
            f"--format {engine}: {', '.join(padded[:3])}{more} were zero-padded to divide over the group (split --pad);"
            f" {engine} asserts that the dim divides when it builds the layer, so it cannot load them. Split with a tp"
            " that divides the dim (--no-pad says which)"
        )
    if config_tied != plan.model.tie_word_embeddings:
        have = "no lm_head.weight" if plan.model.tie_word_embeddings else "an lm_head.weight"
        raise ExportError(
            f"--format {engine}: config.json says tie_word_embeddings={str(config_tied).lower()} but the checkpoint has {have};"
            f" {engine} builds the model from config.json, so it would expect other keys"
        )
    return NameMap(table, plan.model.q_lora_rank)


def _order(name: str) -> tuple:
    # State-dict order: embedding, layers in order, final norm, lm_head (any order loads; this one reads well)
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if name.startswith("model.embed_tokens") else 2 if name.startswith("model.norm") else 3, 0, name)


def refuse_router_bias(plan: Plan, engine: str, config: dict) -> None:
    """vLLM's DeepSeek gate has e_score_correction_bias only for topk_method "noaux_tc"
    (models/deepseek_v2.py L327-332): otherwise the key would be unknown to it (KeyError on load)."""
    method = config.get("topk_method")
    biased = any(s.name.endswith(".e_score_correction_bias") for s in plan.shards)
    if biased and method != "noaux_tc":
        raise ExportError(
            f"--format {engine}: the checkpoint has mlp.gate.e_score_correction_bias but config.json says topk_method"
            f" {method!r}; {engine} builds that parameter only for \"noaux_tc\", so its load would fail; fix config.json"
        )


def _layer_index(name: str) -> int:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def rank_tensors(plan: Plan, rank: int, names: NameMap) -> list[EngineTensor]:
    """The engine state dict of one rank: fused shards and constant buffers, in state-dict order."""
    fused: dict[str, dict[int | None, list]] = {}  # engine key -> expert id (None: not stacked) -> pieces
    layers: set[str] = set()
    anchor = re.compile(names.table.buffers_at)
    for spec in plan.rank_shards(rank):
        if names.table.drop_mtp and _layer_index(spec.name) >= plan.model.num_layers:
            continue  # DeepSeek's MTP layer: not in the target model (names.py), only in vLLM's draft model
        piece = names.piece(spec.name)
        if piece is None:
            raise ExportError(f"{spec.name}: no engine name for it in the {plan.model.architecture} table")
        if not piece.engine:
            continue  # not in the engine model's state
        engine = piece.engine
        if engine == "model.embed_tokens.weight" and plan.model.tie_word_embeddings:
            engine = names.table.tied
        slots = fused.setdefault(engine, {}).setdefault(spec.expert if piece.stacked else None, [None] * piece.count)
        if len(slots) != piece.count or slots[piece.position] is not None:
            raise ExportError(f"rank {rank}: two shards map to piece {piece.position} of {engine}")
        slots[piece.position] = spec
        m = anchor.fullmatch(spec.name)
        if m:
            layers.add(m.group(1))
    out = []
    for engine, by_expert in fused.items():
        stacked = None not in by_expert
        rows = None
        parts: list[ShardSpec] = []
        for expert in sorted(by_expert, key=lambda e: -1 if e is None else e):
            slots = by_expert[expert]
            if any(s is None for s in slots):
                missing = [i for i, s in enumerate(slots) if s is None]
                what = engine if expert is None else f"{engine} expert {expert}"
                raise ExportError(f"rank {rank}: {what} lacks pieces {missing} (of {len(slots)}) in the tpshard output")
            n = sum(s.shape[0] for s in slots) if slots[0].shape else 0
            if rows is not None and n != rows:
                raise ExportError(f"rank {rank}: {engine}: experts of {rows} and {n} rows do not stack")
            rows = n
            parts += slots
        first = parts[0]
        if any(s.dtype != first.dtype or s.shape[1:] != first.shape[1:] or not s.shape for s in parts[1:]):
            raise ExportError(f"rank {rank}: {engine}: pieces {[(s.name, s.dtype, list(s.shape)) for s in parts]} do not concatenate along dim 0")
        if stacked:  # [E_local, rows of one expert, cols]: the same bytes as the 2-D pieces back to back
            shape = (len(by_expert), rows, *first.shape[1:])
        else:
            shape = (rows, *first.shape[1:]) if len(parts) > 1 else first.shape
        out.append(EngineTensor(engine, first.dtype, tuple(shape), tuple(parts)))
    for layer in layers:
        out += [EngineTensor(b.engine, b.dtype, (), (), b.value) for b in names.buffers(layer)]
    return sorted(out, key=lambda t: _order(t.name))


def split_parts(rank: int, tensors: list[EngineTensor], max_part_bytes: int) -> list[PartFile]:
    """Greedy parts in state-dict order: a new part when the next tensor would pass the limit,
    never an empty one; a tensor larger than the limit gets a part of its own."""
    if max_part_bytes < 1:
        raise ExportError(f"--max-part-size {max_part_bytes}: must be positive")
    parts: list[list[EngineTensor]] = [[]]
    size = 0
    for t in tensors:
        if parts[-1] and size + t.nbytes > max_part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += t.nbytes
    return [PartFile(part_name(rank, p), rank, tuple(ts)) for p, ts in enumerate(parts) if ts]


def export_layout(
    plan: Plan, engine: str, config_tied: bool, max_part_bytes: int = DEFAULT_MAX_PART_BYTES, config: dict | None = None
) -> list[PartFile]:
    """Every file of the export, rank by rank (`config`: the source's config.json, for the refusals that need it)."""
    names = refuse_unexportable(plan, engine, config_tied)
    if config is not None and names.table.drop_mtp:
        refuse_router_bias(plan, engine, config)
    files: list[PartFile] = []
    for rank in range(plan.topology.world_size):
        files += split_parts(rank, rank_tensors(plan, rank, names), max_part_bytes)
    return files


def config_tied(config: dict) -> bool:
    """tie_word_embeddings as the engines read it: the config classes of the mapped families default to False."""
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))
