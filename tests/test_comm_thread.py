"""The backend's communication thread alone (c10d/comm_thread.py): order, callbacks, the watchdog.

No processes: the operations are closures that record when they run, so the rules of the module
docstring are checked directly against the order a program issued things in.
"""

import threading
import time

import pytest
import torch

from gradsync.c10d.comm_thread import CommThread, GroupAborted


def recorder(log: list, name: str, seconds: float = 0.0):
    def run():
        if seconds:
            time.sleep(seconds)
        log.append(name)
        return [torch.tensor([len(log)])]
    return run


@pytest.fixture
def thread():
    comm = CommThread("test-comm", timeout=5.0, rank=0)
    yield comm
    comm.close()


@pytest.mark.timeout(20)
def test_operations_run_in_issue_order_whoever_waits(thread):
    log = []
    works = [thread.submit(recorder(log, f"op{i}", 0.01), f"op{i}") for i in range(5)]
    works[3].wait()  # a caller waiting on a later one does not jump the queue
    for work in works:
        work.wait()
    assert log == [f"op{i}" for i in range(5)]


@pytest.mark.timeout(20)
def test_a_collective_issued_in_a_callback_runs_right_after_its_operation(thread):
    # op0's callback issues "nested" and waits for it on the torch future (as torch's PowerSGD
    # does); "later" was queued before the callback ran. nested must run before later, and at once.
    log = []
    gate = threading.Event()
    first = thread.submit(lambda: (gate.wait(5), log.append("op0"), [torch.zeros(1)])[-1], "op0")

    def callback(fut):
        inner = thread.submit(recorder(log, "nested"), "nested")
        return inner.get_future().wait()

    chained = first.get_future().then(callback)
    later = thread.submit(recorder(log, "later"), "later")
    gate.set()
    chained.wait()
    later.wait()
    assert log == ["op0", "nested", "later"]


@pytest.mark.timeout(20)
def test_a_callback_waiting_on_the_work_of_a_queued_operation_runs_the_queue_up_to_it(thread):
    log = []
    gate = threading.Event()
    first = thread.submit(lambda: (gate.wait(5), log.append("op0"), [torch.zeros(1)])[-1], "op0")
    second = thread.submit(recorder(log, "op1"), "op1")
    third = thread.submit(recorder(log, "op2"), "op2")
    chained = first.get_future().then(lambda fut: (third.wait(), log.append("callback"))[-1])
    gate.set()
    chained.wait()
    assert log == ["op0", "op1", "op2", "callback"]
    assert second.is_completed() and third.is_completed()


@pytest.mark.timeout(20)
def test_work_waited_on_from_another_thread(thread):
    log = []
    works = [thread.submit(recorder(log, f"op{i}", 0.01), f"op{i}") for i in range(3)]
    waiters = [threading.Thread(target=work.wait) for work in reversed(works)]
    for waiter in waiters:
        waiter.start()
    for waiter in waiters:
        waiter.join(5)
    assert not any(waiter.is_alive() for waiter in waiters) and log == ["op0", "op1", "op2"]


@pytest.mark.timeout(20)
def test_an_operations_error_reaches_its_waiter_and_its_futures_callbacks(thread):
    def fails():
        raise ValueError("rank 1 never came")
    work = thread.submit(fails, "allreduce")
    with pytest.raises(ValueError, match="rank 1 never came"):
        work.wait()
    with pytest.raises(RuntimeError, match="rank 1 never came"):
        work.get_future().then(lambda fut: fut.value()).wait()
    assert thread.submit(lambda: [torch.ones(1)], "next").result()[0].item() == 1  # the group goes on


@pytest.mark.timeout(20)
def test_the_watchdog_aborts_a_callback_that_waits_for_itself():
    comm = CommThread("test-comm", timeout=0.5, rank=3)
    try:
        gate = threading.Event()
        first = comm.submit(lambda: (gate.wait(5), [torch.zeros(1)])[-1], "allreduce")
        queued = comm.submit(lambda: [torch.zeros(1)], "broadcast").get_future()
        chained = first.get_future().then(lambda fut: queued.wait())  # torch's wait: cannot run the queue
        started = time.monotonic()
        gate.set()
        with pytest.raises(RuntimeError, match="watchdog aborted this process group") as raised:
            chained.wait()
        assert 0.5 <= time.monotonic() - started < 3.0
        assert "rank 3" in str(raised.value) and "broadcast" in str(raised.value)
        with pytest.raises(GroupAborted, match="callback"):
            comm.submit(lambda: None, "barrier")
    finally:
        comm.close()


@pytest.mark.timeout(20)
def test_the_watchdog_fails_an_operation_that_outlives_the_timeout_by_its_grace(monkeypatch):
    from gradsync.c10d import comm_thread

    monkeypatch.setattr(comm_thread, "GRACE", 0.3)
    comm = CommThread("test-comm", timeout=0.3, rank=0)
    try:
        release = threading.Event()
        comm.submit(lambda: time.sleep(0.05), "first")  # ahead of it: the group's thread runs the stuck one
        stuck = comm.submit(lambda: release.wait(10), "allreduce")  # a transfer with no timeout of its own
        started = time.monotonic()
        with pytest.raises(GroupAborted, match="running allreduce"):
            stuck.wait()
        assert time.monotonic() - started < 3.0
        release.set()
    finally:
        comm.close()
