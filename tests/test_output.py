"""What the command prints and where, as a user sees it in a terminal of a given width and through a
pipe: tables and summaries on stdout, warnings, progress and errors on stderr, nothing that
identifies a row cut (issue 28, items 1, 2, 9, 10)."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import tempfile
import termios

import pytest
from rich.console import Console

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\r")


def in_terminal(*args, cols: int, terminal=("stdout", "stderr")) -> tuple[int, dict[str, str]]:
    """Run tpshard with the streams in `terminal` on a pseudo-terminal `cols` wide (the others on
    files): exit code and {"stdout": ..., "stderr": ...}, the terminal's text once in "terminal"."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, cols, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")} | {"TERM": "xterm"}
    files = {name: tempfile.TemporaryFile() for name in ("stdout", "stderr") if name not in terminal}
    streams = {name: slave if name in terminal else files[name] for name in ("stdout", "stderr")}
    p = subprocess.Popen([sys.executable, "-m", "tpshard", *map(str, args)], stdin=slave, env=env, **streams)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    code = p.wait(120)
    os.close(master)
    out = {"terminal": ANSI.sub("", b"".join(chunks).decode(errors="replace"))}
    for name, f in files.items():
        f.seek(0)
        out[name] = f.read().decode()
    return code, out


def piped(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=120)


def test_tables_and_summaries_go_to_stdout(llama, tmp_path):
    p = piped("plan", llama, "--tp", 2)
    assert p.returncode == 0 and "model.layers.N.self_attn.q_proj.weight" in p.stdout and "Per rank" in p.stdout
    assert p.stderr == ""
    out = tmp_path / "out"
    p = piped("split", llama, "-o", out, "--tp", 8, "--attn-dp", 2)
    assert p.stdout.startswith("split ") and "8 ranks" in p.stdout
    assert "warning:" in p.stderr and "warning:" not in p.stdout  # warnings stay on stderr
    p = piped("check", out, "--source", llama)
    assert p.stdout.startswith("ok ") and p.stderr == ""


@pytest.mark.parametrize("cols", [80, 120])
@pytest.mark.parametrize("command", [("plan", "--tp", 8, "--attn-dp", 2), ("explain", "--tp", 8, "--layer", 1)])
def test_no_identifying_cell_is_cut_in_a_terminal(llama, cols, command):
    code, out = in_terminal(command[0], llama, *command[1:], cols=cols)
    text = out["terminal"]
    assert code == 0 and "…" not in text, text
    assert all(len(line) <= cols for line in text.splitlines() if line[:1] in "┏┃┡│└"), text  # no table past the edge
    # every tensor name is there, folded at the key column's width at most
    names = {"model.layers.N.self_attn.q_proj.weight"} if command[0] == "plan" else {"model.layers.1.self_attn.q_proj.weight"}
    key = "".join(cell for line in text.splitlines() if line.startswith("│") for cell in [line.split("│")[1].strip()])
    assert all(n in key for n in names), text


def test_no_identifying_cell_is_cut_through_a_pipe(deepseek_v3):
    p = piped("plan", deepseek_v3, "--tp", 8, "--ep", 4)
    assert p.returncode == 0 and "…" not in p.stdout
    p = piped("explain", deepseek_v3, "--tp", 8, "--ep", 4, "--layer", 3)
    assert p.returncode == 0 and "…" not in p.stdout


def test_verify_table_folds_alike_layers_and_fits_80_columns():
    from tpshard.render import fold_layers, table

    rows = [
        dict(layer=f"layers.{i}.self_attn.qkv_proj", cls="QKV", group="attn_tp", format="-", inputs=2, max_abs="1e-07", max_rel=f"{i}e-07", result="ok")
        for i in range(32)
    ]
    rows.insert(5, dict(rows[5], layer="layers.5.mlp.down_proj", cls="Row", result="FAIL", max_rel="0.9"))
    folded = fold_layers(rows, "layer", largest=("max_abs", "max_rel"))
    assert [(r["layer"], r["max_rel"]) for r in folded] == [("layers.{0-31}.self_attn.qkv_proj", "31e-07"), ("layers.5.mlp.down_proj", "0.9")]
    console = Console(width=80, record=True, file=open(os.devnull, "w"))
    long = [dict(r, layer="model.language_model.layers.{0-31}.self_attn.qkv_proj_with_a_long_name") for r in folded]
    console.print(table("verify", long, drop=("format", "inputs", "max_abs"), console=console))
    text = console.export_text()
    assert "…" not in text and "model.language_model.layers.{0-31}" in text and all(len(line) <= 80 for line in text.splitlines())


def test_plan_says_up_front_which_group_attention_follows(llama, qwen3):
    code, out = in_terminal("plan", llama, "--tp", 8, "--attn-dp", 2, cols=200)
    text = out["terminal"]
    head = text[: text.index("Per weight kind")]
    assert "attention over tp (8 ranks)" in head and "attn_tp=4" not in head
    assert "warning:" in head  # the warning explains it before the tables, not after them
    per_rank = text[text.index("Per rank") :]
    assert "attn tp" not in per_rank  # no "attn tp 0-3" beside a q_proj cut over 8 ranks
    p = piped("plan", qwen3, "--tp", 8, "--attn-dp", 2)
    assert "attention over attn_tp (4 ranks)" in p.stdout.splitlines()[0] and "attn tp" in p.stdout


