"""Ring all-reduce = ring reduce-scatter + ring all-gather, segmented and pipelined.

Vocabulary
    N        number of ranks, arranged in a ring; rank r sends to its right neighbour (r+1) mod N
             and receives from its left neighbour (r-1) mod N
    M        bytes in the tensor being reduced (n elements)
    chunk    one of N contiguous pieces of the flat tensor; chunk c is owned by rank c at the end
             of the reduce-scatter (see ``ring_chunks`` for the exact partition)
    step     one round in which every rank sends one chunk and receives one chunk
    segment  a piece of a chunk of at most ``segment_bytes``; segments are the unit on the wire,
             so the reduction of one segment overlaps the transfer of the next

Phases
    reduce-scatter  N-1 steps. At step s rank r sends chunk (r-s-1) mod N and receives chunk
                    (r-s-2) mod N, adding it into its own copy. The chunk received at step s is the
                    chunk sent at step s+1, so each segment is forwarded as soon as it is reduced
                    (that is the pipeline). After N-1 steps rank r holds the full sum of chunk r.
    all-gather      N-1 steps. At step s rank r sends chunk (r-s) mod N and receives chunk
                    (r-s-1) mod N straight into its place in the output; received segments are
                    forwarded at once.

Over NCCL's point-to-point (a world on NCCL, CUDA tensors: Transport.pairs_exchanges) each step is
one exchange instead, the chunk sent and the chunk received posted as one group (transport/torch_distributed.py
says why), and NCCL pipelines the chunk itself: ``_reduce_scatter_by_steps``, ``_all_gather_by_steps``.

Traffic and time (alpha: latency per message, beta: seconds per byte, gamma: seconds per reduced byte)
    each phase sends (N-1) chunks, so per rank
        bytes_sent = bytes_received = 2 * sum of the N-1 chunks it sends
                   = 2(N-1)/N * M                      when n is divisible by N
    Uneven n: rank r sends, in reduce-scatter, every chunk except chunk r, and in all-gather every
    chunk except chunk (r+1) mod N, so
        bytes_sent(r) = (2n - size[r] - size[(r+1) mod N]) * element_size
    T = 2(N-1)*alpha + 2(N-1)/N*M*beta + (N-1)/N*M*gamma        (Patarasuk & Yuan, JPDC 2009)

float16 and bfloat16 sums (reduce_ops.Reduction.widens) reduce-scatter directly instead
(reduce_scatter_direct.py): a forwarded partial sum would be rounded at every hop. Same bytes per rank
(rank r sends every chunk but its own in each phase: (2n - 2 size[r]) elements), sent to every peer in
the reduce-scatter rather than the right neighbour alone.
"""

from __future__ import annotations

import functools

from dataclasses import dataclass

import torch

from gradsync.comm.scratch import scratch
from gradsync.comm.reduce_ops import SUM, Reduction
from gradsync.comm.reduce_scatter_direct import reduce_scatter_direct
from gradsync.comm.transport import Combine, Transport, wait_all

DEFAULT_SEGMENT_BYTES = 4 << 20
"""Wire unit of the pipeline. 4 MiB: on this machine 1-4 MiB segments tie and 256 KiB loses 10-25%
to per-message cost (~40-60 us each); 4 MiB halves the message count (docs/benchmarks.md)."""


