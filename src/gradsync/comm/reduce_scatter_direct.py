"""Direct reduce-scatter: every rank sends each chunk straight to its owner, which reduces all N at once.

The ring's reduce-scatter (allreduce_ring.py) forwards partial sums: each hop adds one rank's chunk
and sends the result on, so a float16 or bfloat16 sum crosses the wire, and is rounded, N-1 times.
Here no partial result travels: chunk j of every rank goes to rank j, which holds all N inputs of
its chunk and reduces them in one pass (reduce_ops.Reduction.reduce: own first, then the others in
rank order; float16/bfloat16 sums added in float32 and rounded once). allreduce_ring takes this
reduce-scatter for the reductions that widen (Reduction.widens), then its own all-gather.

Vocabulary as allreduce_ring.py: N ranks, n elements, chunk j = ring_chunks(n, N) chunk j.

Phases
    send      rank r posts chunk j of its tensor to rank j, for j = r+1, r+2, ... (mod N): each
              rank starts with a different peer, so no rank receives from everyone at once
    receive   rank r receives chunk r of every other rank's tensor into a buffer of its own
    reduce    rank r reduces chunk r: its own, then the others' in rank order

Traffic: rank r sends every chunk but its own and receives N-1 copies of chunk r, so
    bytes_sent = (n - size[r]) * element_size,  bytes_received = (N-1) * size[r] * element_size
the ring's reduce-scatter's total (2(N-1)/N * M for the whole all-reduce when n is divisible by N),
spread over every peer instead of the right neighbour alone.
T = (N-1)*alpha + (N-1)/N*M*beta + (N-1)/N*M*gamma: the N-1 messages of a rank leave together, where
the ring's take N-1 steps one after another.
"""

from __future__ import annotations

import torch

from gradsync.comm.reduce_ops import Reduction
from gradsync.comm.scratch import scratch
from gradsync.comm.transport import Transport, wait_all


def reduce_scatter_direct(flat: torch.Tensor, chunks, transport: Transport, op: str, reduction: Reduction) -> None:
    """Reduce ``flat`` (1-D, contiguous, partitioned by ``chunks``: allreduce_ring.Chunks) so that chunk
    ``rank`` holds the finished result (avg: divided by N); the other chunks are left as they were."""
    n_ranks, rank = transport.world_size, transport.rank
    others = [(rank + k) % n_ranks for k in range(1, n_ranks)]
    # send (posted before the receives: gloo matches a send posted after its receive a scheduler tick late)
    sends = [transport.isend(chunks.view(flat, peer), peer, op) for peer in others if chunks.sizes[peer]]
    # receive
    own = chunks.view(flat, rank)
    received = {peer: scratch(own.numel(), flat.dtype, flat.device, slot=peer) for peer in others}
    if own.numel():
        wait_all([transport.irecv(received[peer], peer, op) for peer in others])
    # reduce
    reduction.reduce(own, [own, *(received[peer] for peer in sorted(others))], n_ranks)
    wait_all(sends)
