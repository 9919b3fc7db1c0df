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
do. The implementations: TorchTransport (tcp.py: torch.distributed point-to-point, gloo on CPU,
NCCL on GPU) and ShmTransport (shm/transport.py: shared memory between ranks of one host, the
rest handed to a TorchTransport). world_transport.py picks one for a world at init(), by
GRADSYNC_TRANSPORT.
"""

from __future__ import annotations

from typing import Callable

import torch

Combine = Callable[[torch.Tensor, torch.Tensor], None]
"""acc <- acc (op) incoming, in place (see reduce_ops.py)."""


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
    """Point-to-point interface the collectives are written against."""

    rank: int
    world_size: int
    segment_bytes: int | None = None
    """The pipelined algorithms' preferred wire unit on this transport (None: their own default)."""

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
        point-to-point (tcp.py says why); False here, where every posted message progresses."""
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
