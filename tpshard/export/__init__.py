"""Engine exports: a tpshard output as the per-rank files vLLM's and SGLang's `sharded_state`
loaders read without slicing (docs/deploy.md).

    export(out, dest, "vllm")          # write model-rank-{r}-part-{p}.safetensors + tpshard-export.json
    check_export(dest, source=model)   # checksums; with the source, bit-exact from the checkpoint

names.py holds the engines' names, layout.py what each rank's files hold (and what is refused),
writer.py writes them, check.py proves them.
"""

from tpshard.export.layout import DEFAULT_MAX_PART_BYTES, ExportError, export_layout
from tpshard.export.manifest import EXPORT_MANIFEST_NAME, read_export_manifest
from tpshard.export.names import ENGINES
from tpshard.export.writer import export

__all__ = ["DEFAULT_MAX_PART_BYTES", "ENGINES", "EXPORT_MANIFEST_NAME", "ExportError", "export", "export_layout", "read_export_manifest"]
