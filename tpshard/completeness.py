"""Refuse a checkpoint that lacks a tensor its architecture and config.json imply.

A split of a checkpoint that lacks a layer's weight would write an output that `check` proves
"bit-exact" to an incomplete source, and the engine would then load random or missing weights. So
every architecture declares what its config implies (`Arch.expected`, composed from
tpshard.arch.tensors: layer count, norms, biases the config asks for, lm_head when untied, every
routed expert of every sparse layer) and `check_complete` refuses a checkpoint that lacks any of it
(tpshard.plan's rules refuse layers past `num_hidden_layers`).

A quantized linear counts as present when any of its tensors is (its full set of tensors is the
quantized format's business: tpshard.plan refuses a partial one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tpshard.arch import ARCHITECTURES
from tpshard.errors import CheckpointError
from tpshard.manifest import ModelInfo


def check_complete(model: ModelInfo, config: dict, names: Iterable[str], quantized: Callable[[str], bool]) -> None:
    """Refuse a checkpoint missing a tensor its architecture and config imply (layers past
    num_hidden_layers are refused by tpshard.plan's rules). `quantized(module)` says whether the
    quantization config quantizes a module."""
    names = set(names)
    arch = ARCHITECTURES.get(model.architecture)
    if arch is None:
        return  # not an architecture tpshard knows: tpshard.arch.arch_for refuses it
    modules = {n.rpartition(".")[0] for n in names}
    missing = []
    for name in arch.expected(model, config):
        if name in names:
            continue
        module, _, param = name.rpartition(".")
        if param == "weight" and module in modules and quantized(module):
            continue  # stored as qweight/scales/...: the quantized format checks its own set
        missing.append(name)
    if missing:
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise CheckpointError(
            f"the checkpoint lacks {', '.join(missing[:6])}{more}, which {model.architecture} with this"
            " config.json needs (incomplete download? a config from another model?)"
        )
