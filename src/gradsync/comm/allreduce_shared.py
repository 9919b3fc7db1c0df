"""Shared-memory all-reduce: each rank stages only what the others need, and keeps its own slice home.

For ranks of one host only (ShmTransport, GRADSYNC_TRANSPORT auto or shm). Point-to-point
algorithms make each byte travel: copied into a ring, copied or added out of it, once per step.
Here each rank copies into its staging area only the slices the others reduce, folds its own slice
where it lies (in its tensor), posts the result beside them, and copies the others' results out of
their areas; no byte is forwarded.

Vocabulary
    N        ranks, all on this host; rank r
    S        bytes in one staging half (GRADSYNC_SHM_STAGE_MB); each rank has two
    region   region j of a half is its j-th N-th (R = S/N bytes, rounded down to 64): whatever is
             staged for rank j, or on rank j itself its result, lies at the same place in every piece
    piece    a run of at most N x R bytes of the tensor, processed start to end
    slice    slice j of a piece is ring_chunks(piece, N) chunk j; rank j reduces it

Messages below direct_below(transport) take the direct all-reduce instead (allreduce_shared_direct.py:
one barrier, every rank folds every input itself): DIRECT_BELOW_BYTES, with two ranks
TWO_RANKS_DIRECT_BELOW_BYTES, within one staging half. The rest go piece by piece:

Phases, per piece
    stage     rank r copies slice j of its piece into region j of its half, for every j != r (the first
              piece also its fingerprint: the agreement travels with the data, agree.py's staged check)
    barrier   every piece is staged (first piece: every rank compares every rank's fingerprint
              before reading anything)
    reduce    rank r combines region r of every other rank's half into slice r of its own tensor (adds,
              for op sum; reduce_ops.py), own first, then the others in rank order: the result is
              computed once, by its owner, so every rank ends bit-identical; avg divides it by N;
              then it posts the result in region r of its own half
    barrier   every slice is reduced and posted
    gather    rank r copies region j of rank j's half into slice j of its tensor, for every j != r

Why two barriers per piece are enough: region j (j != r) of rank r's half is read by rank j alone,
in its reduce, before the piece's second barrier; rank r writes it again only in the next piece's
stage, after that barrier. Region r is read by every other rank in its gather, before it enters
the next piece's first barrier; rank r writes it again only in the next piece's reduce, after that
barrier. Every slice of every piece lies at its region's start (R is a multiple of 64 bytes, so of
every dtype's size), so a short last piece, or a piece of another call, size or dtype, touches no
other region. So the next split all-reduce may use the same half with no barrier in between, and
does (ShmTransport.split_half): one half stays warm in cache. Any other collective that stages
takes the other half (next_half), as a split does after one: their staging lies elsewhere.

Traffic (bytes read out of another rank's memory, which is what the meter records; a divisible
tensor of M bytes): rank r reads slice r from N-1 ranks and slice j from rank j, so
    bytes_received = bytes_sent = 2(N-1)/N * M      (the ring's figure, with no forwarding)
Memory traffic per rank: read + write (N-1)/N * M (stage), read M + write M/N (reduce), read + write
M/N (post), read + write (N-1)/N * M (gather): one copy of the tensor in and out, against two for a
split that stages and gathers whole pieces. Reading the others' tensors where they lie instead,
through the kernel (single_copy.py, as the reduce-scatter does), saves the stage but each kernel copy
costs 2.7x a copy here; that all-reduce (two kernel copies per byte) was slower at every size from
2 MiB to 64 MiB with 2, 3 and 4 ranks (docs/benchmarks.md, "Staged again").
Time: T = ceil(M/(N R)) * (2 barriers + copies of about 2M/ceil(M/(N R)) bytes).
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, compare_published
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.allreduce_shared_direct import allreduce_shared_direct
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport import Transport

DIRECT_BELOW_BYTES = 2 << 20
"""Messages smaller than this (and fitting one staging half) take the direct all-reduce: one barrier
against three, worth more than the (N-1) x M it reads up to here. Timed on this 2-core host
(2026-12-03, blocks of 40 calls alternating, each call's result checked after it as the bench does,
medians of the three blocks' medians, slowest rank, us), direct against this split: N=3 1 MiB 454
against 614, 1.5 MiB 625 against 757, 2 MiB 825 against 964; N=4 1 MiB 546 against 679, 1.5 MiB 808
against 872, 2 MiB 1,194 against 1,253, 3 MiB 1,947 against 1,681; N=8 1 MiB 1,924 against 2,662,
2 MiB 4,113 against 3,930."""

TWO_RANKS_DIRECT_BELOW_BYTES = 3 << 20
"""With two ranks the direct all-reduce takes messages below this (and fitting one staging half):
it folds all M bytes on each rank where the split folds M/2, but it has one barrier against three.
Timed as DIRECT_BELOW_BYTES, direct against this split, us: 256 KiB 70 against 126 (interleaved
calls), 1 MiB 95 against 158 (interleaved), 2 MiB 206 against 296, 2.5 MiB 277 against 306, 3 MiB
364 against 364, 4 MiB 594 against 544."""


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


def _region_elems(transport, dtype: torch.dtype) -> int:
    """Elements in one region of a staging half: S/N bytes, rounded down to 64 (a multiple of every
    dtype's size, so regions lie at the same bytes whatever the dtype)."""
    region_bytes = transport.stage_bytes // transport.world_size // 64 * 64
    if region_bytes == 0:
        raise RuntimeError(f"all_reduce: staging halves of {transport.stage_bytes} bytes are too small for "
                           f"{transport.world_size} ranks (at least 64 bytes each); set GRADSYNC_SHM_STAGE_MB "
                           f"to at least {64 * transport.world_size / (1 << 20):.6f}")
    return region_bytes // dtype.itemsize


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
    region = _region_elems(transport, flat.dtype)
    half = transport.split_half()
    halves = transport.staged_views(half, n_ranks * region * esize, flat.dtype)
    regions = [[halves[j].narrow(0, i * region, region) for i in range(n_ranks)] for j in range(n_ranks)]
    # bytes this rank reads out of each other rank's staging; by symmetry, also what that rank reads
    # out of ours (region r of theirs and region j of ours, against region j of ours and region r of theirs)
    exchanged = [0] * n_ranks
    for start in range(0, flat.numel(), n_ranks * region):
        piece = flat.narrow(0, start, min(n_ranks * region, flat.numel() - start))
        chunks = ring_chunks(piece.numel(), n_ranks)
        sizes = chunks.sizes
        # stage
        for other in range(n_ranks):
            if other != rank:
                regions[rank][other][:sizes[other]].copy_(chunks.view(piece, other))
        if fingerprint is not None and start == 0:
            transport.publish(fingerprint.values())
        transport.barrier(op, spin)
        if fingerprint is not None and start == 0:
            compare_published(transport, fingerprint)
        # reduce, then post
        own = chunks.view(piece, rank)
        for other in range(n_ranks):
            if other != rank:
                reduction.combine(own, regions[other][rank][:sizes[rank]])
        reduction.finish(own, n_ranks)
        regions[rank][rank][:sizes[rank]].copy_(own)
        transport.barrier(op, spin)
        # gather
        for owner in range(n_ranks):
            if owner != rank:
                chunks.view(piece, owner).copy_(regions[owner][owner][:sizes[owner]])
        for other in range(n_ranks):
            exchanged[other] += (sizes[rank] + sizes[other]) * esize
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=exchanged[other], sent=exchanged[other], op=op)
