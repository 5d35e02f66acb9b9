"""make_plan against the worked tables of the MoE and MLA worked tables of docs/contracts.md (SGLang 0.5.23), from headers alone; the
topologies the engine refuses (§4), each a one-line PlanError / TopologyError."""

from __future__ import annotations

import re

import pytest

import fake_models as fm
from tpshard.errors import PlanError, TopologyError
from tpshard.manifest import Options
from tpshard.plan import make_plan
from tpshard.safetensors_format import nbytes_of
from tpshard.topology import Topology

GIB = 1 << 30


def held(plan, rank: int, name: str):
    """The spec of `name` that world rank `rank` holds (None if it holds none)."""
    found = [s for s in plan.rank_shards(rank) if s.name == name]
    assert len(found) <= 1
    return found[0] if found else None


def cut(spec) -> tuple:
    return (spec.shape, spec.dim, spec.start, spec.length)


@pytest.fixture(scope="module")
def v3_tp8_dp2_ep8():
    """DeepSeek-V3 FP8, layers 0-2 dense, 3 MoE, MTP as layer 4 (the full model's 61 in the table)."""
    return make_plan(fm.deepseek_v3(layers=4), Topology(tp=8, attn_dp=2, ep=8))


def test_v3_tp8_attn_dp2_ep8_table(v3_tp8_dp2_ep8):
    """the MoE and MLA worked tables of docs/contracts.md, row by row, for every rank."""
    p = v3_tp8_dp2_ep8
    L, D, M = "model.layers.3", "model.layers.0", "model.layers.4"  # MoE, dense, MTP
    for r in range(8):
        a = r % 4
        s = lambda n: held(p, r, n)  # noqa: E731
        assert cut(s("model.embed_tokens.weight")) == ((32320, 7168), 0, 32320 * a, 32320)
        assert s("model.embed_tokens.weight").ranks == (a, a + 4)
        assert cut(s("lm_head.weight")) == ((16160, 7168), 0, 16160 * r, 16160)
        for name, shape in (("q_a_proj.weight", (1536, 7168)), ("q_a_proj.weight_scale_inv", (12, 56)),
                            ("kv_a_proj_with_mqa.weight", (576, 7168)), ("kv_a_proj_with_mqa.weight_scale_inv", (5, 56)),
                            ("q_a_layernorm.weight", (1536,)), ("kv_a_layernorm.weight", (512,))):  # fmt: skip
            spec = s(f"{L}.self_attn.{name}")
            assert spec.shape == shape and spec.dim is None and spec.ranks == tuple(range(8))
        assert cut(s(f"{L}.self_attn.q_b_proj.weight")) == ((6144, 1536), 0, 6144 * a, 6144)
        assert cut(s(f"{L}.self_attn.q_b_proj.weight_scale_inv")) == ((48, 12), 0, 48 * a, 48)
        assert cut(s(f"{L}.self_attn.kv_b_proj.weight")) == ((8192, 512), 0, 8192 * a, 8192)
        assert cut(s(f"{L}.self_attn.kv_b_proj.weight_scale_inv")) == ((64, 4), 0, 64 * a, 64)
        assert cut(s(f"{L}.self_attn.o_proj.weight")) == ((7168, 4096), 1, 4096 * a, 4096)
        assert cut(s(f"{L}.self_attn.o_proj.weight_scale_inv")) == ((56, 32), 1, 32 * a, 32)
        assert s(f"{L}.self_attn.o_proj.weight").ranks == (a, a + 4)  # the two DP replicas
        for proj in ("gate_proj", "up_proj"):
            assert cut(s(f"{D}.mlp.{proj}.weight")) == ((2304, 7168), 0, 2304 * r, 2304)
            assert cut(s(f"{D}.mlp.{proj}.weight_scale_inv")) == ((18, 56), 0, 18 * r, 18)
            assert cut(s(f"{L}.mlp.shared_experts.{proj}.weight")) == ((256, 7168), 0, 256 * r, 256)
            assert cut(s(f"{L}.mlp.shared_experts.{proj}.weight_scale_inv")) == ((2, 56), 0, 2 * r, 2)
        assert cut(s(f"{D}.mlp.down_proj.weight")) == ((7168, 2304), 1, 2304 * r, 2304)
        assert cut(s(f"{D}.mlp.down_proj.weight_scale_inv")) == ((56, 18), 1, 18 * r, 18)
        assert cut(s(f"{L}.mlp.shared_experts.down_proj.weight")) == ((7168, 256), 1, 256 * r, 256)
        assert cut(s(f"{L}.mlp.shared_experts.down_proj.weight_scale_inv")) == ((56, 2), 1, 2 * r, 2)
        assert s(f"{L}.mlp.gate.weight").shape == (256, 7168) and s(f"{L}.mlp.gate.weight").dim is None
        bias = s(f"{L}.mlp.gate.e_score_correction_bias")
        assert bias.shape == (256,) and bias.dtype == "F32" and bias.ranks == tuple(range(8))
        for layer in (L, M):  # experts [32r, 32r + 32), whole, with their scales
            experts = sorted({x.expert for x in p.rank_shards(r) if x.name.startswith(f"{layer}.mlp.experts.")})
            assert experts == list(range(32 * r, 32 * r + 32))
            e = 32 * r + 5
            assert s(f"{layer}.mlp.experts.{e}.gate_proj.weight").shape == (2048, 7168)
            assert s(f"{layer}.mlp.experts.{e}.gate_proj.weight_scale_inv").shape == (16, 56)
            assert s(f"{layer}.mlp.experts.{e}.down_proj.weight").shape == (7168, 2048)
            assert s(f"{layer}.mlp.experts.{e}.down_proj.weight_scale_inv").shape == (56, 16)
            assert s(f"{layer}.mlp.experts.{e}.up_proj.weight").ranks == (r,)
            assert s(f"{layer}.mlp.experts.{(e + 32) % 256}.up_proj.weight") is None
        for name, shape in (("enorm.weight", (7168,)), ("hnorm.weight", (7168,)), ("eh_proj.weight", (7168, 14336)),
                            ("shared_head.norm.weight", (7168,))):  # fmt: skip
            assert s(f"{M}.{name}").shape == shape and s(f"{M}.{name}").ranks == tuple(range(8))
        assert cut(s(f"{M}.embed_tokens.weight")) == ((32320, 7168), 0, 32320 * a, 32320)
        assert cut(s(f"{M}.shared_head.head.weight")) == ((16160, 7168), 0, 16160 * r, 16160)
        assert cut(s(f"{M}.self_attn.q_b_proj.weight")) == ((6144, 1536), 0, 6144 * a, 6144)


