"""Hierarchical all-reduce: reduce-scatter inside each host, all-reduce across hosts, all-gather inside.

Vocabulary
    H         number of hosts; L ranks on every host (N = H*L), local index l = 0..L-1
    host ring the L ranks of one host; their messages travel over shared memory (transport/shm/transport.py)
    rail l    the H ranks with local index l, one per host; they own the same shard and talk over
              torch.distributed (TCP between hosts)
    shard l   chunk l of the ring partition of the tensor over L (ring_chunks(n, L))

Phases
    reduce-scatter (host ring)   L-1 steps; local rank l ends with shard l summed over its host
    all-reduce (rail l)          ring all-reduce of shard l among the H ranks of rail l, so every
                                 rail holds shard l summed over all N ranks; the L rails run at once
    all-gather (host ring)       L-1 steps; every rank ends with every shard

Traffic per rank (M bytes, divisible sizes)
    inside the host:  2(L-1)/L * M          (memory copies through shared memory)
    across hosts:     2(H-1)/H * M/L        (the only bytes on the network: 1/L of a flat ring's)
    T = 2(L-1)*alpha_i + 2(L-1)/L*M*beta_i + 2(H-1)*alpha + 2(H-1)/H*M/L*beta   (sim/cost.py)

Every host must have the same number of ranks (rails need one rank per host); ``layout_error``
says why a layout does not qualify.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gradsync.comm.allreduce_ring import all_gather_ring, allreduce_ring, reduce_scatter_ring
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Handle, Transport


class GroupTransport(Transport):
    """A subset of ranks seen as a world of its own: rank i of the group is ``members[i]``."""

    def __init__(self, base: Transport, members: tuple[int, ...], segment_bytes: int | None = None) -> None:
        self.base = base
        self.members = members
        self.segment_bytes = segment_bytes
        self.rank = members.index(base.rank)
        self.world_size = len(members)

    def isend(self, tensor, dst, op, *, control=False, tag=0) -> Handle:
        return self.base.isend(tensor, self.members[dst], op, control=control, tag=tag)

    def irecv(self, tensor, src, op, *, control=False, tag=0) -> Handle:
        return self.base.irecv(tensor, None if src is None else self.members[src], op, control=control, tag=tag)

    def irecv_reduce(self, tensor, src, op, *, staging, combine=torch.Tensor.add_) -> Handle:
        return self.base.irecv_reduce(tensor, self.members[src], op, staging=staging, combine=combine)

    def pairs_exchanges(self, tensor) -> bool:
        return self.base.pairs_exchanges(tensor)

    def exchange(self, send, dst, recv, src, op) -> Handle:
        return self.base.exchange(send, self.members[dst], recv, self.members[src], op)


def layout_error(hosts: tuple[tuple[int, ...], ...]) -> str | None:
    """None when ``hosts`` suits hierarchical all-reduce, else the reason."""
    sizes = sorted({len(group) for group in hosts})
    if len(sizes) != 1:
        return (f"hierarchical all-reduce needs the same number of ranks on every host; this job has "
                f"{', '.join(str(len(g)) for g in hosts)} ranks on its {len(hosts)} hosts")
    return None


def allreduce_hierarchical(flat: torch.Tensor, transport: Transport, *, reduction: Reduction = SUM) -> None:
    """In-place all-reduce of a 1-D contiguous tensor over the host layout ``transport.hosts``."""
    op = "all_reduce/hierarchical"
    hosts = transport.hosts
    problem = layout_error(hosts)
    if problem:
        raise RuntimeError(problem)
    host = next(group for group in hosts if transport.rank in group)
    local = GroupTransport(transport, host, transport.segment_bytes)  # shared memory where available
    rail = GroupTransport(transport, tuple(group[local.rank] for group in hosts))
    # reduce-scatter (host ring)
    chunks = reduce_scatter_ring(flat, local, op, combine=reduction.combine)
    shard = chunks.view(flat, local.rank)
    # all-reduce (rail): one rank per host, shard local.rank
    if rail.world_size > 1 and shard.numel() > 0:
        allreduce_ring(shard, rail, op=op, reduction=replace(reduction, average=False))
    reduction.finish(shard, transport.world_size)
    # all-gather (host ring)
    all_gather_ring(flat, chunks, local, op)
