"""What an engine export holds, rank by rank, computed from a tpshard plan: no tensor data.

Each engine tensor is the rank's shards concatenated along dim 0 in the table's order (one shard
for an unfused tensor) or a constant buffer; for quantized vLLM exports, under the quant method's
parameter names, also fused along dim 1, cast, or one slot per fused matrix (tpshard.export.quant).
Everything the engine cannot build from such files is refused here, before a byte is written:
padded dims, topologies the engine model does not shard the same way, quantized checkpoints the
engine cannot load, architectures without a name table. The files are laid out
one rank at a time (rank_layouts); a plan that lacks a rank's pieces is refused at that rank.

Pipeline stages (vLLM only, docs/pipeline.md): vLLM 0.33.0's sharded_state loader reads
`model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors` when pp > 1
(model_loader/sharded_state_loader.py, PP_AND_TP_PATTERN), copies every key into the stage's
state dict (KeyError on a key the stage does not build) and refuses missing ones, so a stage's
files hold exactly its target model's parameters: its own layers, the embedding on the first stage,
norm and lm_head on the last; a tied model's last stage holds its embedding under `lm_head.weight`
(the head is tied to it, and `_filter_subtensors` keeps the smaller of the two names), the first
stage under `model.embed_tokens.weight` (its lm_head is a PPMissingLayer). Only an output placed
for vLLM (`split --engine vllm`) is exported: SGLang places lm_head and tied heads otherwise.
"""

from __future__ import annotations

import re
import struct
from array import array
from typing import Iterator, NamedTuple

from tpshard.errors import PlanError
from tpshard.export.dcp import dcp_refusal
from tpshard.export.names import ENGINES, REFUSED, TABLES, NameMap
from tpshard.manifest import Cut, Plan, TensorPlan, shard_shape
from tpshard.safetensors_format import nbytes_of
from tpshard.errors import TopologyError
from tpshard.stages import PARTITION_ENV, default_partition, layer_of, partition_value, stage_of_layer, tensor_stages
from tpshard.topology import Topology

ENGINE_VOCAB_MULTIPLE = 64  # vLLM and SGLang DEFAULT_VOCAB_PADDING_SIZE
DEFAULT_MAX_PART_BYTES = 5 << 30  # vLLM's save_sharded_state example's default


class ExportError(PlanError):
    """The tpshard output cannot become files this engine loads as they are."""


class Part(NamedTuple):
    """One shard of the tpshard output as a piece of an engine tensor."""

    tensor: TensorPlan
    cut: Cut
    index: int  # its place in its file (Plan.members(cut.file)): where its offset and digest are
    shape: tuple[int, ...]  # shard_shape(tensor, cut)
    nbytes: int

    @property
    def name(self) -> str:
        return self.tensor.name

    @property
    def group_rank(self) -> int:
        return self.cut.group_rank

    @property
    def dtype(self) -> str:
        return self.tensor.dtype


class EngineTensor(NamedTuple):
    name: str  # engine key
    dtype: str
    shape: tuple[int, ...]
    parts: tuple[Part, ...]  # concatenated along `axis`; () for a constant
    value: float | tuple[float, ...] | None = None  # constant content: one value filling the shape, or every value
    axis: int = 0  # AWQ's [K, N] tensors fuse along dim 1 (tpshard.export.quant); fused experts transposed: -1 (tpshard.export.fused)
    rotary: int = 0  # the head dim of q/k pieces whose rows vLLM reorders for its rotary kernel (tpshard.export.rotary); 0: none

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)

    @property
    def transformed(self) -> bool:
        """Not the parts' bytes back to back: fused along dim 1, cast (tpshard.export.quant.assemble), or q/k rows permuted."""
        return bool(self.parts) and (self.axis != 0 or self.rotary != 0 or self.dtype != self.parts[0].dtype)


def constant_bytes(dtype: str, value: float | tuple[float, ...], shape: tuple[int, ...] = ()) -> bytes:
    """The bytes of a constant tensor (EngineTensor.value) of `shape`."""
    if shape == () and not isinstance(value, tuple) and dtype in ("F32", "F64"):
        return struct.pack({"F32": "<f", "F64": "<d"}[dtype], value)
    from tpshard.export.quant import constant_array

    return constant_array(dtype, value, shape).tobytes()


class PartFile(NamedTuple):
    name: str
    rank: int
    tensors: tuple[EngineTensor, ...]


