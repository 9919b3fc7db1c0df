"""Direct shared-memory all-reduce for small messages: one barrier, every rank folds every input itself.

For ranks of one host only, and for messages that fit one staging half (allreduce_shared.py picks
it below DIRECT_BELOW_BYTES). The split all-reduce there needs two barriers per piece (staged,
reduced) so that each slice is reduced once, by its owner; for a small message the barriers are
the whole cost. Here there is one:

    stage     rank r copies its tensor into its staging half, and its fingerprint into its slot
    barrier   every rank has staged (and published what it is doing)
    check     every rank compares every rank's fingerprint (agree.py, staged): a mismatch raises
              the same error on every rank before any staged byte is read
    fold      rank r computes  x_0 (+) x_1 (+) ... (+) x_{N-1}  in rank order, reading each x_j out of
              rank j's staging half, straight into its own tensor; avg then divides by N

Every rank performs the same operations in the same order on the same values, so every rank ends
bit-identical without a second exchange. No closing barrier: the next collective stages into the
other half, and the one after that into this half again only after its own barrier, which no rank
passes before every rank has finished this fold.

Traffic (what the meter records, as for the split all-reduce: bytes read out of another rank's
memory): rank r reads all M bytes from each of the N-1 others, and by symmetry each reads M from r,

    bytes_received = bytes_sent = (N-1) * M          (the split all-reduce: 2(N-1)/N * M)

Work per rank: N-1 reductions of M bytes against the split all-reduce's (N-1)/N; below
DIRECT_BELOW_BYTES the barrier saved is worth more (docs/benchmarks.md). The first two inputs are
folded out of place (reduce_ops.fold), one pass instead of a copy and a reduction.
"""

from __future__ import annotations

import torch

from gradsync.comm.agree import Fingerprint, compare_published
from gradsync.comm.reduce_ops import SUM, Reduction


def allreduce_shared_direct(flat: torch.Tensor, transport, *, reduction: Reduction = SUM,
                            fingerprint: Fingerprint | None = None, spin: bool = False) -> None:
    """In-place all-reduce of a 1-D contiguous CPU tensor of at most one staging half."""
    op = "all_reduce/shared_memory"
    n_ranks, rank = transport.world_size, transport.rank
    nbytes = flat.numel() * flat.element_size()
    if nbytes > transport.stage_bytes:
        raise ValueError(f"{op}: {nbytes} bytes do not fit a {transport.stage_bytes}-byte staging half")
    half = transport.next_half()
    stages = transport.staged_views(half, nbytes, flat.dtype)
    stages[rank].copy_(flat)
    if fingerprint is not None:
        transport.publish(fingerprint.values())
    transport.barrier(op, spin)
    if fingerprint is not None:
        compare_published(transport, fingerprint)
    if nbytes == 0:
        return
    reduction.fold(flat, stages[0], stages[1])
    for other in range(2, n_ranks):
        reduction.combine(flat, stages[other])
    reduction.finish(flat, n_ranks)
    transport.meter.record_exchanges(((other, nbytes) for other in range(n_ranks) if other != rank), op=op)
