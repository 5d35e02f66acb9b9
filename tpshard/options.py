"""Option values as the command line gives them: sizes (--max-part-size) and rank lists (--ranks).

Parsing only: a bad value is a UsageError (or TpshardError) naming the option, exit 2. The CLI
calls these; they import nothing of tpshard but its errors.
"""

from __future__ import annotations

from tpshard.errors import TpshardError, UsageError


def parse_size(text: str) -> int:
    """'5GiB' -> 5368709120; '500MB' -> 500000000; '4096' -> 4096."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}
    number = text.strip().rstrip("bBiIkKmMgG")
    unit = text.strip()[len(number):].upper()
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise TpshardError(f"--max-part-size {text!r}: expected bytes or a size like 5GiB, 500MB") from None
    if value < 1:
        raise TpshardError(f"--max-part-size {text!r}: must be at least one byte")
    return int(value)


MAX_RANK = 99_999  # rank folders are named rank-NNNNN


def parse_ranks(text: str | None) -> list[int] | None:
    """'0-3,6' -> [0, 1, 2, 3, 6]."""
    if text is None:
        return None
    ranks: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            a, b = int(lo), int(hi if dash else lo)
        except ValueError:
            raise UsageError(f"--ranks {text!r}: expected a list like 0-3 or 0,2,4") from None
        if not 0 <= a <= b <= MAX_RANK:
            raise UsageError(f"--ranks {text!r}: {part.strip()!r} is not a range of ranks from 0 to {MAX_RANK}")
        ranks.update(range(a, b + 1))
    return sorted(ranks)
