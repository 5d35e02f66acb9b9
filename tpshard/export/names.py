"""Per-engine name tables, compiled: what each engine's model `state_dict()` calls a rank's tensors.

The tables are facts about the engines' model classes and live with each family's `Arch`
(`Arch.exports`, tpshard/arch/; tpshard.arch.engine_names says where they come from); an
architecture whose table for an engine is None is refused by that engine's export. Here: `TABLES`
gathered from them, and `NameMap`, a table compiled for one plan.
"""

from __future__ import annotations

import re

from tpshard.arch import ARCHITECTURES
from tpshard.arch.base import ENGINES, Buffer, EngineTable, Piece

# engine -> {architecture: its table}, the architectures whose table for the engine is not None.
TABLES: dict[str, dict[str, EngineTable]] = {
    engine: {a.name: getattr(a.exports, engine) for a in ARCHITECTURES.values() if isinstance(getattr(a.exports, engine), EngineTable)}
    for engine in ENGINES
}
# engine -> {architecture: why its export is refused}, where the family says why (EngineNames).
REFUSED: dict[str, dict[str, str]] = {
    engine: {a.name: getattr(a.exports, engine) for a in ARCHITECTURES.values() if isinstance(getattr(a.exports, engine), str)}
    for engine in ENGINES
}

__all__ = ["ENGINES", "REFUSED", "TABLES", "Buffer", "EngineTable", "NameMap", "Piece"]


def _format(template: str) -> str:
    """A table's engine template (group references \\1, \\2 and plain text) as a str.format
    string: Match.expand parses its template again on every call, and a model of 90k tensors
    has 90k names."""
    if "\\" in re.sub(r"\\\d", "", template):
        raise ValueError(f"{template!r}: an engine template holds plain text and \\N group references only")
    return re.sub(r"\\(\d)", lambda m: "{%d}" % (int(m.group(1)) - 1), template.replace("{", "{{").replace("}", "}}"))


class NameMap:
    """Compiled table: HF tensor name -> its Piece with the engine name filled in."""

    def __init__(self, table: EngineTable, q_lora_rank: int | None = None):
        self.table = table
        pieces = table.pieces + (table.q_lora[0 if q_lora_rank else 1] if table.q_lora else ())
        self._rules = [(re.compile(pattern), piece, _format(piece.engine)) for pattern, piece in pieces]

    def piece(self, hf_name: str) -> Piece | None:
        for pattern, piece, engine in self._rules:
            m = pattern.fullmatch(hf_name)
            if m:
                return piece._replace(engine=engine.format(*m.groups()))
        return None

    def buffers(self, layer: str) -> list[Buffer]:
        return [b._replace(engine=b.engine.format(layer=layer)) for b in self.table.buffers]