@dataclass(frozen=True)
class Chunks:
    """The partition of n elements into N chunks: the first n mod N chunks get one extra element.

    Worked example, N=3, n=10: sizes (4, 3, 3), offsets (0, 4, 7).
    N=4, n=2: sizes (1, 1, 0, 0), offsets (0, 1, 2, 2) -- empty chunks are legal and sent as nothing.
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    def view(self, flat: torch.Tensor, chunk: int) -> torch.Tensor:
        """Chunk ``chunk`` of ``flat`` as a view."""
        return flat.narrow(0, self.offsets[chunk], self.sizes[chunk])


@functools.lru_cache(maxsize=1024)
def ring_chunks(numel: int, world_size: int) -> Chunks:
    """Partition ``numel`` elements into ``world_size`` chunks (see Chunks for the rule); cached, since
    a training job asks for the same few partitions on every step."""
    base, extra = divmod(numel, world_size)
    sizes = tuple(base + (1 if c < extra else 0) for c in range(world_size))
    offsets = tuple(sum(sizes[:c]) for c in range(world_size))
    return Chunks(offsets, sizes)


def ring_bytes_sent(numel: int, world_size: int, rank: int, element_size: int) -> int:
    """Exact payload bytes rank ``rank`` sends in one ring all-reduce (formula in module docstring)."""
    if world_size == 1:
        return 0
    sizes = ring_chunks(numel, world_size).sizes
    return (2 * numel - sizes[rank] - sizes[(rank + 1) % world_size]) * element_size


def _segment_elems(flat: torch.Tensor, transport: Transport, segment_bytes: int | None) -> int:
    """Elements per wire unit: ``segment_bytes``, else the transport's preference, else the default."""
    chosen = segment_bytes or transport.segment_bytes or DEFAULT_SEGMENT_BYTES
    return max(1, chosen // flat.element_size())


def _segments(length: int, segment_elems: int) -> list[tuple[int, int]]:
    """(start, length) pieces of at most segment_elems covering 0..length; none when length is 0."""
    return [(start, min(segment_elems, length - start)) for start in range(0, length, segment_elems)]


def reduce_scatter_ring(flat: torch.Tensor, transport: Transport, op: str,
                        segment_bytes: int | None = None, combine: Combine = torch.Tensor.add_) -> Chunks:
    """Reduce ``flat`` across ranks (``combine``: reduce_ops.py; default sum) so that chunk ``rank``
    holds the result; other chunks are scratch.

    ``flat`` must be 1-D and contiguous. ``segment_bytes``: small values exercise the pipelined path
    in fast tests; None takes the transport's preference (``_segment_elems``).
    """
    n_ranks, rank = transport.world_size, transport.rank
    chunks = ring_chunks(flat.numel(), n_ranks)
    if n_ranks == 1:
        return chunks
    if transport.pairs_exchanges(flat):
        _reduce_scatter_by_steps(flat, chunks, transport, op, combine)
        return chunks
    right, left = (rank + 1) % n_ranks, (rank - 1) % n_ranks
    seg_elems = _segment_elems(flat, transport, segment_bytes)
    # Two staging buffers (used by transports that cannot add in place): step s receives into
    # buffers[s % 2] while step s-1's is still being reduced.
    buffers = [scratch(max(chunks.sizes), flat.dtype, flat.device, slot) for slot in range(min(2, n_ranks - 1))]

    def post_recvs(step: int):
        # Each incoming segment is reduced into our copy of its chunk: in place on shared memory,
        # through buffers[step % 2] on TCP (irecv_reduce).
        recv_chunk = (rank - step - 2) % n_ranks
        target, buf = chunks.view(flat, recv_chunk), buffers[step % 2]
        return recv_chunk, [(start, length, transport.irecv_reduce(target.narrow(0, start, length), left, op,
                                                                   staging=buf.narrow(0, start, length),
                                                                   combine=combine))
                            for start, length in _segments(chunks.sizes[recv_chunk], seg_elems)]

    # reduce-scatter
    first_send = chunks.view(flat, (rank - 1) % n_ranks)
    sends = [transport.isend(first_send.narrow(0, start, length), right, op)
             for start, length in _segments(first_send.numel(), seg_elems)]
    posted = {0: post_recvs(0)}
    if n_ranks > 2:
        posted[1] = post_recvs(1)
    for step in range(n_ranks - 1):
        recv_chunk, recvs = posted.pop(step)
        target = chunks.view(flat, recv_chunk)
        forward = step < n_ranks - 2
        for start, length, handle in recvs:
            handle.wait()
            segment = target.narrow(0, start, length)
            if forward:  # pipeline: this reduced segment is what the right neighbour needs next
                sends.append(transport.isend(segment, right, op))
        if step + 2 < n_ranks - 1:
            posted[step + 2] = post_recvs(step + 2)
    wait_all(sends)
    return chunks


def all_gather_ring(flat: torch.Tensor, chunks: Chunks, transport: Transport, op: str,
                    segment_bytes: int | None = None) -> None:
    """Fill every chunk of ``flat`` from its owner: rank r contributes chunk r (any sizes in ``chunks``)."""
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    if transport.pairs_exchanges(flat):
        _all_gather_by_steps(flat, chunks, transport, op)
        return
    right, left = (rank + 1) % n_ranks, (rank - 1) % n_ranks
    seg_elems = _segment_elems(flat, transport, segment_bytes)
    # all-gather. Sends are posted before receives: on gloo, a receive posted first and matched by a
    # send posted after it costs a scheduler tick (~4 ms median at 64 KiB on this machine).
    own = chunks.view(flat, rank)
    sends = [transport.isend(own.narrow(0, start, length), right, op)
             for start, length in _segments(own.numel(), seg_elems)]
    # Every receive lands in its final place, so all of them can be posted up front.
    recvs = []
    for step in range(n_ranks - 1):
        target = chunks.view(flat, (rank - step - 1) % n_ranks)
        recvs += [(step, target.narrow(0, start, length),
                   transport.irecv(target.narrow(0, start, length), left, op))
                  for start, length in _segments(target.numel(), seg_elems)]
    for step, segment, handle in recvs:
        handle.wait()
        if step < n_ranks - 2:  # forward what arrived; the last step's chunk stops here
            sends.append(transport.isend(segment, right, op))
    wait_all(sends)


def _reduce_scatter_by_steps(flat: torch.Tensor, chunks: Chunks, transport: Transport, op: str,
                             combine: Combine) -> None:
    """reduce_scatter_ring with each step one exchange: at step s send chunk (r-s-1) mod N (what
    step s-1 reduced) and receive chunk (r-s-2) mod N, then add it in."""
    n_ranks, rank = transport.world_size, transport.rank
    right, left = (rank + 1) % n_ranks, (rank - 1) % n_ranks
    incoming = scratch(max(chunks.sizes), flat.dtype, flat.device, 0)
    # reduce-scatter
    for step in range(n_ranks - 1):
        send_chunk, recv_chunk = (rank - step - 1) % n_ranks, (rank - step - 2) % n_ranks
        received = incoming.narrow(0, 0, chunks.sizes[recv_chunk])
        transport.exchange(chunks.view(flat, send_chunk), right, received, left, op).wait()
        combine(chunks.view(flat, recv_chunk), received)


def _all_gather_by_steps(flat: torch.Tensor, chunks: Chunks, transport: Transport, op: str) -> None:
    """all_gather_ring with each step one exchange: at step s send chunk (r-s) mod N and receive chunk
    (r-s-1) mod N into its place."""
    n_ranks, rank = transport.world_size, transport.rank
    right, left = (rank + 1) % n_ranks, (rank - 1) % n_ranks
    # all-gather
    for step in range(n_ranks - 1):
        transport.exchange(chunks.view(flat, (rank - step) % n_ranks), right,
                           chunks.view(flat, (rank - step - 1) % n_ranks), left, op).wait()


def allreduce_ring(flat: torch.Tensor, transport: Transport, *, reduction: Reduction = SUM,
                   segment_bytes: int | None = None, op: str = "all_reduce/ring") -> None:
    """In-place all-reduce of a 1-D contiguous tensor; the owner of each chunk finishes it (avg:
    divides by N) before the all-gather, so every rank ends with bit-identical values. A float16 or
    bfloat16 sum reduce-scatters directly (reduce_scatter_direct.py: each owner adds its chunk's N
    inputs in float32 and rounds once; the same bytes), except over NCCL's exchanges, whose steps
    forward partial sums."""
    if reduction.widens(flat.dtype) and not transport.pairs_exchanges(flat):
        chunks = ring_chunks(flat.numel(), transport.world_size)
        reduce_scatter_direct(flat, chunks, transport, op, reduction)
    else:
        chunks = reduce_scatter_ring(flat, transport, op, segment_bytes, reduction.combine)
        reduction.finish(chunks.view(flat, transport.rank), transport.world_size)
    all_gather_ring(flat, chunks, transport, op, segment_bytes)
