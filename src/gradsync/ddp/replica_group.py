"""Where the wrapper's collectives run: gradsync's own world, or a torch.distributed subgroup.

    group = ReplicaGroup.of(process_group)
    group.rank, group.size              this rank's index in the group, the number of replicas
    group.all_reduce(t, op, algorithm)  in place; op "sum" | "avg" | "max"
    group.broadcast(t, src)             src is a rank *of the group* (0 = its first member)
    group.all_gather(t) -> full         the group's 1-D tensors concatenated in group-rank order
                                        (sizes may differ)
    group.torch_group                   the torch ProcessGroup the program passed, else torch's default
                                        group: what torch's Join context runs its own collectives on

process_group=None, or any group that holds every rank: gradsync's own collectives (comm/) over its
world, with ``algorithm`` as the wrapper was given.

A subgroup (``torch.distributed.new_group(ranks)``, some ranks only): the replicas are the group's
members, and every collective of the wrapper (start-up checks and broadcast, buffers, gradient
buckets, unused-parameter counts, Join) runs as that group's own torch.distributed collective, as
torch's DDP does: gloo's on a gloo group, gradsync's algorithms on a group made with the "gradsync"
backend (c10d/). ``algorithm`` is then not used. A rank outside the group cannot build the wrapper
(torch's DDP raises there too).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.group import runtime
from gradsync.group.world_info import World
from gradsync.comm.collectives import all_gather, all_reduce, broadcast

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _covers_world(process_group, world: World) -> bool:
    return process_group is None or process_group is dist.GroupMember.WORLD or (
        process_group is not dist.GroupMember.NON_GROUP_MEMBER and process_group.size() == world.world_size)


@dataclass(frozen=True)
class ReplicaGroup:
    """The ranks that hold replicas of one wrapped model (see the module docstring)."""

    rank: int
    size: int
    world: World
    subgroup: dist.ProcessGroup | None = None
    """The program's subgroup, or None for gradsync's own world."""
    given: dist.ProcessGroup | None = None
    """The process_group the program passed, if any (what Join compares across joinables)."""

    @staticmethod
    def of(process_group) -> "ReplicaGroup":
        world = runtime.world()
        if _covers_world(process_group, world):
            given = process_group if isinstance(process_group, dist.ProcessGroup) else None
            return ReplicaGroup(world.rank, world.world_size, world, given=given)
        if process_group is dist.GroupMember.NON_GROUP_MEMBER or not isinstance(process_group, dist.ProcessGroup):
            raise ValueError(f"DistributedDataParallel: rank {world.rank} is not a member of process_group "
                             f"(torch.distributed.new_group() gave it GroupMember.NON_GROUP_MEMBER); build the "
                             f"wrapper only on the group's ranks, as torch's DistributedDataParallel requires")
        return ReplicaGroup(dist.get_rank(process_group), process_group.size(), world, process_group, process_group)

    @property
    def torch_group(self) -> dist.ProcessGroup:
        return self.given if self.given is not None else dist.distributed_c10d._get_default_group()

    def _wait(self, work, what: str) -> None:
        if not work.wait(timedelta(seconds=self.world.timeout)):
            raise TimeoutError(f"rank {self.world.rank}: {what} on process_group did not finish within "
                               f"{self.world.timeout:.0f} s")

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto") -> torch.Tensor:
        if self.subgroup is None:
            return all_reduce(tensor, op=op, algorithm=algorithm)
        self._wait(dist.all_reduce(tensor, _TORCH_OPS[op], group=self.subgroup, async_op=True), f"all_reduce {op}")
        if op == "avg":
            tensor.div_(self.size)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.subgroup is None:
            return broadcast(tensor, src=src)
        self._wait(dist.broadcast(tensor, group_src=src, group=self.subgroup, async_op=True), "broadcast")
        return tensor

    def all_gather(self, mine: torch.Tensor) -> torch.Tensor:
        if self.subgroup is None:
            return all_gather(mine)
        counts = torch.zeros(self.size, dtype=torch.int64)
        counts[self.rank] = mine.numel()
        self.all_reduce(counts)
        longest = int(counts.max())
        padded = torch.zeros(longest, dtype=mine.dtype, device=mine.device)
        padded[:mine.numel()] = mine.reshape(-1)
        pieces = [torch.empty_like(padded) for _ in range(self.size)]
        self._wait(dist.all_gather(pieces, padded, group=self.subgroup, async_op=True), "all_gather")
        return torch.cat([piece[:int(count)] for piece, count in zip(pieces, counts)])
