"""Waiting in a ShmTransport (transport.py): sleeping on the doorbell, barriers, liveness, timeouts (Waits).

No busy-wait: a waiting rank sleeps on its doorbell (doorbell.py) in slices of LIVENESS_SLICE
seconds; after each slice it checks that the peers it waits for are still alive (same host, so
/proc tells), which turns a dead peer into an error within a fraction of a second; before it
blames a dead peer it looks once more whether the wait is over (a peer may have done its part,
arrived at the barrier or written its data, and exited while this rank slept). The one
exception is a barrier the caller marks ``spin`` (place.py's ``spins``: where sleeping and
being woken costs more than the wait): while every local rank can have a core of its own
(``spin_allowed``) it polls for at most SPIN_SECONDS before it sleeps (BACKGROUND_SPIN_SECONDS on a
thread other than the main one, which shares its core with the main thread's work); with more ranks
than cores a spinning rank would take the core its peer needs, so it polls for at most YIELD_SECONDS
and yields its core after every poll. The caller's thread is held on one core while it is in a collective
(``own_core``: local rank i on core i mod C, place.py's ``on_own_core``), as Open MPI binds
its ranks to cores: with a core per rank no two polling ranks land on one core (where the one
polling holds the core its peer needs to arrive; collectives below 4 MiB only, where that costs
more than the hold); with more ranks than cores the ranks that share a core yield to each other
instead of following each other across cores. Held lazily: pinned only when found elsewhere or
about to sleep (hold.py).

A failed or timed-out wait breaks the transport: the error is kept, and every later operation
raises it at once.
"""

from __future__ import annotations

import os
import threading
import time

from gradsync.comm.transport.shm.progress import ShmOp
from gradsync.group.liveness import process_alive
from gradsync.comm.transport import Handle, PeerError, abandoned

POLL_SLICE = 0.0005
"""Longest nap between looks at a torch.distributed transfer while shared-memory work is pending."""
LIVENESS_SLICE = 0.2
"""Seconds a waiting rank sleeps before checking that its peers are alive."""
SPIN_SECONDS = 200e-6
"""Longest a ``spin`` wait polls on the main thread before it sleeps: about what a futex sleep and
wake-up cost here, so a peer that arrives later than this costs one wake-up more than it would have
anyway (a sleep and wake-up took 173-176 us median; the A/B against 30 us:
docs/studies/barrier-polling.md)."""
BACKGROUND_SPIN_SECONDS = 30e-6
"""Longest a ``spin`` wait polls on any other thread: DDP's reducer and the c10d backend run their
collectives on a communication thread while the main thread computes backward on the same core, and
a longer poll takes that core from backward (DDP's step with 200 us on its thread, in-world A/B:
1.171-1.207x of the no-communication floor against 1.169-1.199x with 30 us)."""
YIELD_SECONDS = 1e-3
"""With more local ranks than cores, a ``spin`` wait polls this long, giving its core away between
polls (sched_yield): the rank it waits for is likely queued on the same core, and a yield hands it
the core at once where a futex sleep costs a wake-up (4 ranks on 2 cores, 64 KiB: 0.24-0.30 ms
a call against 0.34-0.49 ms)."""


def poll_seconds(spin_allowed: bool) -> float:
    """How long a ``spin`` wait polls before it sleeps: YIELD_SECONDS (yielding the core between
    polls) where local ranks outnumber the cores, else SPIN_SECONDS on the main thread and
    BACKGROUND_SPIN_SECONDS on any other."""
    if not spin_allowed:
        return YIELD_SECONDS
    return SPIN_SECONDS if threading.current_thread() is threading.main_thread() else BACKGROUND_SPIN_SECONDS


