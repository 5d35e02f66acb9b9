"""Architecture tables, one module per model family; `arch_for` finds one by its HF name.

Adding an architecture is adding an `Arch` (rules from tpshard.arch.base fragments, the groups its
engine class uses) to its family's module, or a new module listed here.
"""

from __future__ import annotations

from tpshard.arch import deepseek, llama, mixtral, qwen
from tpshard.arch.base import DROPPED, SHAPES, Arch, Matcher, Rule
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

ARCHITECTURES: dict[str, Arch] = {a.name: a for family in (llama, qwen, mixtral, deepseek) for a in family.ARCHS}


def arch_for(model: ModelInfo) -> Arch:
    arch = ARCHITECTURES.get(model.architecture)
    if arch is None:
        raise PlanError(
            f"architecture {model.architecture} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            " (docs/architectures.md says how to add one)"
        )
    return arch


__all__ = ["ARCHITECTURES", "DROPPED", "SHAPES", "Arch", "Matcher", "Rule", "arch_for"]
