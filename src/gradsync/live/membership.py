"""Membership of a live world: who is in each generation, agreed through the rendezvous store.

Vocabulary
    member      a training process, named by a member id that never changes (its rank in the world it
                started in); its rank changes with every generation, the member id does not
    generation  g = 0, 1, 2, ...: one membership and one world. Generation g+1 is the survivors of g
                in their order in g (members [0, 2, 3] are ranks 0, 1, 2), then any member admitted
                (growth.py: a replacement, or a member that was left out and rejoins), so a member's
                rank only ever moves down and rank 0 holds the training state whenever any member does
    quorum      how generation g+1 is agreed: every survivor of g registers under g, and the
                membership closes once every member of g has either registered or is gone (same host:
                /proc says its process died; any host: its heartbeat went silent, heartbeat.py), or
                after ``quorum_timeout`` seconds with those that did
    evicted     a member left out of generation g+1 while it lived: the others found it silent (a
                partition, a stopped process) or it registered after the quorum closed. It learns so
                when it registers (Evicted) and may join again (live/ddp.py: as a replacement joins)

Store keys (the job's store, which outlives every rank: gs.spawn's launcher hosts it, torchrun's
agent hosts it):
    gradsync/live/member/<id>        "<host id>|<pid>", written once by the member as it starts
    gradsync/live/node/<id>          torchrun's GROUP_RANK of the member (under torchrun only)
    gradsync/live/beat/<id>          the member's heartbeat (heartbeat.py)
    gradsync/live/<g>/broken         why generation g broke, set by the first member that saw it
    gradsync/live/<g>/here/<id>      member <id> survived generation g and waits for g+1
    gradsync/live/<g>/next           generation g+1's member ids "0,2,3": the first proposal stored
                                     wins (compare_set), so every member reads the same list; a
                                     quorum proposes the survivors, a growth (growth.py) the members
                                     and a joiner

Every store call is bounded (group/bounded_store.py): the training thread's, the heartbeat's and the
watch's (watch.py), each on a connection of its own, share one Contact; a store that has not answered
for the job's timeout is StoreUnreachable, which the owner turns into LostContact.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from gradsync.group.bounded_store import BoundedStore, Contact, own_connection
from gradsync.group.liveness import process_alive
from gradsync.group.world_info import host_id
from gradsync.live.failures import EXIT_LOST_CONTACT
from gradsync.live.heartbeat import SILENT_SECONDS, Heart, Listener
from gradsync.live.watch import Watch
from gradsync.observe import stall

PREFIX = "gradsync/live"
CHECK_SECONDS = 0.2
"""How often a waiting member asks the store whether its turn came (growth.py's boundary look, a joiner's
admission); the watch reads the beats and the broken key at the same pace (heartbeat.READ_SECONDS)."""


@dataclass(frozen=True)
class Generation:
    """One agreed membership: ``members`` (member ids, in rank order) and the number ``index``."""

    index: int
    members: tuple[int, ...]

    def rank_of(self, member: int) -> int:
        return self.members.index(member)


class Evicted(RuntimeError):
    """This member, alive, was left out of the generation after ``left`` (module docstring, evicted)."""

    def __init__(self, message: str, left: Generation, agreed: tuple[int, ...]) -> None:
        super().__init__(message)
        self.left, self.agreed = left, agreed


class Membership:
    """This member's view of the live world's membership (see the module docstring). ``store``: the job's
    store (a torch Store: each thread of the member uses a clone of it); ``timeout``: the job's, which
    bounds every store call (default ``quorum_timeout``); ``address``: the store's, for messages."""

    def __init__(self, store, member: int, members: tuple[int, ...], quorum_timeout: float, *,
                 timeout: float | None = None, address: str | None = None) -> None:
        self.prefix = PREFIX
        self.member = member
        self.quorum_timeout = quorum_timeout
        self.contact = Contact(address or "(the job's store)", timeout if timeout is not None else quorum_timeout)
        self.store = BoundedStore(store, self.contact, f"live-store-{member}")
        self.current = Generation(0, tuple(sorted(members)))
        self.me = host_id()
        self.node = os.environ.get("GROUP_RANK", "")
        self._where: dict[int, tuple[str, int, str]] = {}
        self.listener = Listener(None, PREFIX)   # fed by the watch's reads
        if self.node:
            self.store.set(self.node_key(member), self.node)
        self.store.set(self.member_key(member), f"{self.me}|{os.getpid()}")
        timeout = self.contact.timeout
        self._heart = Heart(BoundedStore(own_connection(store, timeout), self.contact, f"live-beat-{member}"), PREFIX,
                            member, stall.doing)
        self.watch = Watch(self, BoundedStore(own_connection(store, timeout), self.contact, f"live-watch-{member}"))

    # -- where the members are -------------------------------------------------------------------------
    def member_key(self, member: int) -> str:
        return f"{PREFIX}/member/{member}"

    def node_key(self, member: int) -> str:
        return f"{PREFIX}/node/{member}"

    def is_located(self, member: int) -> bool:
        return member in self._where

    def located(self, values: dict[int, tuple[bytes, bytes]]) -> None:
        """Members' keys read (member key, node key or b""): remember each one's host, pid and node."""
        for member, (where, node) in values.items():
            host, pid = where.decode().rsplit("|", 1)
            self._where[member] = (host, int(pid), node.decode())

    def read_location(self, store, member: int) -> tuple[bytes, bytes] | None:
        """``member``'s member key and node key (b"" where it has none) on ``store``, or None before it wrote them
        (the node key is written first)."""
        key, node = self.member_key(member), self.node_key(member)
        if not store.check([key]):
            return None
        return store.get(key), (store.get(node) if store.check([node]) else b"")

    def location(self, member: int) -> tuple[str, int] | None:
        """(host id, pid) of ``member``, once it has published them."""
        if member not in self._where:
            found = self.read_location(self.store, member)
            if found is None:
                return None
            self.located({member: found})
        return self._where[member][:2]

    def node_of(self, member: int) -> str:
        """torchrun's node rank (GROUP_RANK) of a located ``member``; "" outside torchrun."""
        return self._where[member][2]

    def describe(self, member: int) -> str:
        """Where ``member`` runs, in words: "node 2, pid 812" under torchrun, else "pid 812, this host"."""
        where = self._where.get(member)
        if where is None:
            return "not located yet"
        host, pid, node = where
        return f"node {node}, pid {pid}" if node else f"pid {pid}, {'this' if host == self.me else 'another'} host"

    # -- who is alive -----------------------------------------------------------------------------------
    def gone(self, member: int) -> str | None:
        """Why ``member`` is taken for gone (died: this host's /proc; silent: its heartbeat, any host), said
        so that a partition and a death read apart; None while it is there (or not located yet)."""
        where = self._where.get(member)
        if where is None:
            return None
        host, pid, _ = where
        if host == self.me and not process_alive(pid):
            return f"member {member} ({self.describe(member)}) died: its process is gone"
        silent = self.listener.silent_for(member)
        if silent >= SILENT_SECONDS:
            cause = "alive but stopped or frozen" if host == self.me else "cut off from the job, or its host is down"
            doing = self.listener.last_seen(member)
            return (f"member {member} ({self.describe(member)}) went silent: no heartbeat for {silent:.1f} s "
                    f"({cause}); last seen {'in ' + doing if doing else 'outside any collective'}")
        return None

    def known_dead(self, member: int) -> bool:
        """True when ``member`` died (this host) or went silent (gone)."""
        if self.location(member) is None:
            return False
        return self.gone(member) is not None

    def dead_members(self) -> list[int]:
        return [m for m in self.current.members if m != self.member and self.known_dead(m)]

    def close(self) -> None:
        """Stop beating and watching (this member leaves the job)."""
        self._heart.stop()
        self.watch.stop()

    def broken(self) -> str | None:
        """Why the current generation is broken (the watch's verdict: a member died or went silent, a member
        said so in the store, or this member lost contact); None while it is whole."""
        return self.watch.verdict()

    def lost_contact_line(self) -> str:
        """The one line of a member cut off from its job (LostContact's message)."""
        silent = self.contact.lost() or self.contact.silence()
        generation = self.current
        seen = time.monotonic() - self.watch.last_answer
        return (f"member {self.member} lost contact with the job: its store at {self.contact.address} has not "
                f"answered for {silent:.1f} s (timeout {self.contact.timeout:g} s); the members it last saw, "
                f"{seen:.1f} s ago: {list(generation.members)} (generation {generation.index}); it stops here "
                f"(exit status {EXIT_LOST_CONTACT})")

    def declare_broken(self, why: str) -> None:
        """Tell every member that the current generation is over (the first reason stays)."""
        self.store.compare_set(f"{PREFIX}/{self.current.index}/broken", "", f"member {self.member}: {why}")

    # -- agreeing on the next generation ------------------------------------------------------------
    def next_generation(self) -> Generation:
        """Register as a survivor of the current generation and return the next one (see the quorum in
        the module docstring). Bounded by ``quorum_timeout``; Evicted if it was agreed without this member."""
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
                self.store.compare_set(decided, "", ",".join(map(str, here)))
                break
            time.sleep(0.005)
        return self._enter(g)

    def propose(self, members: tuple[int, ...]) -> Generation:
        """Propose ``members`` (in rank order) as the next generation (growth.py: the current members and a
        joiner) and return the one agreed: this proposal, or one stored before it (a quorum after a death)."""
        g = self.current.index
        self.store.compare_set(f"{PREFIX}/{g}/next", "", ",".join(map(str, members)))
        return self._enter(g)

    def agreed(self, g: int) -> tuple[int, ...]:
        """Generation g+1's member ids, as stored under gradsync/live/<g>/next."""
        return tuple(int(m) for m in self.store.get(f"{PREFIX}/{g}/next").decode().split(","))

    def _enter(self, g: int) -> Generation:
        members = self.agreed(g)
        if self.member not in members:
            key = f"{PREFIX}/{g}/broken"
            why = self.store.get(key).decode() if self.store.check([key]) else "no reason was recorded"
            raise Evicted(f"member {self.member}: generation {g + 1} was agreed without it (members "
                          f"{list(members)}), alive: generation {g} had ended with \"{why}\"", self.current, members)
        self.current = Generation(g + 1, members)
        return self.current
