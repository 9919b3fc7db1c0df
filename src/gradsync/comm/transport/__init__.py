"""Transport: non-blocking send and receive of contiguous tensors between ranks, metered.

Every collective in gradsync is written against this small interface:

    handle = transport.isend(tensor, dst, op)        # op: a label such as "all_reduce/ring"
    handle = transport.irecv(tensor, src, op)        # src=None: receive from any rank
    peer = handle.wait()                             # blocks at most world.timeout seconds
    handle = transport.exchange(send, dst, recv, src, op)   # one step's send and receive together

Messages between one pair of ranks are matched in the order they were posted, so two ranks that
post the same sequence of sends and receives never need tags. A ``tag`` keeps two streams apart
(the parameter server receives headers from any rank on one tag and payloads on another).

A failed or timed-out wait raises PeerError naming this rank, the peer, the operation and the byte
count; nothing waits forever. Completed transfers are reported to the process-wide TrafficMeter
(meter.py); ``control=True`` marks small headers, counted apart from payload.

This module is the interface alone and imports no implementation, as gloo's transport/ headers
do, and declares everything else a transport may offer (shared memory, its staging halves and
regions, the native core, the hold of a rank's core, the polling policy), with the answer of a
transport that offers none of it. The implementations: TorchTransport (torch_distributed.py:
torch.distributed point-to-point, gloo on CPU, NCCL on GPU) and ShmTransport (shm/transport.py:
shared memory between ranks of one host, the rest handed to a TorchTransport).
comm/world_transport.py picks one for a world at init(), by GRADSYNC_TRANSPORT.
"""

from __future__ import annotations

from typing import Callable

import torch

Combine = Callable[[torch.Tensor, torch.Tensor], None]
"""acc <- acc (op) incoming, in place (see reduce_ops.py)."""


_NOT_SHARED = ("this transport connects no ranks through shared memory (Transport.shares_memory is False); "
               "the shared-memory collectives need GRADSYNC_TRANSPORT=auto or shm with every rank on one host")


