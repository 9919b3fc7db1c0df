"""The doorbell: a ring costs a system call only when someone sleeps, and no wake-up is lost."""

import mmap
import multiprocessing
import time

import pytest

from gradsync.comm.transport.shm import doorbell
from gradsync.comm.transport.shm.doorbell import Doorbell

pytestmark = pytest.mark.skipif(doorbell.supported() is not None, reason=str(doorbell.supported()))


class _CountingLibc:
    """Stands in for libc: counts futex calls and forwards them."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def syscall(self, number, address, operation, *rest):
        self.calls.append(operation)
        return self.real.syscall(number, address, operation, *rest)


def test_a_ring_with_nobody_asleep_makes_no_system_call_and_one_with_a_sleeper_wakes_it(monkeypatch):
    counting = _CountingLibc(doorbell._libc)
    monkeypatch.setattr(doorbell, "_libc", counting)
    mapping = mmap.mmap(-1, 64)
    owner, ringer = Doorbell(mapping, 0, 0), Doorbell(mapping, 0, 1)
    for _ in range(100):
        ringer.ring()
    assert counting.calls == []                        # nobody asleep: not one FUTEX_WAKE

    seen = owner.read()
    ringer.ring()
    started = time.monotonic()
    owner.sleep(seen, 2.0)                             # the word already changed: returns at once
    assert time.monotonic() - started < 0.5
    assert counting.calls == [doorbell._FUTEX_WAIT]
    assert owner._sleepers.value == 0                  # the count is back to zero after the sleep


def _ping_pong(mapping, me: int, rounds: int, result) -> None:
    """Two processes take turns: each waits (sleeping on its own bell, 2 s slices) until the shared
    turn counter says it is its turn, bumps it and rings the other's bell."""
    import ctypes
    turn = ctypes.c_uint64.from_buffer(mapping, 128)
    mine, theirs = Doorbell(mapping, 64 * me, me), Doorbell(mapping, 64 * (1 - me), me)
    slowest = 0.0
    for step in range(me, 2 * rounds, 2):
        started = time.monotonic()
        while True:
            seen = mine.read()
            if turn.value == step:
                break
            mine.sleep(seen, 2.0)
        slowest = max(slowest, time.monotonic() - started)
        turn.value = step + 1
        theirs.ring()
    result.put((me, slowest))


def test_no_wake_up_is_lost_between_two_processes():
    # 6,000 hand-overs: every round either finds the turn already passed or sleeps until the other
    # rings. A ring that skipped its FUTEX_WAKE while the other slept would leave it asleep for its
    # whole 2 s slice. (The fence's race window is nanoseconds wide: this does not show it.)
    mapping = mmap.mmap(-1, 4096)
    context = multiprocessing.get_context("fork")
    result = context.Queue()
    procs = [context.Process(target=_ping_pong, args=(mapping, me, 3000, result)) for me in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        outcome = dict(result.get(timeout=30) for _ in procs)  # 0.3 s here; a lost wake costs 2 s a round
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    assert all(proc.exitcode == 0 for proc in procs)
    assert max(outcome.values()) < 1.0, f"slowest wait per process: {outcome}"
