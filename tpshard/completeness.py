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

import re
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
    fused = _fused_alternatives(arch, names)
    missing = []
    for name in arch.expected(model, config):
        if name in names:
            continue
        found = _EXPERT.fullmatch(name)
        if found is not None and (found.group(1), found.group(2)) in fused:
            continue  # this layer's experts stored fused, the fused tensor present
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


_EXPERT = re.compile(r"(.+\.experts)\.\d+\.(\w+)\.weight")  # one expert's projection, as Arch.expected names it


def _fused_alternatives(arch, names: set[str]) -> set[tuple[str, str]]:
    """(experts module, per-expert projection) that a fused tensor in the checkpoint stands for, where
    the engine reads either form (FusedExperts.per_expert: Qwen3.5's gate_up_proj for gate_proj and
    up_proj, down_proj for down_proj)."""
    per = dict(arch.fused_experts.per_expert) if arch.fused_experts is not None else {}
    out: set[tuple[str, str]] = set()
    for n in names:
        module, _, param = n.rpartition(".")
        if param in per and module.endswith(".experts"):
            out.update((module, p) for p in per[param])
    return out