def part_name(rank: int, part: int, topology: Topology | None = None) -> str:
    """The file name the engines' `sharded_state` loaders glob for world rank `rank`: by TP rank
    alone at one stage (both engines), by stage and TP rank with pipeline stages (vLLM)."""
    if topology is not None and topology.pp > 1:
        return f"model-pp-{topology.pp_rank(rank)}-tp-{topology.tp_rank(rank)}-part-{part}.safetensors"
    return f"model-rank-{rank}-part-{part}.safetensors"


def stage_first_part(rank: int, part: int, topology: Topology) -> str:
    """The name of part `part` of the first rank of `rank`'s stage: the TP ranks of a stage build
    one model, so their files normally hold the same tensors (the export manifest lists them once)."""
    return part_name(topology.stage_ranks(topology.pp_rank(rank))[0], part, topology)


PART_NAME = re.compile(r"model-rank-(\d+)-part-(\d+)\.safetensors")
PP_PART_NAME = re.compile(r"model-pp-(\d+)-tp-(\d+)-part-(\d+)\.safetensors")
PART_GLOBS = ("model-rank-*-part-*.safetensors", "model-pp-*-tp-*-part-*.safetensors")


def parse_part_name(name: str, topology: Topology) -> tuple[int, int] | None:
    """(world rank, part) of an export file name for this topology; None: not one of its names."""
    if topology.pp > 1:
        m = PP_PART_NAME.fullmatch(name)
        if m is None or not int(m.group(2)) < topology.tp:
            return None
        return int(m.group(1)) * topology.tp + int(m.group(2)), int(m.group(3))
    m = PART_NAME.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def partition_env(topology: Topology) -> dict[str, str]:
    """The environment the vLLM server must be started with to build the export's stages."""
    return {PARTITION_ENV["vllm"]: partition_value(topology.pp_layers)} if topology.pp > 1 else {}


def refuse_pipeline_export(plan: Plan, engine: str) -> None:
    """At pp > 1: only vLLM has a per-stage file pattern, and only an output placed for vLLM fits it."""
    topo = plan.topology
    if topo.pp == 1:
        return
    layers = partition_value(topo.pp_layers)
    if engine == "sglang":
        raise ExportError(
            f"--format sglang: the output has {topo.pp} pipeline stages, but SGLang 0.5.23's sharded_state names files by"
            " TP rank only (model-rank-{rank}-part-*), so every stage would read the same files; serve SGLang with"
            f" pipeline stages from the original checkpoint with its normal loader (--pp-size {topo.pp},"
            f" SGLANG_PP_LAYER_PARTITION={layers}), or export for vLLM (split --engine vllm)"
        )
    if topo.placed_for != "vllm":
        vllm_default = partition_value(default_partition(plan.model.num_layers, topo.pp, "vllm"))
        raise ExportError(
            f"--format vllm: the output's {topo.pp} stages are placed as SGLang builds them (layers {layers}; lm_head and a"
            " tied head where SGLang puts them); split again with --engine vllm (vLLM's default partition"
            f" {vllm_default}), or with --engine vllm --pp-layers {layers} and start vLLM with VLLM_PP_LAYER_PARTITION={layers}"
        )


def stage_of_key(key: str, topology: Topology) -> int | None:
    """The stage of vLLM's target model that holds engine key `key` (None: no stage builds it)."""
    last = topology.pp - 1
    layer = layer_of(key)
    if layer is not None:
        try:
            return stage_of_layer(topology.pp_layers, layer)
        except TopologyError:
            return None
    return {"model.embed_tokens.weight": 0, "model.norm.weight": last, "lm_head.weight": last}.get(key)