def test_v3_ranks_a_and_a_plus_4_hold_the_same_attention(v3_tp8_dp2_ep8):
    p = v3_tp8_dp2_ep8
    for a in range(4):
        one = {s.name: s for s in p.rank_shards(a) if "self_attn" in s.name or "embed_tokens" in s.name}
        other = {s.name: s for s in p.rank_shards(a + 4) if "self_attn" in s.name or "embed_tokens" in s.name}
        assert one == other


def test_v3_dp_lm_head_and_moe_dense_tp_1():
    p = make_plan(fm.deepseek_v3(layers=4), Topology(tp=8, attn_dp=2, ep=8, moe_dense_tp=1), Options(dp_lm_head=True))
    for r in range(8):
        assert cut(held(p, r, "lm_head.weight")) == ((32320, 7168), 0, 32320 * (r % 4), 32320)
        assert cut(held(p, r, "model.layers.4.shared_head.head.weight")) == ((32320, 7168), 0, 32320 * (r % 4), 32320)
        dense = held(p, r, "model.layers.0.mlp.gate_proj.weight")
        assert dense.shape == (18432, 7168) and dense.ranks == tuple(range(8)) and dense.group == "replicated"
        assert held(p, r, "model.layers.0.mlp.down_proj.weight_scale_inv").shape == (56, 144)
        assert cut(held(p, r, "model.layers.3.mlp.shared_experts.gate_proj.weight")) == ((256, 7168), 0, 256 * r, 256)


