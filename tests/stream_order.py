"""A stand-in for the CUDA runtime that host staging calls (gradsync/comm/cuda_runtime.py), with a
model of streams, events and synchronizations that finds every race: two accesses to the same
memory, one of them a write, that nothing orders.

What plays what (on a CPU, under GRADSYNC_HOST_STAGING=cpu so that CPU tensors are staged)
    device memory   every tensor, except host memory
    host memory     the buffers the stand-in hands out as pinned memory (host_buffer), the regions
                    it is asked to page-lock (register), and what is made from host memory alone
    a kernel        every aten operation (seen by a TorchDispatchMode that each thread of the test
                    enters: ``watching``) that touches device memory: it is queued on the thread's
                    current stream; one that touches host memory alone runs on the CPU at once
    streams         each thread's current stream is the one it made current (``use``), else the
                    device's default stream, shared by every thread (as CUDA's legacy stream is)

Order, as vector clocks: a stream runs its work in the order it was queued; ``wait_event`` orders a
stream after what the event's stream had queued when it was recorded; a thread that synchronizes
(an event, a stream by a blocking copy, the device) has seen that work end, and everything it
queues or does afterwards comes after it. Nothing else orders anything: in particular work queued
by two threads on two streams is unordered, whatever the wall clock said on this run.

A race is recorded with both accesses' descriptions (``races``); ``copies`` counts the copies
between host and device memory, so a test can tell that staging ran through the stand-in at all.
"""

from __future__ import annotations

import contextlib
import itertools
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gradsync.comm import cuda_runtime

_NAMES = itertools.count()   # stream names unique in the process: a stream outlives its recorder where
                             # staging keeps it (a transport's copy streams), and must not pass for a new one
_EMPTY = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.new_empty.default,
          torch.ops.aten.empty_strided.default}


def _merge(into: dict, other: dict) -> None:
    for unit, tick in other.items():
        if into.get(unit, 0) < tick:
            into[unit] = tick


class FakeStream:
    def __init__(self, model: "Recorder", name: str) -> None:
        self._model, self.name, self.clock = model, name, {}

    @property
    def model(self) -> "Recorder":
        """The recorder in use now (a stream kept by staging outlives the one that made it)."""
        current = cuda_runtime.CUDA
        return current if isinstance(current, Recorder) else self._model

    def wait_event(self, event: "FakeEvent") -> None:
        with self.model.lock:
            _merge(self.clock, event.clock)
            _merge(self.clock, self.model.host_clock())

    def synchronize(self) -> None:
        with self.model.lock:
            _merge(self.model.host_clock(), self.clock)

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, model: "Recorder") -> None:
        self.model, self.clock = model, {}

    def record(self, stream: FakeStream | None = None) -> None:
        model = self.model
        stream = stream if stream is not None else model.current_stream(None)
        with model.lock:
            _merge(stream.clock, model.host_clock())
            self.clock = dict(stream.clock)

    def synchronize(self) -> None:
        with self.model.lock:
            _merge(self.model.host_clock(), self.clock)


