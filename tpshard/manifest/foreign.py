"""What a folder given for a tpshard output is, when it has no tpshard manifest.

A user points a command at the folder beside the right one: tpshard's own engine export, or the
Hugging Face checkpoint it was split from. The refusal names what the folder is and what to run
instead, rather than "not a tpshard output". Only tpshard's own export manifest is read; of a
checkpoint only the names of config.json and its *.safetensors are looked at.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from tpshard.manifest.records import MANIFEST_NAME, MAX_MANIFEST_BYTES

EXPORT_MANIFEST_NAME = "tpshard-export.json"  # = tpshard.export.EXPORT_MANIFEST_NAME (tpshard.export imports this package)


def not_an_output(out_dir: Path) -> str:
    """The one-line refusal for `out_dir`, which has no MANIFEST_NAME."""
    export = out_dir / EXPORT_MANIFEST_NAME
    if export.is_file():
        engine, origin, source = _export_facts(export)
        then = f" ({origin})" if origin else ""
        return (
            f"{out_dir}: a tpshard export{engine} ({EXPORT_MANIFEST_NAME}), not a tpshard output: check it with"
            f" `tpshard check {shlex.quote(str(out_dir))} --source {shlex.quote(source) if source else 'MODEL'}`;"
            f" verify, export and reshard take the tpshard output it was exported from{then}"
        )
    if (out_dir / "config.json").is_file() and any(out_dir.glob("*.safetensors")):
        return (
            f"{out_dir}: a Hugging Face checkpoint (config.json and safetensors), not a tpshard output: split it first"
            f" (`tpshard split {shlex.quote(str(out_dir))} -o OUT --tp N`), then give OUT here and the checkpoint as --source"
        )
    return f"{out_dir}: no {MANIFEST_NAME}; not a tpshard output, or a split that did not finish"


def _export_facts(path: Path) -> tuple[str, str, str]:
    """' for vllm', the output it was exported from where that still holds a manifest (split
    --format removes its own), and the source where it still has a config.json; blanks for what
    cannot be read (the export's own check says what is wrong with it)."""
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            return "", "", ""
        data = json.loads(path.read_bytes())
        engine, origin, source = data.get("engine"), data.get("from", {}).get("path"), data.get("source", {}).get("path")
    except (OSError, ValueError, AttributeError):
        return "", "", ""
    engine = f" for {engine}" if engine in ("vllm", "sglang") else ""
    origin = origin if isinstance(origin, str) and origin and (Path(origin) / MANIFEST_NAME).is_file() else ""
    source = source if isinstance(source, str) and source and (Path(source) / "config.json").is_file() else ""
    return engine, origin, source