def test_v3_tp16_table():
    """§7.2: tp 16, no EP: every expert of every rank cut to one 128-block."""
    p = make_plan(fm.deepseek_v3(layers=4), Topology(tp=16))
    for r in (0, 7, 15):
        s = lambda n: held(p, r, n)  # noqa: E731
        assert cut(s("model.embed_tokens.weight")) == ((8080, 7168), 0, 8080 * r, 8080)
        assert cut(s("model.layers.3.self_attn.q_b_proj.weight")) == ((1536, 1536), 0, 1536 * r, 1536)
        assert s("model.layers.3.self_attn.q_b_proj.weight_scale_inv").shape == (12, 12)
        assert cut(s("model.layers.3.self_attn.kv_b_proj.weight")) == ((2048, 512), 0, 2048 * r, 2048)
        assert s("model.layers.3.self_attn.kv_b_proj.weight_scale_inv").shape == (16, 4)
        assert cut(s("model.layers.3.self_attn.o_proj.weight")) == ((7168, 1024), 1, 1024 * r, 1024)
        assert s("model.layers.3.self_attn.o_proj.weight_scale_inv").shape == (56, 8)
        assert cut(s("model.layers.0.mlp.gate_proj.weight")) == ((1152, 7168), 0, 1152 * r, 1152)
        assert s("model.layers.0.mlp.down_proj.weight_scale_inv").shape == (56, 9)
        for e in (0, 255):
            assert cut(s(f"model.layers.3.mlp.experts.{e}.up_proj.weight")) == ((128, 7168), 0, 128 * r, 128)
            assert cut(s(f"model.layers.3.mlp.experts.{e}.up_proj.weight_scale_inv")) == ((1, 56), 0, r, 1)
            assert cut(s(f"model.layers.3.mlp.experts.{e}.down_proj.weight")) == ((7168, 128), 1, 128 * r, 128)
            assert s(f"model.layers.3.mlp.experts.{e}.down_proj.weight_scale_inv").shape == (56, 1)
        assert cut(s("model.layers.3.mlp.shared_experts.gate_proj.weight")) == ((128, 7168), 0, 128 * r, 128)


@pytest.mark.slow
@pytest.mark.parametrize(
    "topo, tensors, gib",
    [(Topology(tp=8, attn_dp=2, ep=8), 12695, 82.9), (Topology(tp=8, attn_dp=2, ep=8, moe_dense_tp=1), 12695, 83.9),
     (Topology(tp=16), 91991, 41.3)],
)  # fmt: skip
def test_v3_full_model_rank_0_totals(topo, tensors, gib):
    """§7.1 / §7.2 totals of rank 0 on the whole 61 + 1 layer model (91,991 source tensors)."""
    p = make_plan(fm.deepseek_v3(), topo)
    specs = p.rank_shards(0)
    assert len(specs) == tensors
    assert round(sum(nbytes_of(s.dtype, s.shape) for s in specs) / GIB, 1) == gib


def test_qwen3_30b_a3b_tp4_table():
    """§7.3 (4 layers of 48)."""
    p = make_plan(fm.qwen_moe(layers=4), Topology(tp=4))
    for r in range(4):
        s = lambda n: held(p, r, n)  # noqa: E731
        assert cut(s("model.layers.1.self_attn.q_proj.weight")) == ((1024, 2048), 0, 1024 * r, 1024)
        assert cut(s("model.layers.1.self_attn.k_proj.weight")) == ((128, 2048), 0, 128 * r, 128)
        assert cut(s("model.layers.1.self_attn.o_proj.weight")) == ((2048, 1024), 1, 1024 * r, 1024)
        assert s("model.layers.1.self_attn.q_norm.weight").shape == (128,)
        assert s("model.layers.1.mlp.gate.weight").shape == (128, 2048)
        for e in (0, 127):
            assert cut(s(f"model.layers.1.mlp.experts.{e}.gate_proj.weight")) == ((192, 2048), 0, 192 * r, 192)
            assert cut(s(f"model.layers.1.mlp.experts.{e}.down_proj.weight")) == ((2048, 192), 1, 192 * r, 192)
        assert cut(s("model.embed_tokens.weight")) == ((37984, 2048), 0, 37984 * r, 37984)
        assert cut(s("lm_head.weight")) == ((37984, 2048), 0, 37984 * r, 37984)


