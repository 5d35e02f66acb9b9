"""merge (issue 28 item 5): a part given twice is refused, missing ranks are named, and the merged
output shares files between ranks exactly as the direct split does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in p.stderr, p.stderr
    return p


def link_structure(out: Path) -> tuple[int, set[frozenset[str]]]:
    """The number of distinct files and which paths share each one (rank folders and names)."""
    groups: dict[tuple[int, int], set[str]] = {}
    for path in out.rglob("*"):
        if path.is_file() and path.parent != out:
            st = path.stat()
            groups.setdefault((st.st_dev, st.st_ino), set()).add(str(path.relative_to(out)))
    return len(groups), {frozenset(g) for g in groups.values()}


@pytest.fixture(scope="module")
def parts(llama, tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("merge")
    for name, ranks in (("a", "0-3"), ("b", "4-7")):
        assert run("split", llama, "-o", root / name, "--tp", 8, "--attn-dp", 2, "--ranks", ranks).returncode == 0
    assert run("split", llama, "-o", root / "whole", "--tp", 8, "--attn-dp", 2).returncode == 0
    return root / "a", root / "b", root / "whole"


def test_merged_output_shares_files_as_the_split_does(llama, parts, tmp_path):
    a, b, whole = parts
    p = run("merge", a, b, "-o", tmp_path / "m", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == {"out": str(tmp_path / "m"), "parts": 2, "ranks": list(range(8)), "missing_ranks": []}
    assert link_structure(tmp_path / "m") == link_structure(whole)
    assert run("check", tmp_path / "m", "--source", llama).returncode == 0


@pytest.mark.parametrize("spelling", ["same", "dot", "link"])
def test_a_part_given_twice_is_refused(parts, tmp_path, spelling):
    a = parts[0]
    again = {"same": a, "dot": a / ".", "link": tmp_path / "alias"}[spelling]
    if spelling == "link":
        os.symlink(a, again)
    p = run("merge", a, again, "-o", tmp_path / "m")
    assert p.returncode == 2 and "given twice" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "m").exists()


def test_missing_ranks_are_named(parts, tmp_path):
    p = run("merge", parts[0], "-o", tmp_path / "m")
    assert p.returncode == 0, p.stderr
    assert "ranks [4, 5, 6, 7] of 8 are in none of the parts" in p.stderr
    j = run("merge", parts[0], "-o", tmp_path / "m2", "--json")
    assert json.loads(j.stdout)["missing_ranks"] == [4, 5, 6, 7]
