"""BoundedStore: the job's rendezvous store with a deadline on every call.

Why: a torch TCPStore call blocks until the server answers, and when the server's host goes silent
(packets dropped: a cut link, a switch port down, a machine gone without a reset) the kernel keeps
retransmitting for about 15 minutes (net.ipv4.tcp_retries2 = 15) whatever timeout the store was
given. Measured on two network namespaces whose switch port was set down, a client made with
timeout=5 s: get, check, add, compare_set and wait were all still blocked after 25 s; set returns at
once (it does not wait for an answer). Setting TCP_USER_TIMEOUT and keepalives on the client's socket
does end those calls, but closes the connection for good (a member cut for a few seconds could never
use it again) and makes torch print a C++ stack trace for each failed call.

How: a BoundedStore runs its store's calls on a daemon thread of its own, one at a time (a TCPStore
client serializes its calls anyway), and the caller waits for the answer in slices. Every store of one
job shares a Contact, which knows when the store last answered any of them:

    contact lost   a call has waited ``timeout`` seconds and, all that time, no call on any store of
                   the Contact got an answer. From then on every call fails at once with
                   StoreUnreachable (the latch keeps one verdict: the member is leaving the job)

A call that waits on the server's side by design (wait(), get() of a key not written yet) is also
bounded by its own deadline. The thread of a call that never returns stays blocked; it is a daemon,
so it holds nothing at exit, and if the link comes back first its call completes and the connection
is as good as before (it was never closed: TCP delivers what it retransmits).

Each thread of a live member that talks to the store all the time (the heartbeat, the watch) uses a
store of its own, ``own_connection(store)``: a connection of its own, the same key prefix, so that a
call waiting on the server's side never holds up a heartbeat. Its own timeout is long (OWN_TIMEOUT_FACTOR
times the job's): the deadline here ends a call first, and torch's own timeout would only add a C++
warning with a stack trace to the one line a member cut off from its job prints.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Callable

SLICE_SECONDS = 0.05
"""How often a waiting caller looks whether the contact was lost meanwhile."""
GAP_SECONDS = 1.0
"""A silence of the store this long is a gap (Contact.silent_since): more than any answer takes."""
OWN_TIMEOUT_FACTOR = 10
"""own_connection's store timeout, in job timeouts (module docstring)."""


class StoreUnreachable(RuntimeError):
    """The job's store has not answered for the job's timeout (a partition, or its host is gone)."""

    def __init__(self, message: str, address: str, silent_seconds: float) -> None:
        super().__init__(message)
        self.address = address
        self.silent_seconds = silent_seconds


class Contact:
    """When the store at ``address`` last answered any store sharing this Contact, and whether it is lost
    (the module docstring); ``timeout``: the job's, in seconds."""

    def __init__(self, address: str, timeout: float) -> None:
        self.address, self.timeout = address, timeout
        self._lock = threading.Lock()
        self._last_answer = time.monotonic()
        self._waiting: dict[int, float] = {}   # call id -> when it was sent
        self._next = 0
        self._lost_after: float | None = None
        self._gap_ended = float("-inf")

    def sent(self) -> int:
        with self._lock:
            self._next += 1
            self._waiting[self._next] = time.monotonic()
            return self._next

    def answered(self, call: int) -> None:
        with self._lock:
            now, sent = time.monotonic(), self._waiting.pop(call, None)
            if sent is not None and now - max(sent, self._last_answer) >= GAP_SECONDS:
                self._gap_ended = now
            self._last_answer = now

    def silent_since(self, moment: float) -> bool:
        """Whether the store has been silent since monotonic time ``moment``: silent now for GAP_SECONDS, or a
        silence that long ended after it (what was read across it describes a moment long gone)."""
        return self.silence() >= GAP_SECONDS or self._gap_ended >= moment

    def silence(self) -> float:
        """Seconds the store has left a call unanswered with no answer to any other (0 when none waits)."""
        with self._lock:
            if not self._waiting:
                return 0.0
            return time.monotonic() - max(min(self._waiting.values()), self._last_answer)

    def lost(self) -> float | None:
        """The seconds of silence after which contact was lost, or None while it holds."""
        if self._lost_after is None:
            silent = self.silence()
            if silent >= self.timeout:
                self._lost_after = silent
        return self._lost_after

    def unreachable(self, what: str) -> StoreUnreachable:
        silent = self._lost_after if self._lost_after is not None else self.silence()
        return StoreUnreachable(f"the job's store at {self.address} has not answered for {silent:.1f} s "
                                f"(timeout {self.timeout:g} s; {what})", self.address, silent)


