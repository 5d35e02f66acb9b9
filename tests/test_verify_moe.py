"""verify on MoE and MLA outputs (gloo on CPU): every new layer kind on every rank, and the logits.

Compared with what: each layer's TP output against a float64 reference computed on rank 0 from the
*source* tensors (routed experts: the summed top-k output on every rank, and each expert's MoE-TP
slice on the rank holding it; routers: their routing on every rank); the TP decoder's logits
against transformers' float32 forward (DeepseekV3, Qwen3-MoE, Qwen2-MoE, Mixtral tiny checkpoints
saved by transformers). Broken outputs keep consistent checksums, so only the numbers can tell:
two experts swapped, an expert on the wrong EP slot (a plan that deals experts round-robin), a
shifted MoE-TP slice, a wrong MLA head range, a changed router correction bias. Outputs of one
world size are verified in one launch (verify_many): a process start per rank is the main cost.
"""

from __future__ import annotations

import json

import subprocess
from pathlib import Path

import pytest
import torch

import tpshard
from broken import overwrite_tensor, rewrite_checksums
from moe_configs import YARN, add_mtp_layer, make_fp8_deepseek, make_moe_checkpoint
from tpshard.topology import Topology
from tpshard.verify import verify_many

TOPO = Topology(tp=4, ep=2, attn_dp=2)  # attn_tp 2, moe_tp 2: EP slot 0 = ranks 0, 1; slot 1 = ranks 2, 3
EXPERTS = "model.layers.{i}.mlp.experts.{e}.{p}_proj.weight"


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> Path:
    """DeepSeek-V3: MLA with q_lora, 1 dense layer then 2 MoE layers, 8 experts in 4 groups, a shared
    expert, and the MTP module as layer 3 (which transformers does not run: layer level only)."""
    return add_mtp_layer(make_moe_checkpoint(tmp_path_factory.mktemp("dsv3") / "model", "deepseek_v3", max_shard_size="100KB"))


def copy(good: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-a", str(good), str(dst)], check=True)
    return dst


def swap(out: Path, name_a: str, rank_a: int, name_b: str, rank_b: int) -> None:
    a, b = tpshard.open_rank(out, rank_a)[name_a].clone(), tpshard.open_rank(out, rank_b)[name_b].clone()
    overwrite_tensor(out, rank_a, name_a, b)
    overwrite_tensor(out, rank_b, name_b, a)


def round_robin_split(model: Path, out: Path, topo: Topology) -> None:
    """A split by a plan that deals experts to EP slots round-robin (e % ep) instead of in blocks:
    self-consistent (its manifest, files and checksums agree, every source tensor reassembles),
    but each rank holds experts its FusedMoE never owns."""
    from tpshard.plan.experts import Experts

    place = Experts.place

    def round_robin(self, name, rule, expert):
        slot = place(self, name, rule, expert)
        return None if slot is None else expert % topo.ep

    Experts.place = round_robin
    try:
        tpshard.split(model, out, topo)
    finally:
        Experts.place = place


def broken_outputs(model: Path, good: Path, root: Path) -> dict[str, Path]:
    """Three broken copies of `good`, two breakages each where they sit in different layers."""
    outs = {}
    # experts 1 (slot 0, ranks 0 and 1) and 6 (slot 1, ranks 2 and 3) of layer 1 exchanged, all three
    # projections; and layer 2's router correction bias reversed (one replicated file, every rank)
    out = outs["experts_and_router"] = copy(good, root / "experts_and_router")
    for p in ("gate", "up", "down"):
        for m in (0, 1):
            swap(out, EXPERTS.format(i=1, e=1, p=p), m, EXPERTS.format(i=1, e=6, p=p), 2 + m)
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 0)[name].clone().flip(0))
    rewrite_checksums(out)
    # rank 0's down_proj of expert 2 in layer 2 replaced by MoE-TP rank 1's slice (rank 1's file); and
    # layer 1's kv_b_proj heads of attn_tp rank 0 (world ranks 0, 2) replaced by attn_tp rank 1's
    out = outs["slices"] = copy(good, root / "slices")
    name = EXPERTS.format(i=2, e=2, p="down")
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 1)[name].clone())
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    overwrite_tensor(out, 0, name, tpshard.open_rank(out, 1)[name].clone())
    rewrite_checksums(out)
    outs["round_robin"] = root / "round_robin"
    round_robin_split(model, outs["round_robin"], TOPO)
    return outs


