"""Rank math against the tables in LOAD_CONTRACT.md §1.2 and §1.5 (SGLang dp_attention.py)."""

import pytest

from tpshard.errors import TopologyError
from tpshard.topology import Topology


def test_rank_order_dp_cp_tp_with_tp_fastest():
    t = Topology(tp=8, attn_dp=2, attn_cp=2)
    assert t.attn_tp == 2
    assert [t.attn_dp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [t.attn_cp_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [t.attn_tp_rank(r) for r in range(8)] == [0, 1, 0, 1, 0, 1, 0, 1]


@pytest.mark.parametrize(
    "group, factor, expected",
    [("tp", 2, (3, 4)), ("tp", 4, (1, 2)), ("attn_tp", 2, (1, 2)), ("attn_tp", 4, (0, 1)), ("replicated", 1, (0, 1))],
)
def test_replicated_subgroups_of_world_rank_7(group, factor, expected):
    t = Topology(tp=8, attn_dp=2)
    assert (t.group_rank(group, 7, factor), t.group_size(group, factor)) == expected


def test_attention_dp_replicas_share_ranks():
    t = Topology(tp=8, attn_dp=2)
    assert t.ranks_of("attn_tp", 1) == (1, 5)
    assert t.ranks_of("attn_tp", 0, factor=2) == (0, 1, 4, 5)
    assert t.ranks_of("tp", 6) == (6,)
    assert t.ranks_of("replicated", 0) == tuple(range(8))


@pytest.mark.parametrize("kwargs", [dict(tp=6, attn_dp=4), dict(tp=8, attn_dp=3), dict(tp=0), dict(tp=4, attn_cp=-1)])
def test_sizes_that_do_not_divide_are_refused(kwargs):
    with pytest.raises(TopologyError):
        Topology(**kwargs)


def test_factor_must_divide_the_group():
    with pytest.raises(TopologyError, match="factor 3"):
        Topology(tp=8).group_rank("tp", 0, factor=3)
