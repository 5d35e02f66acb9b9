"""Parity of tpshard.runtime's tensor-parallel layers against the unsharded torch reference.

Each spawned gloo rank builds the full float64 weights from a shared seed, cuts its own shards
here in the test with plain `chunk` (never with tpshard code), loads them into the layers and
compares the TP forward with the same computation on the full weights. The cases cover GQA kv
replicas (group size > kv heads), attn_tp groups under attn_dp=2 (each DP replica with its own
input), a row-parallel bias, an intermediate size the group does not divide (zero padding), and a
vocab that is not a multiple of 64. The same runs load deliberately wrong shards (kv heads from
another rank, a row shard from another rank, a bias added on every rank, a reduction over the
wrong group) and the tests assert that the comparison catches each one.

Spawning costs one torch import per rank, so every check for one world size runs in one spawn.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpshard.runtime import (
    ColumnParallelLinear,
    DistInfo,
    LogicalGroup,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RankFailed,
    RowParallelLinear,
    VocabParallelEmbedding,
    bind_groups,
    collective_members,
    run_local,
)
from tpshard.topology import Topology

# Small sizes with the awkward properties on purpose: 2 kv heads (replicated at group size 4 and
# 8), an intermediate of 20 (not divisible by 8), a column of 30 (not by 4 or 8), a vocab of 100.
HIDDEN, HEAD_DIM, N_HEADS, N_KV, INTER, COL_OUT, VOCAB, TOKENS = 32, 8, 8, 2, 20, 30, 100, 12
EXACT = 1e-10  # float64 partial sums in another order differ by ~1e-15
WRONG = 1e-3  # a wrong shard moves outputs by O(1)
DT = torch.float64


# ---------------------------------------------------------------- reference and test-side shards


def full_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=DT) / shape[-1] ** 0.5

    return {
        "wq": rnd(N_HEADS * HEAD_DIM, HIDDEN), "wk": rnd(N_KV * HEAD_DIM, HIDDEN), "wv": rnd(N_KV * HEAD_DIM, HIDDEN),
        "bq": rnd(N_HEADS * HEAD_DIM), "bk": rnd(N_KV * HEAD_DIM), "bv": rnd(N_KV * HEAD_DIM),
        "wo": rnd(HIDDEN, N_HEADS * HEAD_DIM), "bo": rnd(HIDDEN),
        "gate": rnd(INTER, HIDDEN), "up": rnd(INTER, HIDDEN), "down": rnd(HIDDEN, INTER), "b_down": rnd(HIDDEN),
        "col": rnd(COL_OUT, HIDDEN), "b_col": rnd(COL_OUT),
        "embed": rnd(VOCAB, HIDDEN), "lm_head": rnd(VOCAB, HIDDEN),
    }  # fmt: skip


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(TOKENS, HIDDEN, generator=g, dtype=DT)
    ids = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    ids[0], ids[1] = 0, VOCAB - 1  # both ends of the vocab, so the last real row is looked up
    return x, ids


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Non-causal GQA attention: q [T, hq*hd], k/v [T, hkv*hd] -> [T, hq*hd]."""
    t = q.shape[0]
    q = q.view(t, -1, HEAD_DIM).transpose(0, 1)  # [hq, T, hd]
    k = k.view(t, -1, HEAD_DIM).transpose(0, 1)  # [hkv, T, hd]
    v = v.view(t, -1, HEAD_DIM).transpose(0, 1)
    rep = q.shape[0] // k.shape[0]  # query heads per kv head
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)  # [hq, T, hd]
    out = torch.softmax(q @ k.transpose(1, 2) / HEAD_DIM**0.5, dim=-1) @ v  # [hq, T, hd]
    return out.transpose(0, 1).reshape(t, -1)  # [T, hq*hd]


def ref_attention(w: dict, x: torch.Tensor) -> torch.Tensor:
    q, k, v = F.linear(x, w["wq"], w["bq"]), F.linear(x, w["wk"], w["bk"]), F.linear(x, w["wv"], w["bv"])
    return F.linear(attention(q, k, v), w["wo"], w["bo"])


