"""Progress of a ShmTransport's sends and receives (transport.py): moving what can move now.

Vocabulary
    progress     copying what fits: pending sends into peers' rings, available frames out of
                 inbound rings. It runs when an operation is posted and inside wait()/done(); a
                 message larger than C streams through the ring in pieces (ring.py)
    match        giving the frame at the tail of a peer's ring to the earliest-posted receive that
                 takes it: one from that peer, or one from any rank, whichever was posted first

Bytes copied: a send copies the payload once into the receiver's ring; a receive copies it once
out (irecv) or reduces it straight from the ring into its target (irecv_reduce: the reduction reads the
shared segment, so a reduced byte is written once, not copied then added). TCP loopback copies each
byte twice through the kernel besides the reduction.

Whoever moved bytes to or from a peer's ring rings that peer's doorbell once the pass is over, so a
peer asleep on it (waiting.py) wakes to take them or to write more.
"""

from __future__ import annotations

import collections
import threading

import torch

from gradsync.comm.transport.shm.ring import Ring
from gradsync.comm.transport import Handle, PeerError


class ShmOp(Handle):
    """A posted shared-memory send or receive; its transport's progress moves it, its waits wait for it."""

    __slots__ = ("transport", "peer", "op", "nbytes", "data", "reduce_into", "combine", "control", "sent", "order",
                 "header_done", "offset", "finished")

    def __init__(self, transport, peer, op, tensor, sent, control, order, combine=None):
        self.transport = transport
        self.peer = peer
        self.op = op
        self.nbytes = tensor.numel() * tensor.element_size()
        flat = tensor.reshape(-1)
        self.data = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
        self.reduce_into = flat if combine is not None else None
        self.combine = combine
        self.sent = sent
        self.control = control
        self.order = order
        self.header_done = False
        self.offset = 0
        self.finished = False

    def done(self) -> bool:
        if not self.finished:
            self.transport.progress.advance_locked()
        return self.finished

    def wait(self, timeout: float | None = None) -> int:
        if not self.finished:
            self.transport.waits.wait_for(self, timeout)
        return self.peer


class Progress:
    """A ShmTransport's sends and receives in flight, and what moves them (module docstring).

    ``lock`` guards the queues and the rings: every method here runs with it held, except
    ``advance_locked`` and ``break_with``, which take it. ``broken``: the error that broke the
    transport (a failed or timed-out wait, a malformed frame), raised by every later operation.
    ``sleepers``: how many of this process's threads sleep on its doorbell (waiting.py)."""

    def __init__(self, rank: int, segments, meter) -> None:
        self.rank = rank
        self.meter = meter
        self.lock = threading.Lock()
        self.sleepers = 0
        self.broken: Exception | None = None
        self._segments = segments
        self._order = 0
        peers = [r for r in segments.local_ranks if r != rank]
        self._sends: dict[int, collections.deque] = {r: collections.deque() for r in peers}
        self._recvs: dict[int, collections.deque] = {r: collections.deque() for r in peers}
        self._any: collections.deque = collections.deque()
        self._to_ring: set[int] = set()

    def local(self, peer: int) -> bool:
        """Whether ``peer`` is another rank of this host (its messages go through shared memory)."""
        return peer in self._sends

    def post(self, transport, tensor, peer, op, sent, control, combine=None) -> ShmOp:
        """Queue a send to (or a receive from) ``peer`` (None: any rank) and move what can move."""
        with self.lock:
            if self.broken is not None:
                raise self.broken
            self._order += 1
            handle = ShmOp(transport, peer, op, tensor, sent, control, self._order, combine)
            if sent:
                self._sends[peer].append(handle)
            elif peer is None:
                self._any.append(handle)
            else:
                self._recvs[peer].append(handle)
            self.move()
        return handle

    def advance_locked(self) -> None:
        with self.lock:
            self.advance()

    def advance(self) -> int:
        """Lock held: fail if broken, move what can move, wake our other sleeping threads; returns the
        doorbell value read before moving anything (what a following sleep must compare against)."""
        if self.broken is not None:
            raise self.broken
        bell = self._segments.bell
        seen = bell.read()
        if self.move() and self.sleepers:
            bell.ring()  # another thread sleeps on our bell and its operation may be done
        return seen

    def break_with(self, error: Exception) -> Exception:
        """Keep ``error`` as the transport's: every later operation raises it. Returns it."""
        with self.lock:
            self.broken = error
        return error

    def has_pending(self) -> bool:
        """True while any shared-memory send or receive of this rank is unfinished."""
        return (any(self._sends.values()) or any(self._recvs.values()) or bool(self._any)
                or any(ring.current is not None for ring in self._segments.rings_in.values()))

    def move(self) -> int:
        """Move every byte that can move now; returns how many operations finished. Lock held."""
        finished = 0
        try:
            for peer, queue in self._sends.items():
                while queue and self._push(queue[0]):
                    finished += self._finish(queue.popleft())
            for peer, ring in self._segments.rings_in.items():
                while True:
                    if ring.current is None and not self._match(peer, ring):
                        break
                    if not self._pull(ring.current, ring):
                        break
                    finished += self._finish(ring.current)
                    ring.current = None
        except PeerError as exc:
            self.broken = exc
            raise
        finally:
            bells = self._segments.bells
            for peer in self._to_ring:
                bells[peer].ring()
            self._to_ring.clear()
        return finished

    def _finish(self, handle: ShmOp) -> int:
        handle.finished = True
        self.meter.record(peer=handle.peer, nbytes=handle.nbytes, op=handle.op, sent=handle.sent,
                          control=handle.control)
        return 1

    def _push(self, handle: ShmOp) -> bool:
        """Write as much of ``handle`` into the peer's ring as fits; True when all of it is in."""
        moved, done = self._segments.rings_out[handle.peer].write(handle)
        if moved:
            self._to_ring.add(handle.peer)
        return done

    def _match(self, peer: int, ring: Ring) -> bool:
        """Give the frame at the tail of ``peer``'s ring to the earliest-posted receive that takes it."""
        if not ring.has_header():
            return False
        mine = self._recvs[peer][0] if self._recvs[peer] else None
        anyone = self._any[0] if self._any else None
        if mine is None and anyone is None:
            return False
        if mine is None or (anyone is not None and anyone.order < mine.order):
            handle = self._any.popleft()
            handle.peer = peer
        else:
            handle = self._recvs[peer].popleft()
        found = ring.accept(handle)
        if found is not None:
            raise PeerError(f"rank {self.rank}: {handle.op}: receive from rank {peer} expected {handle.nbytes} bytes, "
                            f"rank {peer} sent {found}. Every rank must post matching sends and receives "
                            f"in the same order", rank=self.rank, peer=peer, op=handle.op)
        self._to_ring.add(peer)
        return True

    def _pull(self, handle: ShmOp, ring: Ring) -> bool:
        """Copy (or add) what has arrived of ``handle``'s frame; True when all of it has."""
        moved, done = ring.read(handle)
        if moved:
            self._to_ring.add(handle.peer)
        return done
