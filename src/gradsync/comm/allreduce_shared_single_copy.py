"""Single-copy shared-memory all-reduce: every rank reads the others' tensors where they lie, and
writes its share of the result straight into them.

For ranks of one host whose kernel allows cross-memory reads (single_copy.py; ShmTransport agrees on
it at set-up) and tensors outside shared regions: torch's own DDP buckets, a user's tensor. The
split all-reduce (allreduce_shared.py) copies each tensor into a staging half so the others can read
it, and copies the result back out; here each rank publishes its tensor's address, and the others
read it with process_vm_readv and write into it with process_vm_writev, one kernel copy each.
Same vocabulary as the in-place all-reduce (allreduce_shared_in_place.py): N ranks, slice j =
ring_chunks(n, N) chunk j, owned by rank j.

Phases
    barrier   every rank's tensor is final, and every rank has published its fingerprint with the
              tensor's address (agree.py, staged; a mismatch raises on every rank here)
    reduce    rank r folds slice r of every other rank into slice r of its own, own first, then the
              others in rank order; piece by piece (PIECE_BYTES): read the piece of rank j into a
              private scratch buffer, combine it into the own piece (avg: then divide by N)
    scatter   as soon as a piece is finished, rank r writes it straight into the same place in every
              other rank's tensor (process_vm_writev), while it is still in this core's cache
    barrier   every rank has written its slice everywhere: every tensor holds the whole result, and
              no rank touches another's memory any more, so each may return (and its caller write
              or free the tensor)

Why two barriers are enough: slice r of rank j's tensor is read by rank r alone (in its reduce),
and written by rank r alone (in its scatter, each piece after that piece was read, on the same
thread); rank j itself reads and writes only its own slice j and reads the others' slices j. So no
byte is written while another rank may still read it, and every byte a rank reads stays as it was
until the second barrier. (Gathering by reads instead, each rank reading slice j out of rank j, would need a third
barrier before anyone may return: a rank's result slices are read by the others after it is done.)

Every element is computed once, by its owner, and copied: bit-identical on every rank, in the same
order within a slice as the in-place all-reduce.

Traffic (bytes moved between ranks' memories, metered as the other shared-memory all-reduces):
    bytes_received = bytes_sent = 2(N-1)/N * M
Memory traffic per rank, M bytes: the reads (N-1)/N * M into scratch, the reduction's own slice,
and its slice written N-1 times, each piece from cache (as many bytes as the (N-1)/N * M written
into this rank's tensor by the others), against the split all-reduce's stage (read M + write M),
reduce (read M, write M/N) and gather (read M + write M). Two barriers, against two per staging
half.
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, offer_staged
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.allreduce_shared import direct_below
from gradsync.comm.reduce_ops import SUM, Reduction

FROM_BYTES = 512 << 10
"""Where single-copy reads are allowed, an all-reduce of at least this many bytes runs here; smaller
ones take the direct all-reduce (allreduce_shared_direct.py: one barrier, every rank folds every
input). Timed on this 2-core host, medians of 3 runs of 30 calls (2026-12-01 06:43 UTC), direct
against this one: N=2 128 KiB 34 against 48 us, 256 KiB 55 against 61, 512 KiB 107 against 106;
N=4 512 KiB 857 against 721 us. (Without single-copy reads the staged split all-reduce takes over
at allreduce_shared.DIRECT_BELOW_BYTES, 1 MiB: it has a copy in and out more.)"""

PIECE_BYTES = 2 << 20
"""The reduce phase reads, combines and scatters at most this many bytes at a time (the scratch
buffer's size). Each piece costs two kernel copies per peer, and each kernel copy a fixed cost
(the system call, the peer's pages looked up and pinned) besides its bytes: 2 ranks, 4 MiB, one
world, medians of 32 calls, three rounds (2026-12-03, us): 128 KiB pieces 1,056-1,087, 256 KiB
870-894, 512 KiB 778-800, 1 MiB 723-757, 2 MiB 694-722. Then `gradsync bench collectives
--algorithms auto --reps 30`, 512 KiB (the tree before) and 2 MiB alternating, three runs each,
medians: N=2 4 MiB 840 -> 762 us, 16 MiB 3.67 -> 3.67 ms, 64 MiB 12.6 -> 12.6 ms; N=4 (1 MiB
pieces, below) 4 MiB 3.32 -> 3.00 ms, 16 MiB 10.4 -> 9.7 ms, 1 MiB level. (8 MiB pieces had
been slower: N=2 16 MiB 3.81 against 3.31 ms with 512 KiB, 2026-12-01.) Each piece is scattered
as soon as it is finished, not after the whole slice (2026-12-01 07:01 UTC, 512 KiB pieces: N=2
4 MiB 0.75 against 0.82 ms, 16 MiB 2.75 against 3.08, 64 MiB 16.9 against 20.7; N=4 4 MiB 3.88
against 4.66, 16 MiB 13.9 against 15.9). Where R ranks share a core they share its cache too, so
pieces are PIECE_BYTES / R (piece_bytes): with 4 ranks on 2 cores 1 MiB pieces against 2 MiB ones
(2026-12-03, one world, medians of 32 calls, three rounds): 4 MiB 2.59-2.77 against 2.62-2.75 ms,
16 MiB 8.9-9.2 against 9.1-9.2 ms."""


def from_bytes(transport) -> int:
    """All-reduces of at least this many bytes run here where single-copy reads are allowed:
    FROM_BYTES, and with two ranks only what does not take the direct all-reduce
    (allreduce_shared.direct_below)."""
    if transport.world_size == 2:
        return max(FROM_BYTES, direct_below(transport))
    return FROM_BYTES


def piece_bytes(transport, whole: int = PIECE_BYTES) -> int:
    """``whole`` (PIECE_BYTES), divided among the local ranks that share a core and so its cache."""
    return whole // getattr(transport, "ranks_per_core", 1)


def allreduce_shared_single_copy(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                                 fingerprint: Fingerprint | None = None, spin: bool = False) -> None:
    """In-place all-reduce of the 1-D contiguous CPU tensor ``flat`` (``transport.single_copy`` True)."""
    op = "all_reduce/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    addresses = offer_staged(transport, flat, fingerprint, op, spin)
    esize = flat.element_size()
    chunks = ring_chunks(flat.numel(), n_ranks)
    own = chunks.view(flat, rank)
    piece_elems = max(1, piece_bytes(transport) // esize)
    scratch = transport.scratch(min(own.numel(), piece_elems) * esize).view(flat.dtype)
    for start in range(0, own.numel(), piece_elems):
        piece = own.narrow(0, start, min(piece_elems, own.numel() - start))
        theirs = scratch[:piece.numel()]
        offset = (chunks.offsets[rank] + start) * esize
        for other in range(n_ranks):
            if other != rank:
                transport.read_from(other, addresses[other] + offset, theirs, op)
                reduction.combine(piece, theirs)
        reduction.finish(piece, n_ranks)
        for other in range(n_ranks):
            if other != rank:
                transport.write_to(other, addresses[other] + offset, piece, op)
    transport.barrier(op, spin)
    for other in range(n_ranks):
        if other != rank:
            exchanged = (chunks.sizes[rank] + chunks.sizes[other]) * esize
            transport.meter.record_exchange(peer=other, received=exchanged, sent=exchanged, op=op)
