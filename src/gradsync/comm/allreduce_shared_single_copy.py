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

PIECE_BYTES = 512 << 10
"""The reduce phase reads, combines and scatters at most this many bytes at a time (the scratch
buffer's size), so a piece read in is combined and written out while it is still in this core's
2 MiB L2. Alternating runs of `gradsync bench collectives --sizes 1M,2M,4M,16M,64M --algorithms
shared_memory` (2026-12-01, medians of 3 x 10 calls, ms). 512 KiB pieces against 8 MiB ones, the
scatter after the whole slice (06:58 UTC): N=2 16 MiB 3.31 against 3.81, 64 MiB 21.1 against 21.8;
N=4 4 MiB 4.28 against 4.50, 16 MiB 15.6 against 18.6, 64 MiB 54.6 against 61.1; 2 MiB level;
128 KiB and 256 KiB level with 512 KiB. Then each piece scattered as soon as it is finished,
against after the whole slice (07:01 UTC): N=2 4 MiB 0.75 against 0.82, 16 MiB 2.75 against 3.08,
64 MiB 16.9 against 20.7; N=4 4 MiB 3.88 against 4.66, 16 MiB 13.9 against 15.9, 64 MiB 48.2
against 52.2; 1 MiB level. (With the earlier three-barrier gather by reads, 8 MiB pieces had
measured faster than 256 KiB ones: 3.1-3.3 against 4.4-4.8 ms a call.) Where R ranks share a
core they share its L2 too, so pieces are PIECE_BYTES / R (piece_bytes): 4 ranks on 2 cores with
256 KiB against 512 KiB pieces (08:35 UTC, medians of 4 runs alternating): 4 MiB 3.83 against 4.17
ms, 16 MiB 11.1 against 13.5 ms, 64 MiB 40.1 against 45.0 ms; 1 MiB level. At N=2 256 KiB was no
better (4 MiB 0.60 against 0.57 ms, 16 MiB level)."""


def from_bytes(transport) -> int:
    """All-reduces of at least this many bytes run here where single-copy reads are allowed:
    FROM_BYTES, and with two ranks only what does not take the direct all-reduce
    (allreduce_shared.direct_below)."""
    if transport.world_size == 2:
        return max(FROM_BYTES, direct_below(transport))
    return FROM_BYTES


def piece_bytes(transport) -> int:
    """PIECE_BYTES, divided among the local ranks that share a core and so its cache."""
    return PIECE_BYTES // getattr(transport, "ranks_per_core", 1)


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
