"""The base of the public msgspec classes (Topology, Options, Plan): dir() and help() list their own
fields and methods, not the two dozen members every msgspec.Struct has (__copy__, __rich_repr__,
__struct_config__, ...), which pydoc renders for each class and which made help(tpshard) three
times the public API it documents."""

from __future__ import annotations

import msgspec


class _OwnMembers(msgspec.StructMeta):  # StructMeta can be subclassed from msgspec 0.20 (pyproject)
    def __dir__(cls) -> list[str]:
        # pydoc and inspect.classify_class_attrs read a class's members from dir(); attribute access,
        # msgspec's encoders and copy/pickle look members up directly and are unaffected.
        return sorted(name for name in super().__dir__() if not name.startswith("_"))


class PublicStruct(msgspec.Struct, metaclass=_OwnMembers):
    """A msgspec.Struct whose dir() is its public members."""