def test_deepseek_v3_layer_and_model_level_and_broken_outputs(deepseek, tmp_path):
    """tp 4, ep 2, attn-dp 2: MLA over attn_tp 2, experts over 2 EP slots x MoE-TP 2, one launch."""
    good = tmp_path / "good"
    tpshard.split(deepseek, good, TOPO)
    outs = broken_outputs(deepseek, good, tmp_path)
    for name in ("experts_and_router", "slices"):
        problems = tpshard.check(outs[name]).problems  # checksums consistent: only the numbers can tell
        assert not [p for p in problems if p.check in ("files", "checksum")], (name, problems[:3])
    names = ["good", *outs]
    reports = dict(zip(names, verify_many([good, *outs.values()], [deepseek] * len(names), model=True)))

    r = reports["good"]
    assert r.ok, r.failures()
    classes = {x.layer_class for x in r.layers}
    assert {"FusedMoE", "ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear"} <= classes
    layers = {x.layer: x for x in r.layers}
    assert layers["model.layers.1.mlp.experts"].group == "tp" and layers["model.layers.1.self_attn.kv_b_proj"].batches == 2
    mtp = ("eh_proj", "embed_tokens", "shared_head.head", "mlp.experts", "mlp.gate", "self_attn.kv_b_proj")
    assert all(f"model.layers.3.{m}" in layers for m in mtp), sorted(layers)
    assert max(x.max_rel for x in r.layers) < 1e-6
    assert r.model.top1 == 1.0 and r.model.max_rel < 1e-5 and r.model.kl < 1e-9

    def failing(name: str) -> dict[str, str]:
        rep = reports[name]
        assert not rep.ok and rep.model is not None and not rep.model.ok, f"{name}: the logits must differ too"
        return {x.layer: "; ".join(x.problems) for x in rep.layers if not x.ok}

    bad = failing("experts_and_router")
    assert set(bad) == {"model.layers.1.mlp.experts", "model.layers.2.mlp.gate"}, bad
    msg = bad["model.layers.1.mlp.experts"]
    assert "routed output differs from the source's on world ranks [0, 1, 2, 3]" in msg
    assert "expert 1 (EP slot 0/2, MoE-TP rank 0/2) differs (it holds expert 6's weights) on world ranks [0]" in msg
    assert "expert 6 (EP slot 1/2, MoE-TP rank 1/2) differs (it holds expert 1's weights) on world ranks [3]" in msg
    msg = bad["model.layers.2.mlp.gate"]
    assert "routing (top-k experts and weights) differs from the source's on world ranks [0, 1, 2, 3]" in msg

    bad = failing("slices")
    assert set(bad) == {"model.layers.2.mlp.experts", "model.layers.1.self_attn.kv_b_proj"}, bad
    assert "expert 2 (EP slot 0/2, MoE-TP rank 0/2) differs (its down_proj is MoE-TP rank 1's slice) on world ranks [0]" in bad["model.layers.2.mlp.experts"]
    assert "of group rank 0/2 differs (it is group rank 1's slice) on world ranks [0, 2]" in bad["model.layers.1.self_attn.kv_b_proj"]

    bad = failing("round_robin")
    assert set(bad) == {f"model.layers.{i}.mlp.experts" for i in (1, 2, 3)}, bad  # 3: the MTP layer
    msg = bad["model.layers.1.mlp.experts"]
    assert (
        "rank 2 (EP slot 1/2 (experts [4, 8)), MoE-TP rank 0/2 (world rank 2)) holds experts [1, 3], which the manifest"
        " puts on EP slot(s) [1]; experts are dealt to EP slots in contiguous blocks of 4, so they belong to EP slot(s) [0]"
    ) in msg
    assert "rank 0 (EP slot 0/2 (experts [0, 4)), MoE-TP rank 0/2 (world rank 0)) never loaded experts [1, 3]" in msg


