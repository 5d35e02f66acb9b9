"""Logical groups (rank and size as plain numbers) and their binding to torch.distributed groups.

A `LogicalGroup` says which group a layer is sharded over and where this world rank sits in it;
it is computed from a `Topology` alone, so layers know their per-rank shapes before any process
group exists (the seed's `_LogicalGroup`). `bind_groups` is the one place that creates process
groups; the collectives below look them up by the member ranks.

Two different rank sets belong to a group, and this file keeps them apart:
- the *shard* coordinate `(rank, size)`: which slice this rank holds (Topology.group_rank/size);
- the *collective* members: the world ranks that together hold one full copy and therefore
  reduce or gather with each other. For "tp" that is every rank; for "attn_tp" it is the block
  of ranks with the same attn_dp and attn_cp coordinates; with a replica factor k it is every
  k-th rank of that block (one rank per replica).

Not here: which group a weight uses (the plan decides that), and launching processes (launch.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpshard.topology import GroupName, Topology

# Process groups created so far in this process, keyed by their world ranks (sorted). A process
# has one torch.distributed world at a time, so a module-level cache mirrors torch's own state.
_PROCESS_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}


@dataclass(frozen=True)
class LogicalGroup:
    """One world rank's place in (group name, replica factor) of a topology.

    Build it with `LogicalGroup.of(topology, "attn_tp", world_rank)`; `rank`/`size` are the shard
    coordinates, `members` the world ranks this rank runs collectives with.
    """

    name: GroupName
    factor: int
    rank: int  # shard index held by this world rank
    size: int  # number of distinct shards
    world_rank: int
    members: tuple[int, ...] = field(repr=False)  # world ranks of the collective group, ascending

    @classmethod
    def of(cls, topology: Topology, name: GroupName, world_rank: int, factor: int = 1) -> LogicalGroup:
        if not 0 <= world_rank < topology.world_size:
            raise ValueError(f"world rank {world_rank} is outside 0..{topology.world_size - 1} for {topology.describe()}")
        return cls(
            name=name,
            factor=factor,
            rank=topology.group_rank(name, world_rank, factor),
            size=topology.group_size(name, factor),
            world_rank=world_rank,
            members=collective_members(topology, name, world_rank, factor),
        )

    @classmethod
    def single(cls, world_rank: int = 0) -> LogicalGroup:
        """A size-1 group: no sharding, no collectives (a replicated layer, or a test without dist)."""
        return cls(name="replicated", factor=1, rank=0, size=1, world_rank=world_rank, members=(world_rank,))

    def describe(self) -> str:
        k = f" k={self.factor}" if self.factor != 1 else ""
        return f"{self.name}{k} rank {self.rank}/{self.size} (world rank {self.world_rank}, members {list(self.members)})"

    # Collectives. Size-1 groups return their input untouched and never reach torch.distributed,
    # so a single process (or a replicated layer) needs no process group at all.

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the collective members (in place on `x`, which is returned)."""
        if self.size == 1:
            return x
        pg = self.process_group()
        if _via_host(x, pg):
            x.copy_(_all_reduce(x.cpu(), pg))
            return x
        return _all_reduce(x, pg)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenation along `dim` of every member's `x`, in shard order (rank 0 first)."""
        if self.size == 1:
            return x
        pg = self.process_group()
        device = x.device
        x = x.contiguous().cpu() if _via_host(x, pg) else x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=pg)
        parts = [t.to(device) for t in parts]
        # Members are ascending world ranks and shard rank grows with world rank inside a
        # collective group, so list order is shard order.
        return torch.cat(parts, dim=dim)

    def process_group(self) -> dist.ProcessGroup:
        pg = _PROCESS_GROUPS.get(self.members)
        if pg is None:
            raise RuntimeError(
                f"group {self.describe()} is not bound to a process group; call "
                f"tpshard.runtime.bind_groups(topology, [(\"{self.name}\", {self.factor})]) on every rank first"
            )
        return pg


def _via_host(x: torch.Tensor, pg: dist.ProcessGroup) -> bool:
    """gloo ranks computing on (shared) GPUs: their collectives go through host memory."""
    return x.device.type != "cpu" and dist.get_backend(pg) == "gloo"


def _all_reduce(x: torch.Tensor, pg: dist.ProcessGroup) -> torch.Tensor:
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=pg)
    return x


def collective_members(topology: Topology, name: GroupName, world_rank: int, factor: int = 1) -> tuple[int, ...]:
    """World ranks that, with `world_rank`, hold one full copy of a tensor sharded over (name, factor)."""
    span = topology.span(name)
    size = topology.group_size(name, factor)
    base = world_rank - world_rank % span  # first world rank of this group instance
    offset = (world_rank % span) % factor  # which replica of each shard this rank is
    return tuple(base + offset + j * factor for j in range(size))


def partitions(topology: Topology, name: GroupName, factor: int = 1) -> list[tuple[int, ...]]:
    """Every collective group of (name, factor), in a fixed order (by smallest member)."""
    seen: dict[tuple[int, ...], None] = {}
    for r in range(topology.world_size):
        seen.setdefault(collective_members(topology, name, r, factor))
    return list(seen)


def bind_groups(
    topology: Topology,
    groups: Iterable[tuple[GroupName, int]] = (("tp", 1), ("attn_tp", 1)),
) -> None:
    """Create the process groups behind (name, factor) pairs. Collective: call on every rank, same args.

    torch.distributed requires every rank to call `new_group` for every group, members or not,
    in the same order; walking `partitions` in a fixed order on every rank guarantees that.
    Groups already created (e.g. attn_tp equals tp when attn_dp = attn_cp = 1) are reused.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized; call tpshard.runtime.init_distributed() first")
    world = dist.get_world_size()
    if world != topology.world_size:
        raise RuntimeError(
            f"torch.distributed world size is {world} but the topology ({topology.describe()}) needs {topology.world_size}"
        )
    everyone = tuple(range(world))
    for name, factor in groups:
        for members in partitions(topology, name, factor):
            if len(members) == 1 or members in _PROCESS_GROUPS:
                continue  # size-1 groups never run collectives
            if members == everyone:
                _PROCESS_GROUPS[members] = dist.group.WORLD
            else:
                _PROCESS_GROUPS[members] = dist.new_group(ranks=list(members))


def clear_groups() -> None:
    """Forget bound groups; call before torch.distributed.destroy_process_group()."""
    _PROCESS_GROUPS.clear()