class BoundedStore:
    """A torch Store (``store``) whose calls end by a deadline (module docstring). ``name`` names its
    thread. The Store's own methods, each bounded: get, set, check, add, compare_set, wait, multi_get."""

    def __init__(self, store, contact: Contact, name: str = "store") -> None:
        self.store, self.contact = store, contact
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"gradsync-{name}", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return self.contact.address

    def _serve(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            future, fn, args, answered = item
            if not future.set_running_or_notify_cancel():
                continue
            call = self.contact.sent() if answered else None
            try:
                result = fn(*args)
            except BaseException as exc:   # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)
            finally:
                if call is not None:
                    self.contact.answered(call)

    def submit(self, fn: Callable, *args, answered: bool = True) -> Future:
        """Run ``fn(*args)`` (a call of the store) on this store's thread; its Future. ``answered``: the call
        waits for the server's answer (False for set, which returns once its request is sent, and so
        says nothing about the contact)."""
        future: Future = Future()
        if self.contact.lost() is not None:
            future.set_exception(self.contact.unreachable("not asked: contact was lost before"))
            return future
        self._calls.put((future, fn, args, answered))
        return future

    def result(self, future: Future, what: str, deadline: float | None = None):
        """``future``'s value, waiting in slices until it is done, the contact is lost (StoreUnreachable) or
        ``deadline`` (a monotonic time) passes (StoreUnreachable too: the store did not answer in time)."""
        while True:
            try:
                return future.result(timeout=SLICE_SECONDS)
            except TimeoutError:
                pass
            if self.contact.lost() is not None:
                raise self.contact.unreachable(what)
            if deadline is not None and time.monotonic() >= deadline:
                silent = time.monotonic() - deadline
                raise StoreUnreachable(f"the job's store at {self.address} did not answer {what} within its "
                                       f"deadline ({silent:.1f} s past it)", self.address, silent)

    def call(self, what: str, fn: Callable, *args, seconds: float | None = None, answered: bool = True):
        """``fn(*args)`` on this store's thread, bounded (see result); ``seconds``: a deadline of its own."""
        deadline = None if seconds is None else time.monotonic() + seconds
        return self.result(self.submit(fn, *args, answered=answered), what, deadline)

    # -- the Store's methods, bounded ----------------------------------------------------------------
    def get(self, key: str) -> bytes:
        return self.call(f"get {key}", self.store.get, key)

    def set(self, key: str, value) -> None:
        self.call(f"set {key}", self.store.set, key, value, answered=False)

    def check(self, keys: list[str]) -> bool:
        return self.call(f"check {keys[0]}{' ...' if len(keys) > 1 else ''}", self.store.check, keys)

    def add(self, key: str, amount: int) -> int:
        return self.call(f"add {key}", self.store.add, key, amount)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.call(f"compare_set {key}", self.store.compare_set, key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.call(f"multi_get {keys[0]}{' ...' if len(keys) > 1 else ''}", self.store.multi_get, keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.call(f"wait {keys[0]}{' ...' if len(keys) > 1 else ''}", self.store.wait, keys, timeout,
                  seconds=timeout.total_seconds() + 1.0)

    def close(self) -> None:
        """End the thread once its queue is empty (a call blocked on a silent store keeps it until it returns)."""
        self._calls.put(None)


def own_connection(store, timeout: float):
    """A client of ``store``'s server with the same key prefix on a connection of its own (Store.clone), its
    timeout OWN_TIMEOUT_FACTOR x ``timeout`` (module docstring); an in-process store is shared as it is."""
    clone = store.clone()
    try:
        clone.set_timeout(timedelta(seconds=OWN_TIMEOUT_FACTOR * timeout))
    except (AttributeError, RuntimeError):   # a store without a timeout of its own (HashStore)
        pass
    return clone


def within(seconds: float, what: str, fn: Callable, *args):
    """``fn(*args)`` (a store call of set-up code, e.g. a store.wait whose timeout a silent server would
    not keep) on a daemon thread, waiting at most ``seconds``; TimeoutError naming ``what`` after that."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:   # noqa: BLE001 - handed to the caller
            future.set_exception(exc)

    threading.Thread(target=run, name="gradsync-store-call", daemon=True).start()
    try:
        return future.result(timeout=seconds)
    except TimeoutError:
        raise TimeoutError(f"{what}: the store did not answer within {seconds:.0f} s (its host may be cut off "
                           f"or gone)") from None
