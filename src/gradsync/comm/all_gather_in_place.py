"""In-place all-gather: each rank's shard already lies in its chunk of a shared-region tensor, and
the others copy it out of there.

For ranks of one host, and a tensor inside a shared region (regions.py; ShardedOptimizer keeps
its parameters there). The staged and single-copy all-gathers (all_gather_staged.py,
all_gather_single_copy.py) return a new tensor, which the caller copies where it is needed; here
the result is written there, into the parameters.

Vocabulary: N ranks; n elements; chunk r = ring_chunks(n, N) chunk r (allreduce_ring.py), written
by rank r before the call.

Phases
    barrier   every rank's chunk is written (and every rank has published its fingerprint, with the
              region and offset: agree.py, staged; a mismatch raises on every rank here)
    copy      rank r copies chunk j of rank j's tensor into chunk j of its own, for every j != r
    barrier   every rank has finished copying: only now may a rank return and let its caller write
              its chunk again

Traffic (bytes read out of another rank's memory, as the staged all-gather's):
    received from j = |chunk j|,  sent to j = |chunk r|
Memory traffic per rank: read and write (N-1)/N * M; the staged one also stages the shard and
writes a new tensor of M bytes, which the caller then copies.
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import FINGERPRINT_BYTES, Fingerprint, barrier_staged, compare_published
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.transport.shm import native


def all_gather_in_place(flat: torch.Tensor, transport, views: list[torch.Tensor], *,
                        fingerprint: Fingerprint | None = None, spin: bool = False) -> None:
    """Fill every chunk of ``flat`` (which is ``views[rank]``) from its owner's ``views[j]``."""
    op = "all_gather/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    chunks = ring_chunks(flat.numel(), n_ranks)
    plan = None if fingerprint is None else transport.context.kept_plan(
        ("all_gather_in_place", fingerprint.region, flat.numel(), flat.dtype, spin),
        native.plan, transport, native.ALL_GATHER_IN_PLACE, flat.numel(), flat.dtype,
        "none", fingerprint, op, spin, False)
    if plan is not None:   # the same phases in C (all_gather_in_place.c, beside this file)
        if transport.native(plan.run, flat.data_ptr(), fingerprint.sequence, [view.data_ptr() for view in views]) >= 0:
            compare_published(transport, fingerprint)   # raises the mismatch the core found
        transport.meter.record_exchanges(((other, FINGERPRINT_BYTES) for other in range(n_ranks) if other != rank),
                                         op="all_gather/agree", control=True)
    else:
        barrier_staged(transport, fingerprint, op, spin)
        for owner in range(n_ranks):
            if owner != rank:
                chunks.view(flat, owner).copy_(chunks.view(views[owner], owner))
        transport.barrier(op, spin)
    esize = flat.element_size()
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=chunks.sizes[other] * esize,
                                             sent=chunks.sizes[rank] * esize, op=op)
