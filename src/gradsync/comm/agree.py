"""Agreement before every collective: ranks compare a fingerprint so a mismatch is an error, not a hang.

Why: gloo aborts the whole process (SIGABRT) when a receive's size differs from the matching send,
and a dtype mismatch of equal byte count silently produces garbage. So no collective starts
before its participants have agreed on what it is.

Fingerprint: (kind, sequence number, element count, dtype, op, algorithm, root, region), eight
int64 values, sent as a control message or read out of a shared slot (counted apart from payload
by the meter).

Three ways, by transport
    staged (shared memory, every rank on this host)
                          each rank writes its fingerprint into a slot of its own shared segment
                          and enters one barrier; then it reads every rank's slot and compares each
                          with its own, so every rank raises, naming itself and a rank that
                          differs. No message travels: one barrier, which the shared-memory
                          all-reduce also needs and shares (the fingerprint goes with the data).
    neighbours (default otherwise)
                          each rank exchanges its fingerprint with its left and right ring
                          neighbours: 2 small messages each way, one round trip. Any disagreement
                          is seen by the ranks on both sides of it.
    everyone (debug)      a ring all-gather of all fingerprints (N-1 steps); every rank compares
                          them all and raises the same error naming both ranks. Enabled by
                          gs.init(debug=True) or GRADSYNC_DEBUG=1 (the staged check already is one).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from gradsync.comm.reduce_ops import DTYPES
from gradsync.comm.reduce_ops import OPS as REDUCE_OPS
from gradsync.comm.transport import Transport

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather", "scatter", "all_to_all",
         "barrier")
OPS = ("none",) + REDUCE_OPS
ALGORITHMS = ("ring", "halving_doubling", "tree", "naive", "native", "binomial", "hierarchical", "shared_memory",
              "linear", "pairwise", "shared_memory_in_place", "shared_memory_single_copy")

_KIND_CODE, _DTYPE_CODE, _OP_CODE, _ALGORITHM_CODE = ({name: code for code, name in enumerate(names)}
                                                     for names in (KINDS, DTYPES, OPS, ALGORITHMS))
"""Each name's position in its tuple: a fingerprint's values, looked up rather than searched."""


FINGERPRINT_BYTES = 8 * 8
"""A fingerprint's size as it travels or lies in a shared slot: eight int64 values."""


def next_sequence_of(transport) -> int:
    """The sequence number of ``transport``'s next collective (a fingerprint's second value)."""
    context = transport.context
    context.sequence += 1
    return context.sequence


class CollectiveMismatchError(RuntimeError):
    """Ranks entered different collectives (or the same one with different tensors)."""


class Fingerprint(NamedTuple):
    """What a rank is about to do; equal on every rank for a well-formed program. (A named tuple:
    one is made for every collective, and a tuple is made in a third of a frozen dataclass's time.)"""

    kind: str
    sequence: int
    numel: int
    dtype: torch.dtype
    op: str
    algorithm: str
    root: int = 0
    region: int = -1
    """In-place shared-memory all-reduce: where the tensor lies, region k and byte offset o as
    k * 2**40 + o (every rank's tensor must be at the same place of its copy of the region); -1
    otherwise."""

    def values(self) -> tuple[int, ...]:
        return (_KIND_CODE[self.kind], self.sequence, self.numel, _DTYPE_CODE[self.dtype], _OP_CODE[self.op],
                _ALGORITHM_CODE[self.algorithm], self.root, self.region)

    def encode(self) -> torch.Tensor:
        return torch.tensor(self.values(), dtype=torch.int64)

    @staticmethod
    def decode(values: torch.Tensor) -> "Fingerprint":
        return Fingerprint.from_values(tuple(int(v) for v in values.tolist()))

    @staticmethod
    def from_values(values: tuple[int, ...]) -> "Fingerprint":
        k, seq, numel, dt, op, algo, root, region = values[:8]
        return Fingerprint(KINDS[k], seq, numel, DTYPES[dt], OPS[op], ALGORITHMS[algo], root, region)

    def describe(self) -> str:
        extra = f", root={self.root}" if self.kind in ("broadcast", "reduce", "gather", "scatter") else ""
        if self.region >= 0:
            extra += f", shared region {self.region >> 40} at byte {self.region & ((1 << 40) - 1)}"
        return (f"{self.kind} #{self.sequence} of {self.numel} {str(self.dtype).replace('torch.', '')} "
                f"elements (op={self.op}, algorithm={self.algorithm}{extra})")


def mismatch_error(rank: int, mine: Fingerprint, other_rank: int, other: Fingerprint) -> CollectiveMismatchError:
    return CollectiveMismatchError(
        f"collective mismatch between rank {rank} and rank {other_rank}: rank {rank} called "
        f"{mine.describe()}, rank {other_rank} called {other.describe()}. Every rank must call the same "
        f"collectives in the same order with tensors of the same size and dtype.")


