"""Recursive halving-doubling all-reduce (Rabenseifner), any N.

Vocabulary
    p         the largest power of two <= N; the core algorithm runs on p ranks
    extra     N - p ranks that do not fit; ranks 0..2*extra-1 pair up (even r folds into r+1)
    newrank   a participant's index among the p: odd r < 2*extra -> r // 2, r >= 2*extra -> r - extra
    mask      partner distance in newrank space, p/2 down to 1 when halving, 1 up to p/2 when doubling
    range     the element range [lo, hi) a participant is responsible for at the current level

Phases
    fold             (non-power-of-two only) even r < 2*extra sends its whole tensor to r+1, which
                     adds it; the even rank then waits for the final result
    reduce-scatter   recursive halving: at each level the range splits at mid = lo + (hi-lo)//2;
                     the partner with the mask bit clear keeps [lo, mid), the other [mid, hi); each
                     sends the half it gives away and adds the half it receives
    all-gather       recursive doubling: the same levels in reverse, exchanging owned ranges
    unfold           (non-power-of-two only) odd r < 2*extra sends the result back to r-1

Traffic and time (power-of-two N): each phase moves M/2 + M/4 + ... = (p-1)/p * M per rank, so
    bytes_sent = 2(p-1)/p * M,  T = 2*log2(p)*alpha + 2(p-1)/p*M*beta + (p-1)/p*M*gamma
Non-power-of-two adds one fold and one unfold: 2*(alpha + M*beta) on the paired ranks
(Thakur, Rabenseifner & Gropp, IJHPCA 2005).
"""

from __future__ import annotations

import torch

from gradsync.comm.scratch import scratch
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Combine, Transport


def _exchange(transport: Transport, send: torch.Tensor, recv: torch.Tensor, peer: int, op: str,
              staging: torch.Tensor | None = None, combine: Combine = torch.Tensor.add_) -> None:
    """Send ``send`` to ``peer`` while receiving into ``recv`` (reduced into it with ``combine`` when
    ``staging`` is given); over NCCL as one exchange (Transport.pairs_exchanges)."""
    if transport.pairs_exchanges(send):
        transport.exchange(send, peer, recv if staging is None else staging, peer, op).wait()
        if staging is not None:
            combine(recv, staging)
        return
    handle_out = transport.isend(send, peer, op)
    if staging is None:
        transport.irecv(recv, peer, op).wait()
    else:
        transport.irecv_reduce(recv, peer, op, staging=staging, combine=combine).wait()
    handle_out.wait()


def allreduce_halving_doubling(flat: torch.Tensor, transport: Transport, *, reduction: Reduction = SUM) -> None:
    """In-place all-reduce of a 1-D contiguous tensor by recursive halving then doubling."""
    op = "all_reduce/halving_doubling"
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    p = 1 << (n_ranks.bit_length() - 1)
    extra = n_ranks - p

    # fold
    if rank < 2 * extra:
        if rank % 2 == 0:
            transport.isend(flat, rank + 1, op).wait()
            transport.irecv(flat, rank + 1, op).wait()  # unfold, seen from the folded rank
            return
        transport.irecv_reduce(flat, rank - 1, op, staging=scratch(flat.numel(), flat.dtype, flat.device),
                               combine=reduction.combine).wait()
        newrank = rank // 2
    else:
        newrank = rank - extra

    def real_rank(new: int) -> int:
        return 2 * new + 1 if new < extra else new + extra

    # reduce-scatter (recursive halving)
    half = scratch((flat.numel() + 1) // 2, flat.dtype, flat.device)
    lo, hi = 0, flat.numel()
    levels: list[tuple[int, int, int]] = []  # (mask, lo, hi) of the range before each split
    mask = p >> 1
    while mask >= 1:
        mid = lo + (hi - lo) // 2
        keep_low = not (newrank & mask)
        keep, give = ((lo, mid), (mid, hi)) if keep_low else ((mid, hi), (lo, mid))
        _exchange(transport, flat[give[0]:give[1]], flat[keep[0]:keep[1]], real_rank(newrank ^ mask), op,
                  staging=half.narrow(0, 0, keep[1] - keep[0]), combine=reduction.combine)
        levels.append((mask, lo, hi))
        lo, hi = keep
        mask >>= 1
    reduction.finish(flat[lo:hi], n_ranks)

    # all-gather (recursive doubling)
    for mask, parent_lo, parent_hi in reversed(levels):
        other = (parent_lo, lo) if lo > parent_lo else (hi, parent_hi)
        _exchange(transport, flat[lo:hi], flat[other[0]:other[1]], real_rank(newrank ^ mask), op)
        lo, hi = parent_lo, parent_hi

    # unfold
    if rank < 2 * extra:
        transport.isend(flat, rank - 1, op).wait()
