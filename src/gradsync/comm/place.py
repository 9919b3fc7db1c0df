"""Where a collective runs and how its rank waits there.

    Place(world, transport)     the ranks and what connects them; here() is gradsync's own world's
    on_own_core(collective)     hold the calling thread on its rank's core for the call (holds())
    spins(transport, fp)        whether the call's barriers poll before they sleep

Holding and polling pay where a sleep and a wake-up would cost more than the wait itself; both rest
on measurements (docs/studies/core-hold.md, docs/studies/barrier-polling.md).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import torch

from gradsync.group import runtime
from gradsync.comm.agree import Fingerprint
from gradsync.comm.transport import Transport
from gradsync.comm.world_transport import default_transport


@dataclass(frozen=True)
class Place:
    """Where a collective runs: the ranks (a World) and the transport that connects them."""

    world: runtime.World
    transport: Transport


_HERE: list[Place] = []


def here() -> Place:
    """gradsync's own world and its transport (the same Place while they stay the same)."""
    w, transport = runtime.world(), default_transport()
    if not _HERE or _HERE[0].world is not w or _HERE[0].transport is not transport:
        _HERE[:] = [Place(w, transport)]
    return _HERE[0]


HOLD_BELOW_BYTES = 4 << 20
"""On the Python path with a core per local rank, only collectives of fewer bytes than this are held on
the rank's core (``on_own_core``); with more ranks than cores, or with the native core, every one is
(``holds``)."""


def on_own_core(collective):
    """Run ``collective(place, tensor, ...)`` with the calling thread held on its rank's core where
    the transport has one (shared memory with several local ranks: transport/shm/hold.py, lazily), for
    the calls holds() picks. Unheld, two ranks the scheduler puts on one core take turns at every
    barrier, and a call takes one of two times from run to run; held, it takes the shorter one
    (docs/studies/core-hold.md)."""
    @functools.wraps(collective)
    def held(place: Place, *args, **kwargs):
        transport = place.transport
        hold = transport.hold
        tensor = args[0] if args else None
        if hold is None or (isinstance(tensor, torch.Tensor)
                            and not holds(transport, tensor.numel() * tensor.element_size())):
            return collective(place, *args, **kwargs)
        holding = hold.enter()   # False inside a held collective already
        try:
            return collective(place, *args, **kwargs)
        finally:
            if holding:
                hold.leave()
    return held


def holds(transport: Transport, nbytes: int) -> bool:
    """Whether a collective of ``nbytes`` is held on its rank's core (on_own_core): every one where
    ranks outnumber cores or the native core runs the collectives, below HOLD_BELOW_BYTES on the
    Python path with a core per rank. With the native core, whose barriers come microseconds apart,
    two unheld ranks that the scheduler puts on one core cost a poll and a sleep at every barrier, so
    it holds every size (docs/studies/core-hold.md, "With the native core")."""
    return transport.core is not None or not transport.spin_allowed or nbytes < HOLD_BELOW_BYTES


SPIN_BELOW_BYTES = 4 << 20
"""With more local ranks than cores, collectives of fewer bytes than this poll in their barriers on
any thread, yielding the core, before they sleep (transport/shm/waiting.py's ``spin``): their phases
are short and balanced, so a sleep and a wake-up would dominate them. Larger ones poll on the main
thread only: a communication thread shares its core with backward. With a core per rank every
collective polls. The measurements behind both: docs/studies/barrier-polling.md, "Where ranks
outnumber the cores"."""


def spins(transport: Transport, fingerprint: Fingerprint) -> bool:
    """Whether the collective's barriers poll before they sleep: always while every local rank has a
    core (transport/shm/waiting.py poll_seconds); when ranks outnumber the cores, on the main thread, and on any other
    below SPIN_BELOW_BYTES."""
    return (threading.current_thread() is threading.main_thread()
            or spins_anywhere(transport, fingerprint.numel * fingerprint.dtype.itemsize))


def spins_anywhere(transport: Transport, nbytes: int) -> bool:
    """Whether a collective of ``nbytes`` polls on any thread (spins)."""
    return transport.spin_allowed or nbytes < SPIN_BELOW_BYTES
