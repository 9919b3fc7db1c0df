"""Doorbell: a 32-bit word in shared memory that a rank sleeps on until another rank rings it.

The shared-memory transport must not busy-wait: on a 2-core machine four ranks spinning would
starve the very peers they wait for. So a waiting rank reads its doorbell, makes what progress it
can, and then sleeps in the kernel with futex(FUTEX_WAIT) until the word changes or a time slice
ends. A rank that writes into a peer's ring (or frees space in it) rings the peer's bell: it
stores a new value and calls futex(FUTEX_WAKE). The kernel compares the word with the value the
sleeper last saw, under its own lock, so a ring that lands between "read" and "sleep" is never
lost: the sleeper returns at once.

Values are never repeated by different ringers: ringer i writes ((count << 8) | (i + 1)) with its
own increasing count, so two ringers racing (the store is not an atomic increment) still leave a
value different from the one the sleeper saw.

A ring costs a system call only when someone sleeps: beside the word, a second 32-bit word counts
the owner's threads that are in (or about to enter) FUTEX_WAIT, and a ringer calls FUTEX_WAKE only
when it reads that count above zero. Most rings find nobody asleep (the peer is still computing, or
polling a barrier), and the call cost 1-4 us a ring. No wake is lost:

    sleeper                                  ringer
    1  read the word (seen), check its state a  store its state (a barrier count, ring data)
    2  sleepers += 1                         b  store a new word
    3  FUTEX_WAIT(seen): the kernel takes a  c  full fence
       lock (a full fence), then compares   d  read sleepers; FUTEX_WAKE if above zero
       the word with seen

If d reads zero, step 2 was not yet visible when the ringer's fence completed, so the kernel's
compare in 3 comes after b is visible: the word differs from seen (and FUTEX_WAIT returns at once)
unless 1 already read b's value, and then 1's state check, which follows it, saw a. The fence in c
is a lock acquire and release (on x86-64 a locked instruction, which orders the store before the
load; the store-then-load order is the one x86's total store order does not give by itself).

Where the native core runs (native/signal.c), every ringer adds 256 to the word and every sleeper
adds itself to the count atomically, in C, so that a Python wait and a native one on the same word,
in one process or several, follow one protocol; this file's own ring and sleep are the Python path's.

Linux only (futex is a Linux system call). The ring buffers built on this rely on x86-64's
total store order (data written before the ring's head pointer is visible before it), which is
why ``supported()`` also checks the machine.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import threading

_SYS_FUTEX = {"x86_64": 202}
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_WAKE_EVERYONE = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def supported() -> str | None:
    """None when doorbells and shared-memory rings work here, else the reason they do not."""
    if not sys.platform.startswith("linux"):
        return f"shared-memory transport needs Linux (futex), this is {sys.platform}"
    if platform.machine() not in _SYS_FUTEX:
        return (f"shared-memory transport relies on x86-64 store ordering, this machine is "
                f"{platform.machine()}")
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        return "shared-memory transport needs a writable /dev/shm"
    return None


_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


_FENCE = threading.Lock()


def _full_fence() -> None:
    """Order this thread's earlier stores before its later loads (see the module docstring)."""
    _FENCE.acquire()
    _FENCE.release()


class Doorbell:
    """The 32-bit word at ``offset`` of a shared mapping, and its sleeper count at ``offset + 4``;
    ``ringer`` identifies who rings it."""

    def __init__(self, mapping, offset: int, ringer: int, native=None) -> None:
        self._native = native   # the native core's module: it rings and sleeps (below)
        self._word = ctypes.c_uint32.from_buffer(mapping, offset)
        self._sleepers = ctypes.c_uint32.from_buffer(mapping, offset + 4)
        self._address = ctypes.addressof(self._word)
        self._ringer = (ringer + 1) & 0xFF
        self._count = 0
        self._asleep = 0  # this process's threads in sleep(), under _guard
        self._guard = threading.Lock()

    def read(self) -> int:
        return self._word.value

    def ring(self) -> None:
        """Change the word and wake every sleeper on it (no system call when nobody sleeps)."""
        if self._native is not None:
            self._native.ring(self._address)
            return
        self._count = (self._count + 1) & 0xFFFFFF
        self._word.value = (self._count << 8) | self._ringer
        _full_fence()
        if self._sleepers.value:
            _libc.syscall(_SYS_FUTEX[platform.machine()], ctypes.c_void_p(self._address), _FUTEX_WAKE,
                          _WAKE_EVERYONE, None, None, 0)

    def sleep(self, seen: int, seconds: float) -> None:
        """Sleep until the word differs from ``seen``, a ring, a signal or ``seconds`` pass (only the
        owner of the word sleeps on it)."""
        if self._native is not None:
            self._native.sleep(self._address, seen, seconds)
            return
        whole = int(seconds)
        timeout = _Timespec(whole, int((seconds - whole) * 1e9))
        with self._guard:
            self._asleep += 1
            self._sleepers.value = self._asleep
        try:
            # The result needs no check: every caller re-reads its state after waking, whatever woke it.
            _libc.syscall(_SYS_FUTEX[platform.machine()], ctypes.c_void_p(self._address), _FUTEX_WAIT,
                          ctypes.c_uint32(seen), ctypes.byref(timeout), None, 0)
        finally:
            with self._guard:
                self._asleep -= 1
                self._sleepers.value = self._asleep

    def release(self) -> None:
        """Drop the references into the mapping (so the mapping can be closed)."""
        self._word = None
        self._sleepers = None
