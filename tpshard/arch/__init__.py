"""Architecture tables, one module per model family; `arch_for` finds one by its HF name.

Each family's module declares its `Arch`s: everything tpshard knows about an engine model class
(slicing rules, the tensors of a complete checkpoint, the engines' export names, what `verify
--model` runs, the router). Adding a family is adding its module here (docs/architectures.md).
"""

from __future__ import annotations

from tpshard.arch import deepseek, deepseek_v4, glm, gpt_oss, llama, llama4, minimax, mixtral, qwen, qwen_next
from tpshard.arch.base import DROPPED, ENGINES, HEAD_COUNTS, PARTITIONS, SEGMENTS, SHAPES, Arch, Matcher, Rule
from tpshard.arch.router import RouterConfig
from tpshard.arch.tensors import config_value
from tpshard.errors import PlanError
from tpshard.manifest import ModelInfo

# The families in the order messages list their architectures (verify --model's supported list:
# the dense decoder's, then the MoE / MLA decoder's).
FAMILIES = (llama, deepseek, qwen, mixtral, glm, minimax, gpt_oss, qwen_next, deepseek_v4, llama4)

ARCHITECTURES: dict[str, Arch] = {a.name: a for family in FAMILIES for a in family.ARCHS}


def refuse_architecture(name: str) -> None:
    """A one-line refusal of an architecture no family declares, or one a family refuses (its REFUSED)."""
    why = next((f.REFUSED[name] for f in FAMILIES if name in getattr(f, "REFUSED", {})), None)
    if why:
        raise PlanError(f"{name}: {why}")
    if name not in ARCHITECTURES:
        raise PlanError(
            f"architecture {name} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
            " (docs/architectures.md says how to add one)"
        )


def arch_for(model: ModelInfo) -> Arch:
    refuse_architecture(model.architecture)
    return ARCHITECTURES[model.architecture]


def router_config(config: dict) -> RouterConfig:
    """The RouterConfig of a Hugging Face config.json, by its model_type (the family's `router`).

    Follows transformers 5's router classes: DeepseekV3TopkRouter, DeepseekV2TopkRouter,
    Qwen3MoeTopKRouter, Qwen2MoeTopKRouter, MixtralTopKRouter, Glm4MoeTopkRouter, MiniMaxM2TopKRouter,
    GptOssTopKRouter.
    """
    kind = config.get("model_type", "")
    k = config_value(config, "num_experts_per_tok")  # multimodal wrappers (Llama-4) nest them under text_config
    if k is None:
        raise ValueError(f"config of model_type {kind!r} names no num_experts_per_tok")
    # transformers 5 writes some of these under its own attribute names (Qwen3-MoE: num_local_experts)
    e = next((config_value(config, n) for n in ("n_routed_experts", "num_experts", "num_local_experts") if config_value(config, n)), None)
    if e is None:
        raise ValueError(f"config of model_type {kind!r} names no routed expert count")
    rule = next((a.router for a in ARCHITECTURES.values() if a.model_type == kind and a.router is not None), None)
    if rule is None:
        raise ValueError(f"no router rule for model_type {kind!r}")
    return rule(config, e, k)


__all__ = ["ARCHITECTURES", "DROPPED", "ENGINES", "HEAD_COUNTS", "PARTITIONS", "SEGMENTS", "SHAPES", "Arch", "Matcher", "RouterConfig", "Rule", "arch_for", "refuse_architecture", "router_config"]