class Delegated(Handle):
    """A transfer carried by torch.distributed on behalf of a ShmTransport.

    Waiting for it must not stall this rank's shared-memory traffic: shared-memory sends and
    receives move only when their rank makes progress, and a flat ring across hosts mixes both
    (rank 0 blocked on a TCP receive from rank 3 while rank 1 waits for the rest of rank 0's
    shared-memory send would wait forever). So while shared-memory operations are pending, the
    wait polls: progress, then a nap of at most POLL_SLICE on the doorbell, then a look at the TCP
    transfer. With nothing pending it is torch's own blocking wait.
    """

    __slots__ = ("inner", "waits", "peer", "op")

    def __init__(self, inner: Handle, waits: "Waits", peer, op) -> None:
        self.inner, self.waits, self.peer, self.op = inner, waits, peer, op

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> int:
        waits = self.waits
        limit = waits.timeout if timeout is None else timeout
        started = time.monotonic()
        while waits.progress.has_pending() and not self.inner.done():
            waited = time.monotonic() - started
            if waited >= limit:
                who = "any rank" if self.peer is None else f"rank {self.peer}"
                raise waits.progress.break_with(PeerError(
                    f"rank {waits.rank}: {self.op}: transfer with {who} over torch.distributed timed out after "
                    f"{waited:.1f} s (timeout {limit:.0f} s)", rank=waits.rank, peer=self.peer, op=self.op))
            waits.nap(min(POLL_SLICE, limit - waited))
        return self.inner.wait(None if timeout is None else max(0.0, limit - (time.monotonic() - started)))


