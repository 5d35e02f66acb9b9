"""Collectives over the whole world for small Python objects and flags (reports, digests, verdicts).

What verify exchanges besides tensors: each rank's findings gathered on rank 0, rank 0's report
broadcast, every rank's preflight answer shared, "did every rank build this layer". Kept here so
that only tpshard.runtime imports torch.distributed. Gloo flags live on the CPU (its CUDA support
is partial); NCCL ones on the rank's GPU.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_to_root(obj: Any) -> list | None:
    """Every rank's `obj`, by rank, on rank 0; None on the other ranks."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, gathered, dst=0)
    return gathered


def broadcast_from_root(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (the argument is ignored elsewhere)."""
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_objects(obj: Any) -> list:
    """Every rank's `obj`, by rank, on every rank."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, obj)
    return everyone


def all_true(flag: bool, device: torch.device) -> bool:
    """True on every rank iff `flag` is true on every rank."""
    if dist.get_backend() == "gloo":
        device = torch.device("cpu")
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())
