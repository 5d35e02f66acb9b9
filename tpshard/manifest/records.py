"""The records of a plan and a manifest (versions 3 and 4): each field, its meaning and its bounds.

What this file holds: the manifest's file name, format and version; the bounds on numbers read from
a manifest (MAX_*); ModelInfo and Options (what the rules were given); ShardSpec, one per-rank
tensor with every field spelled out, and its packed form: a TensorPlan per source tensor (what its
cuts share) holding one Cut per distinct per-rank piece; OutputFile with its digests (digest_at,
differing); Source and SourceFile; shard_shape and pack_tensors between the two forms.

What it is not: the Plan and its files' layout (tpshard.manifest.plan), the Manifest document
(tpshard.manifest.document), their JSON (tpshard.manifest.encode, tpshard.manifest.decode) or the
checks of a manifest read (tpshard.manifest.validation). docs/format.md describes the JSON.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from operator import itemgetter
from typing import Annotated, Literal

import msgspec

from tpshard.digest import DIGEST_SIZE
from tpshard.public_struct import PublicStruct
from tpshard.topology import GroupName

MANIFEST_NAME = "tpshard-manifest.json"
MANIFEST_FORMAT = "tpshard-manifest"
# Version 4 added a cut's leading-dim range (Cut.lead_start / lead_length); a manifest without one
# is written as version 3, byte for byte what the tpshard before it wrote, so that older readers
# read every manifest they can understand and refuse, as another version, those they cannot.
MANIFEST_VERSION = 4  # the newest this tpshard writes
MANIFEST_VERSIONS = (3, 4)  # what it reads

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
# row-parallel layer's bias, whole on every rank and added once per reduction group; `segmented` a
# column cut of each of several segments of dim 0 (`segments`), the rank's pieces concatenated.
Kind = Literal["column", "merged", "qkv_q", "qkv_k", "qkv_v", "row", "row_bias", "vocab", "replicated", "segmented"]


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
    # Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next; 0 = none)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    # DeepSeek-V4: the grouped output projection (wo_a [o_groups * o_lora_rank, heads * head_dim / o_groups])
    o_groups: int = 0
    o_lora_rank: int = 0
    index_n_heads: int = 0  # its ratio-4 layers' indexer (wq_b [index_n_heads * index_head_dim, q_lora_rank])
    index_head_dim: int = 0
    # Routed experts stored in blocks of this many intermediate values (gpt-oss MXFP4: 32), cut in
    # whole blocks, ceil(blocks / moe_tp) per rank; 0: not block-quantized.
    expert_block: int = 0


class Options(PublicStruct, frozen=True, kw_only=True, omit_defaults=True):
    """
    How a split treats what the topology alone does not decide (the `split` options of the same names).

    Args:
        pad (`bool`, defaults to True): pad dims the group does not divide (an MLP intermediate) instead of refusing.
        dp_lm_head (`bool`): lm_head over attn_tp instead of tp (SGLang `--enable-dp-lm-head`).
        vocab_multiple (`int`, defaults to 64): the vocab padded to this multiple before the split, as the engines pad it.
        max_file_bytes (`int`, defaults to 5 GiB): a rank's tensors of one group go to files of at most this size.
        checksum (`"crc32"` or `"sha256"`): the tensors' digests in the manifest.
        pad_blocks (`bool`): FP8 block formats: pad each rank's MLP shard to whole 128-blocks instead of refusing.
    """

    pad: bool = True
    dp_lm_head: bool = False
    vocab_multiple: int = 64
    max_file_bytes: int = 5 << 30
    checksum: Literal["crc32", "sha256"] = "crc32"
    pad_blocks: bool = False

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
    # A segmented cut (tpshard.cuts.runs): `dim` holds len(segments) segments of segments[i] * u
    # indices each (u = source_shape[dim] / sum(segments)); start / length / pad are in [0, u), and
    # the rank holds segment i's [segments[i] * start, + segments[i] * length) (+ its padding), the
    # segments' pieces concatenated in order. () = one contiguous run.
    segments: tuple[int, ...] = ()
    # A leading-dim range (manifest version 4; lead_length 0 = none, dim 0 whole): the piece is cut
    # from source[lead_start : lead_start + lead_length] (dim 0) as above, along `dim` > 0. A fused
    # [E, ...] expert tensor under ep < tp: the rank's EP block of experts x its moe_tp slice.
    lead_start: int = 0
    lead_length: int = 0


class Cut(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One group rank's piece of a tensor, a JSON array:
    [group_rank, start, length, pad, file, logical_start, logical_length, logical_pad, value,
    lead_start, lead_length], trailing defaults left out. `file` indexes `Manifest.files`."""

    group_rank: Rank
    start: Count
    length: Count
    pad: Count
    file: Annotated[int, msgspec.Meta(ge=0)]
    logical_start: Count = 0
    logical_length: Count = 0
    logical_pad: Count = 0
    value: tuple[int, ...] | None = None
    lead_start: Count = 0  # ShardSpec.lead_start / lead_length (manifest version 4)
    lead_length: Count = 0


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
    segments: tuple[Positive, ...] = ()  # ShardSpec.segments
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
           "quant", "step", "ratio", "atom", "logical_dim", "logical_size", "ep_slot", "expert", "segments")  # fmt: skip
_PER_CUT = ("group_rank", "start", "length", "pad")
_LOGICAL = ("logical_start", "logical_length", "logical_pad", "value", "lead_start", "lead_length")


def shard_shape(t: TensorPlan, c: Cut) -> tuple[int, ...]:
    """A shard's shape: the source shape with the cut dim replaced by length + pad (and dim 0 by
    the leading-dim range's length, where the cut has one)."""
    if t.dim is None:
        return t.shape
    shape = _resized(t.shape, t.dim, (c.length + c.pad) * (sum(t.segments) or 1))
    return _resized(shape, 0, c.lead_length) if c.lead_length else shape


def manifest_version(tensors: Iterable[TensorPlan]) -> int:
    """The version a manifest of these tensors is written as: 4 where a cut has a leading-dim
    range, else 3 (MANIFEST_VERSION's note). Each distinct cuts tuple is looked at once."""
    seen: set[int] = set()
    for t in tensors:
        if id(t.cuts) not in seen:
            seen.add(id(t.cuts))
            if any(c.lead_length for c in t.cuts):
                return 4
    return 3


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


SPEC_DEFAULTS = {f.name: f.default for f in msgspec.structs.fields(ShardSpec) if f.default is not msgspec.NODEFAULT}


class SourceFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    size: Count
    checksum: str  # weight files: tpshard.digest.file_digest over crc32s; others: sha256


class Source(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # the checkpoint folder split, resolved
    files: tuple[SourceFile, ...]  # safetensors files and index, as read
    extra_files: tuple[SourceFile, ...] = ()  # config, tokenizer, ...: copied into every rank folder
