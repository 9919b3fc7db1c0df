"""The communication thread of one process group, and its watchdog.

Vocabulary
    operation  one collective: a closure over CPU tensors and the torch Future its outcome completes
               (work.py's Operation; the Work handed to torch wraps that outcome)
    turn       the right to run operations; one thread holds it at a time: the group's daemon
               thread, or a caller that runs its operation itself instead of waiting for it
    holder     the thread that holds the turn. It runs the operation, then the callbacks that torch
               and the program chained on the operation's future (Future.then), which run on
               whatever thread completes the future

Rules
    1. Issue order is run order. Every rank issues the same collectives in the same order, so that
       order is also the order on the wire.
    2. A collective issued by the holder runs at once, on the holder, before anything queued. Such a
       collective comes from a callback of the operation just run: torch's PowerSGD hook issues its P
       and Q all-reduces in then() callbacks and waits for each there. Queued, it would wait behind
       the callback that waits for it, for ever (PowerSGD hung that way). Run at once, it comes
       right after the operation whose callback issued it on every rank, whatever the timing: the
       order stays the same everywhere, and nested then() chains run through.
    3. The holder that waits for a queued operation (Work.wait(), result() or get_future()) runs
       the queue up to it first, in order.
    4. Watchdog: a thread per group looks every second (or timeout/10). A holder that has made no
       progress (no operation started or ended) for longer than the group's timeout, inside a
       callback, or for the timeout plus GRACE inside an operation (whose own waits time out first
       and name the missing rank), aborts the group, as NCCL's watchdog does: the operation and
       everything queued behind it fail with an error that names the operation, what the holder is
       doing and for how long, and every later call on the group fails with it at once. A program
       waits at most about the timeout, never for ever.

What rule 2 cannot reach: a callback that waits on a torch Future (fut.wait()) of an operation
queued before the callback ran. That future's wait is torch's own, so nothing can run the queue for
it; the watchdog ends it with an error that says so (wait on the Work, or issue the collective
inside the callback).
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from typing import Callable


from gradsync.observe import stall
from gradsync.c10d.work import DoneWork, Failure, FutureWork, Operation

GRACE = 5.0
"""Seconds past the timeout an operation may run before the watchdog aborts the group (its own
waits normally raise at the timeout, naming the rank that did not arrive)."""


class GroupAborted(RuntimeError):
    """The watchdog ended the group: a holder made no progress for longer than the timeout."""


class CommThread:
    """A process group's operations, run one at a time in issue order; see the module docstring.

    A daemon thread takes them off the queue. A caller that waits for an operation at the head of
    the queue while no one holds the turn runs it itself, and a synchronous call made while
    nothing is queued runs at once (run_now): no hand-over between threads, the same order."""

    def __init__(self, name: str, timeout: float, rank: int) -> None:
        self.timeout, self.rank = timeout, rank
        self._queue: collections.deque[Operation] = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._holder: int | None = None        # threading.get_ident() of the holder
        self._doing = ""                        # what the holder does, for the watchdog's message
        self._in_operation = False              # holder inside an operation (else in its callbacks)
        self._current: Operation | None = None  # the queued operation the holder runs, if any
        self._progress_at = 0.0                 # monotonic time an operation last started or ended
        self._closed = False
        self._aborted: GroupAborted | None = None
        self._stop = threading.Event()
        threading.Thread(target=self._serve, name=name, daemon=True).start()
        threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True).start()

    # -- issuing -----------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._aborted is not None:
            raise self._aborted
        if self._closed:
            raise RuntimeError("this gradsync process group was shut down; create a new one")

    def submit(self, operation: Callable[[], object], what: str, wake: bool = True, handoff=None):
        """Queue ``operation()``; a torch Work whose future's value is its return value. ``wake``
        False: the caller is about to wait, so the thread is not woken for it (if the queue is busy
        the thread still takes it in turn). Issued by the holder: run at once (rule 2). ``handoff``:
        its CUDA tensors' stream order (work.py, Operation)."""
        queued = Operation(operation, what, handoff)
        with self._changed:
            self._check_open()
            nested = self._holder == threading.get_ident()
            if not nested:
                self._queue.append(queued)
                if wake or self._holder is not None or len(self._queue) > 1:
                    self._changed.notify_all()
        if nested:
            self._execute(queued)
        return FutureWork(queued.outcome, self, queued)

    def run_now(self, operation: Callable[..., object], result, *args):
        """Run ``operation(*args)`` on the caller's thread when nothing is queued or held (a
        synchronous call: the order is the same as if it were queued and waited for), or when the
        caller holds the turn (rule 2); return a finished torch Work whose value is ``result``.
        None when the queue is busy: then submit it."""
        me = threading.get_ident()
        with self._lock:
            self._check_open()
            nested = self._holder == me
            if not nested:
                if self._holder is not None or self._queue:
                    return None
                self._take_turn(me)
        previous = self._enter("running a synchronous collective", None)
        try:
            operation(*args)
            outcome = result
        except BaseException as exc:  # carried to Work.wait(), as for a queued operation
            outcome = Failure(exc)
        finally:
            stall.left()
            self._leave(previous)
            if not nested:
                self._release()
        done = DoneWork()
        done._outcome = outcome
        return done

    # -- running -----------------------------------------------------------------------------------
    def _take_turn(self, me: int) -> None:
        """Called with the lock held: the watchdog, which looks under the lock, must not see the new
        holder with the last holder's progress time."""
        self._holder, self._progress_at = me, time.monotonic()

    def _enter(self, doing: str, operation: Operation | None) -> tuple:
        previous = (self._doing, self._in_operation, self._current)
        self._doing, self._in_operation, self._current = doing, True, operation
        self._progress_at = time.monotonic()
        return previous

    def _leave(self, previous: tuple) -> None:
        self._doing, self._in_operation, self._current = previous
        self._progress_at = time.monotonic()

    def _execute(self, queued: Operation) -> None:
        """Run ``queued`` on the holder (this thread), then its future's callbacks; an operation on
        CUDA tensors under its hand-off's side streams, settled there too (its CUDA-aware future
        records its completion on them)."""
        previous = self._enter(f"running {queued.what}", queued)
        try:
            with queued.handoff.running() if queued.handoff is not None else contextlib.nullcontext():
                try:
                    value = queued.run()
                except BaseException as exc:  # crosses to the waiting thread as the Work's error
                    value = Failure(exc)
                finally:
                    stall.left()  # the stall inspector watches the operation in progress
                self._doing, self._in_operation = f"in a callback chained on {queued.what}'s future", False
                self._progress_at = time.monotonic()
                queued.settle(value)
        except BaseException as exc:   # the hand-off itself failed (a CUDA error): the Work raises it
            queued.settle(Failure(exc))
            raise
        finally:
            self._leave(previous)

    def _release(self) -> None:
        with self._lock:
            self._holder = None
            if self._queue:  # only the thread waits on the condition, and only for queued work
                self._changed.notify_all()

    def run_until(self, queued: Operation, take_turn: bool = True) -> None:
        """A waiter's turn: the holder runs the queue up to ``queued`` (rule 3); with ``take_turn``,
        a thread that finds ``queued`` at the head and the turn free runs it itself; anyone else
        just waits."""
        me = threading.get_ident()
        while not queued.settled:
            with self._lock:
                if self._holder == me:
                    if not self._queue:
                        return
                    head = self._queue.popleft()
                    release = False
                elif take_turn and self._holder is None and self._queue and self._queue[0] is queued:
                    head = self._queue.popleft()
                    self._take_turn(me)
                    release = True
                else:
                    return
            try:
                self._execute(head)
            finally:
                if release:
                    self._release()

    def wake(self) -> None:
        """Make sure the thread looks at the queue (an operation queued without waking it is
        about to be waited for some other way than Work.wait())."""
        with self._lock:
            self._changed.notify_all()

    def _serve(self) -> None:
        me = threading.get_ident()
        while True:
            with self._changed:
                while not self._closed and (self._holder is not None or not self._queue):
                    self._changed.wait()
                if self._closed:
                    return
                queued = self._queue.popleft()
                self._take_turn(me)
            try:
                self._execute(queued)
            finally:
                self._release()

    # -- watchdog ----------------------------------------------------------------------------------
    def _watch(self) -> None:
        period = min(1.0, self.timeout / 10)
        while not self._stop.wait(period):
            with self._lock:
                if self._holder is None:
                    continue
                stuck_for = time.monotonic() - self._progress_at
                limit = self.timeout + (GRACE if self._in_operation else 0.0)
                if stuck_for > limit:
                    self._abort(stuck_for)
                    return

    def _abort(self, stuck_for: float) -> None:
        """Fail what the holder runs and everything queued (called with the lock held)."""
        hint = ("Its own waits should have raised first: a transfer that does not time out is a bug."
                if self._in_operation else
                "A Future callback (then() or add_done_callback) has not returned. If it waits on the "
                "future of an operation issued before it (fut.wait()), it waits for itself: operations run "
                "in issue order and that one is queued behind the callback. Wait on the Work instead "
                "(work.wait() runs the queue up to it), or issue the collective inside the callback.")
        queued = list(self._queue)
        self._queue.clear()
        running = [self._current] if self._in_operation and self._current is not None else []
        self._aborted = GroupAborted(
            f"gradsync backend, rank {self.rank}: the watchdog aborted this process group: its "
            f"communication thread has been {self._doing} for {stuck_for:.1f} s with no progress, past the "
            f"group's timeout of {self.timeout:g} s. {hint} "
            f"{len(queued)} operation(s) queued behind it ({', '.join(q.what for q in queued) or 'none'}) "
            f"and every later call on this group fail with this error.")
        failure = Failure(self._aborted)
        # settled on a thread of their own: their callbacks may call back into the group, whose
        # lock this thread holds (they then meet the abort error at once)
        threading.Thread(target=lambda: [q.settle(failure) for q in running + queued], daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._closed = True
            self._queue.clear()
            self._changed.notify_all()
