"""Shared fixtures: tiny real checkpoints saved by transformers, made once per test session."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Path:
    """8 heads / 2 kv heads, vocab 250 (not a multiple of 64), intermediate 96, a two-file index."""
    return make_checkpoint(tmp_path_factory.mktemp("llama") / "model", "llama", max_shard_size="100KB")


@pytest.fixture(scope="session")
def qwen2_tied(tmp_path_factory) -> Path:
    """q/k/v biases and tied embeddings (no lm_head.weight on disk)."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen2") / "model", "qwen2", tie_word_embeddings=True)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> Path:
    """head_dim 32, not hidden / heads = 8; q_norm and k_norm."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen3") / "model", "qwen3", head_dim=32)


@pytest.fixture(scope="session")
def mistral(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mistral") / "model", "mistral", intermediate_size=100)


@pytest.fixture
def copy_of(tmp_path):
    """A private copy of a checkpoint or output, to break on purpose (hard links kept, as cp -a)."""

    def copy(path: Path) -> Path:
        dst = tmp_path / f"copy-{path.name}"
        subprocess.run(["cp", "-a", str(path), str(dst)], check=True)
        return dst

    return copy


@pytest.fixture(scope="session")
def biased(tmp_path_factory) -> tuple[Path, Path]:
    """A Llama with attention biases (o_proj.bias exists), split at tp 8 attn-dp 2; tests break copies."""
    import tpshard
    from tpshard.topology import Topology

    root = tmp_path_factory.mktemp("biased")
    model = make_checkpoint(root / "model", "llama", attention_bias=True)
    out = root / "out"
    tpshard.split(model, out, Topology(tp=8, attn_dp=2))
    return model, out
