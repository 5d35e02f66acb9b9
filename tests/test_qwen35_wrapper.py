"""Qwen3_5MoeForConditionalGeneration, the class the published Qwen3.5-MoE checkpoints are saved as
(tpshard/arch/qwen_next.py): transformers' multimodal wrapper, the text model under
`model.language_model.`, a vision tower under `model.visual.`.

SGLang's wrapper (models/qwen3_5.py) builds the text class's body and renames
`model.language_model.` to `model.` as it loads, so every rank's text tensors must be byte-equal to
the split of the same weights saved as Qwen3_5MoeForCausalLM (both checkpoints made from one random
init, tests/checkpoints.py make_qwen3_5_wrapper); the vision tower is not written and the server hint
carries the language-model-only override. Then another rank's piece (check --source), the
refusals, and verify --model against transformers in one launch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from checkpoints import make_qwen3_5_wrapper
from tpshard.manifest import rank_dir
from tpshard.topology import Topology
from tpshard.verify import MODEL_TOLERANCE, verify_many

WRAPPED = "model.language_model."
OVERRIDE = """--json-model-override-args '{"language_model_only": true}'"""


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("qwen35_wrapper")
    return make_qwen3_5_wrapper(root / "wrapper", root / "text")


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpshard", *map(str, args)], capture_output=True, text=True)


def rank_tensors(out: Path, rank: int) -> dict:
    found = {}
    for f in sorted((out / rank_dir(rank)).glob("*.safetensors")):
        found.update(load_file(f))
    return found


def text_name(name: str) -> str:
    return "model." + name.removeprefix(WRAPPED) if name.startswith(WRAPPED) else name


@pytest.mark.parametrize(
    "args",
    [["--tp", 2], ["--tp", 4, "--attn-dp", 2], ["--tp", 4, "--ep", 2], ["--tp", 4, "--ep", 4, "--attn-dp", 4]],
    ids=["tp2", "tp4-attn_dp2", "tp4-ep2", "tp4-ep4-attn_dp4"],
)
def test_every_rank_is_the_text_class_split(models, tmp_path, args):
    """Today: "architecture Qwen3_5MoeForConditionalGeneration is not supported"."""
    wrapper, text = models
    r = cli("split", wrapper, "-o", tmp_path / "w", *args)
    assert r.returncode == 0, r.stderr
    assert "vision tower (model.visual.*) is not written" in r.stderr
    assert f"start SGLang with {OVERRIDE}" in r.stdout  # the line to paste
    assert cli("split", text, "-o", tmp_path / "t", *args).returncode == 0
    c = cli("check", tmp_path / "w", "--source", wrapper)
    assert c.returncode == 0, c.stdout + c.stderr
    for rank in range(args[1]):
        got, want = rank_tensors(tmp_path / "w", rank), rank_tensors(tmp_path / "t", rank)
        assert not any(n.startswith("model.visual.") for n in got)
        assert sorted(map(text_name, got)) == sorted(want), rank
        for name, t in got.items():
            w = want[text_name(name)]
            assert t.dtype == w.dtype and t.shape == w.shape, (rank, name)
            assert t.reshape(-1).view(torch.uint8).equal(w.reshape(-1).view(torch.uint8)), (rank, name)


def test_another_ranks_segments_are_caught(models, tmp_path):
    """Rank 0 holds rank 1's in_proj_qkv (its q | k | v slices), checksums rewritten: only the source tells."""
    wrapper, _ = models
    out = tmp_path / "out"
    tpshard.split(wrapper, out, Topology(tp=2))
    name = WRAPPED + "layers.1.linear_attn.in_proj_qkv.weight"
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 1)[name].clone())
    rewrite_checksums(out)
    assert tpshard.check(out, None).ok
    found = [p.message for p in tpshard.check(out, wrapper).problems]
    assert any(name in p and "holds the slice of group rank 1" in p for p in found), found[:4]