class PeerError(RuntimeError):
    """A transfer with another rank failed or timed out. ``peer`` is the other rank (None: any)."""

    def __init__(self, message: str, *, rank: int, peer: int | None, op: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.op = op


_ABANDON_CHECK: list[Callable[[], str | None] | None] = [None]
"""Live fault tolerance (live/): a check that says why the whole world is broken (a member died),
or None. Set while a live world runs; shared-memory waits run it after every liveness slice."""


def set_abandon_check(check: Callable[[], str | None] | None) -> None:
    """Install (or with None remove) the live world's check (see _ABANDON_CHECK)."""
    _ABANDON_CHECK[0] = check


def abandoned() -> str | None:
    """Why the world is broken, if a live world's check says so; None otherwise (and outside live mode)."""
    check = _ABANDON_CHECK[0]
    return None if check is None else check()


class Handle:
    """A posted transfer; ``wait()`` completes it and returns the peer rank."""

    def wait(self, timeout: float | None = None) -> int:  # pragma: no cover - interface
        """Complete the transfer within ``timeout`` seconds (default: the world's timeout)."""
        raise NotImplementedError

    def done(self) -> bool:  # pragma: no cover - interface
        """True when ``wait()`` would return at once."""
        raise NotImplementedError


class Transport:
    """Point-to-point interface the collectives are written against, and what else a transport offers.

    Everything an algorithm may ask of a transport is declared here, with the answer of a transport
    that offers only point-to-point (torch_distributed.py); a transport that offers more (shared
    memory: shm/transport.py) sets or overrides it. No algorithm probes a transport for attributes."""

    rank: int
    world_size: int
    timeout: float
    """Seconds any wait may last (the world's timeout)."""
    hosts: tuple
    """The world's hosts: each a tuple of its ranks (group/runtime.py's World.hosts)."""
    meter: object
    """The TrafficMeter completed transfers are counted on (observe/meter.py)."""
    context: object
    """The communicator's state (comm/context.py's CommContext: sequence numbers, kept plans and
    algorithm choices, host staging), made at init and given to the constructor; the transport keeps
    it and closes it first when it closes, and never reads it."""
    segment_bytes: int | None = None
    """The pipelined algorithms' preferred wire unit on this transport (None: their own default)."""

    # --- shared memory: what the intra-host algorithms need (none of it here) ---------------------
    shares_memory: bool = False
    """Every rank of the world is on this host and reachable through shared memory: the intra-host
    algorithms (comm/allreduce_one_shot.py and its kin), shared regions and the staged agreement serve it."""
    local_ranks: tuple[int, ...] = ()
    """The ranks on this host that shared memory connects (empty: none)."""
    stage_bytes: int = 0
    """Bytes in each of a rank's two staging halves (0: none)."""
    single_copy: bool = False
    """Every local rank may read every other's memory where it lies (process_vm_readv)."""
    regions = None
    """SharedRegions (shm/regions.py): tensors every local rank reads where they lie; None here."""
    core = None
    """The native core (shm/native/) where every local rank loaded it; None: the Python path."""
    counters = None
    """barriers, published, half, split_in_half: kept by the native core where it runs."""
    hold = None
    """The hold of a collective's thread on its rank's core (shm/hold.py); None: no hold."""
    spin_allowed: bool = False
    """Every local rank has a core of its own, so a wait may poll before it sleeps (shm/waiting.py)."""
    ranks_per_core: int = 1
    """Local ranks that share one core (and its cache)."""

    def publish(self, values: tuple[int, ...], address: int = 0) -> None:
        """Write this rank's fingerprint (and where its tensor lies) into its next shared slot."""
        raise RuntimeError(_NOT_SHARED)

    def barrier(self, op: str, spin: bool = False) -> None:
        """Return once every local rank has entered as many barriers as this one."""
        raise RuntimeError(_NOT_SHARED)

    def first_differing(self, op: str, metered: bool = True) -> int | None:
        """The lowest local rank whose last published fingerprint differs from this rank's, or None."""
        raise RuntimeError(_NOT_SHARED)

    def published(self, rank: int, op: str) -> tuple[int, ...]:
        """Local rank ``rank``'s last published fingerprint."""
        raise RuntimeError(_NOT_SHARED)

    def published_address(self, rank: int, op: str) -> int:
        """The address local rank ``rank`` published with its last fingerprint."""
        raise RuntimeError(_NOT_SHARED)

    def read_from(self, rank: int, address: int, into: torch.Tensor, op: str) -> None:
        """Single-copy read of ``into``'s size from ``address`` in local rank ``rank``'s memory."""
        raise RuntimeError(_NOT_SHARED)

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A private uint8 buffer of at least ``nbytes``, kept between calls."""
        raise RuntimeError(_NOT_SHARED)

    def next_half(self) -> int:
        """The staging half the next piece uses (they alternate)."""
        raise RuntimeError(_NOT_SHARED)

    def split_half(self) -> int:
        """The staging half for the two-shot all-reduce's pieces."""
        raise RuntimeError(_NOT_SHARED)

    def restart_halves(self) -> None:
        """After a collective mismatch: start again from half 0 (here: nothing is staged)."""

    def stage(self, rank: int, half: int) -> torch.Tensor:
        """Local rank ``rank``'s staging half ``half`` (uint8)."""
        raise RuntimeError(_NOT_SHARED)

    def staged_views(self, half: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The first ``nbytes`` of every local rank's staging half ``half`` as ``dtype``, in rank order."""
        raise RuntimeError(_NOT_SHARED)

    def native(self, call, *args):
        """``call(*args)``, a call into the native core that may wait; a failed wait breaks the transport."""
        raise RuntimeError(_NOT_SHARED)

    # --- every transport ----------------------------------------------------------------------
    def close(self) -> None:
        """Release what the transport holds (gradsync.shutdown, a process group destroyed); it is then
        good for nothing. Here: the context alone."""
        self.context.close()

    def isend(self, tensor: torch.Tensor, dst: int, op: str, *, control: bool = False, tag: int = 0) -> Handle:
        raise NotImplementedError

    def dead_peers(self) -> list[int]:
        """Peers this transport knows to be dead (shared memory: their process is gone from /proc);
        empty where it cannot tell (TCP: a silent peer may be alive)."""
        return []

    def interrupt(self, why: str) -> None:
        """Live mode: the world is over (``why``: a member went silent or died, the generation was declared
        broken). Every transfer waiting now, or posted later, fails at once with a PeerError that says
        ``why``; the transport is then good only for closing. Here: nothing (shared-memory waits ask
        abandoned() themselves every liveness slice)."""

    def irecv(self, tensor: torch.Tensor, src: int | None, op: str, *, control: bool = False,
              tag: int = 0) -> Handle:
        raise NotImplementedError

    def irecv_reduce(self, tensor: torch.Tensor, src: int, op: str, *, staging: torch.Tensor,
                     combine: Combine = torch.Tensor.add_) -> Handle:
        """Receive a message shaped like ``tensor`` from ``src`` and reduce it into ``tensor`` with
        ``combine(tensor, incoming)`` (reduce_ops.py; default: add); done when ``wait()`` returns.
        Here: receive into ``staging`` (same size, the caller's reusable buffer), combine on wait. A
        transport that can read the incoming bytes in place (shm/transport.py) skips the copy."""
        return _ReduceOnWait(self.irecv(staging, src, op), tensor, staging, combine)

    def pairs_exchanges(self, tensor: torch.Tensor) -> bool:
        """Whether a send and a receive between two ranks that each post both must travel as one
        ``exchange`` to be sure to complete: True where messages like ``tensor`` go over NCCL's
        point-to-point (torch_distributed.py says why); False here, where every posted message progresses."""
        return False

    def exchange(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, op: str) -> Handle:
        """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` (one step of an algorithm); one
        handle, done when both are, whose wait() returns ``src``. Here: the send posted, then the
        receive."""
        return _Both(self.isend(send, dst, op), self.irecv(recv, src, op))


class _Both(Handle):
    __slots__ = ("_sent", "_received")

    def __init__(self, sent: Handle, received: Handle) -> None:
        self._sent, self._received = sent, received

    def done(self) -> bool:
        return self._sent.done() and self._received.done()

    def wait(self, timeout: float | None = None) -> int:
        peer = self._received.wait(timeout)
        self._sent.wait(timeout)
        return peer


class _ReduceOnWait(Handle):
    __slots__ = ("_inner", "_target", "_staging", "_combine", "_peer")

    def __init__(self, inner: Handle, target: torch.Tensor, staging: torch.Tensor, combine: Combine) -> None:
        self._inner, self._target, self._staging, self._combine, self._peer = inner, target, staging, combine, None

    def done(self) -> bool:
        return self._peer is not None or self._inner.done()

    def wait(self, timeout: float | None = None) -> int:
        if self._peer is None:
            peer = self._inner.wait(timeout)
            self._combine(self._target, self._staging)
            self._peer = peer
        return self._peer


def wait_all(handles: list[Handle]) -> None:
    """Wait for every handle, in order."""
    for handle in handles:
        handle.wait()
