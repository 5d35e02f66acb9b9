"""Parity of the runtime's MoE and MLA layers (tpshard.runtime.moe / .mla) against transformers.

The reference is transformers' own module (DeepseekV3MoE, Qwen3MoeSparseMoeBlock,
Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock, DeepseekV3Attention), built in this process from a
tiny config with random float64 weights and run on the same input. Spawned gloo ranks get the full
weights and cut their own shards here in the test with plain `chunk` (never with tpshard code):
experts of EP slot `r // moe_tp`, rows / columns `r % moe_tp` of I; MLA heads of attn_tp rank `a`.
Each rank's reduced output must equal the reference, at tp 4 with ep 1, 2, 4 and attention DP 1
and 2. The same runs load deliberately wrong shards (two experts swapped, a shifted MoE-TP slice,
kv_b_proj heads of the next rank, an expert on the wrong EP slot) and the tests see each caught.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_configs import YARN, hf_config, randomize
from tpshard.runtime import DistInfo, LogicalGroup, bind_groups, run_local
from tpshard.runtime.layers import MergedColumnParallelLinear, RowParallelLinear
from tpshard.runtime.mla import MLAAttention, MLAConfig
from tpshard.arch import RouterConfig, router_config
from tpshard.runtime.moe import FusedMoE, MoEBlock, route
from tpshard.topology import Topology

DT = torch.float64
TOKENS, SEQ = 24, 12
TOL = 1e-6  # relative to max |ref|: transformers' DeepSeek router runs in float32
WRONG = 1e-2
FAMILIES = ("deepseek_v3", "qwen3_moe", "qwen2_moe", "mixtral")


# ---------------------------------------------------------------- references (this process)


def moe_reference(kind: str, seed: int):
    """transformers' MoE block of `kind` with random weights, its per-expert weights, an input and its output."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block_cls = {"deepseek_v3": DeepseekV3MoE, "qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock, "mixtral": MixtralSparseMoeBlock}[kind]  # fmt: skip
    config = hf_config(kind)
    block = block_cls(config).to(DT).eval()
    randomize(block, seed)
    sd = {k: v.clone() for k, v in block.state_dict().items()}
    i = sd["experts.down_proj"].shape[-1]
    w = {
        "config": config.to_dict(),
        "router": sd["gate.weight"], "bias": sd.get("gate.e_score_correction_bias"),
        "gate": sd["experts.gate_up_proj"][:, :i], "up": sd["experts.gate_up_proj"][:, i:], "down": sd["experts.down_proj"],
    }  # fmt: skip
    shared = "shared_experts" if kind == "deepseek_v3" else "shared_expert"
    if f"{shared}.gate_proj.weight" in sd:
        w["shared"] = {p: sd[f"{shared}.{p}_proj.weight"] for p in ("gate", "up", "down")}
    w["shared_gate"] = sd.get("shared_expert_gate.weight")
    x = torch.randn(1, TOKENS, config.hidden_size, generator=torch.Generator().manual_seed(seed + 100), dtype=DT)
    with torch.no_grad():
        ref = block(x)[0]  # [T, H]
    return w, x[0], ref