def stage_problems(keys: dict[int, set[str]], topology: Topology) -> list[str]:
    """What a pipeline export's files hold on the wrong stage, or lack, by engine key: every key on
    the stage vLLM builds it on, each stage with every one of its layers, the first stage with the
    embedding, the last with norm and lm_head. keys: world rank -> its engine keys. [] at pp 1."""
    if topology.pp == 1:
        return []
    out: list[str] = []
    last, counts = topology.pp - 1, topology.pp_layers
    for rank in sorted(keys):
        stage = topology.pp_rank(rank)
        first = sum(counts[:stage])
        held = set()
        for key in sorted(keys[rank]):
            want = stage_of_key(key, topology)
            if want != stage:
                where = "no stage of vLLM's model builds it" if want is None else f"vLLM builds it on stage {want}"
                out.append(f"rank {rank} (stage {stage}): {key} is in its files, but {where}")
            layer = layer_of(key)
            if layer is not None:
                held.add(layer)
        missing = sorted(set(range(first, first + counts[stage])) - held)
        if missing:
            out.append(f"rank {rank} (stage {stage}): no tensor of layers {', '.join(map(str, missing[:8]))}; its layers are {first}-{first + counts[stage] - 1}")
        needed = ({"model.embed_tokens.weight"} if stage == 0 else set()) | ({"model.norm.weight", "lm_head.weight"} if stage == last else set())
        for key in sorted(needed - keys[rank]):
            out.append(f"rank {rank} (stage {stage}): lacks {key}, which vLLM builds on that stage")
    return out


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
            " export cannot know; serve the HF checkpoint with SGLang's own loader, or export for vLLM (--format vllm)"
        )
    table = TABLES[engine].get(arch)
    if arch in REFUSED[engine]:
        raise ExportError(f"--format {engine}: {REFUSED[engine][arch]}")
    if table is None:
        raise ExportError(
            f"--format {engine}: no {engine} name table for {arch} yet (mapped: {', '.join(sorted(TABLES[engine]))});"
            " tpshard writes no name it has not mapped exactly"
        )
    quant = sorted({t.quant for t in plan.tensors if t.quant and t.cuts}) or sorted({q.get("format", "?") for q in plan.quant_layers.values()})
    if quant:
        refuse_quantized(plan, engine, quant, table)
    refuse_pipeline_export(plan, engine)
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
            f" dense layers' MLP over tp {topo.tp} (DeepseekV2MLP, models/deepseek_v2.py L1339; Glm4MoeMLP, glm4_moe.py); split again without it"
        )
    if (why := dcp_refusal(plan, engine)) is not None:
        raise ExportError(why)
    if engine == "vllm" and topo.moe_a2a_backend:  # UNSET is falsy
        raise ExportError(
            f"--format vllm: split with --moe-a2a-backend {topo.moe_a2a_backend}, an SGLang server option whose layout"
            " (shared experts whole on every rank) vLLM does not build; split again without it"
        )
    if topo.attn_cp > 1:
        raise ExportError(f"--format {engine}: {topo.describe()}: neither engine has a sharded_state layout for attention context parallelism")
    if topo.attn_dp > 1 and not table.attn_dp:
        why = (
            "vLLM's dense models take attention and MLP widths from the same TP size, so no vLLM rank holds"
            " attention sharded over attn_tp"
            if engine == "vllm"
            else f"SGLang's {arch} splits attention heads over the full tp even with --attn-dp-size,"
            " so its ranks hold other slices than this split"
        )
        raise ExportError(f"--format {engine}: split with --attn-dp {topo.attn_dp}, but {why}; split again without --attn-dp")
    if plan.options.vocab_multiple != ENGINE_VOCAB_MULTIPLE:
        raise ExportError(
            f"--format {engine}: the vocabulary was padded to a multiple of {plan.options.vocab_multiple};"
            f" the engines pad it to {ENGINE_VOCAB_MULTIPLE}"
        )
    padded = sorted({t.source or t.name for t in plan.tensors if t.kind != "vocab" and any(c.pad for c in t.cuts)})
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


def refuse_quantized(plan: Plan, engine: str, quant: list[str], table) -> None:
    """One line for a quantized checkpoint this engine's export cannot hold (tpshard.export.quant)."""
    from tpshard.export.quant import refuse_method

    instead = "serve the HF checkpoint with the engine's own loader, or export for vLLM (--format vllm)"
    if engine == "sglang":
        raise ExportError(
            f"--format sglang: the checkpoint is quantized ({', '.join(quant)}); SGLang's sharded_state loads files after"
            " its quant methods' process_weights_after_loading (srt/model_loader/loader.py ShardedStateLoader), i.e."
            f" kernel- and platform-specific layouts an offline export cannot know; {instead}"
        )
    if plan.model.num_experts or table.q_lora or table.drop_mtp:  # routed experts, MLA (tpshard.export.quant_moe)
        from tpshard.export.quant_moe import refuse_experts

        why = refuse_experts(plan, table)
        if why:
            raise ExportError(f"--format vllm: the checkpoint is quantized ({', '.join(quant)}): {why}")
    for fmt in quant:
        why = refuse_method(fmt, [q for q in plan.quant_layers.values() if q.get("format") == fmt])
        if why:
            raise ExportError(f"--format vllm: the checkpoint is quantized: {why}")