@pytest.mark.slow
def test_qwen3_30b_a3b_tp4_rank_size():
    p = make_plan(fm.qwen_moe(), Topology(tp=4))
    assert round(sum(nbytes_of(s.dtype, s.shape) for s in p.rank_shards(0)) / GIB, 1) == 14.2
    ep = make_plan(fm.qwen_moe(), Topology(tp=4, ep=4))
    assert round(sum(nbytes_of(s.dtype, s.shape) for s in ep.rank_shards(0)) / GIB, 1) == 14.2


def test_qwen3_30b_a3b_ep_variants():
    """§7.3: --ep 4 at tp 4: experts [32r, 32r + 32) whole; tp 8 / attn-dp 2 / ep 8: attention the
    tp-4 slice of a = r % 4, experts [16r, 16r + 16), lm_head [18992, 2048]."""
    p = make_plan(fm.qwen_moe(layers=2), Topology(tp=4, ep=4))
    for r in range(4):
        experts = sorted({s.expert for s in p.rank_shards(r) if s.expert is not None})
        assert experts == list(range(32 * r, 32 * r + 32))
        assert held(p, r, f"model.layers.0.mlp.experts.{32 * r}.gate_proj.weight").shape == (768, 2048)
    p = make_plan(fm.qwen_moe(layers=2), Topology(tp=8, attn_dp=2, ep=8))
    for r in range(8):
        a = r % 4
        assert cut(held(p, r, "model.layers.0.self_attn.q_proj.weight")) == ((1024, 2048), 0, 1024 * a, 1024)
        assert cut(held(p, r, "model.embed_tokens.weight")) == ((37984, 2048), 0, 37984 * a, 37984)
        assert held(p, r, "lm_head.weight").shape == (18992, 2048)
        assert sorted({s.expert for s in p.rank_shards(r) if s.expert is not None}) == list(range(16 * r, 16 * r + 16))


