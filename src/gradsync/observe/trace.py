"""Timeline: what each rank did when, written as Chrome trace JSON (opens in Perfetto / chrome://tracing).

Events are complete spans ("ph": "X") or instants ("ph": "i") on a track: pid is the rank, tid the
track name's index ("compute" for forward/backward/optimizer, "comm" for bucket reductions). Times
are microseconds from the tracer's start.

    tracer = trace.enable()                 # this rank records from now on
    with trace.span("forward", "compute"): ...
    trace.instant("bucket 3 ready", "comm", bucket=3)
    trace.write(path, [events of every rank])

Overlap share (DDP): of the time buckets spent in communication, the part that ran before backward
ended. 1.0: communication fully hidden behind backward; 0.0: it all ran after.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

TRACKS = ("compute", "comm", "wait")


class Tracer:
    """Collects this rank's events; thread-safe (the communication thread records too)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.origin = time.perf_counter()
        self.events: list[dict] = []
        self._lock = threading.Lock()

    def now_us(self) -> float:
        return self.at_us(time.perf_counter())

    def at_us(self, perf_time: float) -> float:
        """A ``time.perf_counter()`` reading on this tracer's clock (microseconds since it began)."""
        return (perf_time - self.origin) * 1e6

    def add(self, name: str, track: str, start_us: float, end_us: float | None = None, **args) -> None:
        event = {"name": name, "cat": track, "pid": self.rank, "tid": TRACKS.index(track) if track in TRACKS else 9,
                 "ts": start_us, "args": args}
        if end_us is None:
            event.update(ph="i", s="t")
        else:
            event.update(ph="X", dur=max(0.0, end_us - start_us))
        with self._lock:
            self.events.append(event)


_TRACER: Tracer | None = None


def enable(rank: int = 0) -> Tracer:
    """Start recording on this rank (replacing any earlier tracer)."""
    global _TRACER
    _TRACER = Tracer(rank)
    return _TRACER


def disable() -> list[dict]:
    """Stop recording; returns the events recorded."""
    global _TRACER
    events = _TRACER.events if _TRACER else []
    _TRACER = None
    return events


def tracer() -> Tracer | None:
    """The active tracer, or None when tracing is off."""
    return _TRACER


@contextmanager
def span(name: str, track: str = "compute", **args):
    """Record the enclosed block as one event (no cost beyond a None check when tracing is off)."""
    active = _TRACER
    if active is None:
        yield
        return
    start = active.now_us()
    try:
        yield
    finally:
        active.add(name, track, start, active.now_us(), **args)


def instant(name: str, track: str = "compute", at: float | None = None, **args) -> None:
    """Record a moment: now, or ``at`` (a ``time.perf_counter()`` reading the caller also uses itself)."""
    active = _TRACER
    if active is not None:
        active.add(name, track, active.now_us() if at is None else active.at_us(at), None, **args)


def overlap_share(comm_spans: list[tuple[float, float]], backward_end: float) -> float | None:
    """Share of communication time spent before ``backward_end`` (None when there was none)."""
    total = sum(end - start for start, end in comm_spans)
    if total <= 0:
        return None
    hidden = sum(max(0.0, min(end, backward_end) - start) for start, end in comm_spans)
    return hidden / total


def write(path: str | Path, events: list[dict]) -> Path:
    """Write events (of one or many ranks) as a Chrome trace file."""
    path = Path(path)
    names = [{"name": "thread_name", "ph": "M", "pid": pid, "tid": TRACKS.index(track), "args": {"name": track}}
             for pid in sorted({e["pid"] for e in events}) for track in TRACKS]
    path.write_text(json.dumps({"traceEvents": names + events, "displayTimeUnit": "ms"}))
    return path
