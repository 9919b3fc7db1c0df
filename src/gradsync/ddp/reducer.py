"""Reducer: autograd hooks mark gradients ready; full buckets are averaged while backward goes on.

Per iteration
    1. each parameter's post-accumulate-grad hook copies its gradient into its bucket's flat
       buffer (once; afterwards ``param.grad`` *is* a view of that buffer, so later iterations
       accumulate straight into it) and marks it ready;
    2. when bucket i and every bucket before it are ready, bucket i is handed to the communication
       thread (one thread, first in first out), so every rank launches buckets in the same order
       whatever order autograd produced them in;
    3. at the end of backward (an autograd engine callback) unready parameters are either an error
       that names them or, with find_unused_parameters, zero gradients; then the reducer waits for
       every bucket, so no optimizer step can see a half-reduced gradient. In debug mode
       (GRADSYNC_DEBUG=1) the averaged gradients are then checked for NaN and Inf.

State: ``ready`` flags live in the buckets; ``_pending`` counts unready parameters per bucket;
``_next_launch`` is the first bucket not yet handed over; ``_futures`` the reductions in flight.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.autograd import Variable

from gradsync import runtime, trace
from gradsync.comm.collectives import all_reduce
from gradsync.ddp.buckets import Bucket


class Reducer:
    """Turns each rank's gradients into the average over ranks, bucket by bucket."""

    def __init__(self, buckets: list[Bucket], algorithm: str, comm_hook, find_unused_parameters: bool) -> None:
        self.buckets = buckets
        self.algorithm = algorithm
        self.comm_hook = comm_hook
        self.find_unused_parameters = find_unused_parameters
        self.sync_this_backward = True
        self.last_overlap: float | None = None
        self.last_comm_seconds = 0.0
        self.last_wait_seconds = 0.0
        self._slot = {id(p): (b.index, slot) for b in buckets for slot, p in enumerate(b.params)}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-comm")
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in buckets for p in b.params]
        self._reset()

    def _reset(self) -> None:
        self._in_backward = False
        self._pending = [len(b.params) for b in self.buckets]
        for b in self.buckets:
            b.ready = [False] * len(b.params)
        self._next_launch = 0
        self._futures: list[Future] = []
        self._comm_spans: list[tuple[float, float]] = []

    # -- 1. hooks ----------------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self.sync_this_backward:
            return
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._finalize_backward)
        bucket_index, slot = self._slot[id(param)]
        bucket = self.buckets[bucket_index]
        if bucket.ready[slot]:
            raise RuntimeError(f"parameter {bucket.names[slot]!r} received its gradient twice in one backward; "
                               f"run extra backward passes under model.no_sync()")
        view = bucket.grad_view(slot)
        if param.grad.data_ptr() != view.data_ptr():
            view.copy_(param.grad)
            param.grad = view
        bucket.ready[slot] = True
        self._pending[bucket_index] -= 1
        if self._pending[bucket_index] == 0:
            trace.instant(f"bucket {bucket_index} ready", "comm", bucket=bucket_index)
            self._launch_ready()

    # -- 2. launch in bucket order -------------------------------------------------------------
    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            bucket = self.buckets[self._next_launch]
            self._futures.append(self._executor.submit(self._reduce, bucket))
            self._next_launch += 1

    def _reduce(self, bucket: Bucket) -> None:
        start = time.perf_counter()
        tracer = trace.tracer()
        t0 = tracer.now_us() if tracer else 0.0
        if self.comm_hook is None:
            all_reduce(bucket.flat, op="avg", algorithm=self.algorithm)
        else:
            self.comm_hook(bucket.flat, self.algorithm)
        end = time.perf_counter()
        self._comm_spans.append((start, end))
        if tracer:
            tracer.add(f"all_reduce bucket {bucket.index}", "comm", t0, tracer.now_us(),
                       bucket=bucket.index, bytes=bucket.nbytes, algorithm=self.algorithm)

    # -- 3. end of backward ----------------------------------------------------------------------
    def _finalize_backward(self) -> None:
        backward_end = time.perf_counter()
        trace.instant("backward end", "compute")
        try:
            unready = [(b, slot) for b in self.buckets for slot, ready in enumerate(b.ready) if not ready]
            if unready and not self.find_unused_parameters:
                names = ", ".join(b.names[slot] for b, slot in unready)
                raise RuntimeError(
                    f"rank {runtime.world().rank}: these parameters received no gradient in this backward: {names}. "
                    f"Their buckets cannot be reduced, and the other ranks would wait for them. Make every "
                    f"parameter take part in the loss, set requires_grad=False on the unused ones, or pass "
                    f"find_unused_parameters=True.")
            for b, slot in unready:
                self._mark_unused(b, slot)
            self._launch_ready()
            globally_unused = self._globally_unused(unready) if self.find_unused_parameters else []
            with trace.span("wait for buckets", "wait"):
                self._wait_all()
            self.last_wait_seconds = time.perf_counter() - backward_end
            for b, slot in globally_unused:  # as in one process: no gradient, not a zero gradient
                b.params[slot].grad = None
            if runtime.world().debug:
                self._check_finite()
            self.last_overlap = trace.overlap_share(self._comm_spans, backward_end)
            self.last_comm_seconds = sum(end - start for start, end in self._comm_spans)
        finally:
            self._reset()

    def _check_finite(self) -> None:
        """Debug mode: a NaN or Inf in the averaged gradients is an error naming the parameters. The
        check runs after the reduction, so every rank sees the same values and raises alike."""
        bad = [b.names[slot] for b in self.buckets for slot in range(len(b.params))
               if not bool(torch.isfinite(b.grad_view(slot)).all())]
        if bad:
            raise FloatingPointError(
                f"rank {runtime.world().rank}: the averaged gradients of {', '.join(bad)} contain NaN or Inf "
                f"(checked because GRADSYNC_DEBUG=1 / init(debug=True)); some rank produced them: look for a "
                f"bad batch, a too-large learning rate or a log/div of zero")

    def _mark_unused(self, bucket: Bucket, slot: int) -> None:
        param = bucket.params[slot]
        view = bucket.grad_view(slot)
        view.zero_()
        if param.grad is None or param.grad.data_ptr() != view.data_ptr():
            param.grad = view
        bucket.ready[slot] = True
        self._pending[bucket.index] -= 1

    def _globally_unused(self, locally_unused: list[tuple[Bucket, int]]) -> list[tuple[Bucket, int]]:
        """Parameters no rank used: a count of users per parameter, all-reduced after the buckets."""
        slots = [(b, slot) for b in self.buckets for slot in range(len(b.params))]
        unused = {(b.index, slot) for b, slot in locally_unused}
        users = torch.tensor([0 if (b.index, slot) in unused else 1 for b, slot in slots], dtype=torch.int64)
        self._executor.submit(all_reduce, users, "sum", "ring").result()
        return [(b, slot) for (b, slot), count in zip(slots, users.tolist()) if count == 0]

    def _wait_all(self) -> None:
        limit = 4 * runtime.world().timeout + 10.0  # each transfer inside already has its own timeout
        for future in self._futures:
            future.result(timeout=limit)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._executor.shutdown(wait=True)
