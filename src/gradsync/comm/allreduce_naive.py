"""Naive all-reduce: gather everything to rank 0, reduce there, send the result back to everyone.

This is the parameter-server traffic pattern, kept as the reference every other algorithm is
tested against and as the picture of the bottleneck:
    rank 0 receives (N-1)*M and sends (N-1)*M bytes; every other rank sends M and receives M.
    T = 2(N-1)*(alpha + M*beta) + (N-1)*M*gamma   (rank 0's link serialises everything)

Rank 0 adds contributions in rank order, so the result does not depend on arrival order; float16 and
bfloat16 sums are added in float32 and rounded once (reduce_ops.py).
"""

from __future__ import annotations

import torch

from gradsync.comm.scratch import scratch
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Transport, wait_all


def allreduce_naive(flat: torch.Tensor, transport: Transport, *, reduction: Reduction = SUM) -> None:
    """In-place all-reduce of a 1-D contiguous tensor through rank 0."""
    op = "all_reduce/naive"
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    if rank != 0:
        send = transport.isend(flat, 0, op)
        transport.irecv(flat, 0, op).wait()
        send.wait()
        return
    # gather: one buffer per contributor, all receives in flight at once
    incoming = {peer: scratch(flat.numel(), flat.dtype, flat.device, slot=peer) for peer in range(1, n_ranks)}
    handles = {peer: transport.irecv(buf, peer, op) for peer, buf in incoming.items()}
    # reduce, in rank order (float16/bfloat16 sums in float32, rounded once: reduce_ops.py)
    acc = reduction.accumulator(flat)
    for peer in range(1, n_ranks):
        handles[peer].wait()
        reduction.combine(acc, incoming[peer])
    reduction.settle(flat, acc, n_ranks)
    # broadcast, one copy per rank
    wait_all([transport.isend(flat, peer, op) for peer in range(1, n_ranks)])
