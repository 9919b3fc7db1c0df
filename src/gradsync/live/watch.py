"""Watch: the thread that says, within seconds, that a live world is over, and ends its waits.

Every READ_SECONDS (0.2 s) the watch of a member reads, on a store connection of its own
(group/bounded_store.py: the training thread's calls never delay it, nor it theirs):

    the beats of every other member of the current generation (heartbeat.py), and where a member it
    has not located yet runs (its host and pid: membership.py's member key)
    ``gradsync/live/<g>/broken``, the reason another member gave for ending generation g

and comes to a verdict, the reason generation g is over, as soon as one of these holds:

    died            a member of this host is gone from /proc
    silent          a member's heartbeat has not moved for SILENT_SECONDS (3 s): on another host, cut
                    off from the job or its machine down (a partition and a death look the same from
                    here); on this host, alive but stopped or frozen
    broken          another member declared generation g over (its reason is quoted)
    lost contact    this member's own reads have had no answer for the job's timeout: it is the one cut
                    off (bounded_store.py's Contact)

A verdict is what abandoned() answers (comm/transport: the shared-memory waits ask it every liveness
slice), and it ends every TCP wait of the world the owner armed for that generation at once
(Transport.interrupt): over TCP too, a silent member is found by its heartbeat in about
SILENT_SECONDS whatever the job's timeout (measured: docs/reliability.md, the partition table), not
by a receive that waits the timeout out. The training thread then recovers (live/ddp.py); a world
armed for another generation is never touched, so a verdict on the old world cannot end the new one.

Lost contact: the training thread learns it from its next store call (StoreUnreachable, turned into
LostContact by its owner: one line, exit status EXIT_LOST_CONTACT). If it is stuck where no store
call of gradsync's reaches it (inside torch's own set-up, on a silent store), the watch prints that
line itself and ends the process GRACE_SECONDS later: a member cut off from its job stops within the
timeout and a few seconds, whatever it was doing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from concurrent.futures import Future

from gradsync.live.failures import EXIT_LOST_CONTACT
from gradsync.live.heartbeat import READ_SECONDS, read_beats

GRACE_SECONDS = 5.0
"""How long the training thread has, after contact is lost, to leave by itself (LostContact)."""


class Watch:
    """One member's watch over its live world (module docstring). ``membership``: its Membership, whose
    store, listener and locations it reads and fills; ``store``: a BoundedStore of its own."""

    def __init__(self, membership, store) -> None:
        self._membership, self._store = membership, store
        self._lock = threading.Lock()
        self._verdict: tuple[int, str] | None = None      # (generation, why)
        self._armed: tuple[int, object] | None = None      # (generation, its world's transport)
        self._interrupted: int | None = None               # the generation whose transport was interrupted
        self._pending: tuple[int, Future] | None = None
        self.last_answer = time.monotonic()
        """When a read of this watch last got its answer."""
        self._lost_at: float | None = None
        self._delivered = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"gradsync-live-watch-{membership.member}",
                                        daemon=True)
        self._thread.start()

    # -- what the owner asks -------------------------------------------------------------------------
    def verdict(self) -> str | None:
        """Why the current generation is over, or None while it holds (the live world's abandon check)."""
        verdict = self._verdict
        return verdict[1] if verdict is not None and verdict[0] == self._membership.current.index else None

    def arm(self, generation: int, transport) -> None:
        """A verdict on ``generation`` interrupts ``transport`` (its world's); at once if one is in."""
        with self._lock:
            self._armed = (generation, transport)
            self._interrupted = None
        why = self.verdict()
        if why is not None:
            self._interrupt(generation, why)

    def disarm(self) -> None:
        """The world armed is being torn down: interrupt nothing (call before gradsync.shutdown())."""
        with self._lock:
            self._armed = None

    def delivered(self) -> None:
        """The training thread has raised LostContact: the watch does not end the process itself."""
        self._delivered = True

    def stop(self) -> None:
        self._stop.set()

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(READ_SECONDS):
            try:
                self._look()
            except Exception as exc:   # noqa: BLE001 - the watch must never die quietly
                sys.stderr.write(f"gradsync live watch (member {self._membership.member}): {exc}\n")

    def _look(self) -> None:
        membership = self._membership
        generation = membership.current
        others = [m for m in generation.members if m != membership.member]
        if self._pending is None:
            self._pending = (generation.index, self._store.submit(self._read, others, generation.index))
        why = None
        index, future = self._pending
        if future.done():
            self._pending = None
            try:
                beats, where, broken, at = future.result()
            except Exception:   # noqa: BLE001 - a store that fails is the contact's to judge
                beats, where, broken, at = {}, {}, None, None
            if at is not None:
                self.last_answer = at
                membership.listener.observe(beats, at)
                membership.located(where)
                if broken is not None and index == generation.index:
                    why = broken
        why = why or self._gone(generation)
        if membership.contact.lost() is not None:
            why = self._lost_contact()
        if why is not None:
            self._settle(generation.index, why)

    def _read(self, members: list[int], index: int):
        """On the watch's store thread: (beats, locations of members not located yet, the broken key's
        reason or None, when the answers were in)."""
        raw, membership = self._store.store, self._membership
        beats = read_beats(raw, membership.prefix, members, membership.listener.heard())
        where = {}
        for m in members:
            found = None if membership.is_located(m) else membership.read_location(raw, m)
            if found is not None:
                where[m] = found
        key = f"{membership.prefix}/{index}/broken"
        broken = raw.get(key).decode() if raw.check([key]) else None
        return beats, where, broken, time.monotonic()

    def _gone(self, generation) -> str | None:
        """The first member of ``generation`` that died (this host) or went silent, said as a verdict."""
        membership = self._membership
        for m in generation.members:
            if m == membership.member:
                continue
            why = membership.gone(m)
            if why is not None:
                return f"member {membership.member}: {why} (generation {generation.index})"
        return None

    def _lost_contact(self) -> str:
        line = self._membership.lost_contact_line()
        now = time.monotonic()
        if self._lost_at is None:
            self._lost_at = now
        elif not self._delivered and now - self._lost_at >= GRACE_SECONDS:
            # the training thread is stuck where no store call of gradsync's reaches it: leave anyway
            sys.stderr.write(f"gradsync: {line}\n")
            sys.stderr.flush()
            os._exit(EXIT_LOST_CONTACT)
        return line

    def _settle(self, index: int, why: str) -> None:
        with self._lock:
            if self._verdict is None or self._verdict[0] != index:
                self._verdict = (index, why)
        self._interrupt(index, self._verdict[1])

    def _interrupt(self, index: int, why: str) -> None:
        with self._lock:
            armed = self._armed
            if armed is None or armed[0] != index or self._interrupted == index:
                return
            self._interrupted = index
            armed[1].interrupt(why)

