"""Stall inspector: when a rank has waited too long inside a collective, say who has not joined it.

Every public collective records, at no communication cost, what this rank is doing:

    entered(fingerprint)    the operation (kind, sequence number, elements, dtype, algorithm) and when
    left()                  back in user code

A daemon thread per rank looks once a second. When the current operation has lasted more than
``stall_seconds`` (GRADSYNC_STALL_SECONDS; default timeout / 3; 0 turns it off), the rank posts
"waiting in <op> #<sequence> since <t>" under its own key in the rendezvous store, reads the other
ranks' posts, and prints one report to stderr:

    gradsync stall inspector (rank 0): waiting 4.0 s in all_reduce #12 (ring, 1000 x float32).
    Also waiting in #12: ranks 1. Not in #12: rank 2 (posted nothing: not inside any gradsync
    collective, e.g. still computing or stalled in user code).

Ranks doing the same collective have the same sequence number, so a rank whose post is missing or
older has not joined. The report repeats every ``stall_seconds`` while the stall lasts; the
transfer's own timeout still ends the job (PeerError) as before.

A live world (live/ddp.py) tells the inspector more through ``watch_with``: where a rank that posted
nothing was last seen (its heartbeat carries ``doing()``, so a rank cut off from the store is named
with the collective it was in: "rank 1 (went silent: no heartbeat for 3.2 s (...); last seen in
all_reduce #12 (ring, 1000 x float32))"), and when a report would mislead: this rank lost contact with
its job (it leaves with one line), its world is already abandoned (the wait is about to end), or its
store was silent while the report was read (after a partition heals, the old world's waits are not
reported as a stall of the new one). The inspector's store calls are bounded by the world's timeout (group/bounded_store.py, on a
connection of its own), and a report whose world was shut down meanwhile (an old world's inspector
that waited on a store cut off from it) is dropped, never printed late.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time

_NOW: list = [None]
"""The collective this rank is in: (fingerprint, sequence number, monotonic time it entered), or None
in user code; one slot, replaced whole, so the inspector never reads half of an update."""
_THREAD: dict = {"thread": None, "stop": None}
_LIVE: dict = {"last_seen": None, "quiet": None}
LATE_SECONDS = 2.0
"""A report whose store reads took longer than this (they take milliseconds, plus the 0.5 s it waits
for the others to post) describes a moment long gone: it is dropped."""
"""live/watch.py's hooks: last_seen(rank) -> text or None, quiet() -> True while the world is abandoned."""


def entered(fingerprint, sequence: int | None = None) -> None:
    """Record the collective this rank is in (described only if a report is ever printed); its
    ``sequence`` number when given, else the fingerprint's (a plan's fingerprint has none of its own:
    comm/allreduce_one_shot.py)."""
    _NOW[0] = (fingerprint, fingerprint.sequence if sequence is None else sequence, time.monotonic())


def _describe(fingerprint) -> str:
    return (f"{fingerprint.kind} ({fingerprint.algorithm}, {fingerprint.numel} x "
            f"{str(fingerprint.dtype).replace('torch.', '')})")


def left() -> None:
    _NOW[0] = None


def doing() -> str:
    """The collective this rank is in, "<kind> #<sequence> (<algorithm>, <elements> x <dtype>)", or "" in user
    code (a live member's heartbeat carries it: live/heartbeat.py)."""
    now = _NOW[0]
    if now is None:
        return ""
    fingerprint, sequence, _ = now
    kind, _, rest = _describe(fingerprint).partition(" ")
    return f"{kind} #{sequence} {rest}"


def watch_with(last_seen, quiet) -> None:
    """Install (or with None, None remove) a live world's hooks (module docstring)."""
    _LIVE.update(last_seen=last_seen, quiet=quiet)


