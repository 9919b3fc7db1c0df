"""The parameter server's outbox (ps/outbox.py), in one process: a transport whose sends complete
only when the test says, so which letters are posted, held and settled is exact, not timing."""

import threading
import time

import pytest
import torch

from gradsync.comm.transport import Handle, PeerError
from gradsync.ps.outbox import Outbox, Part


class Send(Handle):
    """A posted send that completes when ``finish()`` (or ``fail()``) is called."""

    def __init__(self, worker: int, name: str) -> None:
        self.worker, self.name = worker, name
        self.finished = threading.Event()
        self.error: str | None = None

    def finish(self) -> None:
        self.finished.set()

    def fail(self, why: str) -> None:
        self.error = why
        self.finished.set()

    def done(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout=None) -> int:
        if not self.finished.wait(5.0 if timeout is None else timeout):
            raise PeerError(f"send {self.name} timed out", rank=0, peer=self.worker, op="test")
        if self.error:
            raise PeerError(self.error, rank=0, peer=self.worker, op="test")
        return self.worker


class HeldTransport:
    rank = 0

    def __init__(self) -> None:
        self.posted: list[Send] = []

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        self.posted.append(Send(dst, op))
        return self.posted[-1]

    def names(self) -> list[str]:
        return [send.name for send in self.posted]


def letter(name: str) -> list[Part]:
    return [Part(torch.zeros(1), name, tag=1)]


def eventually(condition, what: str, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within} s: {what}")
        time.sleep(0.001)


def failed(call) -> bool:
    try:
        call()
    except PeerError:
        return True
    return False


@pytest.fixture
def transport():
    return HeldTransport()


def test_a_third_answer_waits_for_the_oldest_and_goes_out_when_it_completes(transport):
    outbox = Outbox(transport, room=2, timeout=5.0)
    for worker, name in [(1, "a1"), (2, "a2"), (3, "a3")]:
        outbox.send(worker, letter(name))
    time.sleep(0.05)
    assert transport.names() == ["a1", "a2"], "a third answer went out while two were moving"
    transport.posted[0].finish()   # the thread waits for the oldest first
    eventually(lambda: transport.names() == ["a1", "a2", "a3"], "the held answer posted by the outbox's thread")
    for send in transport.posted:
        send.finish()
    outbox.close()
    assert (outbox.most_answers, outbox.answers_held) == (2, 1)


def test_without_a_limit_every_answer_goes_out_at_once(transport):
    outbox = Outbox(transport, room=None, timeout=5.0)
    for worker in (1, 2, 3):
        outbox.send(worker, letter(f"a{worker}") * 2)
    assert len(transport.posted) == 6 and outbox.most_sends == 6 and outbox.most_answers == 3
    for send in transport.posted:
        send.finish()
    outbox.close()


def test_settling_a_worker_frees_its_room_while_the_oldest_still_moves(transport):
    # the worker behind a2 sent its next message, so a2 is complete: settle() waits for it in the
    # caller's thread and posts the held a3, although the thread is still waiting for a1
    outbox = Outbox(transport, room=2, timeout=5.0)
    for worker, name in [(1, "a1"), (2, "a2"), (3, "a3")]:
        outbox.send(worker, letter(name))
    transport.posted[1].finish()
    outbox.settle(2)
    assert transport.names() == ["a1", "a2", "a3"]
    assert not transport.posted[0].done()
    for send in transport.posted:
        send.finish()
    outbox.close()


def test_settle_returns_only_when_every_letter_to_the_worker_completed(transport):
    outbox = Outbox(transport, room=1, timeout=5.0)
    outbox.send(1, letter("a1"))
    outbox.send(2, letter("a2"))
    outbox.send(2, letter("bye2"), answer=False)   # held behind a2: letters go out in order
    assert transport.names() == ["a1"]
    settled = threading.Event()
    threading.Thread(target=lambda: (outbox.settle(2), settled.set()), daemon=True).start()
    transport.posted[0].finish()
    eventually(lambda: transport.names() == ["a1", "a2", "bye2"], "a2, then the BYE after it")
    transport.posted[2].finish()
    assert not settled.wait(0.05), "settle returned before the answer to the worker completed"
    transport.posted[1].finish()
    assert settled.wait(5.0)
    outbox.close()


def test_a_failed_send_is_raised_naming_its_worker_and_nothing_more_goes_out(transport):
    outbox = Outbox(transport, room=1, timeout=5.0)
    outbox.send(4, letter("a4"))
    outbox.send(5, letter("a5"))
    transport.posted[0].fail("connection reset by peer")
    eventually(lambda: failed(outbox.check), "the failure seen by check()")
    with pytest.raises(PeerError, match="connection reset") as info:
        outbox.settle(5)
    assert info.value.peer == 4 and transport.names() == ["a4"]
    with pytest.raises(PeerError):
        outbox.send(6, letter("a6"))


def test_a_send_that_never_completes_times_out_instead_of_hanging(transport):
    outbox = Outbox(transport, room=2, timeout=0.3)
    outbox.send(1, letter("a1"))
    time.sleep(0.05)   # the outbox's thread is waiting for it
    started = time.monotonic()
    with pytest.raises(PeerError, match="worker rank 1 did not complete within"):
        outbox.settle(1)
    assert time.monotonic() - started < 2.0
    outbox.abandon()


def test_room_must_be_positive(transport):
    with pytest.raises(ValueError, match="at least 1"):
        Outbox(transport, room=0, timeout=1.0)
