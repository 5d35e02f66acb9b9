"""make_plan against the worked examples of docs/contracts.md §2, from headers alone (no tensor data)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tpshard.checkpoint import Checkpoint
from tpshard.errors import PlanError
from tpshard.manifest import Options
from tpshard.plan import make_plan
from tpshard.safetensors_format import TensorInfo, nbytes_of
from tpshard.topology import Topology


def fake_checkpoint(
    *, hidden=4096, heads=32, kv=8, head_dim=128, inter=14336, vocab=128256, layers=1, tied=False,
    arch="LlamaForCausalLM", extra: dict | None = None,
) -> Checkpoint:  # fmt: skip
    """A checkpoint of headers only, shaped like a real model (Llama-3-8B by default)."""
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj.weight": (kv * head_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv * head_dim, hidden),
            f"{p}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj.weight": (inter, hidden),
            f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
            f"{p}.input_layernorm.weight": (hidden,),
            f"{p}.post_attention_layernorm.weight": (hidden,),
        }
        # What the architecture always has: a checkpoint without it is refused as incomplete.
        if arch == "Qwen3ForCausalLM":
            shapes |= {f"{p}.self_attn.q_norm.weight": (head_dim,), f"{p}.self_attn.k_norm.weight": (head_dim,)}
        if arch == "Qwen2ForCausalLM":
            shapes |= {f"{p}.self_attn.{x}_proj.bias": ((heads if x == "q" else kv) * head_dim,) for x in "qkv"}
    shapes |= extra or {}
    tensors, offset = {}, 0
    for name, shape in shapes.items():
        n = nbytes_of("BF16", shape)
        tensors[name] = TensorInfo("model.safetensors", "BF16", shape, offset, offset + n)
        offset += n
    config = dict(
        architectures=[arch], model_type="llama", hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        intermediate_size=inter, vocab_size=vocab,
    )  # fmt: skip
    return Checkpoint(path=Path("/nonexistent"), config=config, weight_files=("model.safetensors",), tensors=tensors, index_file=None)


def rows(plan, name):
    """group rank -> (start, length, pad) for one tensor."""
    return {s.group_rank: (s.start, s.length, s.pad) for s in plan.shards if s.name == name}


@pytest.mark.parametrize(
    "tp, q_rows, kv_rows, replicas",
    [(4, 1024, 256, 1), (8, 512, 128, 1), (16, 256, 128, 2)],  # docs/contracts.md §2 worked examples
)
def test_llama3_8b_qkv(tp, q_rows, kv_rows, replicas):
    plan = make_plan(fake_checkpoint(), Topology(tp=tp))
    q = rows(plan, "model.layers.0.self_attn.q_proj.weight")
    k = {s.group_rank: s for s in plan.shards if s.name == "model.layers.0.self_attn.k_proj.weight"}
    assert q == {r: (r * q_rows, q_rows, 0) for r in range(tp)}
    assert {gr: (s.start, s.length) for gr, s in k.items()} == {gr: (gr * kv_rows, kv_rows) for gr in range(tp // replicas)}
    for r in range(tp):  # rank r takes kv head r // replicas
        (holder,) = [s for s in k.values() if r in s.ranks]
        assert holder.group_rank == r // replicas and holder.factor == replicas


def test_qwen3_30b_attention_dp():
    """tp 8, dp-attn 2, 32 heads, 4 kv heads: attn_tp 4, each rank 8 q heads and 1 kv head (§2)."""
    plan = make_plan(fake_checkpoint(kv=4, arch="Qwen3ForCausalLM"), Topology(tp=8, attn_dp=2))
    q = [s for s in plan.shards if s.name.endswith("q_proj.weight")]
    assert [(s.group, s.group_rank, s.start, s.length, s.ranks) for s in q] == [
        ("attn_tp", a, 1024 * a, 1024, (a, a + 4)) for a in range(4)
    ]
    k = [s for s in plan.shards if s.name.endswith("k_proj.weight")]
    assert [(s.start, s.length, s.ranks) for s in k] == [(128 * a, 128, (a, a + 4)) for a in range(4)]


@pytest.mark.parametrize(
    "vocab, tp, per_rank, last_real",  # vocab padding (docs/contracts.md §2), vLLM/SGLang
    [(50257, 2, 25152, 25105), (50257, 8, 6288, 6241), (32000, 8, 4000, 4000), (128256, 8, 16032, 16032)],
)
def test_vocab_padding(vocab, tp, per_rank, last_real):
    plan = make_plan(fake_checkpoint(hidden=256, heads=8, kv=8, head_dim=32, inter=512, vocab=vocab), Topology(tp=tp))
    lm = rows(plan, "lm_head.weight")
    assert lm[tp - 1] == ((tp - 1) * per_rank, last_real, per_rank - last_real)
    assert all(lm[r] == (r * per_rank, per_rank, 0) for r in range(tp - 1))


@pytest.mark.parametrize("vocab, tp", [(32000, 3), (151936, 6)])
def test_vocab_that_does_not_divide_is_refused(vocab, tp):
    with pytest.raises(PlanError, match=f"vocab {vocab} padded"):
        make_plan(fake_checkpoint(hidden=96, heads=6, kv=6, head_dim=16, inter=96, vocab=vocab), Topology(tp=tp))


def test_embedding_over_attn_tp_lm_head_over_tp():
    ckpt = fake_checkpoint(vocab=1024, arch="Qwen3ForCausalLM")
    plan = make_plan(ckpt, Topology(tp=8, attn_dp=2))
    groups = {s.name: (s.group, s.group_size) for s in plan.shards}
    assert groups["model.embed_tokens.weight"] == ("attn_tp", 4)
    assert groups["lm_head.weight"] == ("tp", 8)
    dp_head = make_plan(ckpt, Topology(tp=8, attn_dp=2), Options(dp_lm_head=True))
    assert {s.group for s in dp_head.shards if s.name == "lm_head.weight"} == {"attn_tp"}


def test_non_divisible_intermediate_is_padded_or_refused():
    """11008 over tp 6: ceil = 1835 per rank, the last rank 1833 real rows + 2 zero rows (the seed's pad_or_narrow)."""
    ckpt = fake_checkpoint(hidden=768, heads=12, kv=6, head_dim=64, inter=11008, vocab=768)
    plan = make_plan(ckpt, Topology(tp=6))
    assert rows(plan, "model.layers.0.mlp.up_proj.weight")[5] == (5 * 1835, 1833, 2)
    down = [s for s in plan.shards if s.name.endswith("down_proj.weight")]
    assert {s.shape for s in down} == {(768, 1835)} and down[-1].pad == 2
    assert any("zero-padded" in w for w in plan.warnings)
    with pytest.raises(PlanError, match="dim 0 of size 11008 does not divide .* --pad"):
        make_plan(ckpt, Topology(tp=6), Options(pad=False))


@pytest.mark.parametrize(
    "kwargs, tp, message",
    [
        (dict(heads=12, kv=4), 8, "12 attention heads do not divide"),
        (dict(heads=24, kv=6), 4, "6 kv heads and the tp group of 4 ranks"),
        (dict(arch="GPT2LMHeadModel"), 2, "architecture GPT2LMHeadModel is not supported"),
        (dict(extra={"model.layers.0.mlp.mystery.weight": (4, 4)}), 2, "no LlamaForCausalLM rule covers model.layers.0.mlp.mystery.weight"),
        (dict(extra={"model.layers.0.self_attn.k_proj.weight": (512, 4095)}), 2, r"shape \[512, 4095\] on disk, but config.json implies \[1024, 4096\]"),
    ],
)
def test_refusals_name_the_numbers(kwargs, tp, message):
    with pytest.raises(PlanError, match=message):
        make_plan(fake_checkpoint(**kwargs), Topology(tp=tp))


def test_identical_tensors_are_planned_once_and_grouped_by_holders():
    plan = make_plan(fake_checkpoint(kv=2, arch="Qwen3ForCausalLM"), Topology(tp=8, attn_dp=2))
    norm = [s for s in plan.shards if s.name == "model.norm.weight"]
    assert len(norm) == 1 and norm[0].ranks == tuple(range(8)) and norm[0].file == "model-common.safetensors"
    # attn_tp 4 over 2 kv heads: one kv head per 2 attn ranks, shared by both DP replicas
    k = [s for s in plan.shards if s.name.endswith("k_proj.weight")]
    assert [s.ranks for s in k] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    files = {f.name: f.ranks for f in plan.files}
    assert files["model-attn_tp-x2-000-of-002.safetensors"] == (0, 1, 4, 5)
    for f in plan.files:  # each file holds exactly the tensors whose holders are its ranks
        assert all(s.ranks == f.ranks for s in plan.shards if s.file == f.name)


def test_files_split_into_parts_by_size():
    plan = make_plan(fake_checkpoint(layers=2, vocab=1024), Topology(tp=2), Options(max_file_bytes=100 << 20))
    parts = [f for f in plan.files if f.name.startswith("model-tp-000")]
    assert len(parts) > 1 and all("-part-" in f.name for f in parts)
    assert all(f.size <= (100 << 20) + 4096 or len(f.tensors) == 1 for f in parts)
