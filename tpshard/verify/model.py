"""Model-level verification: what `verify --model` can run, its token batches, and the verdict.

The tensor-parallel decoders are tpshard.verify.decoder's (dense) and tpshard.verify.moe_model's
(MoE and MLA), chosen by the architecture's `verify` (tpshard/arch/). Every rank's logits are
compared, not one per replica.

Rank 0 runs AutoModelForCausalLM on the source checkpoint in float32 on the same token batches and
compares logits: max abs (and relative to max |logit|) difference, top-1 agreement, mean KL. A
quantized source runs dequantized by other projects' code (tpshard.verify.source_dequant).
"""

from __future__ import annotations

from typing import get_args

import torch

import tpshard.verify.moe_model as moe_model
from tpshard.arch import ARCHITECTURES
from tpshard.arch.base import VerifyKind
from tpshard.errors import TpshardError
from tpshard.manifest import Plan
from tpshard.verify.decoder import rope_config
from tpshard.verify.layer_inputs import generator
from tpshard.verify.report import MODEL_TOLERANCE, ModelResult

ROPE_TYPES = ("default", "llama3")
# Oldest transformers --model runs on (Qwen3 came in 4.51); pyproject's `verify` extra says the same.
MIN_TRANSFORMERS = (4, 51)
SEQUENCES = 2  # sequences per batch


def supported() -> tuple[str, ...]:
    """The architectures --model runs (`Arch.verify`): the dense decoder's, the MoE / MLA decoder's, Llama-4's,
    DeepSeek-V4's, the hybrids'."""
    return tuple(a.name for kind in get_args(VerifyKind) for a in ARCHITECTURES.values() if a.verify == kind)


def unsupported_reason(plan: Plan, config: dict, tokens: int | None = None) -> str | None:
    """Why --model cannot run on this output, or None."""
    if plan.model.architecture in ARCHITECTURES and ARCHITECTURES[plan.model.architecture].verify == "deepseek_v4":
        from tpshard.verify.v4_model import unsupported_reason as v4_reason  # bf16 and its release dequantized

        return transformers_problem(moe_model.MIN_TRANSFORMERS) or v4_reason(plan, config, tokens)
    if is_quantized(plan):  # transformers runs the source dequantized by other projects' code (verify/source_dequant.py)
        from tpshard.verify.source_dequant import unsupported_reason as dequant_reason

        reason = dequant_reason(plan, config)
        if reason:
            return reason
    if plan.topology.attn_cp > 1:
        return "model-level verify does not model context-parallel attention (attn_cp > 1); use layer-level verify"
    if moe_model.is_moe(plan):  # MoE and MLA architectures: their own decoder (verify/moe_model.py)
        return moe_model.unsupported_reason(plan, config, tokens) or transformers_problem(moe_model.MIN_TRANSFORMERS)
    arch = ARCHITECTURES.get(plan.model.architecture)
    if arch is not None and arch.verify == "llama4":
        from tpshard.verify.llama4_model import unsupported_reason as llama4_reason

        return llama4_reason(config) or transformers_problem(moe_model.MIN_TRANSFORMERS)
    if arch is not None and arch.verify == "hybrid":  # Qwen3-Next, Qwen3.5-MoE (verify/hybrid_model.py)
        from tpshard.verify.hybrid_model import unsupported_reason as hybrid_reason

        return hybrid_reason(plan, config, tokens) or transformers_problem(moe_model.MIN_TRANSFORMERS)
    if arch is None or arch.verify != "dense":
        return f"model-level verify supports {', '.join(supported())}, not {plan.model.architecture}"
    kind = rope_config(config).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        return f"model-level verify implements RoPE types {', '.join(ROPE_TYPES)}, not rope_type {kind!r}"
    return transformers_problem()


def is_quantized(plan: Plan) -> bool:
    """A quantized output: linears in a quantized format, or MXFP4 experts."""
    return bool(plan.quant_layers) or bool(plan.model.expert_block)


def transformers_problem(floor: tuple[int, int] = MIN_TRANSFORMERS) -> str | None:
    """Why the installed transformers cannot be the reference, or None."""
    have = transformers_version()
    if have is None:
        return "model-level verify needs transformers (pip install 'tpshard[verify]')"
    if _version(have) < floor:
        need = ".".join(map(str, floor))
        return f"model-level verify needs transformers>={need}, this is {have} (pip install 'tpshard[verify]')"
    return None


