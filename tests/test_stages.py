"""Stage partitions against the worked examples of docs/pipeline.md."""

import pytest

from tpshard.errors import TopologyError
from tpshard.stages import default_partition, parse_partition, partition_value, stage_of_layer, stage_ranges


@pytest.mark.parametrize(
    "layers, pp, sglang, vllm",
    [
        (80, 3, (26, 27, 27), (27, 27, 26)),
        (61, 2, (30, 31), (31, 30)),
        (61, 4, (15, 15, 15, 16), (15, 15, 16, 15)),
        (7, 4, (1, 2, 2, 2), (2, 2, 2, 1)),
        (28, 2, (14, 14), (14, 14)),
        (5, 1, (5,), (5,)),
    ],
)
def test_default_partitions_of_both_engines(layers, pp, sglang, vllm):
    assert default_partition(layers, pp, "sglang") == sglang
    assert default_partition(layers, pp, "vllm") == vllm


def test_stage_ranges_keep_global_layer_indices():
    counts = default_partition(80, 3, "sglang")
    assert stage_ranges(counts) == ((0, 26), (26, 53), (53, 80))
    assert [stage_of_layer(counts, layer) for layer in (0, 25, 26, 52, 53, 79)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(TopologyError, match="layer 80"):
        stage_of_layer(counts, 80)


def test_explicit_partition_is_checked_like_the_engines_check_it():
    assert parse_partition("26,27,27", 80, 3) == (26, 27, 27)
    assert partition_value((26, 27, 27)) == "26,27,27"
    for text, pp, match in [("26,27", 3, "names 2 stages"), ("26,27,28", 3, "adds up to 81"),
                            ("a,b,c", 3, "layer counts"), ("0,40,40", 3, "at least one layer")]:  # fmt: skip
        with pytest.raises(TopologyError, match=match):
            parse_partition(text, 80, pp)


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(TopologyError, match="cannot fill"):
        default_partition(3, 4, "sglang")
