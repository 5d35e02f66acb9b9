"""How the `tpshard` command writes: tables and summaries on stdout, progress, warnings and errors
on stderr, `--json` alone on stdout (as Unix tools and the `hf` CLI do, so `| grep` and `> file` work).

Tables fit the terminal without cutting what identifies a row: the key column (a tensor or layer
name) folds onto more lines instead of ending in an ellipsis, secondary columns are dropped first
when even that does not fit, and verify's rows of alike layers fold into one (`layers.{0-31}.mlp`).
No tpshard imports: the CLI and the library's reports both use it.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
from rich.console import Console

if TYPE_CHECKING:
    from rich.table import Table

    from tpshard.manifest import Plan

# Piped into a file or CI log, a console has no width: 200 columns keep a table row on one line
# for grep (the key column still folds past that, never cut).
PIPE_WIDTH = 200

out = Console(highlight=False, width=None if sys.stdout.isatty() else PIPE_WIDTH)
err = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else PIPE_WIDTH)


def show(*objects, **kwargs) -> None:
    """Print a table or summary line on stdout (rich markup, as Console.print)."""
    out.print(*objects, **kwargs)


def plural(n: int, word: str, many: str | None = None) -> str:
    """plural(1, "rank") -> '1 rank'; plural(3, "batch", "batches") -> '3 batches'."""
    return f"{n} {word if n == 1 else (many or word + 's')}"


def emit_json(obj) -> None:
    sys.stdout.buffer.writelines((msgspec.json.format(msgspec.json.encode(obj), indent=1), b"\n"))


PLAN_JSON_BATCH = 4096  # tensors per piece of plan_json_pieces


def plan_json_pieces(out: dict, plan: Plan) -> Iterator[bytes]:
    """_emit_json's bytes of `plan --json` (`out`, holding `plan`), in pieces: the plan's tensors
    are encoded and indented PLAN_JSON_BATCH at a time and put in their place, one level deeper
    (at 90k tensors and tp 8 the text is 74 MB; it, its compact form and a copy were ~180 MB at
    once). Inside strings JSON escapes quotes and newlines, so `"tensors": []` is only the key and
    every newline is indentation."""
    rest = msgspec.json.format(msgspec.json.encode({k: msgspec.structs.replace(v, tensors=()) if v is plan else v for k, v in out.items()}), indent=1)
    if rest.count(b'"tensors": []') != 1 or not plan.tensors:  # another such key, or nothing to put in it
        yield msgspec.json.format(msgspec.json.encode(out), indent=1) + b"\n"
        return
    at = rest.index(b'"tensors": []') + len(b'"tensors": [')
    yield rest[:at]
    for start in range(0, len(plan.tensors), PLAN_JSON_BATCH):
        batch = msgspec.json.format(msgspec.json.encode(plan.tensors[start : start + PLAN_JSON_BATCH]), indent=1)
        # `[\n {...},\n {...}\n]` at depth 0: the items, two levels deeper (the plan's tensors are at depth 2)
        yield (b"," if start else b"") + batch[1:-2].replace(b"\n", b"\n  ")
    yield b"\n  " + rest[at:] + b"\n"


def table(title: str, rows: list[dict], key: str | None = None, drop: Sequence[str] = (), console: Console = out) -> Table:
    """`rows` as a table that fits `console`: `key` (default: the first column) never cut, the
    columns in `drop` left out in that order while the table is wider than the console, every
    other cell folded onto more lines rather than cut."""
    from rich.table import Table  # imported by the commands that print tables only: 4 ms of every start

    columns = list(rows[0]) if rows else []
    key = key or (columns[0] if columns else None)
    for i in range(len(drop) + 1):
        shown = [c for c in columns if c not in drop[:i]]
        if sum(_width(c, rows) for c in shown) + 3 * len(shown) + 1 <= console.width:
            break
    t = Table(title=title, title_justify="left")
    for c, w in zip(shown, _widths(shown, rows, key, console.width)):
        t.add_column(c.replace("_", " "), overflow="fold", width=w)
    for row in rows:
        t.add_row(*(str(row[c]) for c in shown))
    return t


def _widths(columns: list[str], rows: list[dict], key: str | None, width: int) -> list[int | None]:
    """Each column's width, None where the table fits as it is: the other columns at their longest
    word (they wrap between words), the key at what they leave it (at least 12) and folded past
    that, and what is left back to the other columns in order."""
    room = width - 3 * len(columns) - 1  # a border and two spaces of padding per column
    natural = {c: _width(c, rows) for c in columns}
    if sum(natural.values()) <= room:
        return [None] * len(columns)
    least = {c: min(natural[c], _longest_word(c, rows)) for c in columns if c != key}
    given = dict(least)
    if key in columns:
        given[key] = max(12, min(natural[key], room - sum(least.values())))
    spare = room - sum(given.values())
    for c in columns:
        if c != key and spare > 0:
            more = min(spare, natural[c] - given[c])
            given[c] += more
            spare -= more
    return [given[c] for c in columns]


def _width(column: str, rows: list[dict]) -> int:
    return max([len(column)] + [len(str(r[column])) for r in rows])


def _longest_word(column: str, rows: list[dict]) -> int:
    words = column.replace("_", " ").split() + [w for r in rows for w in str(r[column]).split()]
    return max(map(len, words), default=1)


_NUMBER = re.compile(r"(?<=\.)(\d+)(?=\.)")


def fold_layers(rows: list[dict], name: str, largest: Sequence[str] = ()) -> list[dict]:
    """Rows alike but for the layer number in `name` (and the `largest` columns, which keep their
    largest value) as one row naming the layers, `layers.{0-31}.self_attn.qkv_proj`; rows keep the
    order of their first layer."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        generic = _NUMBER.sub("{}", row[name], count=1)
        same = tuple((k, v) for k, v in row.items() if k != name and k not in largest)
        groups.setdefault((generic, same), []).append(row)
    folded = []
    for (generic, _), group in groups.items():
        numbers = [int(m.group(1)) for r in group if (m := _NUMBER.search(r[name]))]
        if len(group) == 1 or len(numbers) != len(group):
            folded += group
            continue
        row = dict(group[0], **{k: max((r[k] for r in group), key=_as_float) for k in largest})
        row[name] = generic.replace("{}", "{" + ranges(sorted(numbers)) + "}", 1)
        folded.append(row)
    return folded


