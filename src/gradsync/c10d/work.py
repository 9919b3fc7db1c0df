"""The one place where gradsync work becomes a torch Work: a FIFO thread per process group.

torch's DDP launches a bucket's all-reduce from inside backward and waits for it later, so every
operation of the backend must return at once and may finish off the caller's thread. Each
process group owns one communication thread; operations run one at a time in issue order (every
rank issues the same collectives in the same order, so that order is also the order on the
wire), on that thread or on a caller that waits for the operation at the head of the queue
(CommThread). A result or an exception completes a torch.futures.Future, and torch's Work is made
from it (FutureWork): ``work.wait()`` returns when the data is ready and raises the operation's
exception, and ``work.get_future()`` is what DDP's communication hooks chain on. Every operation
has a timeout of its own (the transport's), so no Work waits forever.

Point-to-point transfers are not queued: send and recv are posted at once on the caller's thread
(a program may post a receive before the send it pairs with), and their TransferWork waits on the
transport's handles when the program waits.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

import torch
import torch.distributed as dist

from gradsync import stall


class _Failure:
    """An operation's exception, carried as a value (see _unwrap)."""

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception


def _unwrap(done: torch.futures.Future):
    # Raising inside a callback is the one way from Python to a future that C++ sees as failed.
    # Future.set_exception only stores a Python object that raises when Python reads it: torch's
    # C++ DDP would take that object for the result and crash.
    value = done.value()
    if isinstance(value, _Failure):
        raise value.exception
    return value


class _Operation:
    """One queued operation and the future its outcome completes."""

    __slots__ = ("run", "outcome")

    def __init__(self, run: Callable[[], object]) -> None:
        self.run = run
        self.outcome = torch.futures.Future()

    def execute(self) -> None:
        try:
            self.outcome.set_result(self.run())
        except BaseException as exc:  # crosses to the waiting thread as the Work's error
            self.outcome.set_result(_Failure(exc))
        finally:
            stall.left()  # the stall inspector watches the operation in progress