def _order(name: str) -> tuple:
    # State-dict order: embedding, layers in order, final norm, lm_head (any order loads; this one
    # reads well). No regex: it runs for every engine tensor of every rank (800k at tiny90k, tp 8).
    end = name.find(".", 13) if name.startswith("model.layers.") else -1
    if end > 13 and name[13:end].isdecimal():
        return (1, int(name[13:end]), name)
    return (0 if name.startswith("model.embed_tokens") else 2 if name.startswith("model.norm") else 3, 0, name)


def _layer_index(name: str) -> int:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _route(plan: Plan, names: NameMap, anchor: re.Pattern, t: TensorPlan) -> tuple:
    """Where HF tensor `t` goes in the engine model, the same on every rank: (the pipeline stages
    whose model holds it, None at pp 1; its Piece, None when unmapped; the decoder layer whose
    buffers it anchors, or None; its quantized Param (tpshard.export.quant), or None)."""
    name = t.name
    if names.table.drop_mtp and _layer_index(name) >= plan.model.num_layers:
        return (), None, None, None  # DeepSeek's MTP layer: not in the target model (names.py), only in vLLM's draft model
    held = None
    topo = plan.topology
    if topo.pp > 1:
        # vLLM's target model on this stage (the MTP draft's embedding copy is not in it)
        held = tensor_stages(name, topo.pp_layers, head="last", mtp=False, embed_last=plan.model.tie_word_embeddings)
        if held is None:
            raise ExportError(f"{name}: no pipeline stage of vLLM's {plan.model.architecture} holds it")
    if not t.quant:
        m = anchor.fullmatch(name)
        piece = names.piece(name)
        param = None
        if piece is not None and piece.dtype:  # built in another dtype by the engine: cast on export
            from tpshard.export.quant import Param

            param = Param(piece.engine.rpartition(".")[2], dtype=piece.dtype)
        return held, piece, m.group(1) if m else None, param
    # A quantized module's tensors go where its `.weight` would, under the method's parameter names.
    from tpshard.export.quant import engine_param
    from tpshard.export.quant_moe import expert_param

    module, _, suffix = name.rpartition(".")
    m = anchor.fullmatch(module + ".weight")
    base = names.piece(module + ".weight")
    found = (expert_param if base.stacked else engine_param)(base.engine, suffix, t.quant) if base is not None and base.engine else None
    if found is None:
        return held, None, None, None
    return held, base._replace(engine=found[0]), m.group(1) if m else None, found[1]


class _Shards:
    """Each world rank's shards as cut ordinals (the cuts of plan.tensors numbered in plan order),
    4 bytes a shard: the Parts of one rank are made when it is laid out and dropped after (every
    rank's kept were ~100 MB at 90k tensors and tp 8)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self.places = plan.cut_places()  # each cut's index in its file
        self.owner, self.first = array("I"), array("I")  # each cut's tensor; each tensor's first ordinal
        self.held = [array("I") for _ in range(plan.topology.world_size)]
        k = 0
        for i, t in enumerate(plan.tensors):
            self.first.append(k)
            for c in t.cuts:
                self.owner.append(i)
                for r in plan.files[c.file].ranks:
                    self.held[r].append(k)
                k += 1
        self.nbytes: dict[tuple, int] = {}

    def parts(self, rank: int) -> list[Part]:
        """One rank's shards, in plan order."""
        tensors, owner, first, places, sizes = self.plan.tensors, self.owner, self.first, self.places, self.nbytes
        make = tuple.__new__  # Part(...) without the Python-level __new__ of a NamedTuple: 800k at tiny90k, tp 8
        out = []
        for k in self.held[rank]:
            i = owner[k]
            t = tensors[i]
            c = t.cuts[k - first[i]]
            shape = shard_shape(t, c)
            n = sizes.get((t.dtype, shape))
            if n is None:
                n = sizes[t.dtype, shape] = nbytes_of(t.dtype, shape)
            out.append(make(Part, (t, c, places[k], shape, n)))
        return out


