"""Single-copy reduce-scatter: every rank reduces its own chunk straight out of the others' inputs.

For ranks of one host whose kernel allows cross-memory reads (single_copy.py) and inputs of
single_copy.FROM_BYTES or more. The staged reduce-scatter (reduce_scatter_staged.py) copies each
whole input into a staging half first; here each rank publishes its input's address and the others
read only the chunk they reduce, with process_vm_readv, in one kernel copy.

Vocabulary as reduce_scatter_staged.py: N ranks, n elements, chunk r = ring_chunks(n, N) chunk r,
the result rank r returns.

Phases
    barrier   every rank's input is final, and every rank has published its fingerprint with the
              input's address (agree.py, staged)
    reduce    piece by piece (at most PIECE_BYTES of chunk r): rank r starts from its own input's
              piece, then for every other rank j in rank order reads j's piece into a scratch buffer
              and combines it in (float16/bfloat16 sums into a float32 accumulator, rounded once:
              reduce_ops.py); avg divides the finished piece by N
    barrier   every rank has finished reading: only now may a rank return (and its caller write to
              or free its input)

Same order as the staged reduce-scatter (own first, then rank order), so the same bits.

A rank whose input cannot be read where it lies (single_copy.readable: pinned memory a driver mapped
as device memory) publishes address 0; every rank sees it after the first barrier, reads nothing and
returns None, and the caller runs the staged reduce-scatter instead (collectives.py), every rank alike.

Traffic (bytes read out of another rank's memory, metered as the staged one):
    received from j = |chunk r|,  sent to j = |chunk j|
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, offer_staged
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.transport.shm import single_copy

PIECE_BYTES = 512 << 10
"""Bytes read into the scratch buffer at a time: the split all-reduce's region size; 2 MiB was no
better (docs/studies/staging-or-single-copy.md, "The reduce-scatter's pieces")."""


def reduce_scatter_single_copy(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                               fingerprint: Fingerprint | None = None, spin: bool = False) -> torch.Tensor | None:
    """This rank's reduced chunk (a new tensor) of the 1-D contiguous CPU tensor ``flat`` (unchanged);
    None, on every rank, where some rank's input cannot be read where it lies (module docstring)."""
    op = "reduce_scatter/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    addresses = offer_staged(transport, flat, fingerprint, op, spin,
                             address=flat.data_ptr() if single_copy.readable(flat) else 0)
    if 0 in addresses:
        return None
    esize = flat.element_size()
    chunks = ring_chunks(flat.numel(), n_ranks)
    shard = chunks.view(flat, rank).clone()
    piece_elems = max(1, PIECE_BYTES // esize)
    scratch = transport.scratch(min(shard.numel(), piece_elems) * esize).view(flat.dtype)
    for start in range(0, shard.numel(), piece_elems):   # own first, then the others in rank order
        piece = shard.narrow(0, start, min(piece_elems, shard.numel() - start))
        acc = reduction.accumulator(piece)
        theirs = scratch[:piece.numel()]
        for other in range(n_ranks):
            if other != rank:
                transport.read_from(other, addresses[other] + (chunks.offsets[rank] + start) * esize, theirs, op)
                reduction.combine(acc, theirs)
        reduction.settle(piece, acc, n_ranks)
    transport.barrier(op, spin)
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=chunks.sizes[rank] * esize,
                                             sent=chunks.sizes[other] * esize, op=op)
    return shard
