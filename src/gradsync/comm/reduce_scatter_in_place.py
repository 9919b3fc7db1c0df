"""In-place reduce-scatter: inputs that live in a shared region are read where they lie.

For ranks of one host, and inputs inside a shared region (regions.py; ShardedOptimizer's
gradient buffers are allocated there). The staged reduce-scatter (reduce_scatter_staged.py) first
copies each whole input into a staging half; the single-copy one (reduce_scatter_single_copy.py)
reads each chunk through the kernel into a scratch buffer. Here rank r reads chunk r of every other
rank's input through its mapping of that rank's region: no copy in, no system call.

Vocabulary as reduce_scatter_staged.py: N ranks, n elements, chunk r = ring_chunks(n, N) chunk r,
the result rank r returns.

Phases
    barrier   every rank's input is final (and every rank has published its fingerprint, with the
              region and offset: agree.py, staged; a mismatch raises on every rank here)
    reduce    rank r folds chunk r of its own input and of the lowest other rank's into its result
              (one pass, no copy first), then combines chunk r of the remaining ranks' inputs in
              rank order; avg divides the finished chunk by N
    barrier   every rank has finished reading: only now may a rank return (and its caller write
              to its input again, as the next backward does)

Same order as the staged and single-copy reduce-scatters (own first, then rank order): same bits.

Traffic (bytes read out of another rank's memory, metered as the staged one):
    received from j = |chunk r|,  sent to j = |chunk j|
Memory traffic per rank: the staged one's, less its stage (read M + write M).
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import FINGERPRINT_BYTES, Fingerprint, barrier_staged, compare_published
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport.shm import native


def reduce_scatter_in_place(flat: torch.Tensor, transport, views: list[torch.Tensor], *,
                            reduction: Reduction = SUM, fingerprint: Fingerprint | None = None,
                            spin: bool = False) -> torch.Tensor:
    """This rank's reduced chunk (a new tensor) of ``flat``, which is ``views[rank]`` (unchanged);
    ``views[j]`` is rank j's input."""
    op = "reduce_scatter/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    chunks = ring_chunks(flat.numel(), n_ranks)
    shard = torch.empty(chunks.sizes[rank], dtype=flat.dtype)
    plan = None if fingerprint is None else transport.context.kept_plan(
        ("reduce_scatter_in_place", fingerprint.region, flat.numel(), flat.dtype, reduction.name, spin),
        native.plan, transport, native.REDUCE_SCATTER_IN_PLACE, flat.numel(), flat.dtype,
        reduction.name, fingerprint, op, spin, False)
    if plan is not None:   # the same phases in C (reduce_scatter_in_place.c, beside this file)
        if transport.native(plan.run, flat.data_ptr(), fingerprint.sequence, [view.data_ptr() for view in views],
                            shard.data_ptr()) >= 0:
            compare_published(transport, fingerprint)   # raises the mismatch the core found
        transport.meter.record_exchanges(((other, FINGERPRINT_BYTES) for other in range(n_ranks) if other != rank),
                                         op="reduce_scatter/agree", control=True)
    else:
        barrier_staged(transport, fingerprint, op, spin)
        theirs = [chunks.view(views[other], rank) for other in range(n_ranks) if other != rank]
        reduction.reduce(shard, [chunks.view(flat, rank), *theirs], n_ranks)   # own first
        transport.barrier(op, spin)
    esize = flat.element_size()
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=chunks.sizes[rank] * esize,
                                             sent=chunks.sizes[other] * esize, op=op)
    return shard
