"""The benchmark scripts stay runnable: every name they import from tpshard exists (a renamed one
broke benchmarks/split_phases.py unnoticed), and each answers --help."""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS)
def test_what_a_benchmark_imports_from_tpshard_exists(script):
    for node in ast.walk(ast.parse((BENCHMARKS / script).read_text())):  # inside functions too
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tpshard":
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name) and importlib.util.find_spec(f"{node.module}.{a.name}") is None]
            assert not missing, f"{script}:{node.lineno}: {node.module} has no {missing}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "tpshard":
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_answers_help(script):
    p = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "usage" in p.stdout.lower(), p.stderr[-500:]


# ---- benchmarks/families_bench.py: its generated checkpoints are the families' real layout -----


def _families_bench():
    sys.path.insert(0, str(BENCHMARKS))
    import families_bench

    return families_bench


def _headers(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            out |= {n: tuple(h.get_slice(n).get_shape()) for n in h.keys()}
    return out


def _saved_by_transformers(fb, name: str, tmp_path: Path) -> dict[str, tuple[int, ...]]:
    """What transformers' own model class writes for the case's tiny config (DeepSeek-V4: the
    release's names, as tests/v4_checkpoint.py writes them from transformers' model; Llama-4: the
    text weights only, as text-only exports hold them)."""
    import torch
    import transformers

    case = fb.CASES[name]
    config = case.config(8, 256, True)
    torch.manual_seed(0)
    model = getattr(transformers, case.arch)(config)
    if case.arch == "DeepseekV4ForCausalLM":
        from v4_checkpoint import native_tensors

        return {n: tuple(t.shape) for n, t in native_tensors(model, {"n_routed_experts": 8}).items()}
    model.save_pretrained(tmp_path / "hf")
    return {n: s for n, s in _headers(tmp_path / "hf").items() if n.startswith(case.keep)}


@pytest.mark.parametrize("name", ["gpt-oss", "glm", "minimax", "qwen3.5", "dsv4", "kimi", "llama4"])
def test_families_bench_writes_what_transformers_saves_and_tpshard_plans_it(name, tmp_path):
    """The benchmark's checkpoint (meta-device model, random bits) holds exactly the names and
    shapes transformers' save_pretrained writes for the same config, and tpshard plans every
    topology the benchmark splits it at; tpshard's completeness check sees one expert tensor gone
    (so the names written are the ones it checks, not ones it ignores)."""
    from tpshard.checkpoint import open_checkpoint
    from tpshard.errors import CheckpointError, PlanError
    from tpshard.plan import make_plan
    from tpshard.topology import Topology

    fb = _families_bench()
    assert set(fb.CASES) == {"gpt-oss", "glm", "minimax", "qwen3.5", "dsv4", "kimi", "llama4"}
    path, count, total = fb.write_case(tmp_path, name, 8, 256, tiny=True)
    written = _headers(path)
    assert len(written) == count
    assert fb.case_size(name, argparse.Namespace(experts=8, vocab=256, tiny=True)) == (8, count, total)  # what --sizes prints
    assert written == _saved_by_transformers(fb, name, tmp_path)
    flags = {"--tp": "tp", "--ep": "ep", "--attn-dp": "attn_dp"}
    for topo in fb.CASES[name].topologies:
        kw = {flags[k]: int(v) for k, v in zip(topo[::2], topo[1::2])}
        plan = make_plan(open_checkpoint(path), Topology(**kw))
        assert plan is not None
    # the plan sees a missing expert tensor: the generator's names are the ones tpshard checks
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    victim = next(n for n in data["weight_map"] if ".experts." in n)
    del data["weight_map"][victim]
    index.write_text(json.dumps(data))
    with pytest.raises((CheckpointError, PlanError), match="lacks|missing"):
        make_plan(open_checkpoint(path), Topology(tp=8))


def test_families_bench_sizes_keep_at_most_the_real_experts_and_refuse_a_full_disk(tmp_path, capsys):
    """`--experts 512 --sizes`: Qwen3.5 at its real 512, Llama-4 Maverick cut to its 128 (not 512
    experts it never had); a checkpoint whose copy would not fit the disk is refused before writing."""
    fb = _families_bench()
    assert fb.main(["--sizes", "--tiny", "--experts", "512", "--vocab", "256", "--cases", "qwen3.5,llama4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split(",")[0].strip() for line in lines] == ["512 of 512 experts", "128 of 128 experts"]
    assert "3104 tensors" in lines[0]  # 2 layers x 512 experts x 3 + 32 others
    with pytest.raises(RuntimeError, match="lower --gib or --experts"):
        fb.room(tmp_path, shutil.disk_usage(tmp_path).free, print)
    fb.room(tmp_path, 1 << 20, print)  # 1 MiB fits


@pytest.mark.slow
def test_families_bench_runs_end_to_end(tmp_path):
    out = tmp_path / "out.json"
    p = subprocess.run(
        [sys.executable, str(BENCHMARKS / "families_bench.py"), "--tiny", "--runs", "1", "--cases", "glm",
         "--vocab", "256", "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-800:]
    (case,) = json.loads(out.read_text())["cases"]
    assert list(case["rows"]) == ["cp -r", "split --tp 8", "split --tp 8 --ep 8 --attn-dp 2"]
    assert all(r["time_s"] > 0 and r["maxrss_mib"] > 0 for r in case["rows"].values())
    assert not any((tmp_path / "work").iterdir())  # the checkpoint and outputs are deleted


def test_pairs_times_split_and_check_against_cp_round_by_round(tmp_path):
    """benchmarks/pairs.py on the bundled example: every row ran each round, and a pair's ratio is
    the median of the rounds' own ratios (not a ratio of medians)."""
    repo = BENCHMARKS.parent
    out = tmp_path / "pairs.json"
    p = subprocess.run(
        [sys.executable, str(BENCHMARKS / "pairs.py"), str(repo / "examples" / "tiny-llama"), "--check", "--runs", "3",
         "--prefault", "0", "--workdir", str(tmp_path / "work"), "--json", str(out), "--", "--tp", "2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-800:]
    result = json.loads(out.read_text())
    assert list(result["rows"]) == ["cp -r", "split now", "check now"] and result["split_args"] == ["--tp", "2"]
    assert all(len(row["each"]) == 3 for row in result["rows"].values())
    split, cp = ([w + s for w, s, _ in result["rows"][k]["each"]] for k in ("split now", "cp -r"))
    (pair, _) = result["pairs"]
    each = sorted(a / b for a, b in zip(split, cp))
    assert pair["of"] == "split now" and [pair[k] for k in ("min", "median", "max")] == pytest.approx(each, rel=2e-3)
    assert not any((tmp_path / "work").iterdir())  # outputs removed
