"""The export's own manifest (`tpshard-export.json`): names, shapes, checksums, and where from.

Same envelope as the tpshard manifest (format, version, tool_version), format "tpshard-export",
version 2 (docs/format.md). Each engine tensor records the tpshard shards it concatenates, as
(HF tensor name, group rank): with the source checkpoint, `check` re-derives every byte from the
plan; without it, the checksums and headers here prove the files.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from msgspec import UNSET, UnsetType

from tpshard.errors import OutputError
from tpshard.manifest import Options, Source, plain_name
from tpshard.topology import Topology

EXPORT_MANIFEST_NAME = "tpshard-export.json"
EXPORT_FORMAT = "tpshard-export"
EXPORT_VERSION = 2


class ExportTensor(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str  # engine key
    dtype: str
    shape: tuple[int, ...]
    digest: str  # of its bytes (From.options.checksum: crc32 or sha256, hex)
    parts: tuple[tuple[str, int], ...] = ()  # (HF tensor name, group rank), concatenated along dim 0
    value: float | None = None  # a constant buffer's content (vLLM attention scales); parts empty


class ExportFile(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # model-rank-{rank}-part-{part}.safetensors, or model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors
    rank: int  # the world rank that loads it (pp_rank x tp + tp_rank; the TP rank at one stage)
    size: int  # bytes, header included
    checksum: str  # tpshard.digest.file_digest: sha256 of the header, then the tensor digests
    tensors: tuple[ExportTensor, ...]  # in data order


class From(msgspec.Struct, frozen=True, kw_only=True):
    """The tpshard output exported, and what its plan needs to be made again from the source."""

    path: str
    manifest_sha256: str
    topology: Topology
    options: Options


class ExportManifest(msgspec.Struct, frozen=True, kw_only=True):
    format: str = EXPORT_FORMAT
    version: int = EXPORT_VERSION
    tool_version: str
    engine: str
    from_: From = msgspec.field(name="from")
    source: Source
    max_part_bytes: int
    files: tuple[ExportFile, ...]
    # Pipeline stages: the environment the server must be started with (VLLM_PP_LAYER_PARTITION);
    # UNSET (left out of the JSON) at one stage, so such exports read as before.
    env: dict[str, str] | UnsetType = UNSET

    def __post_init__(self) -> None:
        from tpshard.export.layout import parse_part_name, part_name

        if self.format != EXPORT_FORMAT or self.version != EXPORT_VERSION:
            raise OutputError(f"{EXPORT_MANIFEST_NAME}: format {self.format} v{self.version}; this tpshard reads {EXPORT_FORMAT} v{EXPORT_VERSION}")
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


_encoder = msgspec.json.Encoder(order="sorted")
_decoder = msgspec.json.Decoder(ExportManifest)


def encode_export_manifest(manifest: ExportManifest) -> bytes:
    return _encoder.encode(manifest) + b"\n"


def read_export_manifest(folder: str | Path) -> ExportManifest:
    path = Path(folder) / EXPORT_MANIFEST_NAME
    if not path.is_file():
        raise OutputError(f"{folder}: no {EXPORT_MANIFEST_NAME}; not a tpshard export, or an export that did not finish")
    try:
        return _decoder.decode(path.read_bytes())
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise OutputError(f"{path}: not a valid tpshard export manifest ({e})") from None
