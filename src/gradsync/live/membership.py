"""Membership of a live world: who is in each generation, agreed through the rendezvous store.

Vocabulary
    member      a training process, named by a member id that never changes (its rank in the world it
                started in); its rank changes with every generation, the member id does not
    generation  g = 0, 1, 2, ...: one membership and one world. Generation g+1 is the survivors of g,
                renumbered densely in member-id order (members [0, 2, 3] are ranks 0, 1, 2)
    quorum      how generation g+1 is agreed: every survivor of g registers under g, and the
                membership closes once every member of g has either registered or is known dead
                (same host: /proc says so; another host: its heartbeat went silent, heartbeat.py),
                or after ``quorum_timeout`` seconds with those that did

Store keys (the job's store, which outlives every rank: gs.spawn's launcher hosts it, torchrun's
agent hosts it):
    gradsync/live/member/<id>        "<host id>|<pid>", written once by the member as it starts
    gradsync/live/beat/<id>          the member's heartbeat counter (heartbeat.py)
    gradsync/live/<g>/broken         why generation g broke, set by the first member that saw it
    gradsync/live/<g>/here/<id>      member <id> survived generation g and waits for g+1
    gradsync/live/<g>/next           generation g+1's member ids "0,2,3": the first proposal stored
                                     wins (compare_set), so every member reads the same list; a
                                     quorum proposes the survivors, a growth (growth.py) the members
                                     and a joiner

A member that registers after the membership closed (it was alive but slower than
``quorum_timeout``) is not in it and raises, naming itself and the generation.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from gradsync.comm.world_transport import process_alive
from gradsync.live.heartbeat import Heart, Listener
from gradsync.group.world_info import host_id

PREFIX = "gradsync/live"
CHECK_SECONDS = 0.2
"""How often a waiting rank asks the store whether its generation broke (the /proc look is every slice)."""


@dataclass(frozen=True)
class Generation:
    """One agreed membership: ``members`` (member ids, sorted) and the number ``index``."""

    index: int
    members: tuple[int, ...]

    def rank_of(self, member: int) -> int:
        return self.members.index(member)


class Membership:
    """This member's view of the live world's membership (see the module docstring)."""

    def __init__(self, store, member: int, members: tuple[int, ...], quorum_timeout: float) -> None:
        self.store = store
        self.member = member
        self.quorum_timeout = quorum_timeout
        self.current = Generation(0, tuple(sorted(members)))
        self.me = host_id()
        self._last_store_look = 0.0
        self._dead_seen: str | None = None
        store.set(f"{PREFIX}/member/{member}", f"{self.me}|{os.getpid()}")
        self._where: dict[int, tuple[str, int]] = {}
        self._heart = Heart(store, PREFIX, member)
        self._listener = Listener(store, PREFIX)

    # -- who is alive -------------------------------------------------------------------------------
    def location(self, member: int) -> tuple[str, int] | None:
        """(host id, pid) of ``member``, once it has published them."""
        if member not in self._where:
            key = f"{PREFIX}/member/{member}"
            if not self.store.check([key]):
                return None
            host, pid = self.store.get(key).decode().rsplit("|", 1)
            self._where[member] = (host, int(pid))
        return self._where[member]

    def known_dead(self, member: int) -> bool:
        """True when ``member`` shares this host and /proc says its process is gone, or lives on
        another host and its heartbeat has gone silent."""
        where = self.location(member)
        if where is None:
            return False
        return not process_alive(where[1]) if where[0] == self.me else self._listener.silent(member)

    def dead_members(self) -> list[int]:
        return [m for m in self.current.members if m != self.member and self.known_dead(m)]

    def close(self) -> None:
        """Stop beating (this member leaves the job)."""
        self._heart.stop()

    def broken(self) -> str | None:
        """Why the current generation is broken: a member died (on this host: /proc; elsewhere: its
        heartbeat went silent), or a member said so
        in the store (looked up at most every CHECK_SECONDS); None while it is whole."""
        dead = self.dead_members()
        if dead:
            return f"member(s) {dead} of generation {self.current.index} died"
        now = time.monotonic()
        if now - self._last_store_look >= CHECK_SECONDS:
            self._last_store_look = now
            key = f"{PREFIX}/{self.current.index}/broken"
            if self.store.check([key]):
                return self.store.get(key).decode()
        return None

    def declare_broken(self, why: str) -> None:
        """Tell every member that the current generation is over (the first reason stays)."""
        self.store.compare_set(f"{PREFIX}/{self.current.index}/broken", "", f"member {self.member}: {why}")

    # -- agreeing on the next generation ------------------------------------------------------------
    def next_generation(self) -> Generation:
        """Register as a survivor of the current generation and return the next one (see the quorum in
        the module docstring). Bounded by ``quorum_timeout``."""
        g = self.current.index
        self.store.set(f"{PREFIX}/{g}/here/{self.member}", "1")
        deadline = time.monotonic() + self.quorum_timeout
        decided = f"{PREFIX}/{g}/next"
        while True:
            if self.store.check([decided]):
                break
            here = [m for m in self.current.members if self.store.check([f"{PREFIX}/{g}/here/{m}"])]
            accounted = all(m in here or self.known_dead(m) for m in self.current.members)
            if accounted or time.monotonic() >= deadline:
                self.store.compare_set(decided, "", ",".join(map(str, sorted(here))))
                break
            time.sleep(0.005)
        return self._enter(g, f"it registered after the quorum closed ({self.quorum_timeout:.0f} s)")

    def propose(self, members: tuple[int, ...]) -> Generation:
        """Propose ``members`` as the next generation (growth.py: the current members and a joiner) and
        return the one agreed: this proposal, or one stored before it (a quorum after a death)."""
        g = self.current.index
        self.store.compare_set(f"{PREFIX}/{g}/next", "", ",".join(map(str, sorted(members))))
        return self._enter(g, "a quorum after a death was agreed first")

    def agreed(self, g: int) -> tuple[int, ...]:
        """Generation g+1's member ids, as stored under gradsync/live/<g>/next."""
        return tuple(int(m) for m in self.store.get(f"{PREFIX}/{g}/next").decode().split(","))

    def _enter(self, g: int, why_not: str) -> Generation:
        members = self.agreed(g)
        if self.member not in members:
            raise RuntimeError(f"member {self.member}: generation {g + 1} was agreed without it (members "
                               f"{list(members)}); {why_not}")
        self.current = Generation(g + 1, members)
        return self.current