def check_neighbours(transport: Transport, mine: Fingerprint) -> None:
    """Compare ``mine`` with the left and right ring neighbours; raise on any difference."""
    n_ranks, rank = transport.world_size, transport.rank
    if n_ranks == 1:
        return
    right, left = (rank + 1) % n_ranks, (rank - 1) % n_ranks
    peers = [right] if right == left else [right, left]
    encoded = mine.encode()
    incoming = {peer: torch.empty_like(encoded) for peer in peers}
    op = f"{mine.kind}/agree"
    sends = [transport.isend(encoded, peer, op, control=True) for peer in peers]
    recvs = [transport.irecv(incoming[peer], peer, op, control=True) for peer in peers]
    for handle in recvs + sends:
        handle.wait()
    for peer in peers:
        theirs = Fingerprint.decode(incoming[peer])
        if theirs != mine:
            raise mismatch_error(rank, mine, peer, theirs)


def gather_control(transport: Transport, values: torch.Tensor, op: str) -> torch.Tensor:
    """Ring all-gather of a small int64 vector from every rank: row r of the result is rank r's."""
    n_ranks, rank = transport.world_size, transport.rank
    table = torch.empty((n_ranks, values.numel()), dtype=torch.int64)
    table[rank] = values
    right, left = (rank + 1) % n_ranks, (rank - 1) % n_ranks
    for step in range(n_ranks - 1):
        send = transport.isend(table[(rank - step) % n_ranks], right, op, control=True)
        transport.irecv(table[(rank - step - 1) % n_ranks], left, op, control=True).wait()
        send.wait()
    return table


def check_everyone(transport: Transport, mine: Fingerprint) -> None:
    """Gather every rank's fingerprint; all ranks raise the same error on the first difference."""
    if transport.world_size == 1:
        return
    table = gather_control(transport, mine.encode(), f"{mine.kind}/agree")
    reference = Fingerprint.decode(table[0])
    for other_rank in range(1, transport.world_size):
        theirs = Fingerprint.decode(table[other_rank])
        if theirs != reference:
            raise mismatch_error(0, reference, other_rank, theirs)


def uses_staged_check(transport: Transport) -> bool:
    """True when every rank of ``transport`` is on this host with shared fingerprint slots."""
    return transport.shares_memory


def check_staged(transport, mine: Fingerprint, spin: bool = False) -> None:
    """The staged check: publish ``mine``, one barrier, compare every rank's (see the docstring)."""
    transport.publish(mine.values())
    transport.barrier(f"{mine.kind}/agree", spin)
    compare_published(transport, mine)


def barrier_staged(transport, mine: Fingerprint | None, op: str, spin: bool = False) -> None:
    """The staged check as the first barrier of a collective named ``op``: publish ``mine`` (when
    given), one barrier, compare every rank's fingerprint."""
    if mine is not None:
        transport.publish(mine.values())
    transport.barrier(op, spin)
    if mine is not None:
        compare_published(transport, mine)


def offer_staged(transport, flat: torch.Tensor, mine: Fingerprint | None, op: str, spin: bool = False,
                 address: int | None = None) -> list[int]:
    """The staged check for single-copy reads: publish ``mine`` with ``flat``'s address (or
    ``address``: 0 offers nothing), one barrier, compare every rank's fingerprint; returns every
    rank's published address in rank order."""
    address = flat.data_ptr() if address is None else address
    transport.publish(mine.values() if mine is not None else (), address)
    transport.barrier(op, spin)
    if mine is not None:
        compare_published(transport, mine)
    return [address if other == transport.rank else transport.published_address(other, op)
            for other in range(transport.world_size)]


def compare_published(transport, mine: Fingerprint, sizes_differ: bool = False) -> list[int]:
    """After the barrier that follows ``transport.publish(mine.values())``: raise when any rank's
    fingerprint differs from ``mine``, naming this rank and the first such rank. Any difference makes
    every rank raise (if all others equalled this rank's, they would equal each other), and each
    first puts its staging halves back where every other rank puts them (ShmTransport.restart_halves):
    ranks that disagreed may have taken algorithms that move them differently.
    ``sizes_differ``: element counts may differ (all_gather's shards); returns every rank's element
    count in rank order."""
    try:
        return _compare_published(transport, mine, sizes_differ)
    except CollectiveMismatchError:
        transport.restart_halves()
        raise


def _compare_published(transport, mine: Fingerprint, sizes_differ: bool) -> list[int]:
    op = f"{mine.kind}/agree"
    if not sizes_differ:   # the published bytes compared as they lie; read out only on a difference
        other = transport.first_differing(op)
        if other is not None:
            raise mismatch_error(transport.rank, mine, other, _readable(transport.published(other, op), other,
                                                                        transport.rank))
        return [mine.numel] * transport.world_size
    values = mine.values()
    counts = []
    for other in range(transport.world_size):
        if other == transport.rank:
            counts.append(mine.numel)
            continue
        theirs = transport.published(other, op)
        if theirs[:2] + theirs[3:] != values[:2] + values[3:]:
            raise mismatch_error(transport.rank, mine, other, _readable(theirs, other, transport.rank))
        counts.append(theirs[2])
    return counts


def _readable(values: tuple[int, ...], rank: int, reader: int) -> Fingerprint:
    try:
        return Fingerprint.from_values(values)
    except (IndexError, ValueError):
        raise CollectiveMismatchError(f"rank {reader}: rank {rank} published an unreadable fingerprint {values}: "
                                      f"it is not in a gradsync collective of this group") from None