class Recorder:
    """The stand-in (cuda_runtime.CudaRuntime's methods) and the race model."""

    def __init__(self, register_code: int = 0) -> None:
        self.lock = threading.RLock()
        self.races: list[str] = []
        self.copies = 0
        self.registered: list[str] = []        # "register <nbytes>" / "unregister <nbytes>", in order
        self.register_code = register_code
        self._host: set[int] = set()           # storages that are host memory
        self._default = FakeStream(self, f"default stream {next(_NAMES)}")
        self._streams = [self._default]
        self._threads = threading.local()
        self._accesses: dict[int, list] = {}  # storage -> [last write or None, reads since]

    # -- the runtime ----------------------------------------------------------------------------
    def is_device(self, tensor: torch.Tensor) -> bool:
        return self._key(tensor) not in self._host

    def current_stream(self, device):
        stack = getattr(self._threads, "streams", None)
        return stack[-1] if stack else self._default

    def new_stream(self, device) -> FakeStream:
        stream = FakeStream(self, f"stream {next(_NAMES)}")
        self._streams.append(stream)
        return stream

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        stack = self._threads.__dict__.setdefault("streams", [])
        stack.append(stream)
        if stream not in self._streams:   # one made before this recorder: synchronize() waits for it too
            self._streams.append(stream)
        try:
            yield
        finally:
            stack.pop()

    def on(self, device):
        return contextlib.nullcontext()

    def record_stream(self, tensor, stream) -> None:
        pass

    def synchronize(self, device) -> None:
        with self.lock:
            for stream in self._streams:
                _merge(self.host_clock(), stream.clock)

    def copy(self, destination: torch.Tensor, source: torch.Tensor, non_blocking: bool) -> None:
        with self.lock:
            self.copies += 1
        destination.copy_(source)
        if not non_blocking:
            self.current_stream(None).synchronize()

    def host_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype)
        self._host.add(self._key(buffer))
        return buffer

    def register(self, host: torch.Tensor, device) -> int:
        self.registered.append(f"register {host.numel() * host.element_size()}")
        if self.register_code == 0:
            self._host.add(self._key(host))
        return self.register_code

    def unregister(self, host: torch.Tensor) -> int:
        self.registered.append(f"unregister {host.numel() * host.element_size()}")
        return 0

    def future(self, devices) -> torch.futures.Future:
        return torch.futures.Future()

    # -- the model ------------------------------------------------------------------------------
    def host_clock(self) -> dict:
        clock = getattr(self._threads, "clock", None)
        if clock is None:
            clock = self._threads.clock = {}
        return clock

    @staticmethod
    def _key(tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().data_ptr()

    def operation(self, func, args, kwargs, out) -> None:
        """One aten operation that ran: queue it (a kernel) or run it (host memory alone), and check
        its accesses against the last ones to the same memory."""
        if func in _EMPTY or getattr(func, "is_view", False):
            return
        mutated, read = [], []
        schema = func._schema.arguments
        given = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
        for argument, value in zip(schema, given):
            (mutated if argument.alias_info is not None and argument.alias_info.is_write else read).extend(
                _tensors(value))
        fresh = [] if mutated else list(_tensors(out))   # a functional operation's outputs
        inputs = [t for t in mutated + read if t.numel()]
        with self.lock:
            if inputs and all(self._key(t) in self._host for t in inputs):   # host memory alone: the CPU, now
                thread = f"the CPU ({threading.current_thread().name})"
                clock = self.host_clock()
                clock[thread] = clock.get(thread, 0) + 1
                unit, now = thread, dict(clock)
                self._host.update(self._key(t) for t in fresh)
            else:   # a kernel on this thread's current stream
                stream = self.current_stream(None)
                _merge(stream.clock, self.host_clock())
                stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
                unit, now = stream.name, dict(stream.clock)
            what = f"{func.__name__} on {unit}"
            for tensor in read:
                if tensor.numel():
                    self._access(tensor, False, unit, now, what)
            for tensor in mutated + fresh:
                if tensor.numel():
                    self._access(tensor, True, unit, now, what)
            if func is torch.ops.aten._local_scalar_dense.default:
                _merge(self.host_clock(), now)   # .item() waits for its stream

    def _access(self, tensor: torch.Tensor, write: bool, unit: str, now: dict, what: str) -> None:
        last_write, reads = self._accesses.setdefault(self._key(tensor), [None, []])
        earlier = ([last_write] if last_write is not None else []) + (reads if write else [])
        for their_unit, their_clock, their_what in earlier:
            if their_unit != unit and their_clock[their_unit] > now.get(their_unit, 0):
                self.races.append(f"{'write' if write else 'read'} by {what} unordered with {their_what}")
        if write:
            self._accesses[self._key(tensor)] = [(unit, now, what), []]
        else:
            reads.append((unit, now, what))


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class _Watch(TorchDispatchMode):
    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.recorder.operation(func, args, kwargs, out)
        return out


def watching(recorder: Recorder) -> TorchDispatchMode:
    """A mode that reports every aten operation of the thread that enters it to ``recorder``."""
    return _Watch(recorder)
