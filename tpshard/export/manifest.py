"""The export's own manifest (`tpshard-export.json`): names, shapes, checksums, and where from.

Same envelope as the tpshard manifest (format, version, tool_version), format "tpshard-export",
version 3 (docs/format.md). Each file lists its engine tensors (name, dtype, shape, a constant's
value) and their digests as one hex string; a file that holds the same tensors as the same part of
its stage's first rank (every TP rank of a stage builds one model) leaves them out. Which tpshard
shards make each tensor is not stored: the export rules derive it from the plan, and `check
--source` makes the plan again; without the source, the checksums and headers here prove the files.
Version 2 listed every rank's tensors with their shards and a digest string each (124 MB at 90k
tensors and tp 8; version 3: ~15 MB); there is no reader of it.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import msgspec
from msgspec import UNSET, UnsetType

from tpshard.errors import OutputError, TpshardError
from tpshard.manifest.envelope import decode_versioned, refuse_envelope
from tpshard.manifest.records import Count, Options, Source
from tpshard.inputs import plain_name
from tpshard.manifest.validation import digests_problem
from tpshard.topology import Topology

EXPORT_MANIFEST_NAME = "tpshard-export.json"
EXPORT_FORMAT = "tpshard-export"
EXPORT_VERSION = 3


class ExportTensor(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, gc=False):
    name: str  # engine key
    dtype: str  # a safetensors dtype (_tensors_problem)
    shape: tuple[Count, ...]
    # A constant's content (vLLM attention scales; CT weight_shape): one value filling the shape, or every value.
    value: float | tuple[float, ...] | None = None


class ExportFile(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str  # model-rank-{rank}-part-{part}.safetensors, or model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors
    rank: int  # the world rank that loads it (pp_rank x tp + tp_rank; the TP rank at one stage)
    size: int  # bytes, header included
    checksum: str  # tpshard.digest.file_digest: sha256 of the header, then the tensor digests
    # Each tensor's digest (From.options.checksum: crc32 or sha256) in hex, back to back in data
    # order, as tpshard.manifest.OutputFile.digests: one string, not one per tensor.
    digests: str = ""
    # In data order. Left out of the JSON (and filled in by the reader, the same tuple) where they
    # are those of the same part of the stage's first rank: see encode_export_manifest.
    tensors: tuple[ExportTensor, ...] = ()


class ConfigEdit(msgspec.Struct, frozen=True, kw_only=True):
    """config.json as the export wrote it: the source's, with `added` put into its
    quantization_config so that vLLM loads the export quantized (tpshard.export.quant.config_additions);
    `check --source` accepts exactly this addition and nothing else."""

    added: dict[str, list[str]]
    size: int
    checksum: str  # sha256 of the file written


class From(msgspec.Struct, frozen=True, kw_only=True):
    """The tpshard output exported, and what its plan needs to be made again from the source."""

    path: str
    manifest_sha256: str
    topology: Topology
    options: Options


class ExportManifest(msgspec.Struct, frozen=True, kw_only=True):
    # No defaults: a document without them must fail the schema, to be refused by its envelope
    # (read_export_manifest) instead of read as this version.
    format: str
    version: int
    tool_version: str
    engine: str
    from_: From = msgspec.field(name="from")
    source: Source
    max_part_bytes: int
    files: tuple[ExportFile, ...]
    # Pipeline stages: the environment the server must be started with (VLLM_PP_LAYER_PARTITION);
    # UNSET (left out of the JSON) at one stage, so such exports read as before.
    env: dict[str, str] | UnsetType = UNSET
    # Quantized exports: what config.json gained over the source's (UNSET: a byte-identical copy).
    config: ConfigEdit | UnsetType = UNSET

    def __post_init__(self) -> None:
        from tpshard.export.layout import parse_part_name, part_name

        _refuse_envelope(self.format, self.version)
        seen = set()
        topo = self.from_.topology
        for f in self.files:
            m = parse_part_name(f.name, topo)
            if m is None or m[0] != f.rank or f.name in seen:
                raise OutputError(f"{EXPORT_MANIFEST_NAME}: files: {f.name!r} is not a unique {part_name(f.rank, 'N', topo)} name")
            if not 0 <= f.rank < self.from_.topology.world_size:
                raise OutputError(f"{EXPORT_MANIFEST_NAME}: files: {f.name} has rank {f.rank}, outside {self.from_.topology.describe()}")
            seen.add(f.name)
        for s in self.source.extra_files:
            if not plain_name(s.name):
                raise OutputError(f"{EXPORT_MANIFEST_NAME}: source.extra_files: {s.name!r} is not a plain file name")


def _stage_template(f: ExportFile, files: dict[str, ExportFile], topology: Topology) -> ExportFile | None:
    """The same part of the first rank of f's stage, whose tensors f may share; None for a file of
    a first rank, or where that rank has no such part."""
    from tpshard.export.layout import parse_part_name, stage_first_part

    first = stage_first_part(f.rank, parse_part_name(f.name, topology)[1], topology)
    return None if first == f.name else files.get(first)


def _refuse_envelope(format: object, version: object, where: str = EXPORT_MANIFEST_NAME) -> None:
    refuse_envelope(where, format, version, (EXPORT_FORMAT, EXPORT_VERSION), "tpshard export manifest", "re-export")


_encoder = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder(ExportManifest)


def encode_export_manifest(manifest: ExportManifest) -> bytes:
    """The manifest as JSON, each file's tensors left out where they equal those of the same part
    of its stage's first rank: the TP ranks of a stage build one model, so at tp 8 this stores the
    names, dtypes and shapes once instead of 8 times."""
    files = {f.name: f for f in manifest.files}
    topo = manifest.from_.topology
    compact = []
    for f in manifest.files:
        shared = _stage_template(f, files, topo)
        if shared is not None and shared.tensors and (f.tensors is shared.tensors or f.tensors == shared.tensors):
            f = msgspec.structs.replace(f, tensors=())
        compact.append(f)
    return _encoder.encode(msgspec.structs.replace(manifest, files=tuple(compact))) + b"\n"


def read_export_manifest(folder: str | Path) -> ExportManifest:
    path = Path(folder) / EXPORT_MANIFEST_NAME
    if not path.is_file():
        raise OutputError(f"{folder}: no {EXPORT_MANIFEST_NAME}; not a tpshard export, or an export that did not finish")
    where, invalid = str(path), "not a valid tpshard export manifest"
    # ExportManifest.__post_init__'s refusals (its version first) keep their own messages.
    m = decode_versioned(_decoder, path.read_bytes(), where, partial(_refuse_envelope, where=where), invalid, invalid, keep=(TpshardError,))
    _fill_shared_tensors(m)
    return m


def _tensors_problem(i: int, tensors: tuple[ExportTensor, ...]) -> str | None:
    """The first tensor of files[i] whose dtype is not one safetensors has, or whose constant is
    not one tpshard writes (layout.constant_bytes)."""
    from tpshard.safetensors_format import DTYPE_SIZE

    for j, t in enumerate(tensors):
        if t.dtype not in DTYPE_SIZE:
            return f"files[{i}].tensors[{j}] ({t.name}).dtype: {t.dtype!r} is not a safetensors dtype"
        if t.value is not None:
            from tpshard.export.layout import constant_bytes

            try:
                constant_bytes(t.dtype, t.value, t.shape)
            except (ValueError, KeyError, OverflowError):
                return f"files[{i}].tensors[{j}] ({t.name}).value: {list(t.value) if isinstance(t.value, tuple) else t.value!r} is not a constant tpshard writes as {t.dtype} {list(t.shape)}"
    return None


def _fill_shared_tensors(m: ExportManifest) -> None:
    """Give each file the tensors encode_export_manifest left out (its stage's first rank's tuple,
    shared), then check its tensors' dtypes (once per tuple) and that its digests are one per tensor."""
    files = {f.name: f for f in m.files}
    seen: set[int] = set()  # the tensor tuples checked (a stage's ranks share one)
    for i, f in enumerate(m.files):
        shared = _stage_template(f, files, m.from_.topology)
        if not f.tensors and shared is not None:
            msgspec.structs.force_setattr(f, "tensors", shared.tensors)
        problem = None
        if id(f.tensors) not in seen:
            seen.add(id(f.tensors))
            problem = _tensors_problem(i, f.tensors)
        problem = problem or digests_problem(i, f, len(f.tensors), m.from_.options.checksum)
        if problem is None and f.tensors and not f.digests:
            problem = f"files[{i}].digests: missing for the {len(f.tensors)} tensors of {f.name}"
        if problem:
            raise OutputError(f"{EXPORT_MANIFEST_NAME}: {problem}")
