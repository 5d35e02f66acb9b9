"""The plan and the manifest: the parallel and load contracts as data.

A `Plan` is what `tpshard plan` prints and `tpshard split` executes: for every distinct per-rank
tensor, where its bytes come from (source tensor, dim, start, length, zero padding) and which
group rank holds it. A `Manifest` is the plan as written, plus checksums; it is the last file
`split` writes and the first one `check`, `verify` and `open_rank` read.

One `ShardSpec` per distinct output tensor: ranks that hold identical bytes (replicated tensors,
attention shards shared by attention-DP replicas, GQA kv replicas) share one spec and one file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import msgspec

from tpshard.topology import GroupName, Topology

MANIFEST_NAME = "tpshard-manifest.json"
MANIFEST_FORMAT = "tpshard-manifest"
MANIFEST_VERSION = 1

# How a tensor is cut. The four linear kinds follow the engines' layer classes; `row_bias` is a
# row-parallel layer's bias, whole on every rank and added once per reduction group.
Kind = Literal["column", "merged", "qkv_q", "qkv_k", "qkv_v", "row", "row_bias", "vocab", "replicated"]


class ModelInfo(msgspec.Struct, frozen=True, kw_only=True):
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


class Options(msgspec.Struct, frozen=True, kw_only=True):
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


class ShardSpec(msgspec.Struct, frozen=True, kw_only=True):
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
    file: str  # FileLayout.name holding it
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


class FileLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One output safetensors file, shared (hard linked) by every rank in `ranks`."""

    name: str  # file name inside each rank folder
    ranks: tuple[int, ...]
    tensors: tuple[str, ...]  # tensor names, in data order
    size: int  # bytes, header included


class Plan(msgspec.Struct, frozen=True, kw_only=True):
    topology: Topology
    options: Options
    model: ModelInfo
    shards: tuple[ShardSpec, ...]
    files: tuple[FileLayout, ...]
    warnings: tuple[str, ...] = ()
    # HF module prefix -> its tpshard.quant.formats.QuantSpec as plain data (format, bits,
    # group_size, desc_act, sym, block, static_input), for readers that dequantize (verify).
    quant_layers: dict[str, dict] = {}

    def rank_shards(self, rank: int) -> list[ShardSpec]:
        return [s for s in self.shards if rank in s.ranks]

    def rank_files(self, rank: int) -> list[FileLayout]:
        return [f for f in self.files if rank in f.ranks]

    def specs_by_file(self) -> dict[str, list[ShardSpec]]:
        """File name -> its tensors' specs, in data order."""
        by_file: dict[str, list[ShardSpec]] = {}
        for s in self.shards:
            by_file.setdefault(s.file, []).append(s)
        return by_file


class SourceFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    size: int
    checksum: str  # weight files: tpshard.digest.file_digest over crc32s; others: sha256


class WrittenFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    size: int
    checksum: str  # tpshard.digest.file_digest: sha256 of the header, then the tensor digests
    tensor_checksums: tuple[str, ...]  # per tensor (Options.checksum), in FileLayout.tensors order


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str = MANIFEST_FORMAT
    version: int = MANIFEST_VERSION
    tool_version: str
    source_path: str
    source_files: tuple[SourceFile, ...]  # safetensors files and index, as read
    extra_files: tuple[SourceFile, ...]  # config, tokenizer, ...: copied into every rank folder
    plan: Plan
    written_ranks: tuple[int, ...]  # ranks whose folders this output holds (all, unless --ranks)
    files: tuple[WrittenFile, ...]  # checksums of every output weight file


def rank_dir(rank: int) -> str:
    return f"rank-{rank:05d}"


_encoder = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder(Manifest)


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.format(_encoder.encode(manifest), indent=1) + b"\n"


def read_manifest(out_dir: str | Path) -> Manifest:
    from tpshard.errors import OutputError

    path = Path(out_dir) / MANIFEST_NAME
    if not Path(out_dir).is_dir():
        raise OutputError(f"{out_dir}: no such folder")
    if not path.is_file():
        raise OutputError(
            f"{out_dir}: no {MANIFEST_NAME}; not a tpshard output, or a split that did not finish"
        )
    try:
        manifest = _decoder.decode(path.read_bytes())
    except msgspec.DecodeError as e:
        raise OutputError(f"{path}: not a valid tpshard manifest ({e})") from None
    if manifest.format != MANIFEST_FORMAT or manifest.version != MANIFEST_VERSION:
        raise OutputError(f"{path}: manifest format {manifest.format} v{manifest.version} is not supported")
    return manifest