def mla_reference(seed: int, **overrides):
    """transformers' DeepseekV3Attention with random weights, its rope tables, an input batch and its output."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    config = hf_config("deepseek_v3", **overrides)
    config._attn_implementation = "eager"
    attn = DeepseekV3Attention(config, layer_idx=0).to(DT).eval()
    randomize(attn, seed)
    x = torch.randn(2, SEQ, config.hidden_size, generator=torch.Generator().manual_seed(seed + 200), dtype=DT)
    pos = torch.arange(SEQ)[None]
    cos, sin = DeepseekV3RotaryEmbedding(config)(x, pos)  # [1, S, rope]
    mask = torch.full((SEQ, SEQ), float("-inf"), dtype=DT).triu(1)[None, None]
    with torch.no_grad():
        ref = attn(x, (cos, sin), mask)[0]
    sd = {k: v.clone() for k, v in attn.state_dict().items()}
    return dict(config=config.to_dict(), sd=sd, cos=cos[0], sin=sin[0]), x, ref


# ---------------------------------------------------------------- the spawned side


def cut(t: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    return t.chunk(size, dim)[rank]


def build_moe(w, tp: LogicalGroup, ep: int, *, swap=None, shift_tp=False) -> MoEBlock:
    """The rank's MoE block loaded with test-side shards; `swap` exchanges two global experts'
    weights, `shift_tp` loads the next MoE-TP rank's slice of I into down_proj only (shifting all three
    consistently only permutes I across ranks, which the sum does not see)."""
    cfg = router_config(w["config"])
    e, i, h = w["gate"].shape
    experts = FusedMoE(e, h, i, group=tp, ep_size=ep, dtype=DT, name="mlp.experts")
    moe_tp = tp.size // ep
    m = tp.rank % moe_tp
    m_down = (m + 1) % moe_tp if shift_tp else m
    for g in experts.local_experts:
        src = {swap[0]: swap[1], swap[1]: swap[0]}.get(g, g) if swap else g
        experts.load_expert(g, "gate", cut(w["gate"][src], 0, moe_tp, m))
        experts.load_expert(g, "up", cut(w["up"][src], 0, moe_tp, m))
        experts.load_expert(g, "down", cut(w["down"][src], 1, moe_tp, m_down))
    assert experts.missing_shards() == []
    kw = {}
    if "shared" in w:
        s = w["shared"]
        n = s["gate"].shape[0]
        gate_up = MergedColumnParallelLinear(h, [n, n], group=tp, dtype=DT, name="shared.gate_up_proj")
        gate_up.load_shard("gate", cut(s["gate"], 0, tp.size, tp.rank))
        gate_up.load_shard("up", cut(s["up"], 0, tp.size, tp.rank))
        down = RowParallelLinear(n, h, group=tp, dtype=DT, name="shared.down_proj")
        down.load_shard(None, cut(s["down"], 1, tp.size, tp.rank))
        kw = dict(shared_gate_up=gate_up, shared_down=down, shared_gate=w["shared_gate"])
    return MoEBlock(cfg, experts, w["router"], correction_bias=w["bias"], **kw)


def build_mla(w, at: LogicalGroup, *, kv_b_from: int | None = None) -> MLAAttention:
    cfg = MLAConfig.from_hf(w["config"])
    attn = MLAAttention(cfg, group=at, dtype=DT)
    sd = w["sd"]
    heads = {"q_proj", "q_b_proj", "kv_b_proj"}
    for name, t in sd.items():
        module, param = name.rsplit(".", 1)
        if module in heads:
            src = at.rank if (module != "kv_b_proj" or kv_b_from is None) else kv_b_from
            t = cut(t, 0, at.size, src)
        elif module == "o_proj" and param == "weight":
            t = cut(t, 1, at.size, at.rank)
        attn.load_shard(module, t, param)
    assert attn.missing_shards() == []
    return attn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item() / b.abs().max().item()


def check_world(info: DistInfo, moe_cases: dict, mla_cases: dict) -> dict[str, object]:
    """Every case's relative error on this rank (names with 'wrong/' must be large)."""
    out: dict[str, object] = {}
    for topo in (Topology(tp=info.world_size), Topology(tp=info.world_size, attn_dp=2)):
        bind_groups(topo)
        tp = LogicalGroup.of(topo, "tp", info.rank)
        at = LogicalGroup.of(topo, "attn_tp", info.rank)
        with torch.no_grad():
            if topo.attn_dp == 1:  # the MoE runs over the full tp group whatever the attention DP
                for kind, (w, x, ref) in moe_cases.items():
                    for ep in (1, 2, 4):
                        out[f"{kind} ep={ep}"] = rel(build_moe(w, tp, ep)(x), ref)
                    out[f"wrong/{kind} experts 1 and 6 swapped"] = rel(build_moe(w, tp, 2, swap=(1, 6))(x), ref)
                    out[f"wrong/{kind} MoE-TP slice shifted"] = rel(build_moe(w, tp, 2, shift_tp=True)(x), ref)
                try:
                    w = moe_cases["mixtral"][0]
                    e, i, h = w["gate"].shape
                    FusedMoE(e, h, i, group=tp, ep_size=4, dtype=DT).load_expert((tp.rank + 2) * 2 % e, "gate", torch.zeros(i, h, dtype=DT))
                    out["refused/expert on the wrong EP slot"] = ""
                except ValueError as err:
                    out["refused/expert on the wrong EP slot"] = str(err)
            for name, (w, x, ref) in mla_cases.items():
                b = topo.attn_dp_rank(info.rank)  # each DP replica attends to its own sequence
                attn = build_mla(w, at)
                out[f"{name} attn_dp={topo.attn_dp}"] = rel(attn(x[b : b + 1], w["cos"], w["sin"]), ref[b : b + 1])
                wrong = build_mla(w, at, kv_b_from=(at.rank + 1) % at.size)
                out[f"wrong/{name} kv_b_proj heads of the next rank attn_dp={topo.attn_dp}"] = rel(
                    wrong(x[b : b + 1], w["cos"], w["sin"]), ref[b : b + 1]
                )
    return out


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    moe = {kind: moe_reference(kind, seed) for seed, kind in enumerate(FAMILIES)}
    mla = {
        "mla": mla_reference(10),
        "mla no q_lora": mla_reference(11, q_lora_rank=None),
        "mla yarn": mla_reference(12, rope_parameters=dict(YARN)),
        "mla rotate-half rope": mla_reference(13, rope_interleave=False),
    }
    return [r.value for r in run_local(check_world, 4, moe, mla, backend="gloo", timeout_s=240)]


