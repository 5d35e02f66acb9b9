"""Decode context parallelism (--dcp) in an engine export: which splits the engine loads as they are.

SGLang: a dcp split holds what SGLang's classes build under --dcp-size (tpshard.plan.dense,
Arch.dcp), so its export carries the layout as it is; the launch line adds --dcp-size
(tpshard.export.launch). vLLM 0.33.0 (--decode-context-parallel-size) keeps every weight's tp cut
for DeepSeek's MLA as long as the q projection is not replicated (models/deepseek_v2.py L1067-1098:
ColumnParallelLinear, unless dcp_q_replicate), which is the layout of SGLang's --dcp split; the rest
it refuses or builds otherwise:
- --dcp-replicate-q-proj: vLLM's --dcp-q-replicate makes q_b_proj / q_proj a
  DCPGroupColumnParallelLinear (model_executor/layers/linear.py L645-683) holding its DCP group's
  heads on every rank, where SGLang's files hold the attn_tp cut and gather after loading;
- a hybrid model (Qwen3.5's gated DeltaNet layers): "DCP not support mamba now"
  (v1/core/single_type_kv_cache_manager.py L1485);
- any other family: not established (refused at the split already).
"""

from __future__ import annotations

from tpshard.arch import arch_for
from tpshard.manifest import Plan


def dcp_refusal(plan: Plan, engine: str) -> str | None:
    """Why `engine` cannot load this dcp split as it is (one line), or None: without --dcp, for SGLang,
    and for DeepSeek's MLA in vLLM (its launch line then adds --decode-context-parallel-size)."""
    topo = plan.topology
    if not topo.dcp or engine != "vllm":  # UNSET (1) is falsy
        return None
    flag = f"--format vllm: split with --dcp {topo.dcp}"
    if topo.dcp_replicate_q_proj:
        return (
            f"{flag} --dcp-replicate-q-proj: vLLM 0.33.0's --dcp-q-replicate loads each DCP group's q heads on every rank"
            " (layers/linear.py DCPGroupColumnParallelLinear), SGLang's files hold the attn_tp cut; split again without"
            " --dcp-replicate-q-proj (vLLM then all-gathers the query as SGLang does by default)"
        )
    if arch_for(plan.model).dcp != "neutral":
        return (
            f"{flag}: vLLM 0.33.0 runs no decode context parallelism for {plan.model.architecture}'s hybrid layers"
            " (v1/core/single_type_kv_cache_manager.py: DCP not support mamba now); split again without --dcp"
        )
    return None
