"""Linear gather and scatter through one root, and pairwise all-to-all.

Vocabulary
    root     the rank that collects (gather) or hands out (scatter) one piece per rank
    piece    rank r's part: piece r of the root's list
    step     all-to-all round s = 1..N-1: rank r sends its piece for (r+s) mod N and receives the
             piece (r-s) mod N has for it, so every pair exchanges exactly once

Traffic and time (M: bytes of one piece)
    gather, scatter   the root receives (sends) (N-1)*M; every other rank sends (receives) M;
                      T = (N-1)*(alpha + M*beta) at the root, whose link serialises everything
    all-to-all        every rank sends and receives (N-1) pieces; T = (N-1)*(alpha + M*beta)
All receives are posted before any wait, so arrival order never matters.
"""

from __future__ import annotations

import torch

from gradsync.comm.transport import Transport, wait_all


def gather_linear(piece: torch.Tensor, gathered: list[torch.Tensor] | None, root: int, transport: Transport,
                  op: str = "gather/linear") -> None:
    """On ``root``, fill gathered[r] with rank r's ``piece`` (contiguous); elsewhere send it to root."""
    if transport.rank != root:
        transport.isend(piece, root, op).wait()
        return
    assert gathered is not None and len(gathered) == transport.world_size
    handles = [transport.irecv(gathered[peer], peer, op) for peer in range(transport.world_size) if peer != root]
    gathered[root].copy_(piece)
    wait_all(handles)


def scatter_linear(piece: torch.Tensor, pieces: list[torch.Tensor] | None, root: int, transport: Transport,
                   op: str = "scatter/linear") -> None:
    """Fill ``piece`` on every rank with pieces[rank] of ``root``'s list (contiguous tensors)."""
    if transport.rank != root:
        transport.irecv(piece, root, op).wait()
        return
    assert pieces is not None and len(pieces) == transport.world_size
    sends = [transport.isend(pieces[peer], peer, op) for peer in range(transport.world_size) if peer != root]
    piece.copy_(pieces[root])
    wait_all(sends)


def alltoall_pairwise(received: list[torch.Tensor], sent: list[torch.Tensor], transport: Transport,
                      op: str = "all_to_all/pairwise") -> None:
    """received[r] on this rank <- sent[this rank] on rank r, for every r (contiguous tensors)."""
    n_ranks, rank = transport.world_size, transport.rank
    received[rank].copy_(sent[rank])
    sends, recvs = [], []
    for step in range(1, n_ranks):
        to, source = (rank + step) % n_ranks, (rank - step) % n_ranks
        sends.append(transport.isend(sent[to], to, op))
        recvs.append(transport.irecv(received[source], source, op))
    wait_all(recvs + sends)
