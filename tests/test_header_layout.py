"""Issue 12: a plan sizes its output files without building their headers. header_layout's count is
compared with len(build_header(...)) on crafted inputs."""

from __future__ import annotations

import pytest

from tpshard.safetensors_format import ALIGN, DTYPE_SIZE, build_header, header_layout

# (name, dtype, shape) lists: every dtype, 0-d and zero-size shapes, offsets that cross powers of
# ten (a digit more in `data_offsets`), names JSON escapes, repeated names.
CASES = {
    "empty": [],
    "every dtype": [(f"t.{d}", d, (3, 5)) for d in DTYPE_SIZE],
    "0-d and zero dims": [("scalar", "F32", ()), ("none", "BF16", (0,)), ("inner zero", "I8", (3, 0, 2)), ("after", "U8", (1,))],
    "powers of ten": [(f"p{i}", "U8", (n,)) for i, n in enumerate((9, 1, 89, 1, 899, 1, 8999, 1, 10**10, 7))],
    "ends at a power of ten": [("a", "U8", (10,)), ("b", "U8", (90,)), ("c", "U8", (900,))],
    "one kind, many tensors": [(f"model.layers.{i}.mlp.down_proj.weight", "BF16", (32, 8)) for i in range(2000)],
    "quote": [('say "hi"', "F16", (2,)), ("plain", "F16", (2,))],
    "backslash": [("a\\b", "F16", (2,))],
    "control": [("tab\there", "F16", (2,)), ("nl\n", "F16", (2,))],
    "non-ASCII": [("poids.é", "F16", (2,)), ("重み", "BF16", (4, 4))],
    "astral": [("emoji \U0001f600", "F32", (1,))],
    "repeated name": [("w", "F16", (2,)), ("w", "F32", (3,))],
    "named __metadata__": [("__metadata__", "F16", (2,)), ("x", "F16", (2,))],
}


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"k": 'é"'}])
@pytest.mark.parametrize("case", CASES)
def test_header_layout_is_the_length_of_the_built_header(case, metadata):
    """The counted size and offsets are build_header's, for plain names (counted) and the others."""
    head, offsets = build_header(CASES[case], metadata)
    assert header_layout(CASES[case], metadata) == (len(head), offsets)


def test_every_padding_of_the_header():
    """Names one character longer each time: the header's padding to 8 bytes takes every value."""
    paddings = set()
    for n in range(1, 3 * ALIGN):
        tensors = [("x" * n, "F32", (2, 3)), ("y", "I64", ())]
        head, offsets = build_header(tensors, {"format": "pt"})
        paddings.add(len(head) - len(head.rstrip(b" ")))
        assert header_layout(tensors, {"format": "pt"}) == (len(head), offsets)
    assert paddings == set(range(ALIGN))
