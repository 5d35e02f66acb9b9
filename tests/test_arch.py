"""Every architecture declares everything tpshard knows about it (docs/architectures.md): a family
that forgets a fact fails here, it does not silently skip the check the fact drives."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing

import pytest

import tpshard.arch
from tpshard.arch import ARCHITECTURES, ENGINES, FAMILIES, Arch, Matcher, arch_for, router_config
from tpshard.arch.base import EngineNames, EngineTable, VerifyKind
from tpshard.completeness import check_complete
from tpshard.errors import CheckpointError
from tpshard.manifest import ModelInfo

# The facts docs/architectures.md says a family module declares for every Arch, with no default.
DECLARED = {"name", "rules", "engine", "attn_group", "embed_group", "model_type", "expected", "exports", "verify", "router"}
ARCHS = sorted(ARCHITECTURES)


def model_of(arch: Arch, **kw) -> ModelInfo:
    """A small model of `arch`: two layers, 4 experts for a MoE family, DeepSeek's first layer dense."""
    moe = arch.sparse is not None
    fields = dict(
        architecture=arch.name, model_type=arch.model_type, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=128, vocab_size=256, tie_word_embeddings=False, num_experts=4 if moe else 0, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
        topk_method="noaux_tc", q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    )  # fmt: skip
    return ModelInfo(**(fields | kw))


def test_the_declared_fields_have_no_default():
    """Arch(...) without any of them is a TypeError at import of the family's module."""
    required = {f.name for f in dataclasses.fields(Arch) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    assert required == DECLARED
    with pytest.raises(TypeError, match="missing"):
        Arch("XForCausalLM", (), "x.py", attn_group="tp", embed_group="tp")  # type: ignore[call-arg]


def test_every_family_module_is_listed():
    """A module under tpshard/arch/ with ARCHS that FAMILIES does not list would be unknown to arch_for."""
    families = []
    for info in pkgutil.iter_modules(tpshard.arch.__path__):
        module = importlib.import_module(f"tpshard.arch.{info.name}")
        if hasattr(module, "ARCHS"):
            families.append(module)
    assert set(families) == set(FAMILIES)
    names = [a.name for family in FAMILIES for a in family.ARCHS]
    assert len(names) == len(set(names)) == len(ARCHITECTURES), "an architecture declared twice"


@pytest.mark.parametrize("name", ARCHS)
def test_every_arch_declares_its_exports_verify_and_router(name):
    arch = ARCHITECTURES[name]
    assert isinstance(arch.exports, EngineNames) and EngineNames._fields == ENGINES
    for engine in ENGINES:
        table = getattr(arch.exports, engine)
        assert table is None or isinstance(table, EngineTable) or (isinstance(table, str) and "(models/" in table), (engine, table)  # a str says why, naming the engine file
    assert arch.verify in (*typing.get_args(VerifyKind), None)  # the decoders tpshard.verify has
    assert arch.model_type and isinstance(arch.model_type, str)
    # Routed experts and a router go together: the MoE decoder and layer-level verify route with it.
    # DeepSeek-V4's router (sqrtsoftplus scores, hash-routed layers) is not tpshard's RouterConfig: its
    # own decoder (tpshard.verify.v4_model) routes it, and its gate is held as plain whole tensors, never
    # a ReplicatedLinear `gate` that layer-level verify routes.
    routes = arch.verify not in (None, "deepseek_v4") or any(r.layer_class == "ReplicatedLinear" and r.layer.endswith(".gate") for r in arch.rules)
    assert (arch.router is not None) == (arch.sparse is not None and routes)


@pytest.mark.parametrize("name", ARCHS)
def test_every_arch_declares_a_complete_checkpoint_its_rules_know(name):
    """The names `expected` yields are strings the architecture's rules cut (a checkpoint holding
    exactly them would pass the rules), and a checkpoint lacking them is refused, never skipped."""
    arch = ARCHITECTURES[name]
    for q_lora in (16, None):
        model = model_of(arch, q_lora_rank=q_lora)
        expected = list(arch.expected(model, {}))
        assert expected and all(isinstance(n, str) for n in expected)
        assert len(expected) == len(set(expected)), "a tensor listed twice"
        matcher = Matcher(arch.table(model))
        classes = lambda names: {matcher.match(n.rpartition(".")[0])[0].layer_class for n in names}  # noqa: E731
        # the embedding and the untied lm_head (model.embed_tokens / lm_head; DeepSeek-V4's embed / head)
        assert {"VocabParallelEmbedding", "ParallelLMHead"} <= classes(expected)
        assert "ParallelLMHead" not in classes(arch.expected(model, {"tie_word_embeddings": True}))
        unknown = [n for n in expected if matcher.match(n.rpartition(".")[0]) is None]
        assert not unknown, unknown
        with pytest.raises(CheckpointError, match=f"which {name} with this config.json needs"):
            check_complete(model, {}, expected[1:], lambda module: False)
        check_complete(model, {}, expected, lambda module: False)


@pytest.mark.parametrize("name", [n for n in ARCHS if ARCHITECTURES[n].router is not None])
def test_router_config_finds_every_families_rule(name):
    arch = ARCHITECTURES[name]
    config = {"model_type": arch.model_type, "num_experts_per_tok": 2, "n_routed_experts": 8, "num_local_experts": 8, "num_experts": 8}
    assert router_config(config) == arch.router(config, 8, 2)


def test_the_export_tables_and_verify_support_are_the_archs():
    from tpshard.export.names import TABLES
    from tpshard.verify.model import supported

    for engine in ENGINES:
        tables = {n: getattr(a.exports, engine) for n, a in ARCHITECTURES.items()}
        assert TABLES[engine] == {n: t for n, t in tables.items() if t is not None and not isinstance(t, str)}  # a str: refused, saying why
    assert set(supported()) == {n for n, a in ARCHITECTURES.items() if a.verify is not None}
    assert arch_for(model_of(ARCHITECTURES["LlamaForCausalLM"])).name == "LlamaForCausalLM"
