"""--model across transformers releases and RoPE types: Llama 3.1/3.2/3.3's rope_type llama3.

Compared with what: transformers' own RoPE initialisation (ROPE_INIT_FUNCTIONS["llama3"]) for the
inverse frequencies, and AutoModelForCausalLM's logits for a Llama whose config carries llama3
scaling (in the layout of the installed transformers: rope_parameters from 5.0, rope_scaling before).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import make_checkpoint

import tpshard
from tpshard.topology import Topology
from tpshard.verify import verify
from tpshard.verify.decoder import rope_inv_freq
from tpshard.verify.model import rope_config, transformers_problem, unsupported_reason


def llama3_rope(original: int) -> dict:
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": original}  # fmt: skip
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {**rope, "rope_theta": 10000.0}}
    return {"rope_scaling": rope, "rope_theta": 10000.0}


@pytest.mark.parametrize("original", [8, 64, 8192])
def test_llama3_inverse_frequencies_match_transformers(original):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, num_key_value_heads=1, **llama3_rope(original))
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    got = rope_inv_freq(128, 10000.0, rope_config(config.to_dict()))
    assert torch.equal(got, want.to(torch.float32))
    assert not torch.equal(got, rope_inv_freq(128, 10000.0, {})), "the scaling must change something"


def test_llama3_rope_model_level_against_transformers(tmp_path):
    """Every frequency scaled or smoothed (original context 8 < 16 tokens): the logits must agree."""
    model = make_checkpoint(tmp_path / "model", "llama", **llama3_rope(8))
    out = tmp_path / "out"
    tpshard.split(model, out, Topology(tp=2))
    r = verify(out, model, model=True)
    assert r.ok, r.failures()
    assert r.model.top1 == 1.0 and r.model.max_rel < 1e-5


def test_rope_types_and_transformers_floor_checked_up_front(monkeypatch, llama):
    from tpshard.checkpoint import open_checkpoint
    from tpshard.plan import make_plan

    plan = make_plan(open_checkpoint(llama), Topology(tp=2))
    assert unsupported_reason(plan, {"rope_scaling": {"type": "yarn", "factor": 4.0}}) == (
        "model-level verify implements RoPE types default, llama3, not rope_type 'yarn'"
    )
    assert unsupported_reason(plan, {"rope_parameters": {"rope_type": "llama3"}}) is None
    import tpshard.verify.model as model_module

    monkeypatch.setattr(model_module, "transformers_version", lambda: "4.45.2")
    assert "needs transformers>=4.51, this is 4.45.2" in transformers_problem()
    assert "needs transformers>=4.51" in unsupported_reason(plan, {})
    monkeypatch.setattr(model_module, "transformers_version", lambda: "4.57.1")
    assert "needs transformers>=5.0, this is 4.57.1" in transformers_problem((5, 0))  # the MoE/MLA decoder's floor
