"""What a check found: its findings (Problem), in the order they were made, and what it proved
(CheckReport), as `tpshard check` prints them and `check --json` writes them.

Every check (a tpshard output's, an engine export's, verify's stage and rank-file checks) adds to a
CheckReport; none of them is here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from tpshard.manifest import ShardSpec

MAX_PROBLEMS = 50  # findings a report lists; those past it are counted (omitted)


def some_of(ids) -> str:
    """The first eight of a list of layers or ranks, and how many more: a finding stays one line."""
    ids = list(ids)
    return ", ".join(map(str, ids[:8])) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


class Problem(msgspec.Struct, frozen=True):
    check: str  # group | stages | experts | sizes | logical | replicas | reduction | files | stray | checksum | extras | rules | reassembly | from
    message: str


class CheckReport(msgspec.Struct, kw_only=True):
    out_dir: str
    source: str | None
    from_output: str | None = None  # check --from: the output it was resharded from
    problems: list[Problem] = []
    files_checked: int = 0
    bytes_checked: int = 0
    tensors_reassembled: int = 0  # source tensors proven bit-exact in every copy
    omitted: int = 0  # problems past MAX_PROBLEMS, counted but not listed

    @property
    def ok(self) -> bool:
        return not self.found

    @property
    def found(self) -> int:
        """Every finding so far, listed or past MAX_PROBLEMS: a check that compares it before and
        after knows whether it found something."""
        return len(self.problems) + self.omitted

    def add(self, check: str, message: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(Problem(check, message))
        else:
            self.omitted += 1

    def extend(self, held: CheckReport) -> None:
        """Add the findings of `held` (made apart, to be reported after these), in order; those
        past MAX_PROBLEMS there are past it here too."""
        for p in held.problems:
            self.add(p.check, p.message)
        self.omitted += held.omitted


def shard_text(spec: ShardSpec) -> str:
    """A shard as a finding names it: its file, group rank and ranks."""
    return f"{spec.name} (group {spec.group} rank {spec.group_rank}/{spec.group_size}, ranks {list(spec.ranks)})"
