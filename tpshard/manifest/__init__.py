"""The plan and the manifest: the parallel and load contracts as data (manifest versions 3 and 4).

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

The package, each module importing only those above it:
  records       the records and their bounds: ModelInfo, Options, ShardSpec, TensorPlan, Cut, OutputFile, Source
  envelope      a tpshard document's format and version, read and refused (the export manifest's too)
  plan          Plan and its files' layout (FileShards, header sizes, offsets), SourceCuts
  document      Manifest, rank_dir, plan_differences
  encode        the manifest's bytes, a rank's index.json, write_manifest
  validation    the checks of a manifest read, past its schema
  decode        decode_manifest, read_manifest, the frame check --source reads
  rank_records  one rank's lean reader (open_rank, load_rank)

This file only re-exports their public names: `from tpshard.manifest import X` for any of them.
Private names and tunables (DECODE_BATCH, MANIFEST_BATCH) are read and patched in their own modules.
"""

from tpshard.manifest.records import (
    FILE_METADATA,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    MANIFEST_VERSION,
    MANIFEST_VERSIONS,
    MAX_BYTES,
    MAX_MANIFEST_BYTES,
    MAX_WORLD,
    SPEC_DEFAULTS,
    TENSOR_FIELDS,
    Count,
    Cut,
    Kind,
    ModelInfo,
    Options,
    OutputFile,
    Positive,
    Rank,
    ShardSpec,
    Source,
    SourceFile,
    TensorPlan,
    differing,
    digest_at,
    manifest_version,
    pack_tensors,
    shard_shape,
)
from tpshard.manifest.envelope import Envelope, decode_versioned, refuse_envelope
from tpshard.manifest.plan import FileShards, Plan, SourceCuts
from tpshard.manifest.document import Manifest, plan_differences, rank_dir
from tpshard.manifest.encode import encode_manifest, manifest_pieces, rank_index_pieces, tensor_pieces, write_manifest
from tpshard.inputs import plain_name
from tpshard.manifest.validation import digests_problem
from tpshard.manifest.decode import ManifestFrame, decode_manifest, manifest_with_tensors, read_manifest, read_manifest_frame
from tpshard.manifest.rank_records import RankFile, RankRecords, read_rank_records

__all__ = [
    "FILE_METADATA", "MANIFEST_FORMAT", "MANIFEST_NAME", "MANIFEST_VERSION", "MANIFEST_VERSIONS", "MAX_BYTES", "MAX_MANIFEST_BYTES", "MAX_WORLD",
    "SPEC_DEFAULTS", "TENSOR_FIELDS", "Count", "Cut", "Envelope", "FileShards", "Kind", "Manifest", "ManifestFrame",
    "ModelInfo", "Options", "OutputFile", "Plan", "Positive", "Rank", "RankFile", "RankRecords", "ShardSpec", "Source",
    "SourceCuts", "SourceFile", "TensorPlan", "decode_manifest", "decode_versioned", "differing", "digest_at",
    "digests_problem", "encode_manifest", "manifest_pieces", "manifest_with_tensors", "pack_tensors", "plain_name",
    "plan_differences", "rank_dir", "rank_index_pieces", "read_manifest", "read_manifest_frame", "read_rank_records",
    "refuse_envelope", "manifest_version", "shard_shape", "tensor_pieces", "write_manifest",
]  # fmt: skip
