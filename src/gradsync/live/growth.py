"""Growth of a live world: a replacement rank joins at a step boundary and the world grows back.

Vocabulary (membership.py's, plus)
    joiner      a process that is not in the current generation and asks to be (gs.spawn's
                replacement for a dead rank: member id nprocs + k, never a dead member's id)
    ticket      t = 0, 1, 2, ...: the joiner's place in the queue, from one store counter
    boundary    the moment between two steps of a LiveDDP: every member has committed step S and
                no collective is in flight
    seen        how many tickets the members have dealt with (the same number on every member:
                it changes only by a decision every member receives)

Store keys (the job's store):
    gradsync/live/joiners            the ticket counter (store.add)
    gradsync/live/join/<t>           the member id holding ticket t
    gradsync/live/join/<t>/admitted  the generation the joiner was admitted to, or "refused"
    gradsync/live/closed             set by every member as it closes: the run is over, a joiner
                                     still waiting is not needed (launch.NotNeeded)

Protocol
    announce     the joiner writes gradsync/live/member/<id> (host, pid: the quorum's /proc test)
                 and takes a ticket
    decide       at every boundary, rank 0 looks whether ticket ``seen`` exists (a store lookup, at
                 most every CHECK_SECONDS) and puts the joiner's member id + 1 (0: none) in a one-element
                 int64 all-reduce (max) that every member runs: a store key read by each member on its
                 own could be seen at different steps, the all-reduce is one decision for all. Cost: one
                 8-byte all-reduce per step (docs/reliability.md gives the measured time)
    grow         every member leaves the old world and proposes generation g+1 = members + joiner as
                 gradsync/live/<g>/next (compare_set: a quorum after a death that raced it may win, and
                 then every member reads that one instead), then writes the ticket's admitted key
    rejoin       members and joiner build the new world (runtime.rejoin: shared memory and TCP)
    settle       LiveDDP's step agreement, where a rank without state (the joiner) receives it from
                 rank 0 over the transport (transfer.py); then a new DistributedDataParallel and
                 check_replicas (parameters and optimizer state)

A death during the join: a failure after the members left the old world (a rejoin that times out,
a broadcast whose peer died) is recovered from like any death: the generation g+1 is declared
broken and the survivors of it, the joiner included if alive, form g+2 (membership.py's quorum)
and settle again; if no survivor holds the state, they raise, saying so. A rejoin waits at most the
world's timeout for a dead peer's rendezvous keys, so that is how long such a recovery can take.
"""

from __future__ import annotations

import time

import torch

from gradsync.comm.collectives import all_reduce
from gradsync.live.membership import CHECK_SECONDS, PREFIX

ADMISSION_TIMEOUT = 600.0
"""Seconds a joiner waits for a boundary at which the members admit it before it raises."""


def announce(store, member: int) -> int:
    """Take a ticket for ``member`` (its member key is already written: Membership); returns the ticket."""
    ticket = int(store.add(f"{PREFIX}/joiners", 1)) - 1
    store.set(f"{PREFIX}/join/{ticket}", str(member))
    return ticket


def tickets(store) -> int:
    """How many tickets were taken so far."""
    return int(store.add(f"{PREFIX}/joiners", 0))


class Door:
    """The members' side: the decision at each boundary (module docstring, decide)."""

    def __init__(self, store) -> None:
        self.store = store
        self.seen = 0
        self._last_look = 0.0

    def decide(self, rank: int) -> int | None:
        """Collective over the current world: the member id admitted at this boundary, or None."""
        choice = torch.zeros(1, dtype=torch.int64)
        now = time.monotonic()
        if rank == 0 and now - self._last_look >= CHECK_SECONDS:
            self._last_look = now
            key = f"{PREFIX}/join/{self.seen}"
            if self.store.check([key]):
                choice[0] = int(self.store.get(key).decode()) + 1
        all_reduce(choice, op="max")
        return int(choice[0]) - 1 if int(choice[0]) else None

    def answer(self, joiner: int, generation) -> None:
        """Tell the joiner of ticket ``seen`` whether ``generation`` took it in; every member calls it."""
        admitted = joiner in generation.members
        self.store.set(f"{PREFIX}/join/{self.seen}/admitted", str(generation.index) if admitted else "refused")
        self.seen += 1

    def close(self) -> None:
        self.store.set(f"{PREFIX}/closed", "1")


def wait_for_admission(store, member: int, ticket: int, timeout: float = ADMISSION_TIMEOUT) -> int | None:
    """The generation index the joiner was admitted to; None when it was refused (a quorum after a death
    won the race: take a new ticket) or the run is over (closed). Raises after ``timeout`` seconds."""
    key, closed = f"{PREFIX}/join/{ticket}/admitted", f"{PREFIX}/closed"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if store.check([key]):
            answer = store.get(key).decode()
            return None if answer == "refused" else int(answer)
        if store.check([closed]):
            return None
        time.sleep(0.01)
    raise RuntimeError(f"member {member}: no boundary admitted this joiner (ticket {ticket}) within {timeout:.0f} s")


def is_closed(store) -> bool:
    return store.check([f"{PREFIX}/closed"])
