"""Binomial-tree broadcast: the source's tensor reaches every rank in ceil(log2 N) rounds.

Vocabulary
    src       the rank that holds the data
    relative  a rank's distance from src around the ring: (rank - src) mod N; the tree is built on
              relative ranks, so any src works the same way
    lowbit    the lowest set bit of a relative rank; relative rank v receives from v - lowbit(v)
              and then sends to v + m for m = lowbit/2, lowbit/4, ..., 1 (relative 0: every power
              of two below N), farthest first so the longest branch starts earliest

Traffic: every rank except src receives M once; a rank with k children sends k*M (src sends
ceil(log2 N)*M at most). T = ceil(log2 N) * (alpha + M*beta).
"""

from __future__ import annotations

import torch

from gradsync.comm.transport import Transport, wait_all


def _lowbit(value: int) -> int:
    return value & -value


def broadcast_binomial(flat: torch.Tensor, src: int, transport: Transport, op: str = "broadcast/binomial") -> None:
    """Overwrite ``flat`` on every rank with its value on ``src`` (1-D, contiguous)."""
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    relative = (rank - src) % n_ranks
    if relative == 0:
        top = 1 << (n_ranks - 1).bit_length()  # first power of two >= N
    else:
        top = _lowbit(relative)
        transport.irecv(flat, (relative - top + src) % n_ranks, op).wait()
    sends = []
    child_distance = top >> 1
    while child_distance >= 1:
        if relative + child_distance < n_ranks:
            sends.append(transport.isend(flat, (relative + child_distance + src) % n_ranks, op))
        child_distance >>= 1
    wait_all(sends)
