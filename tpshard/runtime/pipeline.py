"""Point-to-point hand-off of activations from one pipeline stage to the next.

World rank = pp_rank * tp + tp_rank (tpshard.topology): each rank of stage s hands its hidden
states to the rank with the same tp_rank on stage s + 1 (world rank + tp), as the engines pass
them between matching ranks of consecutive stages. Sends and receives form a chain from the first
stage to the last, never a cycle, so blocking send/recv cannot deadlock.

NCCL moves tensors between GPUs and needs them on the rank's device; gloo moves CPU tensors, so a
gloo rank computing on a (shared) GPU goes through host memory, as its collectives do (groups.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _via_host(device: torch.device) -> bool:
    return device.type != "cpu" and dist.get_backend() == "gloo"


def send_forward(x: torch.Tensor, dst: int) -> None:
    """Send `x` to world rank `dst` (returns once it is sent)."""
    t = x.detach().contiguous()
    dist.send(t.cpu() if _via_host(t.device) else t, dst)


def recv_forward(shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device) -> torch.Tensor:
    """Receive a tensor of `shape` and `dtype` from world rank `src`, on `device`."""
    t = torch.empty(shape, dtype=dtype, device="cpu" if _via_host(device) else device)
    dist.recv(t, src)
    return t.to(device)
