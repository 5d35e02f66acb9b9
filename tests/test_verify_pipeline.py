"""verify of pipeline-stage outputs (gloo on CPU): each stage's ranks run the layers their stage holds
inside the stage's TP group, and `--model` passes the hidden states from stage to stage.

Compared with what: every layer's output on every rank of the stages holding it against the float64
reference computed on rank 0 from the *source* tensors (the Llama lm_head on every stage, DeepSeek's
second embedding on the last stage each on their own ranks); the last stage's logits against
transformers' float32 forward of the unsharded model; every rank's whole copies and checksums as at
pp 1; the stage of every tensor against the engine's placement (tpshard.check's stage check).
Broken outputs keep consistent checksums unless said, so only the numbers (or the placement) tell.
One launch per world size: a process start per rank is the main cost.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from checkpoints import make_checkpoint
from pipeline_tools import cli
from tpshard.errors import TpshardError
from tpshard.manifest import rank_dir, read_manifest
from tpshard.topology import Topology
from tpshard.verify import verify_many

PP2 = Topology(tp=2, pp_layers=(3, 4))  # world ranks 0-1 stage 0 (layers 0-2), 2-3 stage 1 (layers 3-6)
DOWN, K = "model.layers.{i}.mlp.down_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"


@pytest.fixture(scope="module")
def llama7(tmp_path_factory) -> Path:
    """Untied Llama, 7 layers (pp 2 and 3 do not divide them), 8 heads / 2 kv heads: one kv head per rank at tp 2."""
    return make_checkpoint(tmp_path_factory.mktemp("llama7") / "model", "llama", num_hidden_layers=7)


@pytest.fixture(scope="module")
def qwen3_tied7(tmp_path_factory) -> Path:
    """Qwen3, tied embeddings, 7 layers: a separate last-stage head (SGLang) or embedding (vLLM) at pp > 1."""
    return make_checkpoint(tmp_path_factory.mktemp("qwen3t7") / "model", "qwen3", num_hidden_layers=7, tie_word_embeddings=True, head_dim=32)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    """DeepSeek-V3 as tests/test_verify_moe.py makes it (transformers' forward runs it): 3 layers, MTP layer 3."""
    from moe_configs import add_mtp_layer, make_moe_checkpoint

    return add_mtp_layer(make_moe_checkpoint(tmp_path_factory.mktemp("dsv3") / "model", "deepseek_v3", max_shard_size="100KB"))


def copy(good: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    return dst


def unshare(out: Path, rank: int, name: str) -> None:
    """Give `rank` a private copy of the file holding `name` (split hard-links identical files)."""
    spec = next(s for s in read_manifest(out).plan.rank_shards(rank) if s.name == name)
    path = out / rank_dir(rank) / spec.file
    shutil.copyfile(path, path.with_suffix(".private"))
    os.replace(path.with_suffix(".private"), path)


def split_with_layer_on_stage(model: Path, out: Path, topo: Topology, layer: int, stage: int) -> None:
    """A split whose plan puts every tensor of decoder layer `layer` on `stage`: self-consistent (its
    files, checksums and reassembly agree), but the engine builds that layer on another stage."""
    from tpshard.plan import refusals  # refuse_pipeline's stages of each tensor
    from tpshard.stages import layer_of

    real = refusals.tensor_stages

    def moved(name, counts, **kw):
        return (stage,) if layer_of(name) == layer else real(name, counts, **kw)

    refusals.tensor_stages = moved
    try:
        tpshard.split(model, out, topo)
    finally:
        refusals.tensor_stages = real


def broken_outputs(model: Path, good: Path, root: Path) -> dict[str, Path]:
    outs = {}
    # A layer's shard swapped between stages: rank 0 (stage 0) holds layer 4's down_proj slice and
    # rank 2 (stage 1) layer 1's; same tp_rank, same shape.
    out = outs["swapped_stages"] = copy(good, root / "swapped_stages")
    a, b = tpshard.open_rank(out, 0)[DOWN.format(i=1)].clone(), tpshard.open_rank(out, 2)[DOWN.format(i=4)].clone()
    overwrite_tensor(out, 0, DOWN.format(i=1), b)
    overwrite_tensor(out, 2, DOWN.format(i=4), a)
    rewrite_checksums(out)
    # The final norm x10 on world rank 3 only (stage 1, tp rank 1); checksums left as they were.
    out = outs["last_norm"] = copy(good, root / "last_norm")
    unshare(out, 3, "model.norm.weight")
    overwrite_tensor(out, 3, "model.norm.weight", tpshard.open_rank(out, 3)["model.norm.weight"] * 10)
    # kv head 1 on world rank 2 (stage 1, tp rank 0, which holds kv head 0) for layer 4.
    out = outs["kv_stage1"] = copy(good, root / "kv_stage1")
    overwrite_tensor(out, 2, K.format(i=4), tpshard.open_rank(out, 3)[K.format(i=4)].clone())
    rewrite_checksums(out)
    # Stage 0's copy of lm_head (SGLang builds a Llama head on every stage; the forward uses the last
    # stage's): rank 0's private copy reversed, checksums recomputed from it, so rank 2, which shared
    # the file, now fails its checksum while rank 0's bytes only show in the layer's numbers.
    out = outs["head_stage0"] = copy(good, root / "head_stage0")
    unshare(out, 0, "lm_head.weight")
    overwrite_tensor(out, 0, "lm_head.weight", tpshard.open_rank(out, 0)["lm_head.weight"].flip(0).clone())
    rewrite_checksums(out)
    # Layer 1 (stage 0's) split onto stage 1, consistently.
    outs["layer_on_stage1"] = root / "layer_on_stage1"
    split_with_layer_on_stage(model, outs["layer_on_stage1"], PP2, layer=1, stage=1)
    return outs


def test_pp2_tp2_layers_model_and_broken_outputs(llama7, deepseek, qwen3_tied7, tmp_path):
    """Llama (7 layers as 3 + 4) and DeepSeek-V3 (1 + 2 layers, MTP on the last stage, ep 2) at pp 2 x
    tp 2, a tied Qwen3 placed for vLLM (4 + 3: the last stage holds the embedding as its head), good
    and broken, in one launch of 4 gloo ranks."""
    good = tmp_path / "good"
    tpshard.split(llama7, good, PP2)
    ds = tmp_path / "deepseek"
    tpshard.split(deepseek, ds, Topology(tp=2, ep=2, pp_layers=(1, 2)))
    vllm = tmp_path / "vllm_tied"
    tpshard.split(qwen3_tied7, vllm, Topology(tp=2, pp_layers=(4, 3), engine="vllm"))
    outs = broken_outputs(llama7, good, tmp_path)
    found = {p.check for p in tpshard.check(outs["layer_on_stage1"], llama7).problems}
    assert "stages" in found and not found & {"reassembly", "checksum", "files"}, found  # the bytes are right, their stage is not
    names = ["good", "deepseek", "vllm_tied", *outs]
    paths = [good, ds, vllm, *outs.values()]
    # pp=2: every output must be split for the 2 stages a server would run (verify --pp 2)
    reports = dict(zip(names, verify_many(paths, [llama7, deepseek, qwen3_tied7] + [llama7] * len(outs), model=True, pp=2)))

    r = reports["good"]
    assert r.ok, r.failures()
    stages = {x.layer: x.stages for x in r.layers}
    assert stages["model.embed_tokens"] == [0] and stages["lm_head"] == [0, 1]  # SGLang: a Llama head on every stage
    assert all(stages[f"model.layers.{i}.self_attn.qkv_proj"] == [0 if i < 3 else 1] for i in range(7))
    assert max(x.max_rel for x in r.layers) < 1e-6 and r.stages == []
    assert r.model.top1 == 1.0 and r.model.max_rel < 1e-5 and r.model.kl < 1e-9
    assert r.tensors.files == 12 and r.tensors.whole == 2 * (3 * 2) + 2 * (4 * 2 + 1)  # 2 norms per layer, model.norm on stage 1

    r = reports["deepseek"]
    assert r.ok, r.failures()
    stages = {x.layer: x.stages for x in r.layers}
    assert stages["model.embed_tokens"] == [0, 1]  # the MTP draft's copy on the last stage
    assert stages["lm_head"] == [1] and stages["model.layers.0.mlp.down_proj"] == [0]
    assert stages["model.layers.2.mlp.experts"] == [1] and stages["model.layers.3.eh_proj"] == [1]
    assert r.model.top1 == 1.0 and r.model.max_rel < 1e-5

    r = reports["vllm_tied"]
    assert r.ok, r.failures()
    stages = {x.layer: x.stages for x in r.layers}
    assert stages["model.embed_tokens"] == [0, 1] and stages["lm_head"] == [0, 1]  # vLLM ties the head to each stage's embedding
    assert stages["model.layers.3.mlp.down_proj"] == [0] and r.model.top1 == 1.0 and r.model.max_rel < 1e-5

    def failing(name: str) -> dict[str, str]:
        rep = reports[name]
        assert not rep.ok, name
        return {x.layer: "; ".join(x.problems) for x in rep.layers if not x.ok}

    bad = failing("swapped_stages")
    assert set(bad) == {"model.layers.1.mlp.down_proj", "model.layers.4.mlp.down_proj"}, bad
    assert "output differs from the reference" in bad["model.layers.1.mlp.down_proj"]
    assert "on world ranks [0, 1]" in bad["model.layers.1.mlp.down_proj"] and "on world ranks [2, 3]" in bad["model.layers.4.mlp.down_proj"]
    assert not reports["swapped_stages"].model.ok

    rep = reports["last_norm"]
    assert failing("last_norm") == {} and not rep.model.ok and rep.model.top1 < 1  # lm_head gathers rank 3's slice to both
    joined = "\n".join(rep.tensors.problems)
    assert "model.norm.weight on world ranks [3]: bytes differ from the source's model.norm.weight" in joined and "(x10)" in joined

    bad = failing("kv_stage1")
    assert set(bad) == {"model.layers.4.self_attn.qkv_proj"}, bad
    assert "piece k of group rank 0/2 differs (it is group rank 1's slice) on world ranks [2]" in bad["model.layers.4.self_attn.qkv_proj"]
    assert not reports["kv_stage1"].model.ok

    rep = reports["head_stage0"]
    bad = failing("head_stage0")
    assert set(bad) == {"lm_head"} and "on world ranks [0, 1]" in bad["lm_head"], bad  # gathered over stage 0's group
    assert rep.model.ok, "the forward uses the last stage's head: only the layer level sees stage 0's"
    assert any(p.startswith("rank 2: ") for p in rep.tensors.problems), rep.tensors.problems

    rep = reports["layer_on_stage1"]
    assert failing("layer_on_stage1") == {}, "the numbers are right: layer 1 ran on stage 1"
    assert {x.layer: x.stages for x in rep.layers}["model.layers.1.mlp.down_proj"] == [1]
    assert any(
        p.startswith("model.layers.1.mlp.down_proj.weight: held by stage 1 (ranks 2-3), but belongs to stage 0 (ranks 0-1)")
        for p in rep.stages
    ), rep.stages
    assert "stage 0 (ranks 0-1) holds no tensor of layers 1; its layers are 0-2" in rep.stages
    assert rep.model.problems[0].startswith("not run: stage 0 (world rank 0, tp rank 0) lacks model.layers.1."), rep.model.problems
    assert any(line.startswith("stages: model.layers.1.") for line in rep.failures())


def test_pp3_uneven_tied_qwen3(qwen3_tied7, tmp_path):
    """Qwen3, tied, 7 layers as 2 + 2 + 3 at pp 3 x tp 1 (SGLang's default: the extra layer on the last
    stage): the last stage's own lm_head.weight, cut from the embedding, gives transformers' logits;
    a broken stage-1 norm (checksums rewritten) is caught at model level and against the source bytes."""
    model = qwen3_tied7
    good = tmp_path / "good"
    tpshard.split(model, good, Topology(tp=1, pp_layers=(2, 2, 3)))
    bad = copy(good, tmp_path / "bad")
    name = "model.layers.3.post_attention_layernorm.weight"
    overwrite_tensor(bad, 1, name, tpshard.open_rank(bad, 1)[name] * 1.5)
    rewrite_checksums(bad)
    ok, wrong = verify_many([good, bad], [model, model], model=True)
    assert ok.ok, ok.failures()
    stages = {x.layer: x.stages for x in ok.layers}
    assert stages["model.embed_tokens"] == [0] and stages["lm_head"] == [2] and stages["model.layers.4.mlp.down_proj"] == [2]
    assert ok.model.top1 == 1.0 and ok.model.max_rel < 1e-5
    assert not wrong.ok and all(x.ok for x in wrong.layers) and not wrong.model.ok
    assert f"{name} on world ranks [1]: bytes differ from the source's {name}" in "\n".join(wrong.tensors.problems)


def test_pp_request_is_checked_like_check_pp(llama7, tmp_path, capsys, monkeypatch):
    """verify --pp / --pp-layers: the stages a server will run. A mismatch is a stage finding (what
    rank 0 reports, from the same function); a value that is no partition is refused before any rank starts."""
    from tpshard.verify.run import stage_problems

    out = tmp_path / "out"
    tpshard.split(llama7, out, PP2)
    plan = read_manifest(out).plan
    assert stage_problems(plan) == [] and stage_problems(plan, 2, "3,4") == []
    assert stage_problems(plan, 3) == ["the output was split for pp 2 (layers 3,4), not --pp 3"]
    assert stage_problems(plan, None, "4,3") == ["the output was split for pp 2 (layers 3,4), not --pp-layers 4,3"]
    flat = tmp_path / "flat"
    tpshard.split(llama7, flat, Topology(tp=2))
    assert stage_problems(read_manifest(flat).plan, 2) == ["the output was split for pp 1, not --pp 2"]
    code, stdout, err = cli(capsys, monkeypatch, "verify", out, "--source", llama7, "--pp-layers", "3,3")
    assert code == 2 and stdout == "" and "adds up to 6 layers; the model has 7" in err and "verify:" not in err


def test_refusals_name_the_pipeline_world(llama7, tmp_path, monkeypatch):
    """What verify still refuses for a pp output, before any process starts: a torchrun world that is not
    pp x tp, and NCCL without a GPU per rank of every stage."""
    out = tmp_path / "out"
    tpshard.split(llama7, out, PP2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TpshardError, match=r"torchrun started 2 processes, but .* was split for pp=2 x tp=2 = 4 ranks: run torchrun"):
        verify_many([out], [llama7])
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    import torch

    if torch.cuda.device_count() < 4:
        with pytest.raises(TpshardError, match="--backend nccl needs one GPU per rank: 4 ranks here"):
            verify_many([out], [llama7], backend="nccl")


@pytest.mark.slow
def test_every_byte_per_stage_under_attention_dp(qwen3, tmp_path):
    """pp 2 x tp 4, attn-dp 2 (8 ranks): attention over attn_tp 2 inside each stage, the MLP and lm_head
    over the stage's tp 4. A norm on a rank whose activations the gather over tp drops (the second
    member of a DP replica) must still fail: rank 1's post-attention norm on stage 0 and rank 7's
    final norm on stage 1, each x10 on that rank only, checksums left as they were."""
    good = tmp_path / "good"
    tpshard.split(qwen3, good, Topology(tp=4, attn_dp=2, pp_layers=(1, 1)))
    bad = copy(good, tmp_path / "bad")
    for rank, name in ((1, "model.layers.0.post_attention_layernorm.weight"), (7, "model.norm.weight")):
        unshare(bad, rank, name)
        overwrite_tensor(bad, rank, name, tpshard.open_rank(bad, rank)[name] * 10)
    ok, wrong = verify_many([good, bad], [qwen3, qwen3], model=True)
    assert ok.ok, ok.failures()
    layers = {x.layer: x for x in ok.layers}
    assert layers["model.layers.1.self_attn.o_proj"].batches == 2 and layers["model.layers.1.self_attn.o_proj"].stages == [1]
    assert ok.model.batches == 2 and ok.model.top1 == 1.0
    assert not wrong.model.ok
    assert any("world ranks [1, 7] hold activations that differ from their attention-DP replica's" in p for p in wrong.model.problems), wrong.model.problems
    joined = "\n".join(wrong.tensors.problems)
    assert "model.layers.0.post_attention_layernorm.weight on world ranks [1]: bytes differ" in joined
    assert "model.norm.weight on world ranks [7]: bytes differ" in joined
