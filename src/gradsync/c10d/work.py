"""The torch Work objects of the "gradsync" backend: how a gradsync operation looks to torch.

torch's DDP launches a bucket's all-reduce from inside backward and waits for it later, so every
operation of the backend returns at once and may finish off the caller's thread (comm_thread.py
runs them). A result or an exception completes a torch.futures.Future, and torch's Work is made
from it (FutureWork): ``work.wait()`` returns when the data is ready and raises the operation's
exception, and ``work.get_future()`` is what DDP's communication hooks chain on. Every operation
has a timeout of its own (the transport's), and the group's watchdog fails whatever outlives it,
so no Work waits for ever.

Point-to-point transfers are not queued: send and recv are posted at once on the caller's thread
(a program may post a receive before the send it pairs with), and their TransferWork waits on the
transport's handles when the program waits.

Below the communication thread: the thread imports the Operation it runs and the Works it hands
back from here, and nothing here imports the thread.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from gradsync.compile_guard import eager

_SETTLE = threading.Lock()


class Failure:
    """An operation's exception, carried as the future's value (see _unwrap)."""

    def __init__(self, exception: BaseException) -> None:
        self.exception = exception

    def __reduce__(self):
        # A CUDA-aware future (an operation on CUDA tensors: comm/host_staging.py, Handoff) finds the
        # tensors of its value by pickling it; a Failure holds none, and its exception need not pickle.
        return (Failure, (None,))


class Operation:
    """One queued operation and the future its outcome completes (once: the watchdog may fail it
    first). The communication thread (comm_thread.py) runs it; the Works below wrap its outcome.
    ``handoff``: where its tensors are on a GPU, the order of its kernels against the caller's
    (comm/host_staging.py, Handoff): the thread runs it under ``handoff.running()``, its outcome is
    a CUDA-aware future, and Work.wait() collects it on the caller's thread."""

    __slots__ = ("run", "what", "outcome", "settled", "handoff")

    def __init__(self, run: Callable[[], object], what: str, handoff=None) -> None:
        self.run = run
        self.what = what
        self.handoff = handoff
        self.outcome = handoff.future() if handoff is not None else torch.futures.Future()
        self.settled = False

    def settle(self, value) -> None:
        with _SETTLE:
            if self.settled:
                return
            self.settled = True
        self.outcome.set_result(value)  # the callbacks chained on it run here, on this thread


def _unwrap(done: torch.futures.Future):
    # Raising inside a callback is the one way from Python to a future that C++ sees as failed.
    # Future.set_exception only stores a Python object that raises when Python reads it: torch's
    # C++ DDP would take that object for the result and crash.
    value = done.value()
    if isinstance(value, Failure):
        raise value.exception
    return value


def run_eagerly(cls, names: tuple[str, ...]) -> None:
    """Make ``cls``'s methods ``names`` run eagerly under torch.compile. A collective called from
    compiled code (DDP's forward broadcasts, a graph break's wait()) would otherwise be traced by
    dynamo, which keeps a ProcessGroup opaque and stops with an error at the first attribute of one
    written in Python (self._run, self.place): compile_guard.eager keeps them out of the trace
    without importing dynamo in a program that never compiles."""
    for name in names:
        setattr(cls, name, eager(getattr(cls, name)))


class FutureWork(dist.Work):
    """A torch Work over one queued operation's outcome (a value or a Failure).

    wait() raises the operation's exception. get_future() hands torch a future that C++ sees as
    failed when the operation failed (made on first request: a synchronous call never needs it).
    (torch's own _create_work_from_future returns a Work whose wait() succeeds on error.)"""

    def __init__(self, outcome: torch.futures.Future, thread, queued: Operation) -> None:
        # thread: the CommThread that runs ``queued`` (comm_thread.py, which imports this module)
        super().__init__()
        self._outcome = outcome
        self._thread, self._queued = thread, queued
        self._future: torch.futures.Future | None = None

    def wait(self, timeout=None) -> bool:
        """See torch.distributed.Work.wait; ``timeout`` (a timedelta) bounds this wait alone."""
        if not self._outcome.done():
            self._thread.run_until(self._queued)
        if timeout and not self._outcome.done():  # torch's kNoTimeout is timedelta(0)
            deadline = time.monotonic() + timeout.total_seconds()
            while not self._outcome.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gradsync backend, rank {self._thread.rank}: {self._queued.what} did "
                                       f"not finish within the {timeout.total_seconds():g} s given to wait()")
                time.sleep(0.001)
        value = self._outcome.wait()
        if isinstance(value, Failure):
            raise value.exception
        if self._queued.handoff is not None:   # the caller's current streams wait for the operation's
            self._queued.handoff.collect()
        return True

    def _wake(self) -> None:
        if not self._outcome.done():
            self._thread.wake()

    def is_completed(self) -> bool:
        self._wake()
        return self._outcome.done()

    def is_success(self) -> bool:
        return self._outcome.done() and not isinstance(self._outcome.value(), Failure)

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outcome.value()

    def get_future(self) -> torch.futures.Future:
        if not self._outcome.done():
            # the holder (inside a callback) runs the queue up to this operation first: torch's
            # wait on the future cannot (comm_thread.py, rule 3); anyone else wakes the thread,
            # since whoever waits on the future (torch's C++ callers) does not run the operation
            self._thread.run_until(self._queued, take_turn=False)
            self._wake()
        if self._future is None:
            self._future = self._outcome.then(_unwrap)
        return self._future


class DoneWork(dist.Work):
    """A torch Work over an operation that has already run (CommThread.run_now): its value or a
    Failure, which wait() raises and whose future C++ sees as failed. Made without an __init__
    of its own and given its outcome after: a Python __init__ over torch's costs a call per
    synchronous collective."""

    _outcome = None

    def wait(self, timeout=None) -> bool:
        if isinstance(self._outcome, Failure):
            raise self._outcome.exception
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return not isinstance(self._outcome, Failure)

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


for _work in (FutureWork, DoneWork, TransferWork):
    run_eagerly(_work, ("wait", "is_completed", "is_success", "result", "get_future"))
