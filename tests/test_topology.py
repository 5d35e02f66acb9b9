"""Rank math against the tables of docs/contracts.md §1 (SGLang layers/dp_attention.py)."""

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


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=8, attn_dp=3), "tp=8 is not divisible by attn_dp=3 x attn_cp=1 = 3; attention needs tp = attn_dp * attn_cp * attn_tp"),
        (dict(tp=0), "tp must be an integer from 1 to 65536, got 0"),
        (dict(tp=4, attn_cp=True), "attn_cp must be an integer from 1 to 65536, got True"),
        (dict(tp=8, ep=3), "ep=3 does not divide tp=8; experts need tp = ep * moe_tp (SGLang: parallel topology is inconsistent)"),
        (dict(tp=8, moe_dense_tp=2), "moe_dense_tp=2: SGLang accepts only 1 (dense MLPs whole on every rank) or the tp size 8"),
        (dict(tp=2, pp_layers=(3, 0)), "pp_layers=(3, 0): give 1 to 65536 stages of 1 to 65536 decoder layers each"),
        (dict(tp=2, pp_layers=(3, 4), engine="trt"), "engine='trt': choose sglang or vllm"),
        (dict(tp=40000, pp_layers=(1, 1)), "len(pp_layers)=2 x tp=40000 = 80000 ranks; at most 65536"),
    ],
)  # fmt: skip
def test_python_refusals_name_the_fields(kwargs, message):
    """Built from Python, a Topology is refused in the arguments the caller wrote, not in CLI flags."""
    with pytest.raises(TopologyError) as e:
        Topology(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "8", "--attn-dp", "3"], "--tp 8 is not divisible by --attn-dp 3 x --attn-cp 1 = 3; attention needs tp = attn_dp * attn_cp * attn_tp"),
        (["--tp", "0"], "--tp must be an integer from 1 to 65536, got 0"),
    ],
)  # fmt: skip
def test_cli_refusals_keep_naming_the_flags(llama, flags, message):
    """The CLI builds the same Topology from its options; its message names the flags, as it always has."""
    import subprocess
    import sys

    p = subprocess.run([sys.executable, "-m", "tpshard", "plan", str(llama), *flags], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (2, f"error: {message}\n")

