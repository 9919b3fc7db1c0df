"""Single-copy all-gather: large shards are read where they lie, small ones through staging.

For ranks of one host whose kernel allows cross-memory reads (single_copy.py; ShmTransport agrees
on it at set-up). The staged all-gather (all_gather_staged.py) copies every shard into its owner's
staging first; a large shard (ZeRO-1's parameters, FSDP's) need not be: its owner publishes its
address and the others read it with process_vm_readv straight into their result. Shards may differ
in size, so each rank chooses for its own shard, and the readers follow what each owner published.

Vocabulary: N ranks; shard r of s_r elements at offset o_r = s_0 + ... + s_{r-1} of the result;
T = min(single_copy.FROM_BYTES, S), S the staging half's size.

Phases
    offer     a shard of T bytes or more: its address, published with the fingerprint; a smaller
              one (it fits a staging half): copied into the staging half, address 0
    barrier   every rank has offered (fingerprints compared, sizes learnt: agree.py, staged,
              sizes_differ)
    copy      rank r reads shard j from rank j's memory (address published) or staging (address 0)
              into the result, for every j
    barrier   only when some rank published an address (every rank knows whether one did): that
              rank may not return, and let its caller change the shard, before every rank has read it
Without an address the staging half is reused two collectives later, after a barrier no rank passes
before every rank has read it (as in all_gather_staged.py).

A shard of T bytes or more that cannot be read where it lies (single_copy.readable: pinned memory a
driver mapped as device memory) is published with address 0. Every rank knows every size after the
first barrier, so every rank sees that an owner offered nothing where it had to: all read nothing
and return None, and the caller runs the staged all-gather instead (collectives.py), every rank alike.

Traffic (bytes read out of another rank's memory): received from j = s_j, sent to j = s_r.
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, compare_published
from gradsync.comm.transport.shm import single_copy


def all_gather_single_copy(shard: torch.Tensor, transport, fingerprint: Fingerprint,
                           spin: bool = False) -> torch.Tensor | None:
    """The concatenation of every rank's 1-D contiguous CPU ``shard`` in rank order (a new tensor);
    None, on every rank, where a shard that had to be offered cannot be read (module docstring)."""
    op = "all_gather/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    esize = shard.element_size()
    half = transport.next_half()
    threshold = min(single_copy.FROM_BYTES, transport.stage_bytes)
    offered = shard.numel() * esize >= threshold
    if not offered:
        transport.stage(rank, half).narrow(0, 0, shard.numel() * esize).view(shard.dtype).copy_(shard)
    mine = shard.data_ptr() if offered and single_copy.readable(shard) else 0
    transport.publish(fingerprint.values(), mine)
    transport.barrier(op, spin)
    sizes = compare_published(transport, fingerprint, sizes_differ=True)
    addresses = [mine if owner == rank else transport.published_address(owner, op) for owner in range(n_ranks)]
    if any(size * esize >= threshold and not address for size, address in zip(sizes, addresses)):
        return None
    full = torch.empty(sum(sizes), dtype=shard.dtype)
    stages = transport.staged_views(half, min(max(sizes) * esize, transport.stage_bytes), shard.dtype)
    anyone_offered, offset = offered, 0
    for owner, size in enumerate(sizes):
        into = full.narrow(0, offset, size)
        offset += size
        if owner == rank:
            into.copy_(shard)
            continue
        address = addresses[owner]
        if address:
            anyone_offered = True
            transport.read_from(owner, address, into, op)
        elif size:
            into.copy_(stages[owner].narrow(0, 0, size))
    if anyone_offered:
        transport.barrier(op, spin)
    for other in range(n_ranks):
        if other != rank:
            transport.meter.record_exchange(peer=other, received=sizes[other] * esize,
                                             sent=shard.numel() * esize, op=op)
    return full