def test_mixtral_8x7b_table():
    """§7.4: tp 8; --ep 8: expert r only, whole; --ep 2: experts [4(r // 4), +4), rows [3584(r % 4), +3584)."""
    p = make_plan(fm.mixtral(layers=2), Topology(tp=8))
    for r in range(8):
        s = lambda n: held(p, r, n)  # noqa: E731
        assert cut(s("model.layers.1.self_attn.q_proj.weight")) == ((512, 4096), 0, 512 * r, 512)
        assert cut(s("model.layers.1.self_attn.k_proj.weight")) == ((128, 4096), 0, 128 * r, 128)
        assert cut(s("model.layers.1.self_attn.o_proj.weight")) == ((4096, 512), 1, 512 * r, 512)
        assert s("model.layers.1.block_sparse_moe.gate.weight").shape == (8, 4096)
        for e in range(8):
            assert cut(s(f"model.layers.1.block_sparse_moe.experts.{e}.w1.weight")) == ((1792, 4096), 0, 1792 * r, 1792)
            assert cut(s(f"model.layers.1.block_sparse_moe.experts.{e}.w2.weight")) == ((4096, 1792), 1, 1792 * r, 1792)
        assert cut(s("model.embed_tokens.weight")) == ((4000, 4096), 0, 4000 * r, 4000)
    p = make_plan(fm.mixtral(layers=2), Topology(tp=8, ep=8))
    for r in range(8):
        assert sorted({s.expert for s in p.rank_shards(r) if s.expert is not None}) == [r]
        assert held(p, r, f"model.layers.0.block_sparse_moe.experts.{r}.w3.weight").shape == (14336, 4096)
    p = make_plan(fm.mixtral(layers=2), Topology(tp=8, ep=2))
    for r in range(8):
        first = 4 * (r // 4)
        assert sorted({s.expert for s in p.rank_shards(r) if s.expert is not None}) == list(range(first, first + 4))
        w1 = held(p, r, f"model.layers.0.block_sparse_moe.experts.{first}.w1.weight")
        assert cut(w1) == ((3584, 4096), 0, 3584 * (r % 4), 3584) and w1.ranks == (r,)


@pytest.mark.slow
def test_mixtral_8x7b_tp8_rank_size():
    p = make_plan(fm.mixtral(), Topology(tp=8))
    assert round(sum(nbytes_of(s.dtype, s.shape) for s in p.rank_shards(0)) / GIB, 1) == 10.9


def test_attention_and_embedding_group_per_architecture():
    """Item 1: the group of attention and of the embedding under attention DP, per SGLang model class."""
    import test_plan

    expected = {
        "LlamaForCausalLM": ("tp", "tp"), "MistralForCausalLM": ("tp", "tp"), "Qwen2ForCausalLM": ("tp", "attn_tp"),
        "Qwen3ForCausalLM": ("attn_tp", "attn_tp"),
    }  # fmt: skip
    for arch, (attn, embed) in expected.items():
        p = make_plan(test_plan.fake_checkpoint(arch=arch, vocab=1024), Topology(tp=8, attn_dp=2))
        groups = {s.name: s.group for s in p.shards}
        assert groups["model.layers.0.self_attn.q_proj.weight"] == attn
        assert groups["model.layers.0.self_attn.o_proj.weight"] == attn
        assert groups["model.embed_tokens.weight"] == embed
        assert groups["lm_head.weight"] == "tp"
        assert any("layout of --attn-dp 1" in w for w in p.warnings) == (embed == "tp")
    for name, ckpt in (("Qwen3Moe", fm.qwen_moe(layers=1)), ("DeepseekV3", fm.deepseek_v3(layers=1, mtp=False))):
        p = make_plan(ckpt, Topology(tp=8, attn_dp=2))
        attn = {s.group for s in p.shards if "self_attn" in s.name and s.dim is not None}
        assert attn == {"attn_tp"}, name
        assert {s.group for s in p.shards if s.name == "model.embed_tokens.weight"} == {"attn_tp"}


# ---- refusals (SGLang 0.5.23's MoE refusals) ---------------------------------------------------------------------


def config_says(ckpt, **changes):
    ckpt.config.update(changes)
    return ckpt


@pytest.mark.parametrize(
    "make, topo, options, message",
    [
        (lambda: fm.mixtral(layers=1), dict(tp=8, ep=3), {}, "ep=3 does not divide tp=8"),
        (lambda: fm.mixtral(layers=1, num_local_experts=6), dict(tp=4, ep=4), {}, "--ep 4 does not divide the 6 routed experts"),
        (lambda: fm.qwen_moe(layers=1, moe_intermediate_size=100), dict(tp=8, attn_dp=2, ep=1), {}, "expert intermediate size 100 does not divide over moe_tp 8"),
        (lambda: fm.qwen_moe(layers=1, num_attention_heads=12, num_key_value_heads=4), dict(tp=8), {}, "12 attention heads do not divide over the attn_tp group of 8"),
        (lambda: fm.deepseek_v3(layers=4, num_attention_heads=12), dict(tp=8), {}, "12 attention heads do not divide over the attn_tp group of 8"),
        (lambda: fm.deepseek_v3(layers=4), dict(tp=8, moe_dense_tp=2), {}, "moe_dense_tp=2: SGLang accepts only 1"),
        (lambda: fm.qwen_moe(layers=1), dict(tp=4, moe_dense_tp=1), {}, "--moe-dense-tp applies to DeepSeek's dense MLP layers"),
        (lambda: fm.deepseek_v3(layers=4), dict(tp=8), dict(dp_lm_head=True), "--dp-lm-head needs --attn-dp > 1"),
        (lambda: fm.mixtral(layers=1), dict(tp=8, attn_dp=2), {}, "--attn-dp 2: MixtralForCausalLM has no attention-DP layout"),
        (lambda: fm.qwen_moe(layers=1, num_experts=2), dict(tp=8, ep=2), {}, "moe_tp size 4 is greater than the 2 routed experts"),
        (lambda: fm.qwen_moe("Qwen2MoeForCausalLM", layers=1, num_experts=4, shared_expert_intermediate_size=512), dict(tp=8, ep=4), {}, "tp size 8 is greater than the 4 routed experts"),
        (lambda: fm.qwen_moe(layers=1, mlp_only_layers=[0]), dict(tp=2), {}, "config.json has dense layers"),
        (lambda: config_says(fm.deepseek_v3(layers=4), first_k_dense_replace=2), dict(tp=8), {}, "a dense MLP tensor in layer 2, which config.json makes a MoE layer"),
        (lambda: config_says(fm.deepseek_v3(layers=4), first_k_dense_replace=4), dict(tp=8), {}, "an expert MLP tensor in layer 3, which config.json makes a dense layer"),
        (lambda: fm.deepseek_v3(layers=4, n_routed_experts=256), dict(tp=8), {}, None),
        (lambda: fm.deepseek_v3(layers=4), dict(tp=32), {}, "do not align at tp=32"),
    ],
)  # fmt: skip
def test_refusals(make, topo, options, message):
    if message is None:
        make_plan(make(), Topology(**topo), Options(**options))
        return
    with pytest.raises((PlanError, TopologyError), match=re.escape(message)):
        make_plan(make(), Topology(**topo), Options(**options))


def test_fp8_misalignment_names_tensor_rank_and_numbers():
    """tp 32 without EP: experts 2048 / 32 = 64, dense 18432 / 32 = 576, shared 2048 / 32 = 64 (§4)."""
    with pytest.raises(PlanError) as e:
        make_plan(fm.deepseek_v3(layers=4, n_routed_experts=32), Topology(tp=32))
    text = str(e.value)
    assert "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv: N 2048 over moe_tp of 32 gives 64 per rank" in text
    assert "(and 63 more like it in other layers/experts)" in text  # experts 1-31 of layer 3, 0-31 of the MTP layer
    assert "model.layers.3.mlp.shared_experts.down_proj.weight_scale_inv: K 2048 over tp of 32 gives 64" in text
    assert "model.layers.0.mlp.gate_proj" in text and "18432" in text
    assert "nothing was written" in text


def test_missing_expert_is_refused():
    ckpt = fm.mixtral(layers=2, num_local_experts=4)
    del ckpt.tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    with pytest.raises(PlanError, match=r"model.layers.1: 1 of 12 routed expert weights are missing .*expert 2 w3"):
        make_plan(ckpt, Topology(tp=2))


def test_expert_id_beyond_the_config_is_refused():
    ckpt = fm.mixtral(layers=1, num_local_experts=4)
    ckpt.tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = ckpt.tensors["model.layers.0.block_sparse_moe.experts.3.w1.weight"]
    with pytest.raises(PlanError, match="expert 4, but config.json has 4 routed experts"):
        make_plan(ckpt, Topology(tp=2))


def test_quantized_preflight_folds_layers_and_experts(v3_tp8_dp2_ep8):
    """plan's quantized table has one row per kind of tensor: DeepSeek-V3 has 256 experts a layer,
    and a row per expert made the table thousands of lines long."""
    from tpshard.quant.shards import alignment_rows

    rows = alignment_rows(v3_tp8_dp2_ep8)
    names = [r["tensor"] for r in rows]
    assert len(names) == len(set(names))
    assert "model.layers.N.mlp.experts.E.gate_proj.weight_scale_inv" in names
    assert not [n for n in names if re.search(r"\d", n.replace("fp8", ""))]  # no layer or expert number left
    experts = next(r for r in rows if r["tensor"] == "model.layers.N.mlp.experts.E.down_proj.weight_scale_inv")
    assert (experts["format"], experts["step"], experts["atom"]) == ("fp8_block", "block_k", 128)


def test_missing_quantized_scale_is_refused():
    ckpt = fm.deepseek_v3(layers=4)
    del ckpt.tensors["model.layers.3.mlp.experts.5.up_proj.weight_scale_inv"]
    del ckpt.tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    with pytest.raises(PlanError, match=r"quantized tensors missing from the checkpoint: model.layers.0.self_attn.o_proj.weight_scale_inv, model.layers.3.mlp.experts.5.up_proj.weight_scale_inv$"):
        make_plan(ckpt, Topology(tp=8, ep=8))