@pytest.mark.slow
def test_fp8_block_deepseek_layer_level(tmp_path):
    """DeepSeek-V3 as it ships, FP8 block 128: experts (weight + weight_scale_inv over MoE-TP or whole
    per EP slot), MLA (q_a/kv_a whole, q_b/kv_b/o by heads), shared and dense MLPs, dequantized per
    rank against the dequantized source; rank 0's expert 1 holding expert 0's tensors is caught."""
    model = make_fp8_deepseek(tmp_path / "model")
    outs = [tmp_path / "tp2", tmp_path / "tp2-ep2", tmp_path / "broken"]
    tpshard.split(model, outs[0], Topology(tp=2))
    tpshard.split(model, outs[1], Topology(tp=2, ep=2))
    copy(outs[1], outs[2])
    for suffix in ("weight", "weight_scale_inv"):
        for p in ("gate", "up", "down"):
            name = f"model.layers.1.mlp.experts.{{e}}.{p}_proj.{suffix}"
            overwrite_tensor(outs[2], 0, name.format(e=1), tpshard.open_rank(outs[2], 0)[name.format(e=0)].clone())
    rewrite_checksums(outs[2])
    good1, good2, broken = verify_many(outs, [model] * 3)
    for r in (good1, good2):
        assert r.ok, r.failures()
        quant = {x.layer_class for x in r.layers if x.quant == "fp8_block"}
        assert {"FusedMoE", "ReplicatedLinear", "ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear"} <= quant
    bad = {x.layer: "; ".join(x.problems) for x in broken.layers if not x.ok}
    assert list(bad) == ["model.layers.1.mlp.experts"], bad
    assert "expert 1 (EP slot 0/2, MoE-TP rank 0/1) differs (it holds expert 0's weights) on world ranks [0]" in bad["model.layers.1.mlp.experts"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "topo",
    [Topology(tp=4), Topology(tp=4, ep=4, attn_dp=2), Topology(tp=4, ep=2, moe_dense_tp=1)],
    ids=["tp4", "tp4-ep4-attn_dp2", "tp4-ep2-dense_tp1"],
)
def test_every_moe_architecture_against_transformers(tmp_path, topo):
    """Qwen3-MoE (q/k norms, norm_topk_prob), Qwen2-MoE (shared expert with its sigmoid gate, q/k/v
    biases), Mixtral (block_sparse_moe, attention over tp), DeepSeek-V3 with yarn rope (mscale in the
    softmax scale) and DeepSeek-V2-Lite-style MLA (no q_lora_rank), all in one launch."""
    models = {
        "qwen3_moe": make_moe_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", seed=1),
        "qwen2_moe": make_moe_checkpoint(tmp_path / "qwen2_moe", "qwen2_moe", seed=2),
        "deepseek_yarn": make_moe_checkpoint(tmp_path / "dsv3_yarn", "deepseek_v3", seed=3, rope_parameters=dict(YARN)),
        "deepseek_no_q_lora": make_moe_checkpoint(tmp_path / "dsv3_nolora", "deepseek_v3", seed=4, q_lora_rank=None),
    }
    if topo.attn_dp == 1:
        models["mixtral"] = make_moe_checkpoint(tmp_path / "mixtral", "mixtral", seed=5)  # no attention DP in SGLang
    outs = []
    for name, model in list(models.items()):
        if topo.moe_dense_tp == 1 and not name.startswith("deepseek"):
            del models[name]  # --moe-dense-tp is DeepSeek's
            continue
        outs.append(tmp_path / f"out-{name}")
        tpshard.split(model, outs[-1], topo)
    for name, r in zip(models, verify_many(outs, list(models.values()), model=True)):
        assert r.ok, (name, r.failures())
        assert r.model.top1 == 1.0 and r.model.max_rel < 1e-5, (name, r.model)
        assert any(x.layer_class == "FusedMoE" for x in r.layers)


def test_model_level_refuses_what_it_cannot_model(deepseek):
    """A sliding window shorter than the sequence is not modelled: refused before any rank starts."""
    from tpshard.verify.moe_model import unsupported_reason

    plan = tpshard.make_plan(tpshard.open_checkpoint(deepseek), Topology(tp=2))
    assert unsupported_reason(plan, {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 8}, 16)
    assert unsupported_reason(plan, {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": 4096}, 16) is None
    assert "no router rule" in unsupported_reason(plan, {"model_type": "llama4", "num_experts_per_tok": 1}, 16)
    # MLA with fewer kv heads than heads: transformers' DeepSeek attention fails on the shapes (a traceback before)
    mla = json.loads((deepseek / "config.json").read_text())
    assert unsupported_reason(plan, mla, 16) is None
    assert "num_key_value_heads 2 with 8 attention heads" in unsupported_reason(plan, {**mla, "num_attention_heads": 8, "num_key_value_heads": 2}, 16)


def test_router_correction_bias_is_used(deepseek):
    """The DeepSeek-V3 router picks with the correction bias: the bias alone can change the choice."""
    import json

    from tpshard.arch import router_config
    from tpshard.runtime.moe import route

    cfg = router_config(json.loads((deepseek / "config.json").read_text()))
    assert cfg.scoring == "sigmoid" and cfg.correction_bias and cfg.n_group == 4 and cfg.routed_scaling_factor == 2.5
    x, w = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)), torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    ids0, _ = route(cfg, x, w, torch.zeros(8))
    ids1, _ = route(cfg, x, w, torch.arange(8.0))
    assert not torch.equal(ids0.sort(-1).values, ids1.sort(-1).values)
