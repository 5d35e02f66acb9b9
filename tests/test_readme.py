"""The README's two set-up commands stay true for a fresh machine of a user, not only for CI's."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Set up on a fresh machine") :]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```\n(.*?)\n```", section, re.S)


def test_two_commands_example_then_tests():
    example, tests = _setup_commands()
    assert "tpshard split examples/tiny-llama" in example and "tpshard check" in example
    assert (ROOT / "examples" / "tiny-llama" / "config.json").exists()
    assert tests.endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^python3? -m pytest -q$", ci, re.M), "CI runs the README's test command"


def test_torch_comes_from_the_cpu_index():
    """A bare `pip install torch==X` takes the CUDA build (several GB) from the default index on
    Linux: a user's CPU box installs from PyTorch's CPU wheel index."""
    for command in _setup_commands():
        first = command.split("&&")[0].strip()
        assert first.startswith("pip install torch"), first
        assert "--index-url https://download.pytorch.org/whl/cpu" in first, first