def tracked(fn):
    """Decorator for a collective's entry point (gs.all_reduce, the backend's all_reduce_in, ...): when
    it returns or raises, this rank is back where it was before the call, in user code or, for a
    collective called inside another (hierarchical's rails), in the outer one."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = _NOW[0]
        try:
            return fn(*args, **kwargs)
        finally:
            _NOW[0] = before
    return wrapper


def stall_seconds(timeout: float) -> float:
    raw = os.environ.get("GRADSYNC_STALL_SECONDS")
    if raw is None:
        return timeout / 3
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"GRADSYNC_STALL_SECONDS={raw!r} is not a number of seconds (0 turns the inspector off)")
    if value < 0:
        raise ValueError(f"GRADSYNC_STALL_SECONDS must be >= 0, got {value}")
    return value


def start(world) -> None:
    """Start this rank's inspector thread (no-op for a world of one or when turned off)."""
    stop()
    limit = stall_seconds(world.timeout)
    if world.world_size == 1 or limit == 0 or world.store is None:
        return
    event = threading.Event()
    thread = threading.Thread(target=_watch, args=(world, limit, event), name="gradsync-stall-inspector",
                              daemon=True)
    _THREAD.update(thread=thread, stop=event)
    thread.start()


def stop() -> None:
    if _THREAD["stop"] is not None:
        _THREAD["stop"].set()
    _THREAD.update(thread=None, stop=None)


def _quiet(since: float) -> bool:
    quiet = _LIVE["quiet"]
    return quiet is not None and bool(quiet(since))


def _watch(world, limit: float, event: threading.Event) -> None:
    from gradsync.group.bounded_store import BoundedStore, Contact

    reported, store = None, None
    while not event.wait(1.0):
        now = _NOW[0]
        if now is None:
            continue
        op, sequence, since = now
        waited = time.monotonic() - since
        asked = time.monotonic()
        if waited < limit or (reported == (sequence, int(waited // limit))) or _quiet(asked):
            continue
        reported = (sequence, int(waited // limit))
        try:
            if store is None:   # (no connection of its own: making one blocks on a store cut off from this rank)
                store = BoundedStore(world.store, Contact(f"{world.master_addr}:{world.master_port}", world.timeout),
                                     "stall-inspector")
            line = _report(world, store, _describe(op), sequence, waited)
            if time.monotonic() - asked > LATE_SECONDS:   # the store was silent meanwhile: a past moment
                continue
        except Exception as exc:  # noqa: BLE001 - the inspector must never take the rank down
            line = f"gradsync stall inspector (rank {world.rank}): could not read the other ranks: {exc}"
        if not event.is_set() and not _quiet(asked):   # this world still runs, and still waits
            _say(line)


def _say(line: str) -> None:
    """Write one report as a single write, newline included, so that reports of ranks sharing a
    terminal or pipe never interleave (print writes the text and the newline separately)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _report(world, store, op: str, sequence: int, waited: float) -> str:
    store.set(f"gradsync/stall/{world.rank}", f"{sequence}|{op}")
    time.sleep(0.5)   # let ranks stalled in the same operation post theirs
    waiting, missing = [], []
    for rank in range(world.world_size):
        if rank == world.rank:
            continue
        key = f"gradsync/stall/{rank}"
        post = store.get(key).decode() if store.check([key]) else None
        their_sequence = int(post.split("|", 1)[0]) if post else None
        if their_sequence == sequence:
            waiting.append(rank)
        else:
            silent = _LIVE["last_seen"](rank) if _LIVE["last_seen"] is not None and not post else None
            seen = f"last posted #{their_sequence}: {post.split('|', 1)[1]}" if post else silent or (
                "posted nothing: not inside any gradsync collective, e.g. still computing or stalled in user code")
            missing.append(f"rank {rank} ({seen})")
    also = f" Also waiting in #{sequence}: ranks {', '.join(map(str, waiting))}." if waiting else ""
    absent = f" Not in #{sequence}: {'; '.join(missing)}." if missing else ""
    return (f"gradsync stall inspector (rank {world.rank}): waiting {waited:.1f} s in {op} #{sequence}"
            f"{also}{absent} The job fails with a timeout error after {world.timeout:.0f} s.")
