"""Heartbeats: how a live world learns that a member has gone silent, on its own host or another.

On one host a member's death is plain: /proc says its process is gone (membership.py). Across
hosts no one can look, and a lost machine, or one cut off by the network, closes none of its TCP
connections. So each member beats: a thread of its own writes a counter to the job's store every
BEAT_SECONDS, and the others read it. A member whose counter has not moved for SILENT_SECONDS, as the
reader's own clock measures it between two reads that both got an answer (the hosts' clocks are
never compared, and a reader that cannot reach the store learns nothing), is silent: dead, stopped,
or cut off from the job. The same holds on one host: a process alive in /proc whose heart has
stopped (stopped by a signal, frozen) is silent too.

Vocabulary
    beat        ``gradsync/live/beat/<id>``: "<counter>|<where>", the counter raised by one every
                BEAT_SECONDS, ``where`` the collective the member is in as it beats (observe/stall.py's
                record; empty in user code), which the stall inspector quotes for a silent rank
    silent      the counter has not moved for SILENT_SECONDS since this reader first read its value

Cost: one store write per member every BEAT_SECONDS, and for a reader (live/watch.py's thread) one
store read of every other member's beat every READ_SECONDS. A member never seen beating is not
taken for silent (it may not have started yet): the quorum's timeout covers it.

Where it can be wrong: a member alive but starved of CPU for SILENT_SECONDS (its beating thread
not scheduled) is taken for silent; the others then form a world without it, and it rejoins when it
finds itself left out (live/ddp.py). SILENT_SECONDS is 12 beats for that reason. A slow link delays
beats without stopping them: 200 ms each way, or 10% of packets lost (TCP resends them), leaves the
counter moving (docs/reliability.md, the partition table).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

BEAT_SECONDS = 0.25
SILENT_SECONDS = 3.0
READ_SECONDS = 0.2
FRESH_SECONDS = 1.0
"""A member is judged only on a read of its beat this recent: a reader that cannot reach the store, or has
not read a member for a while (it was out of the generation, left out and back), learns nothing."""


def beat_key(prefix: str, member: int) -> str:
    return f"{prefix}/beat/{member}"


class Heart:
    """Beats for ``member`` on a daemon thread until stop(). ``where()``: what the member is doing, written
    with each beat (module docstring). The first beat is written before this returns, so a member
    whose member key exists has a beat key too. ``store``: a store of the heart's own (store.clone(),
    bounded_store.py): a beat never waits behind another thread's call."""

    def __init__(self, store, prefix: str, member: int, where: Callable[[], str] | None = None) -> None:
        self._store, self._key, self._where = store, beat_key(prefix, member), where or (lambda: "")
        self._stop = threading.Event()
        self._count = 0
        self._write()
        self._thread = threading.Thread(target=self._beat, name=f"gradsync-live-beat-{member}", daemon=True)
        self._thread.start()

    def _write(self) -> None:
        self._count += 1
        self._store.set(self._key, f"{self._count}|{self._where()}")

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_SECONDS):
            try:
                self._write()
            except Exception:   # noqa: BLE001 - the store is gone: the member's own store calls say so
                return

    def stop(self) -> None:
        self._stop.set()


def read_beats(store, prefix: str, members: list[int], heard: set[int]) -> dict[int, bytes]:
    """The beats of ``members`` on ``store``: one multi_get for those already ``heard``, and for the others
    only once their key exists (a get of a missing key would wait for it)."""
    keys = {m: beat_key(prefix, m) for m in members}
    known = [m for m in members if m in heard]
    values = dict(zip(known, store.multi_get([keys[m] for m in known]))) if known else {}
    for m in members:
        if m not in heard and store.check([keys[m]]):
            values[m] = store.get(keys[m])
    return values


class Listener:
    """Which members have gone silent (module docstring), from the beats read: by read() (the watch's
    thread calls it) or, when silent() finds its last read of a member older than READ_SECONDS, there."""

    def __init__(self, store, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        self._lock = threading.Lock()
        self._heard: dict[int, tuple[bytes, float]] = {}   # member -> (last value, when it was first read)
        self._read_at: dict[int, float] = {}               # member -> when a read last got its value

    def read(self, members: list[int]) -> None:
        """Read the beats of ``members`` (read_beats) and observe them."""
        self.observe(read_beats(self._store, self._prefix, members, self.heard()), time.monotonic())

    def heard(self) -> set[int]:
        """The members seen beating so far."""
        with self._lock:
            return set(self._heard)

    def observe(self, values: dict[int, bytes], at: float) -> None:
        """Beats read at monotonic time ``at`` (a read that got its answer)."""
        with self._lock:
            for member, value in values.items():
                if member not in self._heard or self._heard[member][0] != value:
                    self._heard[member] = (value, at)
                self._read_at[member] = at

    def silent_for(self, member: int) -> float:
        """Seconds ``member``'s counter stood still between reads that got an answer, the last of them at most
        FRESH_SECONDS ago (0: moving, never heard, or not read lately)."""
        with self._lock:
            heard = self._heard.get(member)
            if heard is None or time.monotonic() - self._read_at[member] > FRESH_SECONDS:
                return 0.0
            return self._read_at[member] - heard[1]

    def silent(self, member: int) -> bool:
        if self._store is not None and time.monotonic() - self._read_at.get(member, 0.0) >= READ_SECONDS:
            self.read([member])
        return self.silent_for(member) >= SILENT_SECONDS

    def last_seen(self, member: int) -> str:
        """What ``member`` said it was doing with its last beat read ("" in user code, or never heard)."""
        with self._lock:
            heard = self._heard.get(member)
        return "" if heard is None else heard[0].decode(errors="replace").partition("|")[2]