def test_version_plurals_and_the_single_rank_said(llama, tmp_path):
    from tpshard import __version__
    from tpshard.render import plural

    p = piped("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"tpshard {__version__}"
    p = piped("split", llama, "-o", tmp_path / "one")
    assert p.returncode == 0 and "no --tp given: writing one rank (tp 1)" in p.stderr
    assert "1 rank," in p.stdout and "1 ranks" not in p.stdout and "tp=1" in p.stdout
    p = piped("check", tmp_path / "one")
    assert "1 distinct file " in p.stdout and "1 files" not in p.stdout
    assert plural(1, "batch", "batches") == "1 batch" and plural(2, "part") == "2 parts"


@pytest.mark.parametrize("args", [("plan", "/nonexistent/model", "--json"), ("plan", "/nonexistent/model", "--tpx", "2", "--json")])
def test_an_error_under_json_is_json_on_stdout(args):
    p = piped(*args)
    data = json.loads(p.stdout)
    assert p.returncode == 2 and data["exit_code"] == 2 and data["error"] and "Traceback" not in p.stderr


def test_progress_on_a_terminal_stderr_only(llama, tmp_path):
    """split, reshard and check draw a bar (bytes, GiB units) on stderr when it is a terminal; stdout,
    a file here, gets the summary alone; through a pipe no progress at all (the pipe tests above)."""
    out, new = tmp_path / "out", tmp_path / "new"
    for args, word in [(("split", llama, "-o", out, "--tp", 4), "splitting"), (("reshard", out, "-o", new, "--tp", 2), "resharding"),
                       (("check", new, "--source", llama), "checking"), (("check", new), "checking")]:  # fmt: skip
        code, streams = in_terminal(*args, cols=100, terminal=("stderr",))
        assert code == 0 and word in streams["terminal"] and "/" in streams["terminal"], streams
        assert word not in streams["stdout"] and "\x1b" not in streams["stdout"] and streams["stdout"].strip(), streams
    p = piped("reshard", out, "-o", tmp_path / "third", "--tp", 1)
    assert p.returncode == 0 and p.stderr == "" and p.stdout.startswith("resharded ")


def test_verify_merge_and_export_count_their_progress(llama, tmp_path):
    """verify counts the layers rank 0 has judged, merge the rank folders linked, export the bytes
    written (issue 28 item 3): a bar on a terminal's stderr, as split's; stdout gets the summary alone."""
    a, b, merged, exported, report = tmp_path / "a", tmp_path / "b", tmp_path / "merged", tmp_path / "exp", tmp_path / "r.json"
    for part, ranks in ((a, "0-1"), (b, "2-3")):
        assert piped("split", llama, "-o", part, "--tp", 4, "--ranks", ranks).returncode == 0
    code, streams = in_terminal("merge", a, b, "-o", merged, cols=120, terminal=("stderr",))
    assert code == 0 and "merging 2 parts: linking" in streams["terminal"] and "4/4 ranks" in streams["terminal"], streams
    assert "4/4" not in streams["stdout"] and streams["stdout"].startswith("merged "), streams
    code, streams = in_terminal("export", merged, "-o", exported, "--format", "sglang", cols=120, terminal=("stderr",))
    assert code == 0 and re.search(r"exporting for sglang.*\d/[\d.]+ KiB", streams["terminal"]), streams
    assert "exporting" not in streams["stdout"] and streams["stdout"].startswith("export "), streams
    code, streams = in_terminal("verify", merged, "--source", llama, "--report", report, cols=120, terminal=("stderr",))
    layers = len(json.loads(report.read_text())["layers"])
    assert code == 0 and f"layers against the source" in streams["terminal"], streams
    assert f"{layers}/{layers} layers" in streams["terminal"] and f"/{layers} layers" not in streams["stdout"], streams


def test_export_and_split_format_bars_end_at_their_totals(llama, tmp_path):
    """The bytes export's progress hears add up to the total its bar is drawn against (the total
    counted the files' headers, so a bar ended short of 100 %), and `split --format` draws one bar
    for the split and the export together, told its total before the split starts."""
    from tpshard import Topology, split
    from tpshard.export import export, split_and_export
    from tpshard.export.writer import export_total

    out = tmp_path / "out"
    split(llama, out, Topology(tp=4))
    heard: list[int] = []
    export(out, tmp_path / "exp", "sglang", on_bytes=heard.append)
    assert sum(heard) == export_total(out) > 0
    heard, totals = [], []
    split_and_export(llama, tmp_path / "exp2", Topology(tp=4), "sglang", on_bytes=heard.append, on_total=totals.append)
    assert totals == [sum(heard)] and sum(heard) == export_total(out) + sum(os.path.getsize(f) for f in llama.glob("*.safetensors")) - _headers(llama)
    code, streams = in_terminal("split", llama, "-o", tmp_path / "exp3", "--tp", 4, "--format", "sglang", cols=120, terminal=("stderr",))
    assert code == 0 and re.search(r"splitting for sglang.*\d/[\d.]+ KiB", streams["terminal"]), streams
    assert "splitting" not in streams["stdout"] and streams["stdout"].startswith("export "), streams


def _headers(model) -> int:
    """The header bytes of a checkpoint's safetensors files (8-byte length and JSON)."""
    return sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in model.glob("*.safetensors"))
