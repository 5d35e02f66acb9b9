"""How verify starts and ends: a failing rank ends the job fast naming itself, exit codes under
torchrun, only rank 0 reads the source, the backend said out loud, a rendezvous nobody can steal.

Compared with what: the rank that failed first and its own message (not a peer's transport error);
the exit codes docs/verify.md documents (0 ok, 1 mismatch, 2 bad input, 3 launch problem), through
`verify --torchrun` (torchrun itself turns every failure into 1).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from broken import overwrite_tensor, rewrite_checksums

import tpshard
from tpshard.errors import TpshardError
from tpshard.manifest import rank_dir, read_manifest
from tpshard.runtime import DistInfo, RankFailed, run_local
from tpshard.topology import Topology
from tpshard.verify import choose_launch
from tpshard.verify.verdict import decide


def run(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "COLUMNS": "160", **(env or {})},
    )  # fmt: skip


def raise_in_a_collective(info: DistInfo) -> int:
    """Ranks 0, 1, 3 wait in an all_reduce; rank 2 raises instead of joining it."""
    import torch

    if info.rank == 2:
        time.sleep(0.5)  # the others are inside the collective by now
        raise ValueError("deliberate failure on rank 2, mid-collective")
    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item())


def test_a_rank_raising_mid_collective_ends_the_job_within_seconds_naming_itself():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_local(raise_in_a_collective, 4, backend="gloo", timeout_s=600)
    elapsed = time.monotonic() - start
    root = info.value.root
    assert root.rank == 2 and "deliberate failure on rank 2, mid-collective" in root.error, info.value
    # Process start-up dominates (~10 s idle, more on a loaded CI box); a hang would last the 600 s timeout.
    assert elapsed < 150, f"took {elapsed:.0f} s: the peers stuck in the collective must be ended, not waited for"


@pytest.fixture(scope="module")
def tp2(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tp2") / "out"
    tpshard.split(llama, out, Topology(tp=2))
    return out


def copy_of_output(good: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    return dst


def test_a_missing_rank_file_names_that_rank_and_file(llama, llama_tp8_out, tmp_path):
    out = copy_of_output(llama_tp8_out, tmp_path / "out")
    f = read_manifest(out).plan.rank_files(3)[0].name
    (out / rank_dir(3) / f).unlink()
    p = run("verify", out, "--source", llama)
    assert p.returncode == 2, p.stderr
    assert f"rank 3: {out / rank_dir(3) / f} is missing" in p.stderr and "Traceback" not in p.stderr


@pytest.fixture(scope="module")
def llama_tp8_out(llama, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("v8") / "out"
    tpshard.split(llama, out, Topology(tp=8, attn_dp=2))
    return out


CRASH = """
import os
import tpshard.verify.run as run

_rank_main = run.rank_main


def rank_main(info, jobs):
    if info.rank == 1:  # rank 0 is waiting in the first collective of verify by now
        import time
        time.sleep(0.5)
        raise RuntimeError("deliberate crash on rank 1")
    return _rank_main(info, jobs)


