"""An independent statement of the load contract (SGLang's and vLLM's weight loaders, docs/contracts.md), written
with torch indexing and no tpshard code, that the tests hold every rank's tensors to."""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

# SGLang 0.5.23 model classes: (group of attention, group of the embedding under attention DP).
GROUPS = {
    "LlamaForCausalLM": ("tp", "tp"),
    "MistralForCausalLM": ("tp", "tp"),
    "Qwen2ForCausalLM": ("tp", "attn_tp"),
    "Qwen3ForCausalLM": ("attn_tp", "attn_tp"),
    "Qwen2MoeForCausalLM": ("attn_tp", "attn_tp"),
    "Qwen3MoeForCausalLM": ("attn_tp", "attn_tp"),
    "MixtralForCausalLM": ("tp", "tp"),
    "DeepseekV2ForCausalLM": ("attn_tp", "attn_tp"),
    "DeepseekV3ForCausalLM": ("attn_tp", "attn_tp"),
    "Glm4MoeForCausalLM": ("attn_tp", "attn_tp"),
    "MiniMaxM2ForCausalLM": ("attn_tp", "attn_tp"),
}
# Families whose layers below first_k_dense_replace hold a dense MLP that follows --moe-dense-tp.
DENSE_FIRST = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
WHOLE = re.compile(
    r".*(norm\.weight|o_proj\.bias|down_proj\.bias|\.mlp\.gate\.weight|block_sparse_moe\.gate\.weight|e_score_correction_bias"
    r"|shared_expert_gate\.weight|q_a_proj\.weight|kv_a_proj_with_mqa\.weight|eh_proj\.weight)"
)


def expected_rank_tensor(
    name: str, full: torch.Tensor, rank: int, *, tp: int, attn_dp: int = 1, ep: int = 1, moe_dense_tp: int | None = None,
    config: dict,
) -> torch.Tensor | None:  # fmt: skip
    """What `rank` holds of source tensor `name`; None if the rank holds none of it (another EP slot's expert)."""
    attn_group, embed_group = GROUPS[config["architectures"][0]]
    attn_tp = tp // attn_dp
    a = rank % attn_tp
    ar, asize = (a, attn_tp) if attn_group == "attn_tp" else (rank, tp)  # attention rank and group size
    er, esize = (a, attn_tp) if embed_group == "attn_tp" else (rank, tp)
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    hd = config.get("head_dim") or config["hidden_size"] // heads
    mla = bool(config.get("kv_lora_rank"))
    experts = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0

    def rows(x, start, n):  # rows [start, start+n) of x, zero rows past its end
        part = x[start : start + n]
        return F.pad(part, (0, 0) * (x.dim() - 1) + (0, n - part.shape[0]))

    def split_rows(x, r, size):
        per = math.ceil(x.shape[0] / size)
        return rows(x, r * per, per)

    def split_cols(x, r, size):
        return split_rows(x.T, r, size).T

    m = re.search(r"\.experts\.(\d+)\.(\w+)\.weight$", name)
    if m:  # routed expert: contiguous EP blocks, then MoE-TP slices
        moe_tp = tp // ep
        if int(m.group(1)) // (experts // ep) != rank // moe_tp:
            return None
        if m.group(2) in ("gate_proj", "up_proj", "w1", "w3"):
            return split_rows(full, rank % moe_tp, moe_tp)
        return split_cols(full, rank % moe_tp, moe_tp)
    if config.get("model_type") == "minimax_m2" and name.endswith(("q_norm.weight", "k_norm.weight")):
        # MiniMaxM2RMSNormTP.weight_loader: shard attn_tp_rank // num_head_replicas of whole heads,
        # as the projection it normalises (minimax_m2.py)
        name = name.replace("q_norm", "q_proj").replace("k_norm", "k_proj")
    elif WHOLE.fullmatch(name):
        return full
    if name.endswith(("embed_tokens.weight",)):
        per = math.ceil(full.shape[0] / 64) * 64 // esize
        return rows(full, er * per, per)
    if name == "lm_head.weight" or name.endswith("shared_head.head.weight"):
        per = math.ceil(full.shape[0] / 64) * 64 // tp
        return rows(full, rank * per, per)
    if mla and (".q_b_proj." in name or ".q_proj." in name or ".kv_b_proj." in name):
        return split_rows(full, ar, asize)  # whole heads: rows are head-major
    if mla and ".o_proj.weight" in name:
        return split_cols(full, ar, asize)
    if ".q_proj." in name:
        per = heads // asize * hd
        return full[ar * per : (ar + 1) * per]
    if ".k_proj." in name or ".v_proj." in name:
        if asize >= kv:
            head = ar // (asize // kv)
            return full[head * hd : (head + 1) * hd]
        per = kv // asize * hd
        return full[ar * per : (ar + 1) * per]
    if ".o_proj.weight" in name:
        per = heads // asize * hd
        return full[:, ar * per : (ar + 1) * per]
    dense = ".shared_expert" not in name and config["architectures"][0] in DENSE_FIRST  # a dense-layer MLP follows --moe-dense-tp
    size, r = (1, 0) if dense and moe_dense_tp == 1 else (tp, rank)
    if ".gate_proj." in name or ".up_proj." in name:
        return split_rows(full, r, size)
    if ".down_proj.weight" in name:
        return split_cols(full, r, size)
    raise KeyError(name)
