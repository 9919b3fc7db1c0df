"""Staged all-gather over shared memory: every rank copies every shard straight out of its owner's staging.

For ranks of one host (ShmTransport). Shards may differ in size (reduce_scatter's uneven chunks
do): each rank publishes its fingerprint with its own shard's element count, so the one barrier
that compares fingerprints also tells every rank every size (agree.py, staged, sizes_differ).

Vocabulary: N ranks; shard r of s_r elements, at offset o_r = s_0 + ... + s_{r-1} of the result;
piece p = elements [p*P, (p+1)*P) of every shard, P elements per staging half.

Per piece
    stage     rank r copies piece p of its shard into its staging half (the first piece also its
              fingerprint)
    barrier   every rank has staged (first piece: fingerprints compared, sizes learnt; the number
              of pieces, ceil(max s_r / P), is then the same on every rank)
    copy      rank r copies piece p of shard j out of rank j's staging into the result, for every j
No closing barrier (a half is reused two pieces later, after a barrier; see allreduce_two_shot.py).

Traffic (bytes read out of another rank's memory): received from j = s_j, sent to j = s_r;
total received = M - s_r (the ring all-gather's figure, with no forwarding).
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, compare_published


def all_gather_staged(shard: torch.Tensor, transport, fingerprint: Fingerprint, spin: bool = False) -> torch.Tensor:
    """The concatenation of every rank's 1-D contiguous CPU ``shard`` in rank order (a new tensor)."""
    op = "all_gather/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    esize = shard.element_size()
    piece_elems = transport.stage_bytes // esize
    sizes: list[int] = []
    full = None
    start, pieces = 0, 1
    while start < pieces * piece_elems:
        length = max(0, min(piece_elems, shard.numel() - start))
        stages = transport.staged_views(transport.next_half(), piece_elems * esize, shard.dtype)
        stages[rank].narrow(0, 0, length).copy_(shard.narrow(0, start, length))
        if start == 0:
            transport.publish(fingerprint.values())
        transport.barrier(op, spin)
        if start == 0:
            sizes = compare_published(transport, fingerprint, sizes_differ=True)
            pieces = max(1, -(-max(sizes) // piece_elems))
            full = torch.empty(sum(sizes), dtype=shard.dtype)
        offset = 0
        for owner, size in enumerate(sizes):
            part = max(0, min(piece_elems, size - start))
            if part:
                full.narrow(0, offset + start, part).copy_(stages[owner].narrow(0, 0, part))
            offset += size
        start += piece_elems
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=sizes[other] * esize,
                                             sent=shard.numel() * esize, op=op)
    return full
