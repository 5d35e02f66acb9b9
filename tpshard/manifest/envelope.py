"""The versioned envelope of a tpshard document: its format and version, read and refused.

What this file holds: Envelope, refuse_envelope and decode_versioned, shared by the split manifest
(tpshard.manifest.decode) and the export manifest (tpshard.export.manifest): a document of another
format or version is named as such before any failure of its schema.

What it is not: either document's schema or checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec


class Envelope(msgspec.Struct):
    """The format and version of a tpshard document, read alone where it fails its schema (which
    an older or newer one may not meet): decode_versioned."""

    format: Any = None
    version: Any = None


def refuse_envelope(
    where: str, format: Any, version: Any, expected: tuple[str, int | tuple[int, ...]], what: str, again: str, label: str = "version"
) -> None:  # fmt: skip
    """An OutputError unless (format, version) is `expected` (a version, or the versions read);
    `what` names the document, `again` what remakes one written by an older tpshard."""
    from tpshard.errors import OutputError

    if format != expected[0]:
        raise OutputError(f"{where}: format {format!r} is not {expected[0]!r}; not a {what}")
    if version is None:
        raise OutputError(f"{where}: no {label}; not a {what} this tpshard can read")
    versions = expected[1] if isinstance(expected[1], tuple) else (expected[1],)
    if version not in versions:
        older = isinstance(version, int) and version < min(versions)
        reads = f"version {versions[0]}" if len(versions) == 1 else f"versions {', '.join(map(str, versions))}"
        raise OutputError(
            f"{where}: {label} {version!r}, this tpshard reads {reads}"
            + (f"; written by an older tpshard, {again}" if older else "; written by a newer tpshard, upgrade it")
        )


# What a document nested past the interpreter's recursion limit (msgspec decodes a level per call)
# is refused with: no tpshard document nests more than a few levels.
TOO_DEEP = "JSON nested deeper than any tpshard document"


def decode_versioned(
    decoder: msgspec.json.Decoder, data: bytes, where: str, refuse: Callable[[Any, Any], None], invalid: str, unreadable: str, keep: tuple[type[Exception], ...] = ()
) -> Any:
    """`data` decoded against the schema of `decoder`: the JSON is parsed once when it is a document
    of this version (a 90k-tensor manifest is ~30 MB). Only where that fails are its format and
    version read alone, so that `refuse(format, version)` names a foreign document or another
    version (whose schema may differ) instead of the failure. Then the failure: an OutputError
    "{where}: {invalid} (...)", or the exception itself for the types in `keep` (a __post_init__'s
    own message); "{where}: {unreadable} (...)" for a document that is not a JSON object; TOO_DEEP
    for one nested past the recursion limit."""
    from tpshard.errors import OutputError

    try:
        decoded = decoder.decode(data)
    except RecursionError:  # msgspec recurses once per level of nesting: no format or version to read either
        raise OutputError(f"{where}: {invalid} ({TOO_DEEP})") from None
    except Exception as e:  # msgspec names the field ("... - at `$.files[3].size`"), or a __post_init__ refuses a value
        try:
            envelope = msgspec.json.decode(data, type=Envelope)
        except msgspec.DecodeError as not_object:
            raise OutputError(f"{where}: {unreadable} ({not_object})") from None
        except RecursionError:  # the schema failed before the nesting (a str field given deep arrays)
            raise OutputError(f"{where}: {invalid} ({TOO_DEEP})") from None
        refuse(envelope.format, envelope.version)
        if isinstance(e, keep):
            raise
        raise OutputError(f"{where}: {invalid} ({e})") from None
    refuse(decoded.format, decoded.version)
    return decoded