def _as_float(text) -> float:
    try:
        return float(text)
    except ValueError:
        return float("inf")  # a value that is not a number ("nan", "-") is never hidden behind a smaller one


def ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'"""
    spans: list[list[int]] = []
    for i in ids:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def human_bytes(n: int) -> str:
    """Bytes in binary units, as every summary and progress bar counts them: 175.1 KiB, 3.6 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


@contextlib.contextmanager
def byte_progress(description: str, total: int, quiet: bool = False) -> Iterator[Callable[..., None]]:
    """A transient bar with bytes and rate on stderr while `advance(nbytes)` is called
    (`advance(0, total)` sets a total known only once the work has started); nothing when stderr is
    not a terminal or `quiet` (--json)."""
    from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        """The rate in the summaries' units (rich's TransferSpeedColumn says GB/s)."""

        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("?" if speed is None else f"{human_bytes(int(speed))}/s", style="progress.data.speed")

    # binary_units: GiB, as the summaries count (rich's default is GB)
    columns = ("[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True), Rate())
    with Progress(*columns, console=err, transient=True, redirect_stdout=False, disable=quiet or not err.is_terminal) as progress:
        task = progress.add_task(description, total=total)

        def advance(n: int, total: int | None = None) -> None:
            if total is not None:
                progress.update(task, total=total)
            progress.advance(task, n)

        yield advance


@contextlib.contextmanager
def step_progress(description: str, quiet: bool = False) -> Iterator[Callable[..., None]]:
    """A transient spinner with the time elapsed on stderr, naming the step in progress
    (`step(text)`), and a bar of the step's count once it has one (`step(text, done, total, unit)`:
    verify's layers, merge's ranks), where a command has no byte count to show; nothing when stderr
    is not a terminal or `quiet`."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TimeElapsedColumn

    class Bar(BarColumn):
        """The bar once there is a count (rich pulses one without a total)."""

        def render(self, task):
            return super().render(task) if task.total is not None else ""

    columns = (SpinnerColumn(), "{task.description}", Bar(), "{task.fields[count]}", TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True, redirect_stdout=False, disable=quiet or not err.is_terminal) as progress:
        task = progress.add_task(description, total=None, count="")

        def step(text: str, done: int | None = None, total: int | None = None, unit: str = "") -> None:
            count = {} if total is None else dict(completed=done, total=total, count=f"{done}/{total} {unit}".rstrip())
            progress.update(task, description=f"{description}: {text}", **count)

        yield step