class _Known:
    """What the ranks share, worked out once: each HF name's route (_route), each layer's constant
    buffers."""

    def __init__(self, plan: Plan, names: NameMap):
        self.plan, self.names = plan, names
        self.anchor = re.compile(names.table.buffers_at)
        self.routes: dict[str, tuple] = {}
        self.buffers: dict[str, list[EngineTensor]] = {}

    def route(self, t: TensorPlan) -> tuple:
        route = self.routes.get(t.name)
        if route is None:
            route = self.routes[t.name] = _route(self.plan, self.names, self.anchor, t)
        return route

    def layer_buffers(self, layer: str) -> list[EngineTensor]:
        found = self.buffers.get(layer)
        if found is None:
            found = [EngineTensor(b.engine, b.dtype, (), (), b.value) for b in self.names.buffers(layer)]
            found += self.attention_params(found)
            self.buffers[layer] = found
        return found

    def attention_params(self, buffers: list[EngineTensor]) -> list[EngineTensor]:
        """The parameters a quantized checkpoint's method adds to each attention layer, beside
        vLLM's own buffers (tpshard.export.quant.Method.attention)."""
        from tpshard.export.quant import METHODS

        formats = sorted({q.get("format") for q in self.plan.quant_layers.values()} & set(METHODS))
        if not formats or not buffers:
            return []
        attn = buffers[0].name.rpartition(".")[0]  # {layer}.self_attn.attn
        if attn.endswith(".mla_attn"):  # vLLM's MLA attention has no KV-cache scale parameters of the method
            return []
        dtype = self.plan.model.dtype
        return [EngineTensor(f"{attn}.{a.name}", a.dtype or dtype, a.shape, (), a.value) for a in METHODS[formats[0]].attention]


def rank_tensors(plan: Plan, rank: int, shards: list[Part], known: _Known) -> list[EngineTensor]:
    """The engine state dict of one rank (`shards`: its shards, _Shards.parts): fused shards and
    constant buffers, in state-dict order. `known`: what the ranks share."""
    fused: dict[str, list | dict[int, list]] = {}  # engine key -> its pieces; stacked experts: expert id -> its pieces
    params: dict[str, object] = {}  # engine key -> its quantized Param, where it has one
    layers: set[str] = set()
    topo, tied = plan.topology, plan.model.tie_word_embeddings
    stage, last = topo.pp_rank(rank), topo.pp - 1
    routes = known.routes
    for part in shards:
        name = part.tensor.name
        held, piece, layer, param = routes.get(name) or known.route(part.tensor)
        if held is not None and stage not in held:
            continue
        if piece is None:
            raise ExportError(f"{name}: no engine name for it in the {plan.model.architecture} table")
        if not piece.engine:
            continue  # not in the engine model's state
        engine = piece.engine
        if engine == "model.embed_tokens.weight" and tied and stage == last:
            engine = known.names.table.tied  # the head and the embedding share storage; the loader keeps this name
        if piece.stacked:
            slots = fused.setdefault(engine, {})
            slots = slots.setdefault(part.tensor.expert, [None] * piece.count) if type(slots) is dict else None
        else:
            slots = fused.setdefault(engine, [None] * piece.count)
            slots = slots if type(slots) is list else None
        if slots is None:
            raise ExportError(f"rank {rank}: {engine} has pieces of stacked experts and pieces of no expert")
        if len(slots) != piece.count or slots[piece.position] is not None:
            raise ExportError(f"rank {rank}: two shards map to piece {piece.position} of {engine}")
        slots[piece.position] = part
        if param is not None:
            params[engine] = param
        if layer is not None:
            layers.add(layer)
    out = []
    for engine, by_expert in fused.items():
        stacked = type(by_expert) is dict
        if not stacked:
            by_expert = {None: by_expert}
        rows = None
        parts: list[Part] = []
        for expert in sorted(by_expert) if stacked else by_expert:
            slots = by_expert[expert]
            if None in slots:
                missing = [i for i, s in enumerate(slots) if s is None]
                what = engine if expert is None else f"{engine} expert {expert}"
                raise ExportError(f"rank {rank}: {what} lacks pieces {missing} (of {len(slots)}) in the tpshard output")
            if not slots[0].shape:
                n = 0
            else:
                n = slots[0].shape[0] if len(slots) == 1 else sum(s.shape[0] for s in slots)
            if rows is not None and n != rows:
                raise ExportError(f"rank {rank}: {engine}: experts of {rows} and {n} rows do not stack")
            rows = n
            parts += slots
        param = params.get(engine)
        if param is not None:  # vLLM's create_weights layout (tpshard.export.quant, quant_moe)
            from tpshard.export.quant import fused_tensor
            from tpshard.export.quant_moe import stacked_tensors

            try:
                made = stacked_tensors(engine, param, by_expert, plan.model.dtype) if stacked else [fused_tensor(engine, param, parts)]
            except ValueError as e:
                raise ExportError(f"rank {rank}: {e}") from None
            out += [EngineTensor(*t) for t in made]
            continue
        first = parts[0]
        if len(parts) > 1 and any(s.dtype != first.dtype or s.shape[1:] != first.shape[1:] or not s.shape for s in parts[1:]):
            raise ExportError(f"rank {rank}: {engine}: pieces {[(s.name, s.dtype, list(s.shape)) for s in parts]} do not concatenate along dim 0")
        if stacked:  # [E_local, rows of one expert, cols]: the same bytes as the 2-D pieces back to back
            shape = (len(by_expert), rows, *first.shape[1:])
        else:
            shape = (rows, *first.shape[1:]) if len(parts) > 1 else first.shape
        out.append(EngineTensor(engine, first.dtype, shape, tuple(parts)))
    for layer in layers:
        out += known.layer_buffers(layer)
    out.sort(key=lambda t: _order(t.name))
    return out


