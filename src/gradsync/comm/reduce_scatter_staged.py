"""Staged reduce-scatter over shared memory: every rank reduces its own chunk straight out of the others'
staging (its C variant beside it: reduce_scatter_staged.c).

For ranks of one host (ShmTransport). The ring reduce-scatter forwards partial sums N-1 times; here
each rank stages its whole input once and then reads only its own chunk from every other rank.

Vocabulary (as allreduce_two_shot.py): N ranks; n elements; chunk r = ring_chunks(n, N) chunk r, the
result rank r returns; piece = at most S bytes of the input (one staging half), pieces alternating
between the two halves.

Per piece
    stage     rank r copies the piece of its input into its staging half (the first piece also its
              fingerprint: agree.py, staged)
    barrier   every rank has staged (first piece: fingerprints compared before anything is read)
    reduce    rank r folds the part of chunk r inside this piece from every rank's staging, own
              first, then the others in rank order, into its result
No closing barrier (as the direct all-reduce): a half is staged into again two pieces later, after
a barrier no rank passes before every rank has read it. avg divides the finished chunk by N.

Traffic (bytes read out of another rank's memory): rank r reads its chunk from each other rank and
each other rank j reads chunk j from r:
    received from j = |chunk r|,  sent to j = |chunk j|;  total sent = M - |chunk r|, about (N-1)/N * M
    (the ring reduce-scatter's figure, with no forwarding)
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import FINGERPRINT_BYTES, Fingerprint, compare_published
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport.shm import native


def reduce_scatter_staged(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                          fingerprint: Fingerprint | None = None, spin: bool = False) -> torch.Tensor:
    """This rank's reduced chunk (a new tensor) of the 1-D contiguous CPU tensor ``flat`` (unchanged)."""
    op = "reduce_scatter/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    esize = flat.element_size()
    chunks = ring_chunks(flat.numel(), n_ranks)
    shard = torch.empty(chunks.sizes[rank], dtype=flat.dtype)
    plan = None if fingerprint is None else transport.context.kept_plan(
        ("reduce_scatter_staged", flat.numel(), flat.dtype, reduction.name, spin),
        native.plan, transport, native.REDUCE_SCATTER_STAGED, flat.numel(), flat.dtype,
        reduction.name, fingerprint, op, spin, False)
    if plan is not None:   # the same phases in C (reduce_scatter_staged.c, beside this file)
        if transport.native(plan.run, flat.data_ptr(), fingerprint.sequence, None, shard.data_ptr()) >= 0:
            compare_published(transport, fingerprint)   # raises the mismatch the core found
        transport.meter.record_exchanges(((other, FINGERPRINT_BYTES) for other in range(n_ranks) if other != rank),
                                         op="reduce_scatter/agree", control=True)
    else:
        _stage_and_reduce(flat, transport, shard, reduction, fingerprint, spin)
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=chunks.sizes[rank] * esize,
                                             sent=chunks.sizes[other] * esize, op=op)
    return shard


def _stage_and_reduce(flat: torch.Tensor, transport, shard: torch.Tensor, reduction: Reduction,
                      fingerprint: Fingerprint | None, spin: bool) -> None:
    """The phases in Python (the fallback, and the core's oracle), into ``shard``."""
    op = "reduce_scatter/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    esize = flat.element_size()
    chunks = ring_chunks(flat.numel(), n_ranks)
    low, high = chunks.offsets[rank], chunks.offsets[rank] + chunks.sizes[rank]
    piece_elems = transport.stage_bytes // esize
    for start in range(0, max(flat.numel(), 1), piece_elems):
        length = min(piece_elems, flat.numel() - start)
        stages = transport.staged_views(transport.next_half(), length * esize, flat.dtype)
        stages[rank].copy_(flat.narrow(0, start, length))
        if fingerprint is not None and start == 0:
            transport.publish(fingerprint.values())
        transport.barrier(op, spin)
        if fingerprint is not None and start == 0:
            compare_published(transport, fingerprint)
        lo, hi = max(low, start), min(high, start + length)
        if lo < hi:
            out = shard.narrow(0, lo - low, hi - lo)
            parts = [stage.narrow(0, lo - start, hi - lo) for stage in stages]
            order = [rank] + [r for r in range(n_ranks) if r != rank]   # N >= 2: a world of one never comes here
            reduction.reduce(out, [parts[r] for r in order], n_ranks)