run.rank_main = rank_main
"""


def _torchrun(out, source, *extra, env=None) -> subprocess.CompletedProcess:
    return run(
        "verify", out, "--source", source, "--timeout", "600", "--torchrun", "--standalone --nproc-per-node 2", *extra,
        env=env,
    )  # fmt: skip


def test_torchrun_a_crashing_rank_exits_3_with_its_own_message(llama, tp2, tmp_path):
    """Under torchrun, rank 1 crashes while rank 0 waits in a collective: the job ends within
    seconds, exit 3 (not torchrun's 1), the message names rank 1 and its error."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(CRASH.replace("import tpshard.verify.run as run", "import tpshard.verify.run as run"))
    env = {"PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
    # sitecustomize runs in every process; only workers reach rank_main.
    start = time.monotonic()
    p = _torchrun(tp2, llama, env=env)
    elapsed = time.monotonic() - start
    assert p.returncode == 3, p.stderr[-3000:]
    assert "rank 1 crashed: RuntimeError: deliberate crash on rank 1" in p.stderr, p.stderr[-3000:]
    assert elapsed < 150, elapsed  # start-up dominates; a hang would last the 600 s --timeout


@pytest.mark.slow
def test_torchrun_exit_codes_0_1_2(llama, tp2, qwen3, tmp_path):
    p = _torchrun(tp2, llama, "--report", tmp_path / "r.json")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "r.json").is_file()
    assert _torchrun(tp2, qwen3).returncode == 2  # not the checkpoint it was split from
    bad = copy_of_output(tp2, tmp_path / "bad")
    name = "model.layers.0.mlp.down_proj.weight"
    w0, w1 = (tpshard.open_rank(bad, r)[name].clone() for r in (0, 1))
    overwrite_tensor(bad, 0, name, w1)
    overwrite_tensor(bad, 1, name, w0)
    rewrite_checksums(bad)
    p = _torchrun(bad, llama)
    assert p.returncode == 1, p.stderr[-3000:]
    assert "FAIL model.layers.0.mlp.down_proj" in p.stdout


@pytest.mark.slow
def test_torchrun_missing_file_on_rank_1_exits_2_naming_it(llama, tp2, tmp_path):
    """Each rank checks its own files, then they exchange answers: every rank stops with rank 1's."""
    out = copy_of_output(tp2, tmp_path / "out")
    f = read_manifest(out).plan.rank_files(1)[0].name
    (out / rank_dir(1) / f).unlink()
    p = _torchrun(out, llama)
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"rank 1: {out / rank_dir(1) / f} is missing" in p.stderr


def test_only_rank_0_needs_the_source(llama, tp2, monkeypatch, tmp_path):
    """A rank other than 0 checks only its own files: no source there is no problem."""
    from tpshard.verify.run import Job, rank_preflight

    job = Job(str(tp2), str(tmp_path / "no-such-source"))
    assert rank_preflight(job, 1) == []
    assert "no-such-source" in " ".join(rank_preflight(job, 0))


def test_backend_choice_is_explained_and_impossible_requests_refused(monkeypatch):
    import torch

    monkeypatch.delenv("TPSHARD_BACKEND", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one_gpu = choose_launch(8)
    assert (one_gpu.backend, one_gpu.device) == ("gloo", "cuda"), "never a silent CPU run on a GPU box"
    assert "NCCL needs one GPU per rank" in one_gpu.describe(8)
    assert (choose_launch(1).backend, choose_launch(1).device) == ("nccl", "cuda")
    assert choose_launch(8, device="cpu").device == "cpu"
    with pytest.raises(TpshardError, match="nccl needs one GPU per rank: 8 ranks here, 1 GPU"):
        choose_launch(8, "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert choose_launch(8).describe(8) == "verify: 8 ranks, backend gloo on CPU: auto: 8 ranks here, 0 GPUs"
    with pytest.raises(TpshardError, match="no CUDA GPU"):
        choose_launch(2, device="cuda")
    with pytest.raises(TpshardError, match="expected auto, nccl or gloo"):
        choose_launch(2, "mpi")


def test_local_rank_is_required_for_a_gpu_rank(monkeypatch):
    from tpshard.runtime import init_distributed

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(TpshardError, match="LOCAL_RANK is not set"):
        init_distributed("nccl")


def test_verdicts_decide_the_exit_code():
    v = lambda rank, code, t, msg="": {"rank": rank, "code": code, "time": t, "message": msg}  # noqa: E731
    assert decide([v(0, 0, 1), v(1, 0, 1)], 0) == (0, "")
    assert decide([v(0, 1, 2, "mismatch"), v(1, 1, 2)], 1) == (1, "mismatch")
    assert decide([v(0, 3, 5.0, "peer closed"), v(1, 3, 4.0, "rank 1 crashed")], 1) == (3, "rank 1 crashed")
    assert decide([v(0, 2, 1.0, "rank 1: missing"), v(1, 2, 1.0)], 1) == (2, "rank 1: missing")
    assert decide([v(0, 0, 1)], 1)[0] == 3  # torchrun failed although no rank said so: a kill
    assert decide([], 0)[0] == 3


def test_rendezvous_port_stays_bound_while_the_job_runs():
    """The parent binds the store before spawning: the port cannot be taken meanwhile."""
    import socket

    from tpshard.runtime import local_store

    store = local_store(30)
    with socket.socket() as s, pytest.raises(OSError):
        s.bind(("127.0.0.1", store.port))
    del store
