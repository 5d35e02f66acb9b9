"""The tensor-parallel runtime: groups, layers, quant methods, launching (the compute and reduce contracts).

The only package in tpshard that imports torch.distributed. It loads presharded tensors into
engine-style layers and runs them; it never decides how a tensor is cut (that is the plan).

Typical use on each rank:
    info = init_distributed()                      # torchrun env; NCCL on CUDA, gloo on CPU
    bind_groups(topology)                          # collective: process groups for tp and attn_tp
    g = LogicalGroup.of(topology, "attn_tp", info.rank)
    qkv = QKVParallelLinear(hidden, head_dim, n_heads, n_kv_heads, group=g, dtype=torch.bfloat16)
    qkv.load_shard("q", q_tensor); qkv.load_shard("k", k_tensor); qkv.load_shard("v", v_tensor)

Pipeline stages (pipeline.py): hidden states sent from a stage's rank to the matching rank of the
next stage.

MoE and MLA (moe.py, mla.py): FusedMoE holds a rank's EP slot of experts cut over MoE-TP and
reduces over tp; MoEBlock adds the router and shared experts; MLAAttention cuts heads over attn_tp.
A family's router (RouterConfig, router_config) is tpshard.arch's, re-exported here.

Quant methods: linear_method.py (the protocol, the unquantized method), reference_quant.py
(quantized shards dequantized with torch).
"""

from tpshard.arch import RouterConfig, router_config
from tpshard.runtime.groups import LogicalGroup, bind_groups, clear_groups, collective_members, partitions
from tpshard.runtime.launch import (
    DistInfo,
    RankFailed,
    RankResult,
    default_backend,
    free_port,
    init_distributed,
    listening_to,
    local_store,
    rank_device,
    report_progress,
    run_local,
    shutdown_distributed,
)
from tpshard.runtime.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    ShardInfo,
    VocabParallelEmbedding,
)
from tpshard.runtime.linear_method import QuantMethod, UnquantizedLinearMethod, new_param
from tpshard.runtime.mla import MLAAttention, MLAConfig
from tpshard.runtime.moe import FusedMoE, MoEBlock, route
from tpshard.runtime.pipeline import recv_forward, send_forward

__all__ = [
    "ColumnParallelLinear",
    "DistInfo",
    "FusedMoE",
    "LogicalGroup",
    "MLAAttention",
    "MLAConfig",
    "MergedColumnParallelLinear",
    "MoEBlock",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuantMethod",
    "RankFailed",
    "RankResult",
    "RouterConfig",
    "RowParallelLinear",
    "ShardInfo",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "bind_groups",
    "clear_groups",
    "collective_members",
    "default_backend",
    "free_port",
    "init_distributed",
    "listening_to",
    "local_store",
    "new_param",
    "partitions",
    "rank_device",
    "recv_forward",
    "report_progress",
    "route",
    "router_config",
    "run_local",
    "send_forward",
    "shutdown_distributed",
]