def transformers_version() -> str | None:
    """The installed transformers' version, without importing it (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


def _version(text: str) -> tuple[int, int]:
    import re

    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def model_tokens(plan: Plan, batch: int, *, seed: int, tokens: int) -> torch.Tensor:
    """Token ids [SEQUENCES, tokens] of one attention-DP replica."""
    return torch.randint(0, plan.model.vocab_size, (SEQUENCES, tokens), generator=generator(seed, "model", batch))


def hf_logits(source: str, batches: list[torch.Tensor], *, dequantized: bool = False) -> list[torch.Tensor]:
    """transformers' float32 forward on the source checkpoint: logits [B, S, V] per batch, float64.
    `dequantized`: the source is quantized; transformers runs it dequantized (verify/source_dequant.py)."""
    try:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise TpshardError("model-level verify needs transformers (pip install transformers)") from None
    hf_logging.disable_progress_bar()  # stderr belongs to the report
    # `dtype` replaced `torch_dtype` in 4.56; the old name warns, then goes, in later releases.
    dtype_kw = "dtype" if _version(transformers_version() or "0.0") >= (4, 56) else "torch_dtype"
    kw = {"attn_implementation": "eager", dtype_kw: torch.float32}
    if dequantized:
        from tpshard.verify.source_dequant import dense_model

        model = dense_model(source, **kw)
    else:
        model = AutoModelForCausalLM.from_pretrained(source, **kw)
    model.eval()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the forward's notes on slow kernels (the gated DeltaNet's "falling back to ... PyTorch")
    try:
        with torch.no_grad():
            return [model(input_ids=ids).logits.double() for ids in batches]
    finally:
        hf_logging.set_verbosity(level)


def compare_logits(plan: Plan, sent: dict[int, dict], ref: list[torch.Tensor], *, tokens: int) -> ModelResult:
    """Every rank's logits (sent[world rank] = {batch, logits, disagree}) against transformers' of its
    batch; with pipeline stages only the last stage's ranks have logits (None elsewhere).

    The result holds the worst over ranks (max error, min top-1, max KL); a failure names the ranks."""
    result = ModelResult(
        architecture=plan.model.architecture, batches=len(ref), sequences=SEQUENCES, tokens=tokens,
        tolerance=dict(MODEL_TOLERANCE),
    )  # fmt: skip
    bad: list[int] = []
    result.top1 = 1.0
    with_logits = {rank: msg for rank, msg in sent.items() if msg["logits"] is not None}
    for rank, msg in with_logits.items():
        t, r = msg["logits"].double().flatten(0, 1), ref[msg["batch"]].flatten(0, 1)  # [N, V]
        if t.shape != r.shape:
            result.problems.append(f"rank {rank}: logits shape {list(t.shape)}, transformers gives {list(r.shape)}")
            continue
        max_abs = (t - r).abs().max().item()
        max_rel = max_abs / (r.abs().max().item() or 1.0)
        top1 = (t.argmax(-1) == r.argmax(-1)).double().mean().item()
        logp_r, logp_t = r.log_softmax(-1), t.log_softmax(-1)
        kl = (logp_r.exp() * (logp_r - logp_t)).sum(-1).mean().item()
        result.max_abs, result.max_rel = max(result.max_abs, max_abs), max(result.max_rel, max_rel)
        result.top1, result.kl = min(result.top1, top1), max(result.kl, kl)
        tol = result.tolerance
        if max_rel > tol["max_rel"] or top1 < tol["top1"] or kl > tol["kl"]:
            bad.append(rank)
    if bad and len(bad) < len(with_logits):
        result.problems.append(f"the logits of world ranks {bad} differ from transformers' (the other ranks' agree)")
    disagree: dict[int, float] = {}
    for msg in sent.values():
        for member, rel in msg["disagree"].items():
            disagree[member] = max(disagree.get(member, 0.0), rel)
    if disagree:
        worst = ", ".join(f"{m} ({rel:.3g})" for m, rel in sorted(disagree.items()))
        result.problems.append(
            f"world ranks {sorted(disagree)} hold activations that differ from their attention-DP replica's"
            f" (their own norms?) before a gather over a larger group; rel difference: {worst}"
        )
    return result