def split_parts(rank: int, tensors: list[EngineTensor], max_part_bytes: int, topology: Topology | None = None) -> list[PartFile]:
    """Greedy parts in state-dict order: a new part when the next tensor would pass the limit,
    never an empty one; a tensor larger than the limit gets a part of its own."""
    parts: list[list[EngineTensor]] = [[]]
    size = 0
    for t in tensors:
        n = t.nbytes
        if parts[-1] and size + n > max_part_bytes:
            parts.append([])
            size = 0
        parts[-1].append(t)
        size += n
    return [PartFile(part_name(rank, p, topology), rank, tuple(ts)) for p, ts in enumerate(parts) if ts]


def rank_layouts(
    plan: Plan, engine: str, config_tied: bool, max_part_bytes: int = DEFAULT_MAX_PART_BYTES, config: dict | None = None
) -> Iterator[list[PartFile]]:
    """Every file of the export, one rank's at a time (`config`: the source's config.json, for the
    refusals that need it). The refusals of the engine, its name table and the topology come before
    the first rank; a plan that lacks a rank's pieces or puts a key on the wrong stage is refused
    at that rank (a writer discards what it wrote). One rank's tensors are held at a time: every
    rank's were ~300 MB at 90k tensors and tp 8."""
    names = refuse_unexportable(plan, engine, config_tied)
    why = names.table.refuse(plan, config) if config is not None and names.table.refuse else None
    if why:
        raise ExportError(f"--format {engine}: {why}")
    if max_part_bytes < 1:
        raise ExportError(f"--max-part-size {max_part_bytes}: must be positive")
    return _rank_layouts(plan, names, max_part_bytes)


def _rank_layouts(plan: Plan, names: NameMap, max_part_bytes: int) -> Iterator[list[PartFile]]:
    shards, known = _Shards(plan), _Known(plan, names)
    for rank in range(plan.topology.world_size):
        tensors = rank_tensors(plan, rank, shards.parts(rank), known)
        if names.table.fused:  # experts stored fused: what vLLM's loader does beyond slicing (tpshard.export.fused)
            from tpshard.export.fused import fused_experts

            tensors = fused_experts(plan, rank, tensors, names.table.fused)
        problems = stage_problems({rank: {t.name for t in tensors}}, plan.topology) if plan.topology.pp > 1 else []
        if problems:  # the tpshard output lacks what a stage needs (or holds what it must not): a broken plan
            raise ExportError(f"{problems[0]}" + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
        yield split_parts(rank, tensors, max_part_bytes, plan.topology)


def export_layout(
    plan: Plan, engine: str, config_tied: bool, max_part_bytes: int = DEFAULT_MAX_PART_BYTES, config: dict | None = None
) -> list[PartFile]:
    """Every file of the export, rank by rank (rank_layouts, all held)."""
    return [f for files in rank_layouts(plan, engine, config_tied, max_part_bytes, config) for f in files]


def config_tied(config: dict) -> bool:
    """tie_word_embeddings as the engines read it: the config classes of the mapped families default to False."""
    return bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False)))
