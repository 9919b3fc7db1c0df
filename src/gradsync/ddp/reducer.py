"""Reducer: autograd hooks mark gradients ready; full buckets are reduced while backward goes on.

Per iteration
    1. each parameter's post-accumulate-grad hook copies its gradient into its bucket's flat
       buffer (once; afterwards ``param.grad`` *is* a view of that buffer, so later iterations
       accumulate straight into it) and marks it ready;
    2. when bucket i and every bucket before it are ready, bucket i is handed to the communication
       thread (one thread, first in first out), so every rank launches buckets in the same order
       whatever order autograd produced them in. There the communication hook (ddp/hooks.py) is
       called with the bucket (ddp/grad_bucket.py) and its Future waited for, at most
       ``wait_limit`` seconds, before the next bucket's hook is called. A CUDA bucket's hook runs
       on a side stream that waits for the stream the bucket's gradients were written on, as they
       stood when the bucket became ready (comm/host_staging.py, Handoff: the hook's casts, then its
       staging copies, come after the gradients and not after the rest of backward);
    3. at the end of backward (an autograd engine callback) unready parameters are either an error
       that names them or, with find_unused_parameters, zero gradients; then the reducer waits for
       every bucket (bounded), and the caller's streams for the hooks' side streams, so no optimizer
       step can see a half-reduced gradient. In debug mode
       (GRADSYNC_DEBUG=1) the averaged gradients are then checked for NaN and Inf.

Why one bucket's Future completes before the next bucket's hook starts: torch's hooks chain
collectives inside Future callbacks (PowerSGD: ``dist.all_reduce(...).get_future().wait()`` inside
``then()``), and those callbacks run on the process group's own worker threads, at a time that
depends on each rank's speed. With several buckets in flight, one rank could issue bucket 1's
first collective before bucket 0's second while another does the reverse (mismatched
collectives), and every gloo worker thread could end up blocked inside a callback waiting for a
collective that no free worker can run (a hang). One bucket at a time rules out both; the buckets
still overlap backward, which runs on the main thread meanwhile.

Buckets are rebuilt once (as torch's reducer does): the first backward that synchronises records
the order in which gradients became ready; before the next forward every rank takes rank 0's order
(one broadcast) and rebuilds the buckets in it (ddp/buckets.py), so the first bucket to fill is the
first launched. Not with find_unused_parameters (unless static_graph): the ready order then changes
from iteration to iteration, and torch keeps its buckets too.

Uneven inputs (ddp/uneven_inputs.py): a rank that has joined runs ``shadow_backward()``, the same
hooks on zero gradients, so the others' collectives always have a partner.

State: ``ready`` flags live in the buckets; ``_pending`` counts unready parameters per bucket;
``_next_launch`` is the first bucket not yet handed over; ``_jobs`` the reductions in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for_jobs

import torch
from torch.autograd import Variable

from gradsync.group import runtime
from gradsync.observe import trace
from gradsync.comm.host_staging import Handoff
from gradsync.ddp.buckets import Bucket, build_buckets
from gradsync.ddp.grad_bucket import GradBucket
from gradsync.ddp.replica_group import ReplicaGroup
from gradsync.ddp.hooks import ReduceState


class Reducer:
    """Turns each rank's gradients into the reduced gradients, bucket by bucket."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, bucket_limits: list[int], allocate,
                 group: ReplicaGroup, hook, hook_state, find_unused_parameters: bool, rebuild_buckets: bool,
                 precision=None) -> None:
        self.params, self.names = params, names
        self.bucket_limits = bucket_limits
        self.group = group
        self.hook, self.hook_state = hook, hook_state
        self.find_unused_parameters = find_unused_parameters
        self.precision = precision          # ddp/mixed_precision.py, or None
        self.sync_this_backward = True
        self.divisor = group.size           # what built-in hooks divide the sum by (Join may change it)
        self.synced_backwards = 0
        self.last_overlap: float | None = None
        self.last_comm_seconds = 0.0
        self.last_wait_seconds = 0.0
        self.wait_limit = 4 * runtime.world().timeout + 10.0  # each transfer inside has its own timeout
        self._allocate = allocate
        self._rebuild_pending = rebuild_buckets
        self._ready_order: list[int] | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradsync-comm")
        self._side_streams: dict = {}       # device -> the stream CUDA buckets' hooks run on (Handoff)
        self._build(None)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self._reset()

    def _build(self, order: list[int] | None) -> None:
        dtype = self.precision.param_dtype if self.precision is not None else None
        self.buckets: list[Bucket] = build_buckets(self.params, self.names, self.bucket_limits,
                                                   allocate=self._allocate, order=order, dtype=dtype)
        self._slot = {id(p): (b.index, slot) for b in self.buckets for slot, p in enumerate(b.params)}

    def _reset(self) -> None:
        self._in_backward = False
        self._pending = [len(b.params) for b in self.buckets]
        for b in self.buckets:
            b.ready = [False] * len(b.params)
        self._next_launch = 0
        self._jobs: list[Future] = []
        self._handoffs: list[Handoff] = []
        self._results: dict[int, torch.Tensor] = {}
        self._comm_spans: list[tuple[float, float]] = []
        self._order_seen: list[int] = []

    # -- hooks ---------------------------------------------------------------------------------------
    def set_hook(self, state, hook, ordinary_memory: bool) -> None:
        """Use ``hook(state, bucket)`` from now on; ``ordinary_memory``: move the buckets out of
        shared regions first (a hook of the program's own may resize its buffer, which a region
        cannot do, and its collectives gain nothing from one)."""
        self.hook, self.hook_state = hook, state
        if ordinary_memory and self._allocate is not None:
            self._allocate = None
            self._build([pos for b in self.buckets for pos in b.positions])
            self._reset()

    # -- 1. gradients become ready ---------------------------------------------------------------------
    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._in_backward:
            self._in_backward = True
            Variable._execution_engine.queue_callback(
                self._finalize_backward if self.sync_this_backward else self._finish_local_backward)
        if not self.sync_this_backward:
            return
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
        if self._ready_order is None:   # the first synchronised backward: its order rebuilds the buckets
            self._order_seen.append(bucket.positions[slot])
        self._pending[bucket_index] -= 1
        if self._pending[bucket_index] == 0:
            trace.instant(f"bucket {bucket_index} ready", "comm", bucket=bucket_index)
            self._launch_ready()

    # -- 2. launch in bucket order, one hook at a time on the communication thread ----------------------
    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._pending[self._next_launch] == 0:
            self._submit(self.buckets[self._next_launch])
            self._next_launch += 1

    def _submit(self, bucket: Bucket) -> None:
        """Hand ``bucket`` to the communication thread. A CUDA bucket's hook runs there on a side stream
        that waits for what this thread's stream of the bucket's device has queued now (the bucket's
        gradients), so its kernels and staging copies come after them and not after what backward
        queues later; the end of backward waits for that stream (comm/host_staging.py, Handoff)."""
        handoff = Handoff.of([bucket.flat], self._side_streams)
        if handoff is not None:
            self._handoffs.append(handoff)
        self._jobs.append(self._executor.submit(self._communicate, bucket, handoff))

    def _communicate(self, bucket: Bucket, handoff: Handoff | None = None) -> None:
        start = time.perf_counter()
        if isinstance(self.hook_state, ReduceState):
            self.hook_state.divisor = self.divisor
        with handoff.running() if handoff is not None else contextlib.nullcontext():
            future = self.hook(self.hook_state, GradBucket(bucket, len(self.buckets)))
            result, end = self._wait_for(future, bucket)
            if self.precision is not None:
                self._results[bucket.index] = result   # full-precision gradients are written at the end
            elif result.data_ptr() != bucket.flat.data_ptr() or result.dtype != bucket.flat.dtype:
                bucket.flat.copy_(result.reshape(-1)[:bucket.flat.numel()])
        self._comm_spans.append((start, end))
        tracer = trace.tracer()
        if tracer:   # the span the overlap share is of: from the hook's call to its Future's completion
            tracer.add(f"all_reduce bucket {bucket.index}", "comm", tracer.at_us(start), tracer.at_us(end),
                       bucket=bucket.index, bytes=bucket.nbytes, hook=getattr(self.hook, "__qualname__", "hook"))

    def _wait_for(self, future, bucket: Bucket) -> tuple[torch.Tensor, float]:
        """The hook's Future's tensor and when it completed; bounded by ``wait_limit``."""
        name = getattr(self.hook, "__qualname__", repr(self.hook))
        if not isinstance(future, torch._C.Future):   # torch.futures.Future, or the C++ one get_future() gives
            raise TypeError(f"communication hook {name} returned {type(future).__name__}, not a "
                            f"torch.futures.Future of the reduced bucket (torch's contract)")
        completed: list[float] = []
        done = threading.Event()

        def mark(_) -> None:
            completed.append(time.perf_counter())
            done.set()
        future.add_done_callback(mark)
        if not done.wait(self.wait_limit):
            raise TimeoutError(f"rank {runtime.world().rank}: communication hook {name} did not complete bucket "
                               f"{bucket.index} ({', '.join(bucket.names)}) within {self.wait_limit:.0f} s")
        value = future.wait()   # raises what the hook raised; a CUDA future: this stream waits for its kernels
        tensor = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        if not isinstance(tensor, torch.Tensor) or tensor.numel() < bucket.flat.numel():
            raise TypeError(f"communication hook {name} gave bucket {bucket.index} a Future of "
                            f"{type(tensor).__name__}; it must hold one tensor of the bucket's "
                            f"{bucket.flat.numel()} elements")
        return tensor, completed[0]

    # -- 3. end of backward ------------------------------------------------------------------------------
    def _finish_local_backward(self) -> None:
        """End of a backward under no_sync: nothing to reduce."""
        self._in_backward = False
        if self.precision is not None:
            self.precision.restore_params()

    def _finalize_backward(self) -> None:
        backward_end = time.perf_counter()
        trace.instant("backward end", "compute", at=backward_end)
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
            counted = self._count_users(unready) if self.find_unused_parameters else None
            with trace.span("wait for buckets", "wait"):
                self._wait_all()
            globally_unused = self._globally_unused(counted) if counted is not None else []
            self.last_wait_seconds = time.perf_counter() - backward_end
            if self.precision is not None:
                self.precision.write_gradients(self.buckets, self._results)
            for b, slot in globally_unused:  # as in one process: no gradient, not a zero gradient
                b.params[slot].grad = None
            if runtime.world().debug:
                self._check_finite()
            if self._ready_order is None:
                seen = set(self._order_seen)
                self._ready_order = self._order_seen + [p for b in self.buckets for p in b.positions if p not in seen]
            self.last_overlap = trace.overlap_share(self._comm_spans, backward_end)
            self.last_comm_seconds = sum(end - start for start, end in self._comm_spans)
            self.synced_backwards += 1
        finally:
            if self.precision is not None:
                self.precision.restore_params()
            self._reset()

    def _check_finite(self) -> None:
        """Debug mode: a NaN or Inf in the averaged gradients is an error naming the parameters. The
        check runs after the reduction, so every rank sees the same values and raises alike."""
        bad = [b.names[slot] for b in self.buckets for slot, p in enumerate(b.params)
               if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
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

    def _count_users(self, locally_unused: list[tuple[Bucket, int]]):
        """Queue the all-reduce of a count of users per parameter after the buckets; returns what
        ``_globally_unused`` reads once every job has ended."""
        slots = [(b, slot) for b in self.buckets for slot in range(len(b.params))]
        unused = {(b.index, slot) for b, slot in locally_unused}
        users = torch.tensor([0 if (b.index, slot) in unused else 1 for b, slot in slots], dtype=torch.int64)
        self._jobs.append(self._executor.submit(self.group.all_reduce, users, "sum", "ring"))
        return slots, users

    @staticmethod
    def _globally_unused(counted) -> list[tuple[Bucket, int]]:
        """Parameters no rank used (their count of users is 0)."""
        slots, users = counted
        return [(b, slot) for (b, slot), count in zip(slots, users.tolist()) if count == 0]

    def _wait_all(self) -> None:
        """Wait for every job in launch order. Each hook's Future is bounded by ``wait_limit`` on the
        communication thread, and a job starts when the one before it ends, so each job here gets
        ``wait_limit`` and a margin from the moment the one before it has ended."""
        for number, job in enumerate(self._jobs):
            if not wait_for_jobs([job], timeout=self.wait_limit + 5.0).done:
                raise TimeoutError(f"rank {runtime.world().rank}: the communication thread's job {number} (bucket "
                                   f"reductions in launch order) did not end within {self.wait_limit + 5.0:.0f} s "
                                   f"of the one before it")
            job.result()   # raises what the job raised
        for handoff in self._handoffs:   # this thread's streams wait for the hooks' side streams
            handoff.collect()

    # -- rebuilding the buckets once ------------------------------------------------------------------
    def rebuild_if_due(self) -> bool:
        """After the first synchronised backward (once): every rank rebuilds its buckets in rank 0's
        ready order. Collective; the wrapper calls it before each forward with gradients enabled, a
        joined rank before each shadow iteration (as torch's reducer and its join hook do)."""
        if not self._rebuild_pending or self.synced_backwards == 0:
            return False
        self._rebuild_pending = False
        order = self._ready_order or [p for b in self.buckets for p in b.positions]
        agreed = torch.tensor(order, dtype=torch.int64)
        self.group.broadcast(agreed, src=0)
        old_grads = [(p, p.grad) for p in self.params]
        self._build(agreed.tolist())
        for p, grad in old_grads:   # keep what has accumulated, now in the new buckets
            if grad is not None:
                bucket_index, slot = self._slot[id(p)]
                view = self.buckets[bucket_index].grad_view(slot)
                if grad.dtype == view.dtype:
                    view.copy_(grad)
                    p.grad = view
        self._reset()
        trace.instant("buckets rebuilt", "comm", buckets=len(self.buckets))
        return True

    # -- uneven inputs -----------------------------------------------------------------------------------
    def shadow_backward(self) -> None:
        """A joined rank's part in the others' backward: every bucket through the hook with zero
        gradients, in bucket order (and the unused-parameter count, where the others take one). The
        reduced values stay in this rank's .grad, the average of the others' gradients."""
        self._reset()
        for b in self.buckets:
            b.flat.zero_()
            for slot, p in enumerate(b.params):
                if self.precision is None:
                    p.grad = b.grad_view(slot)
            self._submit(b)
        if self.find_unused_parameters:   # this rank used none of them
            self._count_users([(b, slot) for b in self.buckets for slot in range(len(b.params))])
        try:
            self._wait_all()
            if self.precision is not None:
                self.precision.write_gradients(self.buckets, self._results)
            self.synced_backwards += 1
        finally:
            self._reset()

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._executor.shutdown(wait=True)
