"""The plan and the manifest: the parallel and load contracts as data (manifest version 3).

A `Plan` is what `tpshard plan` prints and `tpshard split` executes: one `TensorPlan` per source
tensor kept, holding what all of its cuts share (layer, kind, group, dim, quantized layout), and one
`Cut` per distinct per-rank piece (group rank, start, length, padding, the file holding it). A
`Manifest` is the plan as written, plus checksums; it is the last file `split` writes and the first
one `check`, `verify` and `open_rank` read. docs/format.md describes the JSON.

`ShardSpec` is the per-rank view of one (TensorPlan, Cut) with every field spelled out, built on
demand: `Plan.rank_shards(rank)` builds one rank's, `Plan.shards` all of them; what walks every
shard (the writer, check, reshard's reader, export) walks (TensorPlan, Cut) pairs instead. A
shard's shape is derived, never stored; its world ranks are its file's `ranks`, which
`make_plan` lays out from `Topology.ranks_of(group, group_rank, factor)` and `check` compares with it. Ranks that hold identical bytes (replicated tensors, attention shards shared by
attention-DP replicas, GQA kv replicas) share one cut and one file.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import json
import re
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import cached_property, lru_cache, partial
from operator import attrgetter, itemgetter
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple

import msgspec

from tpshard.collector import paused
from tpshard.digest import DIGEST_SIZE
from tpshard.safetensors_format import Numbering, Shapes, kinds_header_layout, kinds_header_pieces, plain_json
from tpshard.topology import GroupName, Topology

MANIFEST_NAME = "tpshard-manifest.json"
MANIFEST_FORMAT = "tpshard-manifest"
MANIFEST_VERSION = 3

# Bounds on numbers read from a manifest (docs/format.md): no command may hang or allocate without
# limit on a crafted one.
MAX_BYTES = 1 << 50  # one tensor or one file
MAX_WORLD = 1 << 16  # ranks
MAX_MANIFEST_BYTES = 1 << 31
FILE_METADATA = {"format": "pt"}  # what transformers expects to find in an output file's header
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BYTES)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_WORLD)]
Positive = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD)]

# How a tensor is cut. The four linear kinds follow the engines' layer classes; `row_bias` is a
# row-parallel layer's bias, whole on every rank and added once per reduction group.
Kind = Literal["column", "merged", "qkv_q", "qkv_k", "qkv_v", "row", "row_bias", "vocab", "replicated"]


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The config numbers the rules use; recorded so that readers need not re-parse config.json."""

    architecture: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    dtype: str = "BF16"
    # Mixture of experts (0 = dense model). Routing numbers are recorded for readers that run the
    # router (verify); the cut needs only the counts and sizes.
    num_experts: int = 0  # routed experts (n_routed_experts / num_experts / num_local_experts)
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # I_e of one routed expert (Mixtral: intermediate_size)
    num_shared_experts: int = 0  # DeepSeek n_shared_experts
    shared_expert_intermediate_size: int = 0  # width of the shared-expert MLP (DeepSeek: n_shared * I_e)
    first_k_dense_replace: int = 0  # DeepSeek: layers below this have a dense MLP
    moe_layer_freq: int = 1  # DeepSeek: layer i has experts iff i >= first_k_dense_replace and i % freq == 0
    norm_topk_prob: bool = False
    scoring_func: str = ""  # DeepSeek: sigmoid (V3) / softmax (V2); "" = softmax
    topk_method: str = ""  # DeepSeek: noaux_tc (V3), greedy, group_limited_greedy
    n_group: int = 0
    topk_group: int = 0
    routed_scaling_factor: float = 1.0
    # DeepSeek MLA (kv_lora_rank 0 = no MLA)
    q_lora_rank: int | None = None  # None: q_proj instead of q_a_proj/q_b_proj (V2-Lite)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    num_nextn_predict_layers: int = 0  # DeepSeek MTP layers, stored as layers num_layers, num_layers + 1, ...


