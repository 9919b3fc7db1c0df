"""In-place shared-memory all-reduce: tensors that live in a shared region need no staging copy.

For ranks of one host, and tensors inside a shared region (regions.py; DDP's gradient buckets
are allocated there). The split all-reduce (allreduce_two_shot.py) first copies each rank's tensor into
its staging half so the others can read it; here every rank reads the others' tensors where they
are. Same vocabulary: N ranks, slice j = ring_chunks(n, N) chunk j, owned by rank j.

Phases
    barrier   every rank's tensor is final (and every rank has published its fingerprint, with the
              region and offset: agree.py, staged; a mismatch raises on every rank here)
    reduce    rank r combines slice r of every other rank's tensor into slice r of its own, own first
              then the others in rank order (reduce_ops.reduce); avg divides by N
    scatter   rank r copies its finished slice r into slice r of every other rank's tensor
              (reduce and scatter go piece by piece, piece_bytes, so each piece is copied out
              while it is still in cache)
    barrier   every rank has scattered its slice: every tensor holds the whole result, and no rank
              touches another's tensor any more, so each may write its own again (the next backward
              accumulates into it)

Why two barriers are enough: slice r of rank j's tensor is read by rank r alone (in its reduce) and
written by rank r alone (in its scatter, each piece after it was read, on the same thread); rank j
reads and writes only its own slice j, and reads the others' slices j. So nothing is overwritten
while another rank may still read it. (Gathering instead, each rank copying slice j out of rank j,
would need a third barrier before anyone may go on: a rank's slices are read by the others after
it is done.)

Every element is computed once, by its owner, and copied: bit-identical on every rank, as in the
split all-reduce (same order within a slice: own first, then rank order).

Traffic (bytes read out of another rank's memory, metered as the split all-reduce's):
    bytes_received = bytes_sent = 2(N-1)/N * M
Memory traffic per rank, against the split all-reduce's: no stage (read M + write M saved);
reduce reads M and writes M/N; scatter reads M/N and writes (N-1)/N * M. The same two barriers.
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import FINGERPRINT_BYTES, Fingerprint, barrier_staged, compare_published
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport.shm import native

AGREE = "all_reduce/agree"

PIECE_BYTES = 512 << 10
"""The reduce and scatter go at most this many bytes at a time (divided among the ranks that share
a core: piece_bytes), so a finished piece is copied out while it is still in cache."""

IN_PLACE_FROM_BYTES = 256 << 10
"""Tensors in a shared region of at least this many bytes are all-reduced in place; smaller ones
take the direct all-reduce (allreduce_one_shot.py)."""


def piece_bytes(transport) -> int:
    """PIECE_BYTES, divided among the local ranks that share a core and so its cache."""
    return PIECE_BYTES // transport.ranks_per_core


def allreduce_in_place(flat: torch.Tensor, transport, views: list[torch.Tensor], *,
                              reduction: Reduction = SUM, fingerprint: Fingerprint | None = None,
                              spin: bool = False) -> None:
    """In-place all-reduce of ``flat``, which is ``views[rank]``; ``views[j]`` is rank j's copy."""
    op = "all_reduce/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    plan = _native_plan(flat, transport, reduction, fingerprint, spin)
    if plan is not None:   # the same phases in C (allreduce_in_place.c, beside this file)
        if transport.native(plan.run, flat.data_ptr(), fingerprint.sequence, [view.data_ptr() for view in views]) >= 0:
            compare_published(transport, fingerprint)   # raises the mismatch the core found
        transport.meter.record_exchanges(((other, FINGERPRINT_BYTES) for other in range(n_ranks) if other != rank),
                                         op=AGREE, control=True)
    else:
        _reduce_and_scatter(flat, transport, views, reduction, fingerprint, spin)
    if flat.numel() == 0:
        return
    chunks = ring_chunks(flat.numel(), n_ranks)
    esize = flat.element_size()
    for other in range(n_ranks):
        if other != rank:
            exchanged = (chunks.sizes[rank] + chunks.sizes[other]) * esize
            transport.meter.record_exchange(peer=other, received=exchanged, sent=exchanged, op=op)


def _native_plan(flat: torch.Tensor, transport, reduction: Reduction, fingerprint: Fingerprint | None, spin: bool):
    """The native core's plan for this call (kept per region, shape, op and spin), or None."""
    if fingerprint is None or transport.core is None:
        return None
    return transport.context.kept_plan(
        ("all_reduce_in_place", fingerprint.region, flat.numel(), flat.dtype, reduction.name, spin),
        native.plan, transport, native.IN_PLACE, flat.numel(), flat.dtype, reduction.name, fingerprint,
        "all_reduce/shared_memory", spin, False, piece_bytes(transport))


def _reduce_and_scatter(flat: torch.Tensor, transport, views: list[torch.Tensor], reduction: Reduction,
                        fingerprint: Fingerprint | None, spin: bool) -> None:
    """The phases in Python (the fallback, and the core's oracle)."""
    op = "all_reduce/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    barrier_staged(transport, fingerprint, op, spin)
    if flat.numel() == 0:
        return
    chunks = ring_chunks(flat.numel(), n_ranks)
    own = chunks.view(flat, rank)
    theirs = [chunks.view(views[other], rank) for other in range(n_ranks) if other != rank]
    piece_elems = max(1, piece_bytes(transport) // flat.element_size())   # in cache
    for start in range(0, own.numel(), piece_elems):
        length = min(piece_elems, own.numel() - start)
        piece = own.narrow(0, start, length)
        reduction.reduce(piece, [piece, *(other.narrow(0, start, length) for other in theirs)], n_ranks)
        for other in theirs:
            other.narrow(0, start, length).copy_(piece)
    transport.barrier(op, spin)
