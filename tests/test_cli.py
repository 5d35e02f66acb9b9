"""The tpshard command as a user runs it: exit codes, one-line errors, no tracebacks, --json."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args, ok=True) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in p.stderr, p.stderr
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_plan_json_and_table(llama):
    p = run("plan", llama, "--tp", 8, "--attn-dp", 2, "--json")
    data = json.loads(p.stdout)
    assert {r["rank"] for r in data["by_rank"]} == set(range(8))
    assert data["plan"]["topology"] == {"tp": 8, "attn_dp": 2, "attn_cp": 1, "ep": 1, "moe_dense_tp": None}
    human = run("plan", llama, "--tp", 8, "--attn-dp", 2)
    assert "Per rank" in human.stdout and "Per rank" not in human.stderr  # tables on stdout, for | grep and > file


@pytest.mark.parametrize("batch", [1, 3, 4096])
@pytest.mark.parametrize("case", ["llama tp 8", "deepseek-v3 ep 2"])
def test_plan_json_in_pieces_is_the_whole_text(llama, deepseek_v3, case, batch, monkeypatch):
    """plan --json writes the plan's tensors a batch at a time, indented into their place: the
    text is byte for byte the whole output indented at once, at every seam between batches."""
    import msgspec

    from tpshard import cli, render
    from tpshard.checkpoint import open_checkpoint
    from tpshard.plan import make_plan
    from tpshard.report import kind_rows, rank_rows
    from tpshard.topology import Topology

    model, topology = {"llama tp 8": (llama, Topology(tp=8, attn_dp=2)), "deepseek-v3 ep 2": (deepseek_v3, Topology(tp=4, ep=2))}[case]
    p = make_plan(open_checkpoint(model), topology)
    out = {"plan": p, "by_kind": kind_rows(p), "by_rank": rank_rows(p), "alignment": [{"tensors": []}]}
    monkeypatch.setattr(render, "PLAN_JSON_BATCH", batch)
    assert b"".join(cli.plan_json_pieces(out, p)) == msgspec.json.format(msgspec.json.encode(out), indent=1) + b"\n"
    del out["alignment"]
    assert b"".join(cli.plan_json_pieces(out, p)) == msgspec.json.format(msgspec.json.encode(out), indent=1) + b"\n"


def test_explain_layer(llama, qwen3):
    rows = json.loads(run("explain", qwen3, "--tp", 8, "--attn-dp", 2, "--layer", 1, "--json").stdout)
    k = [r for r in rows if r["tensor"] == "model.layers.1.self_attn.k_proj.weight"]
    assert [(r["ranks"], r["loads"]) for r in k] == [([0, 1, 4, 5], "dim 0 [0, 32)"), ([2, 3, 6, 7], "dim 0 [32, 64)")]
    assert all(r["group"].startswith("attn_tp") for r in rows if "self_attn" in r["tensor"] and "norm" not in r["tensor"])
    llama_rows = json.loads(run("explain", llama, "--tp", 8, "--attn-dp", 2, "--layer", 1, "--json").stdout)
    assert all(r["group"].startswith("tp") for r in llama_rows if "self_attn" in r["tensor"])
    assert all("all-reduce" in r["reduction"] for r in rows if "o_proj" in r["tensor"])
    assert "Layer 1" in run("explain", llama, "--tp", 2, "--layer", 1).stdout
    p = run("explain", llama, "--tp", 2, "--layer", 9, ok=False)
    assert p.returncode == 2 and "layer 9 does not exist" in p.stderr


def test_split_then_check(qwen3, tmp_path):
    out = tmp_path / "out"
    summary = json.loads(run("split", qwen3, "-o", out, "--tp", 8, "--attn-dp", 2, "--json").stdout)
    assert summary["ranks"] == list(range(8))
    assert "ok" in run("check", out, "--source", qwen3).stdout
    report = json.loads(run("check", out, "--json").stdout)
    assert report["ok"] and report["files_checked"] == 15


def test_check_exit_1_on_a_broken_output(llama, tmp_path):
    out = tmp_path / "out"
    run("split", llama, "-o", out, "--tp", 2)
    path = out / "rank-00001" / "model-tp-001-of-002.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(data)
    p = run("check", out, "--source", llama, ok=False)
    assert p.returncode == 1 and "FAIL" in p.stdout and "model-tp-001-of-002" in p.stdout


def test_split_ranks_option(llama, tmp_path):
    out = tmp_path / "out"
    run("split", llama, "-o", out, "--tp", 4, "--ranks", "1-2")
    assert sorted(p.name for p in out.glob("rank-*")) == ["rank-00001", "rank-00002"]
    p = run("split", llama, "-o", tmp_path / "bad", "--tp", 4, "--ranks", "3-5", ok=False)
    assert p.returncode == 2 and "ranks must lie in 0..3" in p.stderr


def broken_index(tmp: Path, llama: Path) -> Path:
    bad = tmp / "bad-index"
    subprocess.run(["cp", "-r", str(llama), str(bad)], check=True)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = next(iter(index["weight_map"].values()))
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    return bad


def copy_with_config(tmp: Path, llama: Path, name: str, **changes) -> Path:
    bad = tmp / name
    subprocess.run(["cp", "-r", str(llama), str(bad)], check=True)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(config | changes))
    return bad


def unknown_arch(tmp: Path, llama: Path) -> Path:
    return copy_with_config(tmp, llama, "gpt2", architectures=["GPT2LMHeadModel"])


def wrong_shape(tmp: Path, llama: Path) -> Path:
    return copy_with_config(tmp, llama, "shape", intermediate_size=128)


def pickle_only(tmp: Path, llama: Path) -> Path:
    bad = tmp / "pickle"
    bad.mkdir()
    (bad / "config.json").write_text((llama / "config.json").read_text())
    (bad / "pytorch_model.bin").write_bytes(b"\x80\x04")
    return bad


def no_config(tmp: Path, llama: Path) -> Path:
    bad = tmp / "noconfig"
    bad.mkdir()
    return bad


@pytest.mark.parametrize(
    "make, args, message",
    [
        (no_config, [], "no config.json"),
        (pickle_only, [], "only pickle weights (pytorch_model.bin)"),
        (broken_index, [], "maps model.layers.0.mlp.extra.weight to"),
        (unknown_arch, [], "architecture GPT2LMHeadModel is not supported"),
        (wrong_shape, [], "but config.json implies ["),
        (None, ["--tp", "3"], "8 attention heads do not divide over the tp group of 3 ranks"),
        (None, ["--tp", "8", "--attn-dp", "3"], "--tp 8 is not divisible by --attn-dp 3"),
        (None, ["--tp", "2", "--no-pad", "--tp", "64"], "8 attention heads do not divide over the tp group of 64 ranks"),  # heads before the MLP dims --no-pad refuses
    ],
)
def test_user_errors_exit_2_with_one_message_and_no_output(llama, tmp_path, make, args, message):
    model = make(tmp_path, llama) if make else llama
    out = tmp_path / "out"
    for command in (["plan", model], ["split", model, "-o", out]):
        p = run(*command, *args, ok=False)
        assert p.returncode == 2 and message in p.stderr, p.stderr
        assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_output_exists(llama, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    p = run("split", llama, "-o", out, "--tp", 2, ok=False)
    assert p.returncode == 2 and "already exists; pass --force" in p.stderr
    run("split", llama, "-o", out, "--tp", 2, "--force")


def test_check_on_something_that_is_not_an_output(tmp_path):
    p = run("check", tmp_path, ok=False)
    assert p.returncode == 2 and "not a tpshard output" in p.stderr
