"""An independent statement of the load contract (LOAD_CONTRACT.md §10), written with torch
indexing and no tpshard code, that the tests hold every rank's tensors to."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def expected_rank_tensor(name: str, full: torch.Tensor, rank: int, *, tp: int, attn_dp: int = 1, config: dict) -> torch.Tensor:
    attn_tp = tp // attn_dp
    a, t = rank % attn_tp, rank  # rank in attn_tp, rank in tp
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // heads

    def rows(x, start, n):  # rows [start, start+n) of x, zero rows past its end
        part = x[start : start + n]
        return F.pad(part, (0, 0) * (x.dim() - 1) + (0, n - part.shape[0]))

    if name.endswith(("norm.weight",)) or name.endswith("o_proj.bias") or name.endswith("down_proj.bias"):
        return full
    if name == "model.embed_tokens.weight" or name == "lm_head.weight":
        group = attn_tp if name.startswith("model.") else tp
        r = a if name.startswith("model.") else t
        per = math.ceil(full.shape[0] / 64) * 64 // group
        return rows(full, r * per, per)
    if ".q_proj." in name:
        per = heads // attn_tp * hd
        return full[a * per : (a + 1) * per]
    if ".k_proj." in name or ".v_proj." in name:
        if attn_tp >= kv:
            head = a // (attn_tp // kv)
            return full[head * hd : (head + 1) * hd]
        per = kv // attn_tp * hd
        return full[a * per : (a + 1) * per]
    if ".o_proj.weight" in name:
        per = heads // attn_tp * hd
        return full[:, a * per : (a + 1) * per]
    if ".gate_proj." in name or ".up_proj." in name:
        per = math.ceil(full.shape[0] / tp)
        return rows(full, t * per, per)
    if ".down_proj.weight" in name:
        per = math.ceil(full.shape[1] / tp)
        return rows(full.T, t * per, per).T
    raise KeyError(name)
