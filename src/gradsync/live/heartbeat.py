"""Heartbeats: how a live world learns that a member on another host has died.

On one host a member's death is plain: /proc says its process is gone (membership.py). Across
hosts no one can look, and a lost machine may not even close its TCP connections. So each member
beats: a thread of its own writes a counter to the job's store every BEAT_SECONDS, and the others
read it. A member on another host whose counter has not moved for SILENT_SECONDS, as the reader's
own clock measures it (the hosts' clocks are never compared), is taken for dead.

Vocabulary
    beat        the counter under ``gradsync/live/beat/<id>``, raised by one every BEAT_SECONDS
    silent      the counter has not moved for SILENT_SECONDS since this reader first saw its value

Cost: one store write per member every BEAT_SECONDS, and for a reader one store read per remote
member at most every READ_SECONDS. A member never seen beating is not taken for dead (it may not
have started yet): the quorum's timeout covers it.

Where it can be wrong: a member alive but starved of CPU for SILENT_SECONDS (its beating thread
not scheduled) is taken for dead; the survivors then form a world without it, and it raises when
it finds itself left out (membership.py). SILENT_SECONDS is 12 beats for that reason.
"""

from __future__ import annotations

import threading
import time

BEAT_SECONDS = 0.25
SILENT_SECONDS = 3.0
READ_SECONDS = 0.2


def beat_key(prefix: str, member: int) -> str:
    return f"{prefix}/beat/{member}"


class Heart:
    """Beats for ``member`` on a daemon thread until stop()."""

    def __init__(self, store, prefix: str, member: int) -> None:
        self._store, self._key = store, beat_key(prefix, member)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"gradsync-live-beat-{member}", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        count = 0
        while not self._stop.is_set():
            count += 1
            try:
                self._store.set(self._key, str(count))
            except Exception:   # the store's host is gone: the members' own store calls say so
                return
            self._stop.wait(BEAT_SECONDS)

    def stop(self) -> None:
        self._stop.set()


class Listener:
    """Which remote members have gone silent (see the module docstring)."""

    def __init__(self, store, prefix: str) -> None:
        self._store, self._prefix = store, prefix
        self._heard: dict[int, tuple[bytes, float]] = {}   # member -> (last value, when it was first read)
        self._read_at: dict[int, float] = {}

    def silent(self, member: int) -> bool:
        now = time.monotonic()
        if now - self._read_at.get(member, 0.0) >= READ_SECONDS:
            self._read_at[member] = now
            key = beat_key(self._prefix, member)
            value = self._store.get(key) if self._store.check([key]) else None
            if value is not None and (member not in self._heard or self._heard[member][0] != value):
                self._heard[member] = (value, now)
        heard = self._heard.get(member)
        return heard is not None and now - heard[1] >= SILENT_SECONDS