def ref_mlp(w: dict, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"], w["b_down"])


def shard(t: torch.Tensor, dim: int, size: int, rank: int, multiple: int = 1) -> torch.Tensor:
    """rank's chunk of `t` along `dim`, after zero-padding that dim to a multiple of size*multiple."""
    n = t.shape[dim]
    step = size * multiple
    padded = -(-n // step) * step
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, padded - n]
    return F.pad(t, pad).chunk(size, dim)[rank]


def kv_shard(t: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """kv rows of group rank `rank`: the kv heads split into min(N_KV, size) pieces, piece rank // R."""
    replicas = max(size // N_KV, 1)
    return t.chunk(min(N_KV, size), 0)[rank // replicas]


# ---------------------------------------------------------------- the spawned side


class BiasOnEveryRank(RowParallelLinear):
    """The reduction bug check 5 is about: every rank adds the bias before the all-reduce."""

    def local_bias(self) -> torch.Tensor | None:
        return self.bias


def build_attention(w, g: LogicalGroup, *, kv_from: int | None = None, row_cls=RowParallelLinear, reduce_results=True):
    """QKV + o_proj over `g`, loaded with test-side shards; kv_from loads another group rank's kv."""
    qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, N_HEADS, N_KV, group=g, bias=True, dtype=DT, name="qkv_proj")
    kv_rank = g.rank if kv_from is None else kv_from
    for sid, wname, bname in (("q", "wq", "bq"), ("k", "wk", "bk"), ("v", "wv", "bv")):
        pick = (lambda t: shard(t, 0, g.size, g.rank)) if sid == "q" else (lambda t: kv_shard(t, g.size, kv_rank))
        qkv.load_shard(sid, pick(w[wname]))
        qkv.load_shard(sid, pick(w[bname]), param="bias")
    o = row_cls(N_HEADS * HEAD_DIM, HIDDEN, group=g, bias=True, reduce_results=reduce_results, dtype=DT, name="o_proj")
    o.load_shard(None, shard(w["wo"], 1, g.size, g.rank))
    o.load_shard(None, w["bo"], param="bias")
    assert not qkv.missing_shards() and not o.missing_shards()
    return qkv, o


def tp_attention(qkv: QKVParallelLinear, o: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.split(qkv(x))  # this rank's heads: [T, nh*hd], [T, nkv*hd], [T, nkv*hd]
    return o(attention(q, k, v))


def build_mlp(w, g: LogicalGroup, *, down_from: int | None = None):
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], group=g, pad=True, dtype=DT, name="gate_up_proj")
    gate_up.load_shard("gate", shard(w["gate"], 0, g.size, g.rank))
    gate_up.load_shard(1, shard(w["up"], 0, g.size, g.rank))  # by index too, as the engines do
    down = RowParallelLinear(INTER, HIDDEN, group=g, bias=True, pad=True, dtype=DT, name="down_proj")
    down.load_shard(None, shard(w["down"], 1, g.size, g.rank if down_from is None else down_from))
    down.load_shard(None, w["b_down"], param="bias")
    return gate_up, down


def tp_mlp(gate_up: MergedColumnParallelLinear, down: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.split(gate_up(x))  # [T, ceil(I/size)] each, zero beyond the real I
    return down(F.silu(gate) * up)


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def check_topology(t: Topology, rank: int) -> dict[str, float]:
    """Max abs error of every case on this rank; names starting 'wrong/' must be large."""
    w = full_weights()
    tp = LogicalGroup.of(t, "tp", rank)
    at = LogicalGroup.of(t, "attn_tp", rank)
    x, _ = tokens(0)  # shared by all ranks: the MLP and lm_head run over tp
    x_dp, ids_dp = tokens(1 + t.attn_dp_rank(rank))  # each DP replica attends to its own tokens
    out: dict[str, float] = {}

    with torch.no_grad():
        qkv, o = build_attention(w, at)
        q, k, v = qkv.split(qkv(x_dp))
        out["qkv/k_rows"] = err(k, F.linear(x_dp, kv_shard(w["wk"], at.size, at.rank), kv_shard(w["bk"], at.size, at.rank)))
        out["attention"] = err(tp_attention(qkv, o, x_dp), ref_attention(w, x_dp))

        gate_up, down = build_mlp(w, tp)
        out["mlp_padded"] = err(tp_mlp(gate_up, down, x), ref_mlp(w, x))

        col = ColumnParallelLinear(HIDDEN, COL_OUT, group=tp, bias=True, gather_output=True, pad=True, dtype=DT)
        col.load_shard(None, shard(w["col"], 0, tp.size, tp.rank))
        col.load_shard(None, shard(w["b_col"], 0, tp.size, tp.rank), param="bias")
        out["column_gather_padded"] = err(col(x), F.linear(x, w["col"], w["b_col"]))

        # Row with the full input, split inside the layer, and the reduction left to the caller.
        row = RowParallelLinear(INTER, HIDDEN, group=tp, bias=True, input_is_parallel=False, reduce_results=False, pad=True, dtype=DT)
        row.load_shard(None, shard(w["down"], 1, tp.size, tp.rank))
        row.load_shard(None, w["b_down"], param="bias")
        h = torch.randn(TOKENS, INTER, generator=torch.Generator().manual_seed(7), dtype=DT)
        out["row_caller_reduces"] = err(tp.all_reduce(row(h)), F.linear(h, w["down"], w["b_down"]))

        emb = VocabParallelEmbedding(VOCAB, HIDDEN, group=at, dtype=DT, name="embed_tokens")
        emb.load_shard(None, shard(w["embed"], 0, at.size, at.rank, multiple=64 // at.size))
        out["embedding"] = err(emb(ids_dp), w["embed"][ids_dp])

        head = ParallelLMHead(VOCAB, HIDDEN, group=tp, dtype=DT, name="lm_head")
        head.load_shard(None, shard(w["lm_head"], 0, tp.size, tp.rank, multiple=64 // tp.size))
        logits = head(x)
        assert logits.shape == (TOKENS, VOCAB), logits.shape
        out["lm_head"] = err(logits, F.linear(x, w["lm_head"]))

        # Deliberately wrong outputs; each must move the result far beyond EXACT.
        pieces = min(N_KV, at.size)
        replicas = max(at.size // N_KV, 1)
        other_kv = ((at.rank // replicas + 1) % pieces) * replicas  # a group rank holding the other kv head
        out["wrong/kv_heads_swapped"] = err(tp_attention(*build_attention(w, at, kv_from=other_kv), x_dp), ref_attention(w, x_dp))
        out["wrong/bias_on_every_rank"] = err(
            tp_attention(*build_attention(w, at, row_cls=BiasOnEveryRank), x_dp), ref_attention(w, x_dp)
        )
        out["wrong/row_shard_of_next_rank"] = err(
            tp_mlp(*build_mlp(w, tp, down_from=(tp.rank + 1) % tp.size), x), ref_mlp(w, x)
        )
        if t.attn_dp > 1:
            # o_proj partial sums reduced over tp instead of attn_tp: DP replicas' tokens mix.
            qkv, o = build_attention(w, at, reduce_results=False)
            q, k, v = qkv.split(qkv(x_dp))
            out["wrong/reduced_over_tp_not_attn_tp"] = err(tp.all_reduce(o(attention(q, k, v))), ref_attention(w, x_dp))
    return out


def check_world(info: DistInfo, topologies: list[Topology]) -> dict[str, float]:
    results = {}
    for t in topologies:
        bind_groups(t)  # same order on every rank: collective
        for name, value in check_topology(t, info.rank).items():
            results[f"{t.describe()}: {name}"] = value
    return results


def raise_on_rank_one(info: DistInfo) -> int:
    if info.rank == 1:
        raise ValueError("deliberate failure on rank 1")
    return info.rank * 10


# ---------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def world4() -> list[dict[str, float]]:
    return [r.value for r in run_local(check_world, 4, [Topology(tp=4)], backend="gloo", timeout_s=120)]


@pytest.fixture(scope="module")
def world8() -> list[dict[str, float]]:
    topologies = [Topology(tp=8), Topology(tp=8, attn_dp=2)]
    return [r.value for r in run_local(check_world, 8, topologies, backend="gloo", timeout_s=120)]


def _split(results: list[dict[str, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Worst error over ranks of each case, split into (must match, must mismatch)."""
    worst: dict[str, float] = {}
    for per_rank in results:
        for name, value in per_rank.items():
            worst[name] = max(worst.get(name, 0.0), value)
    good = {n: v for n, v in worst.items() if "wrong/" not in n}
    bad = {n: v for n, v in worst.items() if "wrong/" in n}
    return good, bad


def test_parity_tp4(world4):
    """tp=4 (2 kv heads: one per 2 ranks; intermediate 20 -> 5 per rank; vocab 100 -> 128, 32 per rank)."""
    good, _ = _split(world4)
    assert len(good) == 7
    assert {n: v for n, v in good.items() if v > EXACT} == {}


def test_parity_tp8_and_attn_dp2(world8):
    """tp=8 (kv replicas 4, intermediate padded 20 -> 24) and tp=8 attn_dp=2 (attn_tp=4 per DP replica)."""
    good, _ = _split(world8)
    assert any("attn_dp=2" in n for n in good) and len(good) == 14
    assert {n: v for n, v in good.items() if v > EXACT} == {}


def test_wrong_shards_are_detected(world4, world8):
    """Every deliberately broken case must differ from the reference by far more than EXACT."""
    _, bad4 = _split(world4)
    _, bad8 = _split(world8)
    assert len(bad4) == 3 and len(bad8) == 7
    assert {n: v for n, v in {**bad4, **bad8}.items() if v < WRONG} == {}


def test_wrong_shards_look_wrong_on_every_rank_that_holds_them(world8):
    """Bias-on-every-rank and kv swaps show on every rank (all ranks hold the reduced output)."""
    for per_rank in world8:
        for name in ("tp=8 attn_dp=1 attn_cp=1 (attn_tp=8): wrong/bias_on_every_rank",
                     "tp=8 attn_dp=2 attn_cp=1 (attn_tp=4): wrong/kv_heads_swapped"):  # fmt: skip
            assert per_rank[name] > WRONG, (name, per_rank[name])


def test_run_local_reports_the_failing_rank():
    with pytest.raises(RankFailed, match="deliberate failure on rank 1") as info:
        run_local(raise_on_rank_one, 2, backend="gloo", timeout_s=60)
    assert [r.ok for r in info.value.results] == [True, False]
    assert info.value.results[0].value == 0


# ---------------------------------------------------------------- in-process (no collectives)


def test_logical_groups_match_the_contract_table():
    """docs/contracts.md §1: tp=8, attn_dp=2, world rank 7; and the collective members of each group."""
    t = Topology(tp=8, attn_dp=2)
    cases = {("tp", 2): (3, 4), ("tp", 4): (1, 2), ("attn_tp", 2): (1, 2), ("attn_tp", 4): (0, 1), ("replicated", 1): (0, 1)}
    for (name, k), (rank, size) in cases.items():
        g = LogicalGroup.of(t, name, 7, k)
        assert (g.rank, g.size) == (rank, size), (name, k)
        assert len(g.members) == size and 7 in g.members
    assert collective_members(t, "tp", 5) == tuple(range(8))
    assert collective_members(t, "attn_tp", 5) == (4, 5, 6, 7)  # same attn_dp rank only
    assert collective_members(t, "tp", 7, 2) == (1, 3, 5, 7)  # one rank per replica pair
    assert collective_members(t, "replicated", 6) == (6,)


def test_qkv_head_math():
    """docs/contracts.md §2 worked examples (Llama-3-8B 32/8 heads at tp 4, 8, 16; Qwen3 32/4 at attn_tp 4)."""
    for tp, attn_dp, h_kv, rank, want in [
        (4, 1, 8, 3, (8, 2, 1, 3)),
        (8, 1, 8, 5, (4, 1, 1, 5)),
        (16, 1, 8, 5, (2, 1, 2, 2)),
        (8, 2, 4, 6, (8, 1, 1, 2)),
    ]:
        g = LogicalGroup.of(Topology(tp=tp, attn_dp=attn_dp), "attn_tp", rank)
        layer = QKVParallelLinear(64, 2, 32, h_kv, group=g, dtype=DT)
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas, layer.kv_shard_rank) == want
        info = layer.shard_info("k")
        assert (info.factor, info.group_rank, info.shape) == (want[2], want[3], (want[1] * 2, 64))


def test_load_asserts_exact_shapes_and_never_slices():
    g = LogicalGroup.of(Topology(tp=4), "tp", 1)
    gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], group=g, pad=True, dtype=DT, name="mlp.gate_up_proj")
    with pytest.raises(ValueError, match=r"mlp.gate_up_proj.weight\[gate\]: presharded tensor has shape \(20, 32\).*expects \(5, 32\)"):
        gate_up.load_shard("gate", torch.zeros(INTER, HIDDEN, dtype=DT))  # the full tensor is refused
    with pytest.raises(ValueError, match="cannot be loaded"):
        gate_up.load_shard("up", torch.zeros(5, HIDDEN, dtype=torch.float32).to(torch.int32))
    with pytest.raises(KeyError, match="unknown shard id 'down'"):
        gate_up.load_shard("down", torch.zeros(5, HIDDEN, dtype=DT))
    assert gate_up.missing_shards() == ["weight[gate]", "weight[up]"]
    gate_up.load_shard("up", torch.ones(5, HIDDEN, dtype=torch.float32))  # a lossless upcast is allowed
    assert gate_up.missing_shards() == ["weight[gate]"]
    assert gate_up.weight[:5].abs().sum() == 0 and gate_up.weight[5:].sum() == 5 * HIDDEN


def test_divisibility_errors_name_the_numbers():
    g = LogicalGroup.of(Topology(tp=6), "tp", 0)
    with pytest.raises(ValueError, match="20 is not divisible by the group size 6; pass pad=True to give each rank 4"):
        RowParallelLinear(INTER, HIDDEN, group=g)
    with pytest.raises(ValueError, match="query heads over a group of 6: 8 is not divisible by 6"):
        QKVParallelLinear(HIDDEN, HEAD_DIM, N_HEADS, N_KV, group=g)
    with pytest.raises(ValueError, match="vocab 100 padded .* 128 is not divisible by 6"):
        VocabParallelEmbedding(VOCAB, HIDDEN, group=g)


def test_single_rank_layers_need_no_process_group():
    """Size-1 groups never call a collective: the layers run without torch.distributed."""
    w = full_weights()
    x, ids = tokens(0)
    g = LogicalGroup.single()
    qkv, o = build_attention(w, g)
    assert err(tp_attention(qkv, o, x), ref_attention(w, x)) < EXACT
    head = ParallelLMHead(VOCAB, HIDDEN, group=g, dtype=DT)
    emb = VocabParallelEmbedding(VOCAB, HIDDEN, group=g, dtype=DT)
    emb.load_shard(None, F.pad(w["embed"], (0, 0, 0, 28)))  # 100 rows + 28 zero rows
    head.tie_weights(emb)
    assert head.missing_shards() == []
    assert err(emb(ids), w["embed"][ids]) == 0
    assert err(head(x), F.linear(x, w["embed"])) < EXACT


def test_unbound_group_says_how_to_bind():
    g = LogicalGroup.of(Topology(tp=2), "tp", 0)
    with pytest.raises(RuntimeError, match="not bound to a process group; call tpshard.runtime.bind_groups"):
        g.all_reduce(torch.zeros(1))
