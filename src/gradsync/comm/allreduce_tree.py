"""Tree all-reduce = binomial-tree reduce to rank 0 + binomial-tree broadcast from rank 0.

Vocabulary
    root      the rank that ends the reduce with the full result (rank 0 in the all-reduce; any
              rank in reduce_tree, torch's reduce)
    relative  a rank's distance from the root, (rank - root) mod N; the tree is built on it
    mask      the tree level, 1, 2, 4, ...; at level mask a rank whose relative rank has that bit
              set sends its partial result to relative - mask and leaves; a rank without it
              receives from relative + mask (if that rank exists) and combines

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


def reduce_tree(flat: torch.Tensor, root: int, transport: Transport, *, reduction: Reduction = SUM,
                op: str = "reduce/tree") -> None:
    """Reduce a 1-D contiguous tensor onto ``root`` (finished: avg divided by N). On the other ranks
    ``flat`` ends holding a partial result. Traffic: every rank but the root sends M once."""
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    incoming = scratch(flat.numel(), flat.dtype, flat.device)
    relative = (rank - root) % n_ranks
    mask = 1
    while mask < n_ranks:
        if relative & mask:
            transport.isend(flat, (relative - mask + root) % n_ranks, op).wait()
            return
        if relative + mask < n_ranks:
            transport.irecv_reduce(flat, (relative + mask + root) % n_ranks, op, staging=incoming,
                                   combine=reduction.combine).wait()
        mask <<= 1
    reduction.finish(flat, n_ranks)


def allreduce_tree(flat: torch.Tensor, transport: Transport, *, reduction: Reduction = SUM) -> None:
    """In-place all-reduce of a 1-D contiguous tensor; rank 0 reduces, then broadcasts."""
    op = "all_reduce/tree"
    if transport.world_size == 1:
        return
    # reduce
    reduce_tree(flat, 0, transport, reduction=reduction, op=op)
    # broadcast
    broadcast_binomial(flat, 0, transport, op)
