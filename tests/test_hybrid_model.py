"""verify --model for the hybrid decoders (tpshard/verify/hybrid_model.py, tpshard/runtime/deltanet.py):
Qwen3.5-MoE and Qwen3-Next, every rank's logits against transformers' own forward on the source.

The tiny checkpoints are tests/checkpoints.py's (layers 0-2 gated DeltaNet: 8 key heads of 4, 16
value heads of 4, conv kernel 4; layer 3 gated full attention, 8 heads of 8 over 2 kv heads, rope on
a quarter of each head; 8 experts, a shared expert and its gate). Then outputs broken on purpose
(another rank's key-head groups, A_log or conv1d; a contiguous qkv cut) and forwards that leave out
one piece of the math (the norm's gate, the shared expert's gate, the zero-centred norms): each must
fail the logits, so the comparison has teeth.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import tpshard
import tpshard.arch as arch
from broken import overwrite_tensor, rewrite_checksums
from tpshard.topology import Topology
from tpshard.verify import MODEL_TOLERANCE, verify_many

Q35, NEXT = "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM"


@pytest.fixture(scope="module")
def models(hybrid_models) -> dict[str, Path]:
    return hybrid_models  # conftest: one pair of checkpoints for this module and its sibling


def from_other_rank(out: Path, name: str, rank: int = 0, other: int = 1) -> None:
    """Rank `rank` holds rank `other`'s slice of `name`, checksums rewritten (only the source can tell)."""
    overwrite_tensor(out, rank, name, tpshard.open_rank(out, other)[name].clone())
    rewrite_checksums(out)


def assert_model_ok(report) -> None:
    m = report.model
    assert report.ok and m is not None and m.ok, (report.failures(), m and m.problems)
    assert m.max_rel <= MODEL_TOLERANCE["max_rel"] and m.top1 == 1.0, (m.max_rel, m.top1)


def assert_model_fails(report) -> None:
    m = report.model
    assert m is not None and not m.ok and m.batches > 0, m  # the forward ran, its logits are wrong
    assert m.max_rel > MODEL_TOLERANCE["max_rel"], m.max_rel


# ---- the runtime alone: two ranks' partial sums against transformers' module, no process group


def chunk(x: torch.Tensor, r: int, n: int, dim: int = 0) -> torch.Tensor:
    return x.chunk(n, dim)[r]


def segments(x: torch.Tensor, sizes: tuple[int, ...], r: int, n: int) -> torch.Tensor:
    """Rank r's slice of each segment of dim 0, concatenated (mamba's sharded conv1d loader, Qwen3.5's in_proj_qkv)."""
    return torch.cat([chunk(s, r, n) for s in x.split(sizes)])


def hf_deltanet(family: str):
    """transformers' gated DeltaNet of the tiny config, every parameter random (A_log, dt_bias and the norm too)."""
    import transformers
    from checkpoints import ARCH_DEFAULTS, BASE

    kind = "qwen3_5_moe" if family == Q35 else "qwen3_next"
    if family == Q35:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet as cls

        config = transformers.Qwen3_5MoeTextConfig(**{**BASE, **ARCH_DEFAULTS[kind]})
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet as cls

        config = transformers.Qwen3NextConfig(**{**BASE, **ARCH_DEFAULTS[kind]})
    torch.manual_seed(3)
    module = cls(config, layer_idx=0).float()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5) + (1.0 if p.dim() == 1 else 0.0))
    return config, module


def rank_deltanet(family: str, config, hf, r: int, n: int, *, wrong: bool = False):
    """Rank r of n's GatedDeltaNet, its shards cut here as SGLang cuts them (or, `wrong`, as a broken split would)."""
    from tpshard.runtime import ColumnParallelLinear, LogicalGroup, MergedColumnParallelLinear, RowParallelLinear
    from tpshard.runtime.deltanet import DeltaNetConfig, GatedDeltaNet

    cfg = DeltaNetConfig.from_hf(config.to_dict())
    kk, vv, h = cfg.key_heads * cfg.key_dim, cfg.value_heads * cfg.value_dim, config.hidden_size
    group = LogicalGroup(name="attn_tp", factor=1, rank=r, size=n, world_rank=r, members=tuple(range(n)))
    if family == Q35:
        qkvz = MergedColumnParallelLinear(h, [2 * kk + vv, vv], group=group, piece_names=("qkv", "z"))
        qkv = hf.in_proj_qkv.weight
        qkvz.load_shard("qkv", chunk(qkv, r, n) if wrong else segments(qkv, (kk, kk, vv), r, n))  # wrong: one block
        qkvz.load_shard("z", chunk(hf.in_proj_z.weight, r, n))
        ba = MergedColumnParallelLinear(h, [cfg.value_heads] * 2, group=group, piece_names=("b", "a"))
        ba.load_shard("b", chunk(hf.in_proj_b.weight, r, n))
        ba.load_shard("a", chunk(hf.in_proj_a.weight, r, n))
    else:
        qkvz = ColumnParallelLinear(h, 2 * kk + 2 * vv, group=group)
        qkvz.load_shard(None, chunk(hf.in_proj_qkvz.weight, (r + wrong) % n, n))  # wrong: the other rank's key-head groups
        ba = ColumnParallelLinear(h, 2 * cfg.value_heads, group=group)
        ba.load_shard(None, chunk(hf.in_proj_ba.weight, r, n))
    out = RowParallelLinear(vv, h, group=group, reduce_results=False)
    out.load_shard(None, chunk(hf.out_proj.weight, r, n, 1))
    net = GatedDeltaNet(cfg, group=group, in_proj_qkvz=qkvz, in_proj_ba=ba, out_proj=out, norm=hf.norm.weight.detach())
    net.load_shard("conv1d", segments(hf.conv1d.weight, (kk, kk, vv), r, n))
    net.load_shard("A_log", chunk(hf.A_log, r, n))
    net.load_shard("dt_bias", chunk(hf.dt_bias, r, n))
    assert not net.missing_shards() and not qkvz.missing_shards()
    return net


