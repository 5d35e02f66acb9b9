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
    """A Qwen3 with attention biases (o_proj.bias exists), split at tp 8 attn-dp 2 (attention over attn_tp:
    DP replicas); tests break copies."""
    import tpshard
    from tpshard.topology import Topology

    root = tmp_path_factory.mktemp("biased")
    model = make_checkpoint(root / "model", "qwen3", attention_bias=True, head_dim=8)
    out = root / "out"
    tpshard.split(model, out, Topology(tp=8, attn_dp=2))
    return model, out


# MoE and MLA families (tests/checkpoints.py ARCH_DEFAULTS): 8 experts, 3 layers, several files.
@pytest.fixture(scope="session")
def qwen3_moe(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_moe") / "model", "qwen3_moe", max_shard_size="100KB")


@pytest.fixture(scope="session")
def qwen2_moe(tmp_path_factory) -> Path:
    """A shared expert of 48 and its sigmoid gate; q/k/v biases."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen2_moe") / "model", "qwen2_moe", max_shard_size="100KB")


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory) -> dict[str, Path]:
    """Qwen3.5-MoE and Qwen3-Next, by architecture (tests/test_hybrid.py, test_hybrid_model.py)."""
    root = tmp_path_factory.mktemp("hybrid")
    return {
        "Qwen3_5MoeForCausalLM": make_checkpoint(root / "qwen3_5_moe", "qwen3_5_moe", max_shard_size="100KB"),
        "Qwen3NextForCausalLM": make_checkpoint(root / "qwen3_next", "qwen3_next", seed=1, max_shard_size="100KB"),
    }


@pytest.fixture(scope="session")
def mixtral(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("mixtral") / "model", "mixtral", max_shard_size="100KB")


@pytest.fixture(scope="session")
def deepseek_v3(tmp_path_factory) -> Path:
    """MLA with q_lora_rank, layer 0 dense, layers 1-2 MoE with a shared expert, MTP layer 3 in its own file."""
    return make_checkpoint(tmp_path_factory.mktemp("deepseek_v3") / "model", "deepseek_v3", max_shard_size="100KB", mtp=True)


@pytest.fixture(scope="session")
def deepseek_v2(tmp_path_factory) -> Path:
    """MLA without q_lora_rank (q_proj, as V2-Lite), two shared experts."""
    return make_checkpoint(tmp_path_factory.mktemp("deepseek_v2") / "model", "deepseek_v2")


@pytest.fixture(scope="session")
def glm4_moe(tmp_path_factory) -> Path:
    """GLM-4.5 in small: layer 0 dense, layers 1-2 MoE with a shared expert, q/k/v biases and q/k
    norms, fp32 router and correction bias, the MTP layer 3 in its own file, several files."""
    return make_checkpoint(tmp_path_factory.mktemp("glm4_moe") / "model", "glm4_moe", max_shard_size="100KB", mtp=True)


@pytest.fixture(scope="session")
def deepseek_fp8(tmp_path_factory) -> Path:
    """DeepSeek-V3 in its FP8 block format (tests/checkpoints.py FP8_DEEPSEEK), MTP layer included."""
    from checkpoints import make_fp8_deepseek

    return make_fp8_deepseek(tmp_path_factory.mktemp("deepseek_fp8") / "model")


@pytest.fixture(scope="session")
def llama_tp2(llama, tmp_path_factory) -> Path:
    """The llama split at tp 2, shared read-only: tests that break it work on a copy."""
    import tpshard
    from tpshard.topology import Topology

    out = tmp_path_factory.mktemp("llama-tp2") / "out"
    tpshard.split(llama, out, Topology(tp=2))
    return out