@pytest.mark.parametrize("args", [["--tp", 2], ["--tp", 4, "--ep", 2, "--attn-dp", 2]], ids=["tp2", "tp4-ep2-attn_dp2"])
def test_the_release_form_is_the_text_class_split(models, tmp_path, args):
    """The published form (the MTP layer mtp.* at the top, the experts fused: tests/qwen_release.py)
    through the wrapper: every rank byte-equal to the text class's split of the same tensors; the MTP
    layer stays mtp.* (SGLang's draft loads it by those names whatever the wrapper). Today refused."""
    from qwen_release import released

    wrapper, text = (released(m, tmp_path / f"src-{i}", mtp=True, fused=True) for i, m in enumerate(models))
    for src, out in ((wrapper, tmp_path / "w"), (text, tmp_path / "t")):
        r = cli("split", src, "-o", out, *args)
        assert r.returncode == 0, r.stderr
    c = cli("check", tmp_path / "w", "--source", wrapper)
    assert c.returncode == 0, c.stdout + c.stderr
    for rank in range(args[1]):
        got, want = rank_tensors(tmp_path / "w", rank), rank_tensors(tmp_path / "t", rank)
        assert "mtp.layers.0.mlp.experts.gate_up_proj" in got and WRAPPED + "layers.0.mlp.experts.gate_up_proj" in got
        assert sorted(map(text_name, got)) == sorted(want), rank
        for name, t in got.items():
            w = want[text_name(name)]
            assert t.dtype == w.dtype and t.shape == w.shape, (rank, name)
            assert t.reshape(-1).view(torch.uint8).equal(w.reshape(-1).view(torch.uint8)), (rank, name)


def test_reshard_keeps_the_wrapper(models, tmp_path):
    """reshard reads the output back without the vision tower and gives the split's layout at the new topology."""
    wrapper, _ = models
    tpshard.split(wrapper, tmp_path / "a", Topology(tp=2))
    r = cli("reshard", tmp_path / "a", "-o", tmp_path / "b", "--tp", 4, "--ep", 2)
    assert r.returncode == 0, r.stderr
    c = cli("check", tmp_path / "b", "--source", wrapper)
    assert c.returncode == 0, c.stdout + c.stderr


def test_verify_model_and_another_ranks_piece(models, tmp_path):
    """One launch at tp 2 ep 2: the wrapper's output agrees with transformers (AutoModelForCausalLM loads
    its text model) at layer and model level; rank 0 holding rank 1's in_proj_qkv fails both."""
    wrapper, _ = models
    good, bad = tmp_path / "good", tmp_path / "bad"
    for out in (good, bad):
        tpshard.split(wrapper, out, Topology(tp=2, ep=2))
    name = WRAPPED + "layers.0.linear_attn.in_proj_qkv.weight"
    overwrite_tensor(bad, 0, name, tpshard.open_rank(bad, 1)[name].clone())
    rewrite_checksums(bad)
    ok, broken = verify_many([good, bad], [wrapper, wrapper], model=True)
    m = ok.model
    assert ok.ok and m is not None and m.ok and m.max_rel <= MODEL_TOLERANCE["max_rel"], (ok.failures(), m)
    assert broken.model is not None and not broken.model.ok and broken.model.batches > 0, broken.model
    assert {x.layer for x in broken.layers if not x.ok} == {WRAPPED + "layers.0.linear_attn.in_proj_qkvz"}


@pytest.mark.slow
def test_verify_model_tp4_attention_dp_and_ep(models, tmp_path):
    """tp 4 with attention DP 2 and EP 2: each attention-DP replica its own tokens, the embedding whole."""
    wrapper, _ = models
    tpshard.split(wrapper, tmp_path / "out", Topology(tp=4, attn_dp=2, ep=2))
    (report,) = verify_many([tmp_path / "out"], [wrapper], model=True)
    m = report.model
    assert report.ok and m is not None and m.ok and m.max_rel <= MODEL_TOLERANCE["max_rel"], (report.failures(), m)
