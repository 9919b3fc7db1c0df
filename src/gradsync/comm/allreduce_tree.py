"""Tree all-reduce = binomial-tree reduce to rank 0 + binomial-tree broadcast from rank 0.

Vocabulary
    mask    the tree level, 1, 2, 4, ...; at level mask a rank with that bit set sends its partial
            sum to rank - mask and leaves; a rank without it receives from rank + mask (if that
            rank exists) and adds
    root    rank 0, which ends the reduce with the full sum

Phases
    reduce     ceil(log2 N) levels, each moving whole tensors towards rank 0
    broadcast  ceil(log2 N) levels back out (see broadcast.py)

Traffic and time: every rank sends M in the reduce except rank 0; rank 0 receives up to
ceil(log2 N)*M. Few messages, whole tensors each, so it wins for small M:
    T = 2*ceil(log2 N) * (alpha + M*beta) + ceil(log2 N)*M*gamma
"""

from __future__ import annotations

import torch

from gradsync.comm.broadcast import broadcast_binomial
from gradsync.comm.scratch import scratch
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Transport


def allreduce_tree(flat: torch.Tensor, transport: Transport, *, reduction: Reduction = SUM) -> None:
    """In-place all-reduce of a 1-D contiguous tensor; rank 0 reduces, then broadcasts."""
    op = "all_reduce/tree"
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    incoming = scratch(flat.numel(), flat.dtype, flat.device)
    # reduce
    mask = 1
    while mask < n_ranks:
        if rank & mask:
            transport.isend(flat, rank - mask, op).wait()
            break
        if rank + mask < n_ranks:
            transport.irecv_reduce(flat, rank + mask, op, staging=incoming, combine=reduction.combine).wait()
        mask <<= 1
    if rank == 0:
        reduction.finish(flat, n_ranks)
    # broadcast
    broadcast_binomial(flat, 0, transport, op)
