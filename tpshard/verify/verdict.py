"""Exit codes under torchrun: each rank writes its verdict; `tpshard verify --torchrun` reads them.

torchrun exits 1 whenever any worker exits non-zero, so verify's codes (0 ok, 1 mismatch, 2 a user
error, 3 a launch problem) would all read 1. With $TPSHARD_VERDICT_DIR set (the --torchrun wrapper
sets it to a fresh folder), every rank writes `rank-NNNNN.json` = {rank, code, message, time}
before it exits; the wrapper decides from them: a user error (2) or a crash (3), the earliest
first (peers of a dead rank fail later, with a transport error), then a mismatch (1); no failure
reported but torchrun failed: 3 (a rank was killed, or never started).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tpshard.lifetime import kill_tree, set_death_signal

VERDICT_DIR_ENV = "TPSHARD_VERDICT_DIR"


def write_verdict(code: int, message: str = "") -> None:
    """This rank's verdict, if a wrapper asked for it (atomically: a reader never sees half a file)."""
    folder = os.environ.get(VERDICT_DIR_ENV)
    if not folder:
        return
    rank = int(os.environ.get("RANK", "0"))
    path = Path(folder) / f"rank-{rank:05d}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"rank": rank, "code": code, "message": message, "time": time.time()}))
    os.replace(tmp, path)


def read_verdicts(folder: str | Path) -> list[dict]:
    out = []
    for path in sorted(Path(folder).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def decide(verdicts: list[dict], torchrun_code: int) -> tuple[int, str]:
    """(exit code, message) of a torchrun launch from its ranks' verdicts and torchrun's own code."""
    for codes in ((2, 3), (1,)):
        failed = sorted((v for v in verdicts if v["code"] in codes), key=lambda v: (v["time"], v["rank"]))
        if failed:
            first = failed[0]  # the earliest failure is the cause; its peers' errors follow from it
            return first["code"], first["message"]
    if torchrun_code != 0:
        return 3, f"torchrun exited with {torchrun_code} and no rank reported a failure (a rank was killed or never started)"
    if not verdicts:
        return 3, "no rank reported a verdict"
    return 0, ""


def torchrun_world(torchrun_args: list[str]) -> int | str:
    """The world size torchrun would start with these options (nnodes x nproc-per-node), read as
    torch/distributed/run.py parses them; a str says why it cannot be known before the launch."""
    import argparse

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    # torchrun's defaults, which its PET_ variables replace (torch/distributed/argparse_util.py `env`)
    parser.add_argument("--nnodes", default=os.environ.get("PET_NNODES", "1"))
    parser.add_argument("--nproc-per-node", "--nproc_per_node", default=os.environ.get("PET_NPROC_PER_NODE", "1"))
    try:
        known, _ = parser.parse_known_args(torchrun_args)
    except argparse.ArgumentError as e:
        return str(e)
    low, _, high = known.nnodes.partition(":")
    if not (low.isdecimal() and (not high or high == low)):
        return f"--nnodes {known.nnodes} (an elastic range) leaves the world size to the rendezvous"
    if not known.nproc_per_node.isdecimal():
        return f"--nproc-per-node {known.nproc_per_node} leaves the processes per node to torchrun"
    return int(low) * int(known.nproc_per_node)


def refuse_torchrun_world(out: str | Path, torchrun_args: list[str]) -> None:
    """Before torchrun starts: a world that is not the output's pp x tp would only end in every
    rank's traceback around verify's own line (tpshard.verify._in_place)."""
    from tpshard.errors import UsageError
    from tpshard.manifest import read_manifest

    topo = read_manifest(out).plan.topology
    split_for = f"tp={topo.tp}" if topo.pp == 1 else f"pp={topo.pp} x tp={topo.tp} = {topo.world_size} ranks"
    world = torchrun_world(torchrun_args)
    if world == topo.world_size:
        return
    started = f"would start {world} processes" if isinstance(world, int) else f"cannot say how many processes: {world}"
    raise UsageError(
        f"--torchrun {' '.join(torchrun_args)!r} {started}, but {out} was split for {split_for}:"
        f" give torchrun --nnodes and --nproc-per-node numbers whose product is {topo.world_size}"
    )


def run_under_torchrun(torchrun_args: list[str], verify_args: list[str]) -> tuple[int, str]:
    """`torchrun TORCHRUN_ARGS -m tpshard verify VERIFY_ARGS`, then verify's exit code and message."""
    with tempfile.TemporaryDirectory(prefix="tpshard-verdict-") as folder:
        env = {**os.environ, VERDICT_DIR_ENV: folder}
        cmd = [sys.executable, "-m", "torch.distributed.run", *torchrun_args, "-m", "tpshard", "verify", *verify_args]
        # torchrun in a session of its own: a terminal's Ctrl-C reaches this process alone, which
        # stops the agent and every rank (tpshard.lifetime) and exits 130; and if this process is
        # killed, the kernel kills the agent, whose ranks follow it.
        agent = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=set_death_signal)
        try:
            code = agent.wait()
        except BaseException:
            kill_tree(agent.pid)
            agent.wait()
            raise
        return decide(read_verdicts(folder), code)
