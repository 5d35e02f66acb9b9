"""Engine exports: a tpshard output as the per-rank files vLLM's and SGLang's `sharded_state`
loaders read without slicing (docs/deploy.md).

    export(out, dest, "vllm")          # write model-rank-{r}-part-{p}.safetensors + tpshard-export.json
    check_export(dest, source=model)   # checksums; with the source, bit-exact from the checkpoint
    split_and_export(model, dest, Topology(tp=8), "vllm")  # split --format: checkpoint to export

names.py compiles the engines' names (the tables are the architectures', tpshard/arch/), layout.py
what each rank's files hold (and what is refused), quant.py what vLLM's quant methods build per rank
(quantized checkpoints, vLLM only), writer.py writes them, tpshard.check.export
proves them, split_export.py goes from a checkpoint to an export through a hidden tpshard output.
"""

from __future__ import annotations

import importlib

# Imported on first use: `tpshard check` looks for tpshard-export.json in every output it checks,
# and the writer would bring in the split's writer and numpy.
_EXPORTS = {
    "DEFAULT_MAX_PART_BYTES": "tpshard.export.layout", "ExportError": "tpshard.export.layout",
    "export_layout": "tpshard.export.layout", "EXPORT_MANIFEST_NAME": "tpshard.export.manifest",
    "read_export_manifest": "tpshard.export.manifest", "ENGINES": "tpshard.export.names", "export": "tpshard.export.writer",
    "split_and_export": "tpshard.export.split_export",
}  # fmt: skip

__all__ = [
    "DEFAULT_MAX_PART_BYTES", "ENGINES", "EXPORT_MANIFEST_NAME", "ExportError", "export", "export_layout", "read_export_manifest",
    "split_and_export",
]  # fmt: skip


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(_EXPORTS[name]), name)
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
