"""Shared-memory all-reduce: every rank reads the others' contributions straight out of their memory.

For ranks of one host only (ShmTransport, GRADSYNC_TRANSPORT auto or shm). Point-to-point
algorithms make each byte travel: copied into a ring, copied or added out of it, once per step.
Here each rank copies its data once into its own staging half, and the reduction then reads every
rank's staging directly; no byte is forwarded.

Vocabulary
    N        ranks, all on this host; rank r
    S        bytes in one staging half (GRADSYNC_SHM_STAGE_MB); each rank has two
    piece    a run of at most S bytes of the tensor, processed start to end; pieces alternate between
             the two halves (see ShmTransport.next_half)
    slice    slice j of a piece is ring_chunks(piece, N) chunk j; rank j reduces it

Messages below direct_below(transport) take the direct all-reduce instead (allreduce_shared_direct.py:
one barrier, every rank folds every input itself): DIRECT_BELOW_BYTES, with two ranks
TWO_RANKS_DIRECT_BELOW_BYTES, within one staging half. The rest go piece by piece:

Phases, per piece
    stage     rank r copies its piece into its staging half (the first piece also its fingerprint:
              the agreement travels with the data, agree.py's staged check)
    barrier   every piece is staged (first piece: every rank compares every rank's fingerprint
              before reading anything)
    reduce    rank r combines slice r of every other rank's staging into slice r of its own (adds,
              for op sum; reduce_ops.py), in rank order, starting from its own: the result is
              computed once, by its owner, so every rank ends bit-identical; avg divides it by N
    barrier   every slice is reduced
    gather    rank r copies slice j of rank j's staging into its tensor, for every j
No third barrier: the next piece uses the other half, and the next piece's first barrier is only
passed once every rank has finished this piece's gather, so a half is never overwritten while read.

Traffic (bytes read out of another rank's memory, which is what the meter records; a divisible
tensor of M bytes): rank r reads slice r from N-1 ranks and slice j from rank j, so
    bytes_received = bytes_sent = 2(N-1)/N * M      (the ring's figure, with no forwarding)
Memory traffic per rank: read M + write M (stage), read M + write M/N (reduce), read M + write M
(gather) -- against the ring's (N-1) copies into rings, (N-1) reductions and (N-1) copies out.
Time: T = ceil(M/S) * (2 barriers + (M/S)-sized copies); barriers cost a doorbell each way.
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, compare_published
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.allreduce_shared_direct import allreduce_shared_direct
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Transport

DIRECT_BELOW_BYTES = 1 << 20
"""Messages smaller than this (and fitting one staging half) take the direct all-reduce: against the
single-copy one (three barriers), one barrier saved is worth more than the (N-1) x M reads up to
here (2 cores, median of 40 calls, 16:55 UTC: N=2 256 KiB 86 against 138 us, 512 KiB 140 against
197 us, 1 MiB 335 against 310 us; N=4 512 KiB 0.79-0.82 against 0.89-0.92 ms, 1 MiB 1.48-1.51
against 1.26-1.37 ms; N=8 the same crossing)."""

TWO_RANKS_DIRECT_BELOW_BYTES = 2 << 20
"""With two ranks the direct all-reduce takes messages below this (and fitting one staging half).
It folds all M bytes on each rank where the others fold M/2, but it has one barrier against two,
and no kernel copies (the single-copy one reads and writes through the kernel, page by page).
Blocks of 50 calls alternating in one world, each call's result checked after it as the bench
does (docs/benchmarks.md, "The own input read where it lies, and two ranks direct up to 2 MiB"),
direct against single-copy, us: 512 KiB 172 and 201 against 197 and 250; 1 MiB 402 and 361
against 445 and 378; 2 MiB 556 and 548 against 573 and 531; 4 MiB 1,613 and 2,101 against 1,189
and 1,550 (it reads and writes more memory, which costs more the colder the caches: without the
checks it was 3-6% ahead there). Against the split all-reduce (single-copy reads off), without
checks: 1 MiB 285-451 against 432-574 us, 2 MiB 483-547 against 788-918."""


def direct_below(transport) -> int:
    """Messages of fewer bytes than this take the direct all-reduce: DIRECT_BELOW_BYTES, or with two
    ranks TWO_RANKS_DIRECT_BELOW_BYTES, and at most one staging half."""
    below = TWO_RANKS_DIRECT_BELOW_BYTES if transport.world_size == 2 else DIRECT_BELOW_BYTES
    return min(below, transport.stage_bytes + 1)


def layout_error(transport: Transport) -> str | None:
    """None when the shared-memory all-reduce can run on ``transport``, else why not."""
    local = getattr(transport, "local_ranks", ())
    if len(local) != transport.world_size or not hasattr(transport, "stage"):
        return ("the shared-memory all-reduce needs every rank on this host and the shared-memory transport "
                "(GRADSYNC_TRANSPORT=auto or shm)")
    return None


def allreduce_shared(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                     fingerprint: Fingerprint | None = None, spin: bool = False) -> None:
    """In-place all-reduce of a 1-D contiguous CPU tensor through the ranks' staging halves;
    ``fingerprint``: agree on it with the first piece; ``spin``: barriers may spin (shm.py)."""
    op = "all_reduce/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    esize = flat.element_size()
    if flat.numel() * esize < direct_below(transport):
        allreduce_shared_direct(flat, transport, reduction=reduction, fingerprint=fingerprint, spin=spin)
        return
    piece_elems = transport.stage_bytes // esize
    # bytes this rank reads out of each other rank's staging; by symmetry, also what that rank reads
    # out of ours (slice r of theirs and slice j of ours, against slice j of ours and slice r of theirs)
    exchanged = [0] * n_ranks
    for start in range(0, flat.numel(), piece_elems):
        piece = flat.narrow(0, start, min(piece_elems, flat.numel() - start))
        half = transport.next_half()
        stages = transport.staged_views(half, piece.numel() * esize, flat.dtype)
        chunks = ring_chunks(piece.numel(), n_ranks)
        # stage
        stages[rank].copy_(piece)
        if fingerprint is not None and start == 0:
            transport.publish(fingerprint.values())
        transport.barrier(op, spin)
        if fingerprint is not None and start == 0:
            compare_published(transport, fingerprint)
        # reduce
        own = chunks.view(stages[rank], rank)
        for other in range(n_ranks):
            if other != rank:
                reduction.combine(own, chunks.view(stages[other], rank))
        reduction.finish(own, n_ranks)
        transport.barrier(op, spin)
        # gather
        for owner in range(n_ranks):
            chunks.view(piece, owner).copy_(chunks.view(stages[owner], owner))
        for other in range(n_ranks):
            exchanged[other] += (chunks.sizes[rank] + chunks.sizes[other]) * esize
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=exchanged[other], sent=exchanged[other], op=op)
