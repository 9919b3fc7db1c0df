"""Holding a collective's thread on its rank's core, as Open MPI binds its ranks to cores.

Local rank i has core i mod C (transport.py, ``own_core``). While a rank's thread is in a collective it
may only run there, so two polling ranks never share one core while the other core idles (the one
polling holds the core its peer needs to arrive), and ranks that share a core yield to each other
instead of following each other across cores. Only the collective is held: the program's other
threads, and threads and processes it starts later, keep their affinity, and the caller's own
affinity is given back when the collective returns.

How: lazily. A thread that is already on its core when it enters a collective (one sched_getcpu, a
fraction of a microsecond, without a system call) is not pinned until it is about to sleep
(``before_sleep``, called by the transport before it waits in the kernel): a sleeping thread is
woken wherever the scheduler likes, often on the waker's core, so it is pinned first. A
collective whose waits are all polls runs where it is, on its own core, and makes no system call
for the hold; a thread found on another core at entry is pinned at once. Pinning costs three
system calls (the affinity read, set, and given back), and with two ranks to a core they cost
more than a core each, which the lazy hold saves (the timings: docs/studies/core-hold.md).

One holder at a time: a collective started inside a held one (on the same thread), or on a second
thread while another holds, runs without taking the hold again.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading

_libc = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_sched_getcpu = getattr(_libc, "sched_getcpu", None)


def current_cpu() -> int | None:
    """The core this thread runs on now (None where libc does not say)."""
    return _sched_getcpu() if _sched_getcpu is not None else None


class CoreHold:
    """The hold of one rank's collectives on ``core``."""

    def __init__(self, core: int) -> None:
        self.core = core
        self._holder: int | None = None      # the thread in the held collective
        self._given_back: set[int] | None = None   # its affinity before it was pinned
        self._held = threading.Lock()        # taken for as long as a thread holds

    def enter(self) -> bool:
        """Start holding the calling thread (see the module docstring); True when this call holds,
        and must ``leave``."""
        if not self._held.acquire(blocking=False):
            return False
        self._holder = threading.get_ident()
        if _sched_getcpu is None or _sched_getcpu() != self.core:   # current_cpu(), one call less
            self._pin()
        return True

    def before_sleep(self) -> None:
        """The holding thread is about to sleep in the kernel: pin it first (lazy holds)."""
        if self._given_back is None and self._holder == threading.get_ident():
            self._pin()

    def leave(self) -> None:
        """Give the thread its own affinity back (if it was pinned) and end the hold."""
        try:
            if self._given_back is not None:
                os.sched_setaffinity(0, self._given_back)
        finally:
            self._given_back = None
            self._holder = None
            self._held.release()

    def _pin(self) -> None:
        before = os.sched_getaffinity(0)
        try:
            os.sched_setaffinity(0, (self.core,))
        except OSError:  # the core was taken from this process since (cpuset): run where it may
            return
        self._given_back = before
