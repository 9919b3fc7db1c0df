"""The one place where gradsync work becomes a torch Work: a FIFO thread per process group.

torch's DDP launches a bucket's all-reduce from inside backward and waits for it later, so every
operation of the backend must return at once and finish off the caller's thread. Each process
group owns one communication thread; operations run on it one at a time in issue order (every
rank issues the same collectives in the same order, so that order is also the order on the
wire). A result or an exception completes a torch.futures.Future, and torch's Work is made from
it (FutureWork): ``work.wait()`` returns when the data is ready and raises the operation's
exception, and ``work.get_future()`` is what DDP's communication hooks chain on. Every operation below has a
timeout of its own (the transport's), so no Work waits forever.

Point-to-point transfers are not queued: send and recv are posted at once on the caller's thread
(a program may post a receive before the send it pairs with), and their TransferWork waits on the
transport's handles when the program waits.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
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


class CommThread:
    """One thread running a process group's operations in the order they were issued."""

    def __init__(self, name: str) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._closed = threading.Event()

    def submit(self, operation: Callable[[], object]):
        """Run ``operation()`` on the thread; a torch Work whose future's value is its return value."""
        if self._closed.is_set():
            raise RuntimeError("this gradsync process group was shut down; create a new one")
        outcome = torch.futures.Future()

        def run() -> None:
            try:
                outcome.set_result(operation())
            except BaseException as exc:  # crosses to the waiting thread as the Work's error
                outcome.set_result(_Failure(exc))
            finally:
                stall.left()  # the stall inspector watches the operation in progress

        self._executor.submit(run)
        return FutureWork(outcome.then(_unwrap))

    def close(self) -> None:
        self._closed.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


class FutureWork(dist.Work):
    """A torch Work over a torch.futures.Future. (torch's own _create_work_from_future returns a
    Work whose wait() succeeds even when the future holds an error; this one raises it.)"""

    def __init__(self, future: torch.futures.Future) -> None:
        super().__init__()
        self._future = future

    def wait(self, timeout=None) -> bool:
        self._future.wait()  # raises the operation's exception
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.wait()
        except Exception:
            return False
        return True

    def result(self) -> list[torch.Tensor]:
        return self._future.wait()

    def get_future(self) -> torch.futures.Future:
        return self._future


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