class CommThread:
    """A process group's operations, run one at a time in the order they were issued.

    A daemon thread takes them off the queue. A caller that waits for an operation still at the
    head of the queue, with nothing running, runs it itself instead, and a synchronous call
    (dist.all_reduce without async_op) made while nothing is queued runs at once (run_now, no
    Future): it then costs no hand-over between threads, and the order is the same either way."""

    def __init__(self, name: str) -> None:
        self._queue: collections.deque[_Operation] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._running = False
        self._closed = False
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def submit(self, operation: Callable[[], object], wake: bool = True):
        """Queue ``operation()``; a torch Work whose future's value is its return value. ``wake``
        False: the caller is about to wait, so the thread is not woken for it (if the queue is busy
        the thread still takes it in turn)."""
        queued = _Operation(operation)
        with self._changed:
            if self._closed:
                raise RuntimeError("this gradsync process group was shut down; create a new one")
            self._queue.append(queued)
            if wake or self._running or len(self._queue) > 1:
                self._changed.notify_all()
        return FutureWork(queued.outcome, self, queued)

    def run_now(self, operation: Callable[..., object], result, *args):
        """Run ``operation(*args)`` on the caller's thread when nothing is queued or running (a
        synchronous call: the order is the same as if it were queued and waited for), and return a
        finished torch Work whose value is ``result``; None when the queue is busy (then submit
        it). The lock is taken once, to claim the turn: giving it back needs none (below)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this gradsync process group was shut down; create a new one")
            if self._running or self._queue:
                return None
            self._running = True
        try:
            operation(*args)
            outcome = result
        except BaseException as exc:  # carried to Work.wait(), as for a queued operation
            outcome = _Failure(exc)
        finally:
            stall.left()
            # Without the lock: an operation queued before this line saw _running and woke the
            # thread, which then waits for the notify below; one queued after it sees nothing running.
            self._running = False
            if self._queue:
                with self._lock:
                    self._changed.notify_all()
        done = DoneWork()
        done._outcome = outcome
        return done

    def wake(self) -> None:
        """Make sure the thread looks at the queue (an operation queued without waking it is
        about to be waited for some other way than Work.wait())."""
        with self._lock:
            self._changed.notify_all()

    def run_if_next(self, queued: _Operation) -> None:
        """Run ``queued`` on this (waiting) thread if it is next and nothing is running."""
        with self._lock:
            if self._running or not self._queue or self._queue[0] is not queued:
                return
            self._queue.popleft()
            self._running = True
        self._finish(queued)

    def _finish(self, queued: _Operation) -> None:
        try:
            queued.execute()
        finally:
            with self._lock:
                self._running = False
                if self._queue:  # only the thread waits on the condition, and only for queued work
                    self._changed.notify_all()

    def _serve(self) -> None:
        while True:
            with self._changed:
                while not self._closed and (self._running or not self._queue):
                    self._changed.wait()
                if self._closed:
                    return
                queued = self._queue.popleft()
                self._running = True
            self._finish(queued)

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()


class FutureWork(dist.Work):
    """A torch Work over one queued operation's outcome (a value or a _Failure).

    wait() raises the operation's exception. get_future() hands torch a future that C++ sees as
    failed when the operation failed (made on first request: a synchronous call never needs it).
    (torch's own _create_work_from_future returns a Work whose wait() succeeds on error.)"""

    def __init__(self, outcome: torch.futures.Future, thread: CommThread, queued: _Operation) -> None:
        super().__init__()
        self._outcome = outcome
        self._thread, self._queued = thread, queued
        self._future: torch.futures.Future | None = None

    def wait(self, timeout=None) -> bool:
        if not self._outcome.done():
            self._thread.run_if_next(self._queued)
        value = self._outcome.wait()
        if isinstance(value, _Failure):
            raise value.exception
        return True

    def _wake(self) -> None:
        if not self._outcome.done():
            self._thread.wake()

    def is_completed(self) -> bool:
        self._wake()
        return self._outcome.done()

    def is_success(self) -> bool:
        return self._outcome.done() and not isinstance(self._outcome.value(), _Failure)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outcome.value()

    def get_future(self) -> torch.futures.Future:
        self._wake()  # whoever waits on the future (torch's C++ callers) does not run the operation
        if self._future is None:
            self._future = self._outcome.then(_unwrap)
        return self._future


class DoneWork(dist.Work):
    """A torch Work over an operation that has already run (CommThread.run_now): its value or a
    _Failure, which wait() raises and whose future C++ sees as failed. Made without an __init__
    of its own and given its outcome after: a Python __init__ over torch's costs a call per
    synchronous collective."""

    _outcome = None

    def wait(self, timeout=None) -> bool:
        if isinstance(self._outcome, _Failure):
            raise self._outcome.exception
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return not isinstance(self._outcome, _Failure)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outcome

    def get_future(self) -> torch.futures.Future:
        done = torch.futures.Future()
        done.set_result(self._outcome)
        return done.then(_unwrap)


class TransferWork(dist.Work):
    """A torch Work over posted transport handles (send, recv, recv from any rank)."""

    def __init__(self, handles: list, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._handles = handles
        self._tensors = tensors
        self._source: int | None = None
        self._lock = threading.Lock()

    def wait(self, timeout=None) -> bool:
        seconds = timeout.total_seconds() if timeout else None
        with self._lock:
            for handle in self._handles:
                self._source = handle.wait(seconds or None)
        return True

    def is_completed(self) -> bool:
        return all(handle.done() for handle in self._handles)

    def is_success(self) -> bool:
        return self.is_completed()

    def _source_rank(self) -> int:
        if self._source is None:
            self.wait()
        return self._source

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self):
        future = torch.futures.Future()
        try:
            self.wait()
            future.set_result(self._tensors)
        except BaseException as exc:
            future.set_exception(exc)
        return future