def test_moe_and_mla_match_transformers_at_every_ep_and_attn_dp(world4):
    """tp 4: experts over EP 1/2/4 x MoE-TP 4/2/1, shared experts over tp; MLA heads over attn_tp 4 and 2."""
    for per_rank in world4:
        good = {n: v for n, v in per_rank.items() if "/" not in n}
        assert len(good) == 4 * 3 + 4 * 2
        assert {n: v for n, v in good.items() if v > TOL} == {}


def test_wrong_shards_are_caught(world4):
    for per_rank in world4:
        bad = {n: v for n, v in per_rank.items() if n.startswith("wrong/")}
        assert len(bad) == 4 * 2 + 4 * 2
        assert {n: v for n, v in bad.items() if v < WRONG} == {}


def test_an_expert_on_the_wrong_ep_slot_is_refused(world4):
    for rank, per_rank in enumerate(world4):
        msg = per_rank["refused/expert on the wrong EP slot"]
        assert f"is not on this rank's EP slot {rank}/4 (experts [{2 * rank}, {2 * rank + 2}))" in msg, msg


# ---------------------------------------------------------------- in-process


def test_router_rules_follow_each_transformers_router():
    """The same tokens through route() and through transformers' router module: same picks, same weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    classes = {"deepseek_v3": DeepseekV3TopkRouter, "qwen3_moe": Qwen3MoeTopKRouter, "qwen2_moe": Qwen2MoeTopKRouter, "mixtral": MixtralTopKRouter}  # fmt: skip
    for seed, (kind, cls) in enumerate(classes.items()):
        for norm in (True, False):
            config = hf_config(kind, norm_topk_prob=norm) if kind != "mixtral" else hf_config(kind)
            router = cls(config).float()
            randomize(router, seed)
            x = torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(seed))
            _, ref_w, ref_ids = router(x)
            ids, weights = route(router_config(config.to_dict()), x, router.weight, getattr(router, "e_score_correction_bias", None))
            order, ref_order = ids.sort(-1), ref_ids.sort(-1)
            assert torch.equal(order.values, ref_order.values), kind
            got = weights.gather(1, order.indices)
            want = ref_w.float().gather(1, ref_order.indices)
            assert (got - want).abs().max() < 1e-6, (kind, norm)


def test_grouped_routing_only_picks_from_the_best_groups():
    """DeepSeek-V3: 8 experts in 4 groups; the two best groups by top-2 sum; the bias picks, the score weighs."""
    cfg = RouterConfig(num_experts=8, top_k=2, scoring="sigmoid", renormalize=True, n_group=4, topk_group=2, correction_bias=True, routed_scaling_factor=2.5)  # fmt: skip
    weight = torch.eye(8, 8)  # logits = x
    x = torch.tensor([[3.0, 2.9, 0.0, 0.0, 5.0, -9.0, 1.0, 1.0]])
    bias = torch.zeros(8)
    ids, w = route(cfg, x, weight, bias)
    # group sums: g0 = s(3)+s(2.9) ~ 1.9, g1 ~ 1.0, g2 ~ 0.99, g3 ~ 1.46 -> groups 0 and 3; expert 4 (5.0) is not eligible
    assert sorted(ids[0].tolist()) == [0, 1]
    assert abs(w.sum().item() - 2.5) < 1e-6
    bias[6] = 10.0  # bias lifts group 3 and expert 6 into the choice; its weight stays sigmoid(1)
    ids, w = route(cfg, x, weight, bias)
    assert sorted(ids[0].tolist()) == [0, 6]
    s = torch.sigmoid(torch.tensor([3.0, 1.0]))
    assert torch.allclose(w[0].sort().values, (s / s.sum() * 2.5).sort().values)


def test_fused_moe_layout_and_refusals():
    """Mixtral-style (docs/contracts.md, MoE): 8 experts over tp 8 ep 2 -> moe_tp 4; world rank 6 holds experts 4..7, slice 2 of I."""
    g = LogicalGroup.of(Topology(tp=8), "tp", 6)
    moe = FusedMoE(8, 16, 32, group=g, ep_size=2, dtype=DT, name="layers.0.mlp.experts")
    assert (moe.ep_rank, moe.moe_tp_rank, moe.moe_tp_size, moe.local_experts) == (1, 2, 4, range(4, 8))
    assert moe.shard_info(5, "gate").shape == (8, 16) and moe.shard_info(5, "down").shape == (16, 8)
    with pytest.raises(ValueError, match=r"expert 2 is not on this rank's EP slot 1/2 \(experts \[4, 8\)\).*belongs to EP slot 0"):
        moe.load_expert(2, "gate", torch.zeros(8, 16, dtype=DT))
    with pytest.raises(ValueError, match=r"expert 5 up has shape \(32, 16\).*expects \(8, 16\)"):
        moe.load_expert(5, "up", torch.zeros(32, 16, dtype=DT))
    with pytest.raises(ValueError, match="experts over ep: 8 is not divisible by 3"):
        FusedMoE(8, 16, 32, group=LogicalGroup.of(Topology(tp=6), "tp", 0), ep_size=3)
    with pytest.raises(ValueError, match="expert intermediate size over MoE-TP: 30 is not divisible by 4"):
        FusedMoE(8, 16, 30, group=g, ep_size=2)
    assert len(moe.missing_shards()) == 12


def test_mla_scale_and_head_divisibility():
    config = hf_config("deepseek_v3", rope_parameters=dict(YARN)).to_dict()
    m = 0.1 * math.log(4.0) + 1.0
    assert abs(MLAConfig.from_hf(config).scale - 24**-0.5 * m * m) < 1e-12
    assert MLAConfig.from_hf(hf_config("deepseek_v3").to_dict()).scale == 24**-0.5
    with pytest.raises(ValueError, match="attention heads over the attn_tp group: 8 is not divisible by 3"):
        MLAAttention(MLAConfig.from_hf(config), group=LogicalGroup.of(Topology(tp=3), "attn_tp", 0))