@pytest.mark.parametrize("family", [Q35, NEXT])
@pytest.mark.parametrize("n", [2, 4])
def test_deltanet_ranks_sum_to_transformers(family, n):
    """Each rank runs its heads; the sum of the ranks' out_proj partials (the all-reduce) is
    transformers' module output. With Qwen3.5's in_proj_qkv cut as one block, or a Qwen3-Next rank
    holding the other rank's key-head groups, it is not."""
    config, hf = hf_deltanet(family)
    x = torch.randn(2, 16, config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf(x)
        got = sum(rank_deltanet(family, config, hf, r, n)(x) for r in range(n))
        rel = ((got - ref).abs().max() / ref.abs().max()).item()
        assert rel < 1e-5, rel
        if n > 1:
            bad = sum(rank_deltanet(family, config, hf, r, n, wrong=True)(x) for r in range(n))
            assert ((bad - ref).abs().max() / ref.abs().max()).item() > 1e-2


def test_verify_model_tp2_and_another_ranks_pieces(models, tmp_path):
    """One launch at tp 2: both families agree with transformers on every rank (today: refused,
    "no gated DeltaNet runtime"); a rank holding the other rank's key-head groups of Qwen3-Next's
    packed in_proj_qkvz, the other value heads' A_log, or the other channels of conv1d, each with its
    checksums rewritten, fails the logits."""
    outs = {k: tmp_path / k for k in ("q35", "next", "qkvz", "a_log", "conv")}
    tpshard.split(models[Q35], outs["q35"], Topology(tp=2))
    tpshard.split(models[NEXT], outs["next"], Topology(tp=2, ep=2))
    for k, family in (("qkvz", NEXT), ("a_log", Q35), ("conv", NEXT)):
        tpshard.split(models[family], outs[k], Topology(tp=2))
    from_other_rank(outs["qkvz"], "model.layers.1.linear_attn.in_proj_qkvz.weight")
    from_other_rank(outs["a_log"], "model.layers.0.linear_attn.A_log")
    from_other_rank(outs["conv"], "model.layers.2.linear_attn.conv1d.weight", rank=1, other=0)
    sources = [models[Q35], models[NEXT], models[NEXT], models[Q35], models[NEXT]]
    q35, nxt, qkvz, a_log, conv = verify_many(list(outs.values()), sources, model=True)
    assert_model_ok(q35)
    assert_model_ok(nxt)
    for broken in (qkvz, a_log, conv):
        assert_model_fails(broken)
    # the layer level sees the projection; A_log and conv1d have no layer of their own: their bytes and the logits
    assert {x.layer for x in qkvz.layers if not x.ok} == {"model.layers.1.linear_attn.in_proj_qkvz"}
    assert all(x.ok for x in a_log.layers) and all(x.ok for x in conv.layers)
    assert any("linear_attn.A_log" in p for p in a_log.tensors.problems), a_log.tensors.problems
    assert any("conv1d.weight" in p for p in conv.tensors.problems), conv.tensors.problems


@pytest.mark.slow
def test_verify_model_tp4_attention_dp_and_ep(models, tmp_path, monkeypatch):
    """tp 4 with attention DP 2 and EP 2, tp 4 with EP 4 (kv heads replicated over attn_tp 4), and
    attention DP 2 with --dp-lm-head (lm_head over attn_tp), for both families in one launch; and Qwen3.5's in_proj_qkv cut as one contiguous block (its conv1d
    still segmented) fails the logits as well as the layer."""
    dp2 = Topology(tp=4, attn_dp=2, ep=2)
    topos = {"dp2ep2": (dp2, None), "ep4": (Topology(tp=4, ep=4), None), "dp2lmhead": (dp2, tpshard.Options(dp_lm_head=True))}
    outs, sources = [], []
    for family in (Q35, NEXT):
        for name, (topo, options) in topos.items():
            out = tmp_path / f"{family}-{name}"
            tpshard.split(models[family], out, topo, options)
            outs.append(out)
            sources.append(models[family])
    contiguous = tmp_path / "contiguous"
    good = arch.ARCHITECTURES[Q35]
    rules = tuple(r._replace(segments="") if r.module.endswith("in_proj_qkv") else r for r in good.rules)
    with monkeypatch.context() as m:
        m.setitem(arch.ARCHITECTURES, Q35, dataclasses.replace(good, rules=rules))
        tpshard.split(models[Q35], contiguous, dp2)
    reports = verify_many([*outs, contiguous], [*sources, models[Q35]], model=True)
    for out, report in zip(outs, reports):
        assert_model_ok(report)
        assert report.model.batches == (2 if "dp2" in out.name else 1), out
    assert_model_fails(reports[-1])
    assert {x.layer for x in reports[-1].layers if not x.ok} == {f"model.layers.{i}.linear_attn.in_proj_qkvz" for i in range(3)}


@pytest.mark.slow
def test_verify_model_tp8(models, tmp_path):
    """tp 8: one key head and two value heads per rank (Qwen3.5, EP 4, kv heads replicated x4); Qwen3-Next
    under attention DP 2 with EP 8."""
    outs = [tmp_path / "q35", tmp_path / "next"]
    tpshard.split(models[Q35], outs[0], Topology(tp=8, ep=4))
    tpshard.split(models[NEXT], outs[1], Topology(tp=8, attn_dp=2, ep=8))
    for report in verify_many(outs, [models[Q35], models[NEXT]], model=True):
        assert_model_ok(report)


# ---- forwards that leave out one piece of the math: in this process (world of one), so a patch applies


def verify_here(out: Path, source: Path):
    """verify --model of a tp 1 output in this process, as one rank would run it."""
    from tpshard.runtime import init_distributed, shutdown_distributed
    from tpshard.verify.run import Job, rank_main

    info = init_distributed("gloo", device="cpu")
    try:
        (report,) = rank_main(info, [Job(str(out), str(source), model=True)])
    finally:
        shutdown_distributed()
    return report


def no_gate_on_the_norm(monkeypatch):
    import tpshard.runtime.deltanet as deltanet

    plain = lambda x, z, w, eps: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # noqa: E731
    monkeypatch.setattr(deltanet, "gated_rms_norm", plain)


def no_shared_expert_gate(monkeypatch):
    import tpshard.verify.moe_model as moe_model

    build = moe_model.MoEDecoder._moe_block

    def ungated(self, prefix):
        block = build(self, prefix)
        block.shared_gate = None
        return block

    monkeypatch.setattr(moe_model.MoEDecoder, "_moe_block", ungated)


def plain_norms(monkeypatch):
    import tpshard.verify.hybrid_model as hybrid_model

    monkeypatch.setattr(hybrid_model, "zero_centred", lambda name: False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, leave_out",
    [(Q35, None), (NEXT, None), (Q35, no_gate_on_the_norm), (NEXT, no_shared_expert_gate), (Q35, plain_norms)],
    ids=["q35", "next", "no-norm-gate", "no-shared-gate", "plain-norms"],
)
def test_a_forward_without_one_piece_fails(models, tmp_path, monkeypatch, family, leave_out):
    out = tmp_path / "out"
    tpshard.split(models[family], out, Topology(tp=1))
    if leave_out is None:
        assert_model_ok(verify_here(out, models[family]))
        return
    leave_out(monkeypatch)
    report = verify_here(out, models[family])
    assert_model_fails(report)
    assert all(x.ok for x in report.layers)  # the layers are right; the decoder's math is not


def test_refused_activation(models, tmp_path):
    """The conv and the output gate are SiLU in both classes; another hidden_act is refused in one line."""
    import json

    from tpshard.manifest import read_manifest
    from tpshard.verify.model import unsupported_reason

    out = tmp_path / "out"
    tpshard.split(models[NEXT], out, Topology(tp=2))
    config = json.loads((models[NEXT] / "config.json").read_text())
    plan = read_manifest(out).plan
    assert unsupported_reason(plan, config, 16) is None
    reason = unsupported_reason(plan, {**config, "hidden_act": "gelu"}, 16)
    assert reason == "the gated DeltaNet decoder runs SiLU (the conv and the output gate), not hidden_act 'gelu'"