class Options(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pad: bool = True  # pad dims the group does not divide (MLP intermediate) instead of refusing
    dp_lm_head: bool = False  # lm_head over attn_tp instead of tp (SGLang --enable-dp-lm-head)
    vocab_multiple: int = 64  # vocab padded to this multiple before the split (vLLM/SGLang)
    max_file_bytes: int = 5 << 30  # a rank's tensors for one group go to parts of at most this size
    checksum: Literal["crc32", "sha256"] = "crc32"  # tensor digests in the manifest (tpshard.digest)
    pad_blocks: bool = False  # FP8 block formats: pad each rank's MLP shard up to whole 128-blocks instead of refusing

    def __post_init__(self) -> None:
        from tpshard.errors import PlanError

        if self.checksum not in ("crc32", "sha256"):
            raise PlanError(f"--checksum {self.checksum}: choose crc32 or sha256")


# gc=False on the per-shard and per-tensor records: there are hundreds of thousands of them in a
# large plan, they hold only numbers, strings and tuples (no cycle), and tracked they made every
# collection of the garbage collector walk them all.
class ShardSpec(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One distinct per-rank tensor: source[dim][start : start+length] followed by `pad` zeros."""

    name: str  # HF tensor name in the rank's files
    source: str  # source tensor name
    layer: str  # the engine layer it loads into, e.g. model.layers.0.self_attn.qkv_proj
    layer_class: str  # QKVParallelLinear, RowParallelLinear, ...
    piece: str = ""  # q / k / v of a QKV layer, gate / up of a merged one
    kind: Kind
    dtype: str  # safetensors dtype string, as on disk
    source_shape: tuple[int, ...]
    shape: tuple[int, ...]  # per-rank shape, padding included
    dim: int | None = None  # sharded dim; None = whole copy
    start: int = 0
    length: int = 0
    pad: int = 0
    group: GroupName
    factor: int = 1  # consecutive group ranks holding one replica (GQA kv heads)
    group_rank: int = 0
    group_size: int = 1
    ranks: tuple[int, ...]  # world ranks holding these bytes
    file: str  # OutputFile.name holding it
    # Routed experts: only the ranks of one EP slot hold an expert (Topology.ranks_of(..., ep_slot)).
    ep_slot: int | None = None
    expert: int | None = None  # global expert id, as in the HF name
    # Quantized layers (docs/quantization.md). The physical cut above is the layer's logical cut
    # along N (logical_dim 0) or K (1) converted by the format's layout: physical = logical * ratio,
    # offsets on multiples of `atom` logical values, a partial last word/group/block taken at the end.
    quant: str = ""  # format name (tpshard.quant.formats.LAYOUTS); "" = not a quantized tensor
    step: str = ""  # how a logical index maps onto `dim`: packed, group, block_n, tile, marlin_n, ...
    ratio: tuple[int, int] = (1, 1)  # physical indices per logical index, as numerator / denominator
    atom: int = 1  # logical offsets and sizes must be multiples of this (pack unit, group, block, tile)
    logical_dim: int | None = None  # 0 = N (output), 1 = K (input) of the layer's [N, K]; None = not cut
    logical_size: int = 0  # N or K of the whole layer
    logical_start: int = 0
    logical_length: int = 0
    logical_pad: int = 0
    value: tuple[int, ...] | None = None  # exact content, written instead of source bytes (CT weight_shape)


class Cut(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One group rank's piece of a tensor, a JSON array:
    [group_rank, start, length, pad, file, logical_start, logical_length, logical_pad, value],
    trailing defaults left out. `file` indexes `Manifest.files`."""

    group_rank: Rank
    start: Count
    length: Count
    pad: Count
    file: Annotated[int, msgspec.Meta(ge=0)]
    logical_start: Count = 0
    logical_length: Count = 0
    logical_pad: Count = 0
    value: tuple[int, ...] | None = None


class TensorPlan(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """What every cut of one source tensor shares; ShardSpec documents each field."""

    name: str  # HF name, in the source and in the rank files
    source: str = ""  # the source tensor cut, when not `name` (a tied model's lm_head copy at pp > 1)
    layer: str
    layer_class: str
    piece: str = ""
    kind: Kind
    dtype: str
    shape: tuple[Count, ...]  # the source shape
    group: GroupName
    factor: Positive = 1
    group_size: Positive = 1
    dim: Annotated[int, msgspec.Meta(ge=0)] | None = None
    quant: str = ""
    step: str = ""
    ratio: tuple[Positive, Positive] = (1, 1)
    atom: Positive = 1
    logical_dim: Annotated[int, msgspec.Meta(ge=0, le=1)] | None = None
    logical_size: Count = 0
    ep_slot: Annotated[int, msgspec.Meta(ge=0)] | None = None
    expert: Annotated[int, msgspec.Meta(ge=0)] | None = None
    cuts: tuple[Cut, ...]


class OutputFile(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    """One output safetensors file, shared (hard linked) by every rank in `ranks`."""

    name: str  # a plain file name inside each rank folder
    ranks: tuple[Rank, ...]  # world ranks holding it: the only place ranks are stored
    size: Count  # bytes, header included
    checksum: str = ""  # tpshard.digest.file_digest: sha256 of the header, then the tensor digests
    # Each tensor's digest (Options.checksum) in hex, back to back in file order: one string, not one
    # per tensor (460k strings were 29 MB at DeepSeek-V3's count and tp 8); "" = not written.
    digests: str = ""

    def digest(self, i: int, algorithm: str) -> bytes:
        """The digest of the file's tensor `i`, as tpshard.digest.tensor_digest gives it."""
        return digest_at(self.digests, i, algorithm)


def digest_at(digests: str, i: int, algorithm: str) -> bytes:
    """Digest `i` of a string of hex digests back to back (OutputFile.digests)."""
    width = 2 * DIGEST_SIZE[algorithm]
    return bytes.fromhex(digests[i * width : (i + 1) * width])


def differing(digests: bytes, recorded: str, algorithm: str) -> list[int]:
    """The indices of the digests in `digests` (back to back, as tpshard.digest.tensor_digest gives
    them) that differ from those in `recorded` (lower-case hex, as OutputFile.digests); [] when all
    agree. The whole strings are compared at once first: one comparison for a file that is right."""
    found = digests.hex()
    if found == recorded:
        return []
    width = 2 * DIGEST_SIZE[algorithm]
    return [k // width for k in range(0, len(found), width) if found[k : k + width] != recorded[k : k + width]]


# The fields of a ShardSpec stored once per tensor (TensorPlan) and once per cut (Cut).
TENSOR_FIELDS = ("layer", "layer_class", "piece", "kind", "dtype", "group", "factor", "group_size", "dim",
           "quant", "step", "ratio", "atom", "logical_dim", "logical_size", "ep_slot", "expert")  # fmt: skip
_PER_CUT = ("group_rank", "start", "length", "pad")
_LOGICAL = ("logical_start", "logical_length", "logical_pad", "value")


def shard_shape(t: TensorPlan, c: Cut) -> tuple[int, ...]:
    """A shard's shape: the source shape with the cut dim replaced by length + pad."""
    if t.dim is None:
        return t.shape
    return _resized(t.shape, t.dim, c.length + c.pad)


@lru_cache(maxsize=4096)
def _resized(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    """`shape` with dim `dim` of `size`: one tuple per kind of shard, not one per shard (half the
    time of building each, and a file's header lists ~90k shards of a few dozen shapes)."""
    return shape[:dim] + (size,) + shape[dim + 1 :]


def pack_tensors(specs: Iterable[ShardSpec], files: Iterable[OutputFile]) -> tuple[TensorPlan, ...]:
    """TensorPlans from ShardSpecs, in the order tensors first appear: the inverse of the ShardSpec
    view, with which tests write a deliberately wrong manifest. Shards of one tensor must agree on
    every shared field."""
    index = {f.name: i for i, f in enumerate(files)}
    shared_of, cut_of, logical_of = itemgetter("source", "source_shape", *TENSOR_FIELDS), itemgetter(*_PER_CUT), itemgetter(*_LOGICAL)
    shared: dict[str, tuple] = {}
    cuts: dict[str, list[Cut]] = {}
    for s in specs:
        d = msgspec.structs.asdict(s)
        name = d["name"]
        key = shared_of(d)
        if name not in shared:
            shared[name], cuts[name] = key, []
        elif shared[name] != key:
            raise ValueError(f"{name}: its shards disagree on {[f for f, a, b in zip(('source', 'source_shape', *TENSOR_FIELDS), key, shared[name]) if a != b]}")
        cuts[name].append(Cut(*cut_of(d), index[d["file"]], *logical_of(d)))
    out = []
    for name, key in shared.items():
        source = "" if key[0] == name else key[0]  # recorded only where it differs from the name
        out.append(TensorPlan(name=name, source=source, shape=tuple(key[1]), cuts=tuple(cuts[name]), **dict(zip(TENSOR_FIELDS, key[2:]))))
    return tuple(out)


class FileShards(NamedTuple):
    """An output file's shards in data order, as a plan keeps them: 12 bytes a shard (a pair of
    objects a shard for every file was ~30 MB at 90k tensors and tp 8)."""

    tensors: array  # each shard's tensor, by its index in Plan.tensors
    cuts: array  # each shard's cut, by its index in the tensor's cuts
    kinds: array  # each shard's (dtype, shape), by its index in `shapes`
    shapes: Shapes  # each kind's (dtype, shape): a few dozen in a file


class SourceCuts:
    """Where each source tensor's cuts lie, by the tensor's position in a list of source names: its
    TensorPlans (a tied lm_head copy at pp > 1 is a second one), each cut with its index in its
    file (Plan.cut_places). In arrays: the places of every shard listed at once were 75 MB in the
    writer and 56 MB in check at 90k tensors and tp 8, a dict by name 6 MB."""

    def __init__(self, plan: Plan, names: Sequence[str]):
        self.tensors = plan.tensors
        self.first = array("I")  # per TensorPlan: the number of its first cut, cuts numbered in plan order
        self.place = plan.cut_places()  # per cut: its index in its file
        plan_of: dict[str, int] = {}  # source name -> its first TensorPlan: only while the arrays are made
        others: dict[str, list[int]] = {}  # source name -> its other TensorPlans (rare)
        n = 0
        for k, t in enumerate(plan.tensors):
            name = t.source or t.name
            if plan_of.setdefault(name, k) != k:
                others.setdefault(name, []).append(k)
            self.first.append(n)
            n += len(t.cuts)
        self.plan_at = array("i", [plan_of.get(name, -1) for name in names])  # -1: no TensorPlan
        self.more = {p: others[name] for p, name in enumerate(names) if name in others}

    def of(self, position: int) -> list[tuple[TensorPlan, Cut, int]]:
        """(tensor, cut, the cut's index in its file) of each cut of the source tensor at `position`."""
        found = []
        first = self.plan_at[position]
        for k in () if first < 0 else (first, *self.more.get(position, ())):
            t = self.tensors[k]
            found += [(t, c, self.place[n]) for n, c in enumerate(t.cuts, self.first[k])]
        return found


SPEC_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(ShardSpec) if f.default is not msgspec.NODEFAULT}


class Plan(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    topology: Topology
    options: Options
    model: ModelInfo
    tensors: tuple[TensorPlan, ...]
    files: tuple[OutputFile, ...]
    warnings: tuple[str, ...] = ()
    # HF module prefix -> its tpshard.quant.formats.QuantSpec as plain data (format, bits,
    # group_size, desc_act, sym, block, static_input), for readers that dequantize (verify).
    quant_layers: dict[str, dict] = {}

    def view(self, t: TensorPlan, c: Cut) -> ShardSpec:
        """The ShardSpec of one cut of a tensor."""
        f = self.files[c.file]
        return ShardSpec(
            name=t.name, source=t.source or t.name, layer=t.layer, layer_class=t.layer_class, piece=t.piece, kind=t.kind,
            dtype=t.dtype, source_shape=t.shape, shape=shard_shape(t, c), dim=t.dim, start=c.start,
            length=c.length, pad=c.pad, group=t.group, factor=t.factor, group_rank=c.group_rank,
            group_size=t.group_size, ranks=f.ranks, file=f.name, quant=t.quant, step=t.step,
            ratio=t.ratio, atom=t.atom, logical_dim=t.logical_dim, logical_size=t.logical_size,
            logical_start=c.logical_start, logical_length=c.logical_length, logical_pad=c.logical_pad, value=c.value,
            ep_slot=t.ep_slot, expert=t.expert,
        )  # fmt: skip

    @cached_property
    def shards(self) -> tuple[ShardSpec, ...]:
        """Every distinct per-rank tensor, in plan order (built on first use)."""
        return tuple(self.view(t, c) for t in self.tensors for c in t.cuts)

    def rank_shards(self, rank: int) -> list[ShardSpec]:
        """Rank `rank`'s tensors, in plan order; builds only this rank's views."""
        if "shards" in self.__dict__:  # every view is built already
            return [s for s in self.shards if rank in s.ranks]
        held = {i for i, f in enumerate(self.files) if rank in f.ranks}
        return [self.view(t, c) for t in self.tensors for c in t.cuts if c.file in held]

    def rank_files(self, rank: int) -> list[OutputFile]:
        return [f for f in self.files if rank in f.ranks]

    def file_index(self, name: str) -> int:
        """The index in `files` of the file of this name."""
        if "_file_index" not in self.__dict__:
            self.__dict__["_file_index"] = {f.name: i for i, f in enumerate(self.files)}
        return self.__dict__["_file_index"][name]

    def members(self, index: int) -> list[tuple[TensorPlan, Cut]]:
        """The tensors of file `index` as (TensorPlan, Cut), in data order: what check and an
        output's reader walk instead of ShardSpec views. Made on each call from the file's shards:
        every file's kept were 29 MB at 90k tensors and tp 8."""
        shards = self._file_shards()[index]
        return [(t, t.cuts[j]) for t, j in zip(map(self.tensors.__getitem__, shards.tensors), shards.cuts)]

    def member(self, index: int, k: int) -> tuple[TensorPlan, Cut]:
        """Tensor k of file `index` as (TensorPlan, Cut): members(index)[k] without the list."""
        shards = self._file_shards()[index]
        t = self.tensors[shards.tensors[k]]
        return t, t.cuts[shards.cuts[k]]

    def cut_places(self) -> array:
        """Each cut's index in its file, cuts numbered in plan order: a file holds its tensors in
        plan order, so a cut's place counts the cuts of its file before it."""
        places, count = array("I"), [0] * len(self.files)
        for t in self.tensors:
            for c in t.cuts:
                places.append(count[c.file])
                count[c.file] += 1
        return places

    def index_names(self, index: int) -> list[str]:
        """The names of the tensors of file `index`, sorted (each rank's model.safetensors.index.json
        merges its files' lists), made on each call from the file's shards: kept, every file's were
        4 MB at 90k tensors and tp 8."""
        return sorted(map(attrgetter("name"), map(self.tensors.__getitem__, self._file_shards()[index].tensors)))

    def header(self, file: str) -> bytes:
        """The header bytes of an output file (header_pieces joined)."""
        return b"".join(self.header_pieces(file))

    def header_pieces(self, file: str) -> Iterator[bytes]:
        """The header bytes of an output file, in pieces built as they are asked for and kept
        nowhere: the writer and check need each file's once (at 90k tensors and tp 8 the headers are
        48 MB in all). Its length is the one the file's offsets were laid out with: anything else is
        a bug, never a file written with its data in the wrong place."""
        size, relative, pieces = kinds_header_pieces(*self._file_kinds(file), FILE_METADATA)
        layouts = self.__dict__.setdefault("_layouts", {})
        if file not in layouts:  # not laid out yet: this header is the layout
            layouts[file] = (size, array("Q", map(size.__add__, relative)))
        elif size != layouts[file][0]:
            raise AssertionError(f"{file}: the header built is {size} bytes, the plan laid it out as {layouts[file][0]}")
        return pieces

    def offsets(self, file: str) -> Sequence[int]:
        """Each tensor's absolute data offset in an output file, in data order; no header is built."""
        return self._layout(file)[1]

    def header_size(self, file: str) -> int:
        """The length of a file's header: its data follows."""
        return self._layout(file)[0]

    def _layout(self, file: str) -> tuple[int, Sequence[int]]:
        """(header size, data offsets) of a file: make_plan's, or counted on first use (a plan read
        from a manifest)."""
        layouts = self.__dict__.setdefault("_layouts", {})
        if file not in layouts:
            size, offsets = kinds_header_layout(*self._file_kinds(file), FILE_METADATA)
            layouts[file] = (size, array("Q", offsets))
        return layouts[file]

    def _file_kinds(self, file: str) -> tuple[list[str], Sequence[int], Shapes]:
        """A file's tensors, in data order, as build_kinds_header takes them."""
        shards = self._file_shards()[self.file_index(file)]
        return list(map(attrgetter("name"), map(self.tensors.__getitem__, shards.tensors))), shards.kinds, shards.shapes

    def _file_shards(self) -> list[FileShards]:
        """Per file (indexing `files`): its FileShards, make_plan's or made here in one pass."""
        if "_shards" not in self.__dict__:
            held = [(array("I"), array("I"), array("I"), Numbering()) for _ in self.files]
            for i, t in enumerate(self.tensors):
                for j, c in enumerate(t.cuts):
                    tensors, cuts, kinds, numbers = held[c.file]
                    tensors.append(i)
                    cuts.append(j)
                    kinds.append(numbers[(t.dtype, shard_shape(t, c))])
            self.__dict__["_shards"] = [FileShards(tensors, cuts, kinds, list(numbers)) for tensors, cuts, kinds, numbers in held]
        return self.__dict__["_shards"]

    def share_layout(self, other: Plan) -> None:
        """Take the files' layout (shards, header sizes, offsets) that `other` has made, when it
        plans the same tensors into files of the same names: a manifest's plan that is the
        rules' (check --source) need not lay its files out again beside theirs."""
        if self.tensors is other.tensors and [f.name for f in self.files] == [f.name for f in other.files]:
            for cache in ("_shards", "_layouts"):
                if cache in other.__dict__:
                    self.__dict__.setdefault(cache, other.__dict__[cache])

    def with_shards(self, specs: Iterable[ShardSpec]) -> Plan:
        """This plan with its tensors rebuilt from `specs` (files kept): for tests that break a plan."""
        return msgspec.structs.replace(self, tensors=pack_tensors(specs, self.files))


def plan_differences(a: Plan | Manifest, b: Plan | Manifest) -> list[str]:
    """Which of model, tensors, files (names, ranks, sizes), warnings and quant_layers differ
    between two plans or manifests: what make_plan gives against what a manifest records.
    quant_layers are compared as JSON: a plan made holds tuples where a decoded one holds lists."""
    parts = {
        "model": lambda p: p.model,
        "tensors": lambda p: p.tensors,
        "files": lambda p: [(f.name, f.ranks, f.size) for f in p.files],
        "warnings": lambda p: p.warnings,
        "quant_layers": lambda p: msgspec.json.encode(p.quant_layers, order="sorted"),
    }
    return [what for what, part in parts.items() if part(a) != part(b)]


class SourceFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    size: Count
    checksum: str  # weight files: tpshard.digest.file_digest over crc32s; others: sha256


class Source(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # the checkpoint folder split, resolved
    files: tuple[SourceFile, ...]  # safetensors files and index, as read
    extra_files: tuple[SourceFile, ...] = ()  # config, tokenizer, ...: copied into every rank folder


class Manifest(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION
    tool_version: str
    source: Source
    topology: Topology
    options: Options
    model: ModelInfo
    quant_layers: dict[str, dict] = {}
    warnings: tuple[str, ...] = ()
    written_ranks: tuple[Rank, ...]  # ranks whose folders this output holds (all, unless --ranks)
    tensors: tuple[TensorPlan, ...]
    files: tuple[OutputFile, ...]  # every file of the plan; checksums for those written

    @classmethod
    def of(cls, plan: Plan, *, tool_version: str, source: Source, written_ranks: tuple[int, ...], files: tuple[OutputFile, ...]) -> Manifest:
        return cls(
            tool_version=tool_version, source=source, topology=plan.topology, options=plan.options, model=plan.model,
            quant_layers=plan.quant_layers, warnings=plan.warnings, written_ranks=written_ranks, tensors=plan.tensors, files=files,
        )  # fmt: skip

    @cached_property
    def plan(self) -> Plan:
        return Plan(
            topology=self.topology, options=self.options, model=self.model, tensors=self.tensors, files=self.files,
            warnings=self.warnings, quant_layers=self.quant_layers,
        )  # fmt: skip

    def with_plan(self, plan: Plan) -> Manifest:
        """This manifest recording `plan` instead (tests that break a manifest)."""
        return msgspec.structs.replace(self, tensors=plan.tensors, files=plan.files, topology=plan.topology, options=plan.options)

    @property
    def source_path(self) -> str:
        return self.source.path

    @property
    def source_files(self) -> tuple[SourceFile, ...]:
        return self.source.files

    @property
    def extra_files(self) -> tuple[SourceFile, ...]:
        return self.source.extra_files

    @property
    def written_files(self) -> list[OutputFile]:
        """The files at least one written rank holds."""
        written = set(self.written_ranks)
        return [f for f in self.files if written.intersection(f.ranks)]


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


def rank_index_pieces(plan: Plan, rank: int) -> Iterator[bytes]:
    """The model.safetensors.index.json of rank `rank`, byte for byte (check compares it so), in
    pieces: json.dumps(indent=2) of {"metadata": {"total_size"}, "weight_map"}, written line by line
    where names need no escape (a rank's index at 90k tensors and tp 8 is 7 MB, and a dict, its JSON
    and its indented copy held ~25 MB at once)."""
    held = [i for i, f in enumerate(plan.files) if rank in f.ranks]
    # the data follows each header, without gaps
    total = sum(plan.files[i].size - plan.header_size(plan.files[i].name) for i in held)
    # One sorted run per file (a rank holds one piece of each tensor): merged, they are the sorted map.
    runs = [plan.index_names(i) for i in held]
    pairs = heapq.merge(*(zip(names, itertools.repeat(plan.files[i].name)) for i, names in zip(held, runs)))
    if not runs or not all(plain_json("".join(names)) for names in runs):
        yield (json.dumps({"metadata": {"total_size": total}, "weight_map": dict(pairs)}, indent=2) + "\n").encode()
        return
    yield f'{{\n  "metadata": {{\n    "total_size": {total}\n  }},\n  "weight_map": {{\n'.encode()
    lines = (f'    "{name}": "{file}"' for name, file in pairs)
    first = True
    while batch := list(itertools.islice(lines, 4096)):
        yield ("" if first else ",\n").encode() + ",\n".join(batch).encode()
        first = False
    yield b"\n  }\n}\n"


_encoder = msgspec.json.Encoder(order="sorted")
_DEFAULT_TAIL = [0, 0, 0, None]


def encode_manifest(manifest: Manifest) -> bytes:
    """Compact JSON, keys sorted, defaults left out (trailing ones of each cut array too)."""
    return b"".join(manifest_pieces(manifest))


MANIFEST_BATCH = 4096  # tensors per piece of manifest_pieces


def manifest_pieces(manifest: Manifest) -> Iterator[bytes | memoryview]:
    """encode_manifest's bytes in pieces, MANIFEST_BATCH tensors each: a writer need not hold them
    all (at 90k tensors the manifest is ~30 MB, and its tensors' parts as much again).

    Each tensor is encoded from its struct with its cuts spliced in, each distinct cuts tuple
    encoded once (make_plan shares one between the tensors of a kind): no tree of Python dicts for
    ~90k tensors. The splices are safe: inside strings JSON escapes every quote, so `"cuts":[]`
    and `"tensors":[]` occur only as the keys themselves."""
    # All but the tensors: the files' digests are 4 MB of it at 90k tensors and tp 8, not held
    # while the tensors are encoded (the part after them, a few fields, is copied out).
    rest = _encoder.encode(msgspec.structs.replace(manifest, tensors=()))
    at = rest.index(b'"tensors":[]') + len(b'"tensors":[')
    tail = rest[at:]
    yield memoryview(rest)[:at]
    del rest
    yield from tensor_pieces(manifest.tensors)
    yield tail + b"\n"


def tensor_pieces(tensors: Sequence[TensorPlan]) -> Iterator[bytes]:
    """The text of a manifest's "tensors" array, without its brackets, MANIFEST_BATCH tensors a piece."""
    cuts_json: dict[int, bytes] = {}
    for start in range(0, len(tensors), MANIFEST_BATCH):
        pieces = []
        for t in tensors[start : start + MANIFEST_BATCH]:
            cuts = cuts_json.get(id(t.cuts))
            if cuts is None:
                cuts = cuts_json[id(t.cuts)] = b'"cuts":' + _encoder.encode([_trim(msgspec.to_builtins(c)) for c in t.cuts])
            pieces.append(_encoder.encode(msgspec.structs.replace(t, cuts=())).replace(b'"cuts":[]', cuts, 1))
        yield (b"," if start else b"") + b",".join(pieces)


def _trim(cut) -> list:
    cut = list(cut)
    if cut[5:] == _DEFAULT_TAIL:
        return cut[:5]
    while len(cut) > 5 and cut[-1] == _DEFAULT_TAIL[len(cut) - 6]:
        cut.pop()
    return cut


class Envelope(msgspec.Struct):
    """The format and version of a tpshard document, read alone where it fails its schema (which
    an older or newer one may not meet): decode_versioned."""

    format: Any = None
    version: Any = None


def refuse_envelope(where: str, format: Any, version: Any, expected: tuple[str, int], what: str, again: str, label: str = "version") -> None:
    """An OutputError unless (format, version) is `expected`; `what` names the document, `again`
    what remakes one written by an older tpshard."""
    from tpshard.errors import OutputError

    if format != expected[0]:
        raise OutputError(f"{where}: format {format!r} is not {expected[0]!r}; not a {what}")
    if version is None:
        raise OutputError(f"{where}: no {label}; not a {what} this tpshard can read")
    if version != expected[1]:
        older = isinstance(version, int) and version < expected[1]
        raise OutputError(
            f"{where}: {label} {version!r}, this tpshard reads version {expected[1]}"
            + (f"; written by an older tpshard, {again}" if older else "; written by a newer tpshard, upgrade it")
        )


def decode_versioned(
    decoder: msgspec.json.Decoder, data: bytes, where: str, refuse: Callable[[Any, Any], None], invalid: str, unreadable: str, keep: tuple[type[Exception], ...] = ()
) -> Any:
    """`data` decoded against the schema of `decoder`: the JSON is parsed once when it is a document
    of this version (a 90k-tensor manifest is ~30 MB). Only where that fails are its format and
    version read alone, so that `refuse(format, version)` names a foreign document or another
    version (whose schema may differ) instead of the failure. Then the failure: an OutputError
    "{where}: {invalid} (...)", or the exception itself for the types in `keep` (a __post_init__'s
    own message); "{where}: {unreadable} (...)" for a document that is not a JSON object."""
    from tpshard.errors import OutputError

    try:
        decoded = decoder.decode(data)
    except Exception as e:  # msgspec names the field ("... - at `$.files[3].size`"), or a __post_init__ refuses a value
        try:
            envelope = msgspec.json.decode(data, type=Envelope)
        except msgspec.DecodeError as not_object:
            raise OutputError(f"{where}: {unreadable} ({not_object})") from None
        refuse(envelope.format, envelope.version)
        if isinstance(e, keep):
            raise
        raise OutputError(f"{where}: {invalid} ({e})") from None
    refuse(decoded.format, decoded.version)
    return decoded


def _decode(decoder: msgspec.json.Decoder, data: bytes, where: str):
    """A split manifest decoded against the schema of `decoder` (decode_versioned)."""
    refuse = partial(refuse_envelope, where, expected=(MANIFEST_FORMAT, MANIFEST_VERSION), what="tpshard split manifest", again="re-run tpshard split", label="manifest version")
    return decode_versioned(decoder, data, where, refuse, "not a valid tpshard manifest", "not a tpshard manifest")


def _text_twin(struct: type, **types: Any) -> type:
    """A struct with the fields and defaults of `struct`, those named in `types` typed so instead:
    what a manifest is decoded into before the cuts that tensors share are decoded once each. Its
    format and version are the document's, None where it has none (refused): `struct`'s defaults
    are the ones written."""
    fields = []
    for f in msgspec.structs.fields(struct):
        typ = types.get(f.name, f.type)
        if f.name in ("format", "version"):
            fields.append((f.name, Any, None))
        elif f.default is not msgspec.NODEFAULT:
            fields.append((f.name, typ, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, typ, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, typ))
    return msgspec.defstruct(f"_{struct.__name__}Text", fields, kw_only=True, gc=False)


# Tensors of a kind share their cuts: decoded as text, decoded and checked once per kind (dtype,
# shape, dim, group size and text: _tensors_problem), each tensor given the kind's tuple (90k tensors
# at tp 8 are 460k Cut structs otherwise: 45 MB).
_TensorText = _text_twin(TensorPlan, cuts=msgspec.Raw)
# A quantized module's spec is text too, decoded once per distinct text (_quant_specs).
_decoder = msgspec.json.Decoder(_text_twin(Manifest, tensors=list[_TensorText], quant_layers=dict[str, msgspec.Raw]))  # a list: replaced in place
# The lean way: the tensors left as text, then decoded DECODE_BATCH at a time.
_frame_decoder = msgspec.json.Decoder(_text_twin(Manifest, tensors=msgspec.Raw, quant_layers=dict[str, msgspec.Raw]))
_spec_decoder = msgspec.json.Decoder(dict)
_items_decoder = msgspec.json.Decoder(list[msgspec.Raw])
_batch_decoder = msgspec.json.Decoder(list[_TensorText])
DECODE_BATCH = 4096


def _decode_text(decoder: msgspec.json.Decoder, data: bytes, where: str):
    """The manifest as `decoder` decodes it (_decode), its quantized modules' specs decoded."""
    text = _decode(decoder, data, where)
    return msgspec.structs.replace(text, quant_layers=_quant_specs(text.quant_layers, where))


def _quant_specs(texts: dict[str, msgspec.Raw], where: str) -> dict[str, dict]:
    """Each module's spec, decoded once per distinct text and shared between the modules that have
    it, as make_plan shares them (DeepSeek-V3's FP8 release: ~46k modules of one spec, a dict each
    was 20 MB in every reader of its manifest)."""
    from tpshard.errors import OutputError

    specs: dict[bytes, dict] = {}
    out = {}
    for module, raw in texts.items():
        key = bytes(raw)
        spec = specs.get(key)
        if spec is None:
            try:
                spec = specs[key] = _spec_decoder.decode(key)
            except msgspec.DecodeError as e:
                raise OutputError(f"{where}: not a valid tpshard manifest ({_located(e, f'$.quant_layers[{module!r}]')})") from None
        out[module] = spec
    return out


def decode_manifest(data: bytes, where: str) -> Manifest:
    """A manifest from JSON bytes, decoded against its schema and validated (docs/format.md):
    OutputError otherwise, naming the field.

    Its tensors are decoded DECODE_BATCH at a time, each batch's records made TensorPlans before
    the next is decoded: the records of all of them at once were ~50 MB at DeepSeek-V3's count, the
    peak of every reader of a manifest. At the first fault the whole document is decoded and
    checked at once (_decode_whole), which names the first fault as it always has: the same
    schema and checks, in the order of the document."""
    text = _decode_text(_frame_decoder, data, where)
    tensors = None if _frame_problem(text) else _tensor_plans(text)
    if tensors is None:
        return _decode_whole(data, where)
    return _manifest_of(text, tensors)


def _tensor_plans(text) -> tuple[TensorPlan, ...] | None:
    """The TensorPlans of a manifest whose tensors are text (_frame_decoder), validated as
    _tensors_problem does; None at the first fault."""
    checks, out, one = _TensorChecks(text), [], {}.setdefault
    try:
        items = _items_decoder.decode(text.tensors)
        for start in range(0, len(items), DECODE_BATCH):
            for i, t in enumerate(_batch_decoder.decode(b"[" + b",".join(items[start : start + DECODE_BATCH]) + b"]"), start):
                problem, kind = checks.tensor(i, t)
                if problem:
                    return None
                out.append(_tensor_plan(t, kind, one))
    except msgspec.DecodeError:
        return None
    return None if checks.files(text) else tuple(out)


def _tensor_plan(t, kind: _CutKind, one: Callable) -> TensorPlan:
    """A decoded tensor record as the TensorPlan it describes, with its kind's cuts. `one`: a
    dict's setdefault, through which equal values decoded apart become one object (90k tensors
    have a few dtypes, layer classes and shapes: 16 MB of copies at tp 8)."""
    return TensorPlan(**(msgspec.structs.asdict(t) | {"cuts": kind.cuts, "dtype": one(t.dtype, t.dtype), "layer_class": one(t.layer_class, t.layer_class), "shape": one(t.shape, t.shape)}))  # fmt: skip


def _decode_whole(data: bytes, where: str) -> Manifest:
    """decode_manifest in one piece: the first fault named, or the manifest."""
    from tpshard.errors import OutputError

    text = _decode_text(_decoder, data, where)
    kinds: list[_CutKind] = []
    problem = _frame_problem(text) or _tensors_problem(text, kinds)
    if problem:
        raise OutputError(f"{where}: not a valid tpshard manifest ({problem})")
    tensors, one = text.tensors, {}.setdefault
    for i, (t, kind) in enumerate(zip(tensors, kinds)):  # each record replaced as its TensorPlan is made
        tensors[i] = _tensor_plan(t, kind, one)
    return _manifest_of(text, tuple(tensors))


def _manifest_bytes(out_dir: str | Path) -> tuple[bytes, str]:
    from tpshard.errors import OutputError

    path = Path(out_dir) / MANIFEST_NAME
    if not Path(out_dir).is_dir():
        raise OutputError(f"{out_dir}: no such folder")
    if not path.is_file():
        raise OutputError(f"{out_dir}: no {MANIFEST_NAME}; not a tpshard output, or a split that did not finish")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise OutputError(f"{path}: {size} bytes, more than any tpshard manifest ({MAX_MANIFEST_BYTES})")
    return path.read_bytes(), str(path)


@paused()
def read_manifest(out_dir: str | Path) -> Manifest:
    return decode_manifest(*_manifest_bytes(out_dir))


class ManifestFrame(NamedTuple):
    """A manifest read and checked but for its tensors, of which only the sha256 of their text is
    kept: check --source takes the tensors the rules make for the source instead, when their text
    is the same (decoding the manifest's own beside the rules' was a fifth of its peak at 90k tensors)."""

    text: Any  # decoded by _frame_decoder, its tensors left out
    tensors_sha256: bytes


@paused()
def read_manifest_frame(out_dir: str | Path) -> ManifestFrame:
    """The frame of the manifest at `out_dir`; OutputError, naming the fault, where read_manifest would raise one."""
    data, where = _manifest_bytes(out_dir)
    text = _decode_text(_frame_decoder, data, where)
    if _frame_problem(text):
        _decode_whole(data, where)  # raises, naming the first fault
    return ManifestFrame(msgspec.structs.replace(text, tensors=msgspec.Raw()), hashlib.sha256(text.tensors).digest())


def manifest_with_tensors(frame: ManifestFrame, plan: Plan) -> Manifest | None:
    """The manifest `frame` was read from, when its tensors are those of `plan`: their text (as
    manifest_pieces writes it) has the frame's sha256 and they pass decode_manifest's checks
    against the frame; None otherwise (read_manifest then says what it holds). That text decodes
    to `plan`'s tensors, field for field (test_manifest checks it for every kind of model)."""
    tensors, h = plan.tensors, hashlib.sha256(b"[")
    for piece in tensor_pieces(tensors):
        h.update(piece)
    h.update(b"]")
    if h.digest() != frame.tensors_sha256:
        return None
    manifest = _manifest_of(frame.text, tensors)
    if _tensors_problem(manifest, []):
        return None
    manifest.plan.share_layout(plan)
    return manifest


def _manifest_of(text, tensors: tuple[TensorPlan, ...]) -> Manifest:
    """The Manifest of a decoded text (_frame_decoder, _decoder) with these TensorPlans."""
    return Manifest(**(msgspec.structs.asdict(text) | {"tensors": tensors}))


# ---- one rank's records -------------------------------------------------------------------------
# open_rank / load_rank read one rank of an output whose manifest may describe hundreds of thousands
# of shards. They decode the fields that place bytes (names, dtypes, shapes, cuts, files, digests)
# and what validate() checks across fields, never build a ShardSpec, and lay out only the rank's own
# files. The fields for engines and checks (layer, kind, quantized layout, ...) are check's and
# verify's: those read the whole manifest. Field for field these are Manifest's (a test holds them so).


class _TensorRecord(msgspec.Struct, kw_only=True, gc=False):
    name: str
    source: str = ""
    dtype: str
    shape: tuple[Count, ...]
    group: GroupName
    group_size: Positive = 1
    dim: Annotated[int, msgspec.Meta(ge=0)] | None = None
    ep_slot: Annotated[int, msgspec.Meta(ge=0)] | None = None
    expert: Annotated[int, msgspec.Meta(ge=0)] | None = None
    cuts: msgspec.Raw  # decoded once per kind (_tensors_problem): tensors of a kind share it


class _FileRecord(msgspec.Struct, kw_only=True, gc=False):
    name: str
    ranks: tuple[Rank, ...]
    size: Count
    checksum: str = ""
    digests: str = ""  # checked for the rank's own files only


class _RankManifest(msgspec.Struct, kw_only=True):
    format: Any = None
    version: Any = None
    source: Source
    topology: Topology
    options: Options
    model: ModelInfo
    written_ranks: tuple[Rank, ...]
    tensors: tuple[_TensorRecord, ...]
    files: tuple[_FileRecord, ...]


_rank_decoder = msgspec.json.Decoder(_RankManifest)
_cuts_decoder = msgspec.json.Decoder(tuple[Cut, ...])


class RankFile(msgspec.Struct, frozen=True, gc=False):
    """One file of a rank: its record (digests included) and its tensors in data order."""

    record: OutputFile
    members: list[tuple[str, str, tuple[int, ...]]]  # (name, dtype, shape), as the file's header lists them


class RankRecords(msgspec.Struct, frozen=True):
    written_ranks: tuple[int, ...]
    checksum: str  # the digests' algorithm (Options.checksum)
    files: list[RankFile]  # the files holding the rank, in manifest order


def read_rank_records(out_dir: str | Path, rank: int) -> RankRecords:
    """Rank `rank`'s files and their tensors, from the manifest of `out_dir`, validated as
    read_manifest does except for what no byte of the rank depends on (see above); OutputError otherwise."""
    from tpshard.errors import OutputError

    data, where = _manifest_bytes(out_dir)
    m = _decode(_rank_decoder, data, where)
    kinds: list[_CutKind] = []
    problem = _frame_problem(m) or _tensors_problem(m, kinds)
    if problem:
        raise OutputError(f"{where}: not a valid tpshard manifest ({problem})")
    held = {i for i, f in enumerate(m.files) if rank in f.ranks}
    members: dict[int, list] = {i: [] for i in held}
    for t, kind in zip(m.tensors, kinds):
        placed = kind.placed
        if placed is None:  # the kind's shards in the rank's files, worked out once
            placed = kind.placed = [(members[c.file], shard_shape(t, c)) for c in kind.cuts if c.file in held]
        for into, shape in placed:
            into.append((t.name, t.dtype, shape))
    files = []
    for i in sorted(held):
        f = m.files[i]
        record = OutputFile(name=f.name, ranks=f.ranks, size=f.size, checksum=f.checksum, digests=f.digests)
        files.append(RankFile(record, members[i]))
    return RankRecords(m.written_ranks, m.options.checksum, files)


def _located(e: msgspec.DecodeError, path: str) -> str:
    """msgspec's message for a part decoded on its own, at `path` as decoding the whole manifest says it."""
    text = str(e)
    return text.replace("`$", f"`{path}") if "`$" in text else f"{text} - at `{path}`"


def plain_name(name: str) -> bool:
    """A file name that stays inside the folder it is joined to: no separator, no '..', not hidden."""
    return bool(name) and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")


def _check_cuts(shape: tuple[int, ...], dim: int | None, group_size: int, cuts: tuple[Cut, ...], size: int, nfiles: int) -> str | None:
    """What is wrong with a tensor's shape, dim or cuts (the text after its name), or None."""
    for d in shape:  # zero dims count as one: no dim may hide a huge product
        size *= max(d, 1)
        if size > MAX_BYTES:
            return f".shape: {list(shape)} is more than {MAX_BYTES} bytes"
    if dim is not None and dim >= len(shape):
        return f".dim: {dim} but the shape {list(shape)} has {len(shape)} dims"
    full = shape[dim] if dim is not None else 0
    row = size // max(full, 1)  # bytes per index along the cut dim
    for j, c in enumerate(cuts):
        if c.file >= nfiles:
            return f".cuts[{j}]: file index {c.file} but there are {nfiles} files"
        if c.group_rank >= group_size:
            return f".cuts[{j}]: group rank {c.group_rank} of a group of {group_size}"
        if dim is not None and (c.start + c.length > full or (c.length + c.pad) * row > MAX_BYTES):
            return f".cuts[{j}]: [{c.start}, +{c.length}) + {c.pad} padding does not fit dim {dim} of size {full}"
        if c.value is not None and len(c.value) > 64:
            return f".cuts[{j}]: a value of {len(c.value)} numbers"
    return None


def _frame_problem(m: Manifest | _RankManifest) -> str | None:
    """The topology, written ranks, files and extra files of a manifest (or of its rank records)."""
    world = m.topology.world_size
    if world > MAX_WORLD:
        return f"topology: world size {world} exceeds {MAX_WORLD}"
    if m.topology.pp > 1 and sum(m.topology.pp_layers) != m.model.num_layers:
        return f"topology.pp_layers: {list(m.topology.pp_layers)} adds up to {sum(m.topology.pp_layers)} layers; the model has {m.model.num_layers}"
    for i, r in enumerate(m.written_ranks):
        if r >= world:
            return f"written_ranks[{i}]: rank {r} outside the world of {world}"
    if len(set(m.written_ranks)) != len(m.written_ranks):
        return "written_ranks: a rank is listed twice"
    names: set[str] = set()
    for i, f in enumerate(m.files):
        if not plain_name(f.name) or not f.name.endswith(".safetensors"):
            return f"files[{i}].name: {f.name!r} is not a plain *.safetensors file name"
        if f.name in names:
            return f"files[{i}].name: {f.name!r} listed twice"
        names.add(f.name)
        for r in f.ranks:
            if r >= world:
                return f"files[{i}].ranks: rank {r} outside the world of {world}"
    for i, e in enumerate(m.source.extra_files):
        if not e.name or "/" in e.name or "\\" in e.name or "\0" in e.name or e.name in (".", "..") or e.name == MANIFEST_NAME:
            return f"source.extra_files[{i}].name: {e.name!r} is not a plain file name"
    return None


class _CutKind:
    """The tensors sharing one (dtype, shape, dim, group size, cuts): checked once, counted for the
    per-file tensor counts, and (rank records) placed in the rank's files once."""

    __slots__ = ("count", "cuts", "placed")

    def __init__(self, cuts: tuple[Cut, ...]):
        self.count, self.cuts, self.placed = 1, cuts, None


def _tensors_problem(m, kind_of: list) -> str | None:
    """The tensors' fields and cuts (JSON text, decoded here once per kind), and each written
    file's digests; `kind_of` receives each tensor's _CutKind."""
    checks = _TensorChecks(m)
    for i, t in enumerate(m.tensors):
        problem, kind = checks.tensor(i, t)
        if problem:
            return problem
        kind_of.append(kind)
    return checks.files(m)


class _TensorChecks:
    """_tensors_problem's checks, a tensor at a time, then the files' digests."""

    def __init__(self, m) -> None:
        from tpshard.safetensors_format import DTYPE_SIZE

        self.size_of = DTYPE_SIZE.get
        self.nfiles, self.ep, self.experts = len(m.files), m.topology.ep, m.model.num_experts
        # The cuts' checks depend on a tensor's dtype, shape, dim, group size and cuts, which most
        # tensors share with many others (every layer, every expert): each distinct one is checked once.
        self.kinds: dict[tuple, _CutKind] = {}

    def tensor(self, i: int, t) -> tuple[str | None, _CutKind | None]:
        """(the problem of tensors[i], None) or (None, its _CutKind)."""
        size = self.size_of(t.dtype)
        if size is None:
            return f"tensors[{i}] ({t.name}).dtype: {t.dtype!r} is not a safetensors dtype tpshard writes", None
        if t.source == t.name:
            return f"tensors[{i}] ({t.name}).source: equal to the name (recorded only where they differ)", None
        if t.ep_slot is not None and t.ep_slot >= self.ep:
            return f"tensors[{i}] ({t.name}).ep_slot: {t.ep_slot} but --ep is {self.ep}", None
        if t.expert is not None and t.expert >= self.experts:
            return f"tensors[{i}] ({t.name}).expert: {t.expert} but the model has {self.experts} routed experts", None
        cuts = t.cuts  # text (a record being decoded) or Cuts (a TensorPlan: manifest_with_tensors)
        key = (t.dtype, t.shape, t.dim, t.group_size, cuts if isinstance(cuts, tuple) else bytes(cuts))
        kind = self.kinds.get(key)
        if kind is not None:
            kind.count += 1
            return None, kind
        if not isinstance(cuts, tuple):
            try:
                cuts = _cuts_decoder.decode(key[-1])
            except msgspec.DecodeError as e:
                return _located(e, f"$.tensors[{i}].cuts"), None
        problem = _check_cuts(t.shape, t.dim, t.group_size, cuts, size, self.nfiles)
        if problem:
            return f"tensors[{i}] ({t.name}){problem}", None
        kind = self.kinds[key] = _CutKind(cuts)
        return None, kind

    def files(self, m) -> str | None:
        """The first written file whose digests are not one per tensor it holds."""
        per_file = [0] * self.nfiles
        for kind in self.kinds.values():
            for c in kind.cuts:
                per_file[c.file] += kind.count
        for i, f in enumerate(m.files):
            problem = digests_problem(i, f, per_file[i], m.options.checksum)
            if problem:
                return problem
        return None


def digests_problem(i: int, f: OutputFile | _FileRecord, count: int, algorithm: str) -> str | None:
    """What is wrong with files[i].digests for a file of `count` tensors, or None."""
    width = 2 * DIGEST_SIZE[algorithm]
    if f.digests and len(f.digests) != count * width:
        return f"files[{i}].digests: {len(f.digests)} hex digits for the {count} tensors of {f.name} ({width} each)"
    if not _LOWER_HEX.fullmatch(f.digests):
        return f"files[{i}].digests: not lower-case hex"
    return None


_LOWER_HEX = re.compile("[0-9a-f]*")
