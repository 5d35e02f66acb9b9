"""benchmarks/engine_load.py's own parts: the page-cache drop and its check, the bytes-read reading,
the argument handling, the checkpoints it writes (tpshard plans them at tp 8 and 4), the rows it
computes; and, where vLLM 0.33.0's CPU venv exists, one child load of each side."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import engine_load  # noqa: E402
from split_bench import Sample  # noqa: E402

VLLM = Path(engine_load.VLLM_PYTHON)


def _file(tmp_path: Path, mib: int = 8) -> Path:
    p = tmp_path / "data" / "f.bin"
    p.parent.mkdir()
    p.write_bytes(os.urandom(mib << 20))
    return p


def test_the_drop_evicts_every_page_and_the_check_sees_pages_that_stay(tmp_path):
    p = _file(tmp_path)
    size = p.stat().st_size
    assert engine_load.resident_bytes(p) == size  # just written: in the page cache
    engine_load.drop_page_cache(p.parent)
    if engine_load.resident_bytes(p) and shutil.which("df") and "tmpfs" in subprocess.run(["df", "--output=fstype", str(p)], capture_output=True, text=True).stdout:
        pytest.skip("tmpfs keeps its pages: nothing to drop them to")
    assert engine_load.resident_bytes(p.parent) == 0
    with open(p, "rb") as f:
        f.read(1 << 20)  # the first MiB back (and whatever the kernel reads ahead)
    assert 1 << 20 <= engine_load.resident_bytes(p) <= size
    if shutil.which("fincore"):  # util-linux's count of the same pages, at rest (no readahead in flight)
        for state in ("dropped", "read"):
            engine_load.drop_page_cache(p.parent) if state == "dropped" else p.read_bytes()
            res = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES", str(p)], capture_output=True, text=True)
            assert int(res.stdout.split()[0]) == engine_load.resident_bytes(p) == (0 if state == "dropped" else size)


def test_a_cold_read_shows_in_read_bytes_a_warm_one_only_in_rchar(tmp_path):
    p = _file(tmp_path)
    size = p.stat().st_size
    engine_load.drop_page_cache(p.parent)
    io0 = engine_load.proc_io()
    p.read_bytes()
    io1 = engine_load.proc_io()
    p.read_bytes()
    io2 = engine_load.proc_io()
    assert io1["read_bytes"] - io0["read_bytes"] >= size  # from the disk
    assert io1["rchar"] - io0["rchar"] >= size
    assert io2["read_bytes"] - io1["read_bytes"] < size // 8  # from the page cache
    assert io2["rchar"] - io1["rchar"] >= size


@pytest.mark.parametrize("argv, message", [
    (["--rank", "4", "--tp", "8,4"], "--rank 4 must be a rank of every --tp"),
    (["--tp", "8,x"], "--tp 8,x: comma-separated integers"),
    (["--cases", "llama-bf16,llama-int4"], "--cases: choose from"),
    (["--strategies", "eager"], "--strategies: choose from"),
    (["--runs", "0"], "--runs, --layers and --experts must be at least 1"),
    (["--vllm-python", "/nonexistent/python"], "--vllm-python /nonexistent/python: not an executable"),
])  # fmt: skip
def test_bad_arguments_end_in_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        engine_load.parse(["--vllm-python", sys.executable, *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_arguments_are_read_as_given():
    a = engine_load.parse(["--vllm-python", sys.executable, "--tp", "4", "--rank", "1", "--cases", "dsv3-fp8", "--strategies", "prefetch"])
    assert (a.tp, a.rank, a.cases, a.strategies) == ([4], 1, ["dsv3-fp8"], ["prefetch"])
    cases = engine_load.load_cases(Path("/m"), Path("/d"), 1, 4, ["default", "prefetch"], "py")
    assert list(cases) == ["hf default", "export default", "hf prefetch", "export prefetch"]  # the sides alternate
    assert cases["hf prefetch"][0] == Path("/m") and cases["hf prefetch"][1][-5:] == ["/m", "auto", "prefetch", "1", "4"]
    assert cases["export default"][1][-5:] == ["/d", "sharded_state", "default", "1", "4"]


def test_the_fp8_llama_is_fp8_block_in_every_linear():
    config, items = engine_load.llama(2, fp8=True)
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    kinds = {name: (dtype, shape) for name, dtype, shape in items}
    assert kinds["model.layers.1.mlp.down_proj.weight"] == ("F8_E4M3", (4096, 14336))
    assert kinds["model.layers.1.mlp.down_proj.weight_scale_inv"] == ("F32", (32, 112))
    assert kinds["model.layers.0.self_attn.k_proj.weight_scale_inv"] == ("F32", (8, 32))
    assert {d for n, (d, _) in kinds.items() if not n.endswith(("_proj.weight", "weight_scale_inv"))} == {"BF16"}
    assert sum(n.endswith("_proj.weight") for n in kinds) == 2 * 7
    bf16 = {n: s for n, _, s in engine_load.llama(2, fp8=False)[1]}
    assert {n: s for n, (d, s) in kinds.items() if not n.endswith("scale_inv")} == bf16  # the same tensors


@pytest.mark.parametrize("case", ["llama-fp8", "dsv3-fp8"])
def test_tpshard_plans_the_benchmark_checkpoints_at_tp_8_and_4(case, tmp_path):
    args = engine_load.parse(["--vllm-python", sys.executable, "--layers", "1", "--experts", "8"])
    config, items = engine_load.CASES[case](args)
    model = tmp_path / "m"
    engine_load.moe_bench.write_random_checkpoint(model, items, config, files=2, sparse=True)  # headers and holes
    for tp in ("8", "4"):
        p = subprocess.run([sys.executable, "-m", "tpshard", "plan", str(model), "--tp", tp, "--json"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stderr[-800:]
        assert json.loads(p.stdout)


def _sample(load_weights: float, read: int, resident: int = 0) -> Sample:
    info = {"times": {"load_model": {"s": load_weights + 1.0}, "create_model": {"s": 0.5}, "load_weights": {"s": load_weights}},
            "read_bytes_with_prefetch": read, "rchar": read // 2}  # fmt: skip
    return Sample(ok=True, wall_s=load_weights + 10, sync_s=0, maxrss_mib=100, anon_mib=50, file_mib=0, loadavg=2.0, info=info)


def test_rows_are_medians_against_the_rank_share_and_the_hf_side():
    result = {
        "share": 100,
        "samples": {"hf default": [_sample(6.0, 800), _sample(4.0, 900), _sample(5.0, 700)],
                    "export default": [_sample(1.0, 100), _sample(2.0, 110), _sample(0.5, 100)]},
        "resident_before": {"hf default": [0, 0, 0], "export default": [0, 4096, 0]},
    }  # fmt: skip
    rows = engine_load.load_rows(result)
    assert rows["hf default"]["load_weights_s"] == 5.0 and rows["hf default"]["x_share"] == 8.0
    assert rows["export default"]["load_weights_s"] == 1.0 and rows["export default"]["load_model_s"] == 2.0
    assert rows["export default"]["hf_over_export_load_weights"] == 5.0 and rows["export default"]["hf_over_export_load_model"] == 3.0
    assert rows["export default"]["resident_before"] == 4096  # the worst round shows
    assert "hf_over_export_load_weights" not in rows["hf default"]


@pytest.mark.slow
@pytest.mark.skipif(not VLLM.exists(), reason="vLLM 0.33.0's CPU venv (docs/deploy.md) is not at /tmp/vllmvenv")
def test_a_child_loads_one_rank_of_each_side_with_vllms_loader(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out, deploy = tmp_path / "out", tmp_path / "deploy"
    for cmd in (["split", str(REPO / "examples/tiny-llama"), "-o", str(out), "--tp", "2"], ["export", str(out), "-o", str(deploy), "--format", "vllm"]):
        subprocess.run([sys.executable, "-m", "tpshard", *cmd], check=True, capture_output=True, env=env, timeout=300)
    shares = {}
    for path, fmt in ((REPO / "examples/tiny-llama", "auto"), (deploy, "sharded_state")):
        p = subprocess.run([str(VLLM), str(REPO / "benchmarks/engine_load.py"), "_child", str(path), fmt, "prefetch", "1", "2"],
                           capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
        assert p.returncode == 0, p.stderr[-1500:]
        info = json.loads(p.stdout.strip().splitlines()[-1])
        t = info["times"]
        assert 0 < t["load_weights"]["s"] < t["load_model"]["s"] and 0 < t["create_model"]["s"] < t["load_model"]["s"]
        shares[fmt] = info["params_bytes"]
    assert shares["auto"] == shares["sharded_state"] == engine_load.rank_share(deploy, 1) - _headers(deploy, 1)


def _headers(deploy: Path, rank: int) -> int:
    """Bytes of the rank's files that are not tensor data (safetensors headers)."""
    total = 0
    for p in deploy.glob(f"model-rank-{rank}-part-*.safetensors"):
        with open(p, "rb") as f:
            total += 8 + int.from_bytes(f.read(8), "little")
    return total