class Waits:
    """A ShmTransport's waits: every one makes progress (progress.py) and sleeps on this rank's
    doorbell until its condition holds, a peer it waits for has died, or the timeout has passed.

    Reads the segments' doorbell, process ids and barrier counter words, the transport's counters
    (``counters``: the native core once it runs, which keeps them for both paths) and its hold."""

    def __init__(self, rank: int, timeout: float, segments, progress, counters, hold, spin_allowed: bool) -> None:
        self.rank = rank
        self.timeout = timeout
        self.segments = segments
        self.progress = progress
        self.counters = counters
        self.hold = hold
        self.spin_allowed = spin_allowed
        self.core = None   # the native core, once it runs (use_core)

    def use_core(self, core, hold) -> None:
        """From now on the native core keeps the counters and the hold, and barriers are its own."""
        self.core, self.counters, self.hold = core, core, hold

    def dead_peers(self) -> list[int]:
        """The local peers whose process is gone (Transport.dead_peers)."""
        return [peer for peer, pid in self.segments.pids.items() if not process_alive(pid)]

    def nap(self, seconds: float) -> None:
        """Make what progress there is, then sleep on the doorbell for at most ``seconds``."""
        progress = self.progress
        with progress.lock:
            seen = progress.advance()
        if self.hold is not None:
            self.hold.before_sleep()
        self.segments.bell.sleep(seen, seconds)

    def wait_for(self, handle: ShmOp, timeout: float | None) -> None:
        """Until the posted send or receive ``handle`` has finished."""
        peers = [handle.peer] if handle.peer is not None else list(self.segments.pids)
        self.wait_until(lambda: handle.finished, timeout, peers,
                        lambda waited, limit, what: self._stuck(handle, waited, limit, what))

    def wait_until(self, is_done, timeout: float | None, peers: list[int], stuck, spin: bool = False) -> None:
        """Make progress and sleep on our doorbell until ``is_done()``; a dead peer among ``peers`` or
        the timeout raises ``stuck(waited, limit, what)``. ``spin``: first poll ``is_done`` alone, for
        ``poll_seconds``, moving nothing (for conditions the other ranks make true, as a barrier's; a
        poll that also moved traffic under the lock cost 4 ranks on 2 cores 8-10% of a 64 KiB call)."""
        if spin and is_done():   # nothing to wait for (other traffic moves in the next wait that needs it)
            return
        limit = self.timeout if timeout is None else timeout
        started = time.monotonic()
        if spin:
            until = time.perf_counter() + poll_seconds(self.spin_allowed)
            while time.perf_counter() < until:
                if not self.spin_allowed:
                    os.sched_yield()
                if is_done():
                    return
        progress, pids = self.progress, self.segments.pids
        while True:
            with progress.lock:
                seen = progress.advance()
                if is_done():
                    return
                progress.sleepers += 1
            waited = time.monotonic() - started
            try:
                if waited >= limit:
                    raise progress.break_with(stuck(waited, limit, "timed out"))
                if self.hold is not None:
                    self.hold.before_sleep()
                self.segments.bell.sleep(seen, min(LIVENESS_SLICE, limit - waited))
                if time.monotonic() - started >= LIVENESS_SLICE:
                    dead = [peer for peer in peers if not process_alive(pids[peer])]
                    why = None if dead else abandoned()   # live mode: a rank this wait does not name has died
                    if (dead or why is not None) and not self._done_after_all(is_done):
                        raise progress.break_with(stuck(time.monotonic() - started, limit,
                                                        f"failed: rank {dead[0]} (pid {pids[dead[0]]}) exited"
                                                        if dead else f"was abandoned: {why}"))
                    if dead or why is not None:
                        return
            finally:
                with progress.lock:
                    progress.sleepers -= 1

    def _done_after_all(self, is_done) -> bool:
        """One more look before a death is blamed: a peer may have done its part (arrived at the
        barrier, written its data) and exited while this rank slept."""
        with self.progress.lock:
            self.progress.advance()
            return is_done()

    def _stuck(self, handle: ShmOp, waited: float, limit: float, what: str) -> PeerError:
        verb = "send to" if handle.sent else "receive from"
        who = "any rank" if handle.peer is None else f"rank {handle.peer}"
        why = f"; {who} may have died or stalled" if what == "timed out" else ""
        return PeerError(f"rank {self.rank}: {handle.op}: {verb} {who} ({handle.nbytes} bytes, shared memory) {what} "
                         f"after {waited:.1f} s (timeout {limit:.0f} s){why}",
                         rank=self.rank, peer=handle.peer, op=handle.op)

    def barrier(self, op: str, spin: bool = False) -> None:
        """Return once every local rank has entered as many barriers as this one (with the timeout
        and liveness checks of any wait; ``spin``: see the module docstring). The native core's own
        barrier where the transport has one (native/signal.c: the same counters, so both paths meet)."""
        if self.core is not None:
            self.native(self.core.barrier, op, spin)
            return
        self.counters.barriers += 1
        count = self.counters.barriers
        segments = self.segments
        segments.counters[self.rank].value = count
        for bell in segments.bells.values():
            bell.ring()
        counters = segments.peer_counters
        if spin and all(c.value >= count for c in counters):   # all here: none of the wait's set-up
            return
        self.wait_until(lambda: all(c.value >= count for c in counters), None, list(segments.pids),
                        lambda waited, limit, what: self._barrier_stuck(op, count, waited, limit, what), spin)

    def _barrier_stuck(self, op: str, count: int, waited: float, limit: float, what: str) -> PeerError:
        behind = [peer for peer in self.segments.pids if self.segments.counters[peer].value < count]
        return PeerError(f"rank {self.rank}: {op}: barrier {count} on shared memory {what} after {waited:.1f} s "
                         f"(timeout {limit:.0f} s); not arrived: {', '.join(f'rank {p}' for p in behind)}",
                         rank=self.rank, peer=behind[0] if behind else None, op=op)

    def native(self, call, *args):
        """``call(*args)``, a call into the native core that may wait: the transport's error first if
        it is broken, and a failed wait breaks it, as any wait here does."""
        if self.progress.broken is not None:
            raise self.progress.broken
        try:
            return call(*args)
        except PeerError as exc:
            raise self.progress.break_with(exc) from None

    def on_slice(self, op: str, count: int, waited: float) -> PeerError | None:
        """The native core's question once a wait for barrier ``count`` has lasted a liveness slice
        (native/signal.c): the error to raise (the timeout passed, a local peer exited, the live world
        was abandoned) or None to go on. As wait_until's checks; the core looks once more before it
        raises. Moves this rank's point-to-point traffic too, as any wait here does."""
        self.progress.advance_locked()
        if waited >= self.timeout:
            return self._barrier_stuck(op, count, waited, self.timeout, "timed out")
        pids = self.segments.pids
        dead = [peer for peer in pids if not process_alive(pids[peer])]
        why = None if dead else abandoned()
        if dead:
            return self._barrier_stuck(op, count, waited, self.timeout,
                                       f"failed: rank {dead[0]} (pid {pids[dead[0]]}) exited")
        if why is not None:
            return self._barrier_stuck(op, count, waited, self.timeout, f"was abandoned: {why}")
        return None
