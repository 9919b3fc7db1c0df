"""Host staging: a CUDA tensor's collective runs on a host copy, by the CPU algorithms, as gloo does.

For worlds whose CUDA path is "host" (device_path.py: ranks that share a GPU, no NCCL, live mode),
and for the bitwise reductions NCCL lacks in a world on NCCL (collectives.py). Each collective copies
the device tensor into a host buffer, runs the same collective on that buffer as on any CPU tensor
(shared memory within a host, TCP across hosts; fingerprints compared on the host side, so a
mismatch is still named on every rank), and copies the result back.

This file is the one place that orders staging's copies against the caller's kernels: the
collectives (and so the DDP wrapper, its hooks, ZeRO-1, DiLoCo, the parameter server's broadcasts)
stage through ``in_place`` and ``producing``; work that is issued on one thread and runs on another
(a DDP bucket's hook on the wrapper's communication thread, an operation of the "gradsync" backend
on its group's thread) goes through a ``Handoff``. Every CUDA call goes through cuda_runtime.CUDA.

Vocabulary
    device tensor   the caller's tensor on a GPU (or, under GRADSYNC_HOST_STAGING=cpu, a CPU tensor
                    sent the same way: the copies and their bookkeeping without streams)
    host buffer     where its bytes go: for an all-reduce or a broadcast, a shared region of the
                    transport (every local rank reads it where it lies, so an all-reduce of 256 KiB
                    or more needs no staging copy: allreduce_in_place.py), page-locked with
                    cudaHostRegister (cuda_runtime.py) so both copies are DMA and asynchronous; else
                    (a reduce-scatter's or an all-gather's, whose sizes may differ by rank) pinned
                    private memory; kept per (dtype, element count), as DDP's buckets repeat the same few
    caller's stream the current stream of the thread that calls the collective, on the tensor's device:
                    the tensor's producers are queued there before the call, its readers after
    copy stream     one per device; the copies run there, not on the caller's stream

gloo's discipline (ProcessGroupGloo's CUDA work), for a collective on a device tensor t of M bytes
    in       an event recorded on the caller's stream when the collective is called (after every
             kernel the caller queued before it: a hook's casts included); the copy stream waits
             for it and copies t into the host buffer; the CPU waits for that copy alone (its
             event), not for the whole device
    reduce   the CPU collective on the host buffer
    out      an event recorded on the caller's stream (nothing queued before still reads the
             target), the copy stream waits for it and copies the result back; the caller's stream
             waits for that copy (an event), so later kernels read the result, and the CPU goes on
    reuse    a host buffer is written again only after its last copy out has finished

Handoff: work issued on one thread and run on another
    issued   on the caller's thread, when the work is issued (a DDP bucket ready, a backend method
             called): an event on the caller's stream of each device the work's tensors are on
    run      on the worker's thread, under a side stream per device that first waits for that event:
             every kernel of the work (a hook's casts, the staging above, a result copied into the
             caller's output) is queued there, after what the caller had queued when it issued the
             work and before nothing it queues later
    collect  on the caller's thread, when it takes the result (the end of backward; Work.wait(), or
             the Work's future, which is CUDA-aware): its current stream waits for an event recorded
             on the side stream after the work's last kernel

Two modes, GRADSYNC_STAGING_MODE (read at each collective and each hand-off)
    overlap  the default: the above, events only
    sync     plainly synchronous, obviously right, slower: the device synchronized, copy in (the CPU
             waits), collective, copy out (the CPU waits), synchronized; a hand-off synchronizes
             when the work is issued, starts and ends, and when it is collected. The GPU check
             (benchmarks/cuda_check.sh) compares the two bit for bit before it times anything.

Copies counted: M to the host and M (an all-gather: N x M) back per rank, beside the wire's bytes:
the meter records them apart (TrafficMeter.record_staging). What it costs: the two copies over the
bus plus the host collective of the same bytes; a DDP bucket's copy waits for the bucket's own
gradients and its hook's kernels (the hand-off), so it overlaps the rest of backward.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Callable

import torch

from gradsync.comm import cuda_runtime
from gradsync.observe.meter import METER

KEEP_BUFFERS = 64
"""Host buffers kept per transport (a program with more shapes allocates afresh)."""

MODE_ENV = "GRADSYNC_STAGING_MODE"
MODES = ("overlap", "sync")
"""GRADSYNC_STAGING_MODE's values (see the module docstring)."""

_WARNED: list[bool] = [False]


def staging_mode() -> str:
    """GRADSYNC_STAGING_MODE, checked."""
    value = os.environ.get(MODE_ENV, "overlap").strip().lower() or "overlap"
    if value not in MODES:
        raise ValueError(f"{MODE_ENV}={os.environ[MODE_ENV]!r}: choose overlap (events, the default) or sync "
                         f"(every staging step synchronizes the device: slower, the reference)")
    return value


def _recorded(stream):
    event = cuda_runtime.CUDA.event()
    event.record(stream)
    return event


class HostStaging:
    """The host buffers and copy streams of one transport (``staging_of``)."""

    def __init__(self, allocate) -> None:
        self._allocate = allocate          # shared regions (collectives.shared_allocator), or None
        # (dtype, numel, cuda) -> [host tensor, event of its last copy out], shared regions and private
        # buffers apart: every local rank looks up the shared ones in the same order (their sizes agree),
        # so each keeps and drops them alike, as a region's allocation is collective; private ones' sizes
        # differ by rank (an all-gather's shards), and so may their keeping
        self._buffers: dict[bool, dict[tuple, list]] = {True: {}, False: {}}
        self._registered: dict[int, torch.Tensor] = {}   # data_ptr -> a region page-locked with CUDA
        self._streams: dict[torch.device, object] = {}

    # -- buffers and streams ------------------------------------------------------------------
    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device | None, shared: bool) -> list:
        cuda = cuda_runtime.CUDA
        key, buffers = (dtype, numel, device is not None), self._buffers[shared]
        entry = buffers.get(key)
        if entry is None:
            host = self._allocate(numel, dtype) if shared and self._allocate is not None and numel else None
            if host is None:
                host = cuda.host_buffer(numel, dtype) if device is not None else torch.empty(numel, dtype=dtype)
            elif device is not None:
                self._register(host, device)
            if len(buffers) >= KEEP_BUFFERS:
                self._drop(buffers)
            entry = buffers[key] = [host, None]
        if entry[1] is not None:   # its last copy out must be over before it is written again
            entry[1].synchronize()
            entry[1] = None
        return entry

    def _register(self, host: torch.Tensor, device: torch.device) -> None:
        code = cuda_runtime.CUDA.register(host, device)
        if code == 0:
            self._registered[host.data_ptr()] = host
        elif not _WARNED[0]:
            _WARNED[0] = True
            warnings.warn(f"gradsync host staging: cudaHostRegister of a {host.numel() * host.element_size()}-byte "
                          f"shared region failed (CUDA error {code}); copies through such regions are unpinned "
                          f"(synchronous) from now on", RuntimeWarning, stacklevel=3)

    def _drop(self, buffers: dict[tuple, list]) -> None:
        """Forget ``buffers``: each one's copies finished and, a region, unregistered from CUDA first
        (its memory is unmapped once nothing holds it)."""
        for host, copied_out in buffers.values():
            if copied_out is not None:
                copied_out.synchronize()
            if self._registered.pop(host.data_ptr(), None) is not None:
                cuda_runtime.CUDA.unregister(host)
        buffers.clear()

    def close(self) -> None:
        """Unregister every region and forget every buffer: the transport closes its regions after."""
        for buffers in self._buffers.values():
            self._drop(buffers)

    def _stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = cuda_runtime.CUDA.new_stream(device)
        return stream

    # -- the copies ---------------------------------------------------------------------------
    def to_host(self, flat: torch.Tensor, shared: bool) -> list:
        """A host buffer entry holding ``flat``'s values, the copy finished. ``shared``: a shared region
        (allocated by every local rank alike: only for collectives whose tensors are the same size on
        every rank)."""
        cuda = cuda_runtime.CUDA
        if not cuda.is_device(flat):
            entry = self._buffer(flat.numel(), flat.dtype, None, shared)
            entry[0].copy_(flat)
        else:
            with cuda.on(flat.device):
                entry = self._buffer(flat.numel(), flat.dtype, flat.device, shared)
                if staging_mode() == "sync":
                    cuda.synchronize(flat.device)
                    cuda.copy(entry[0], flat, non_blocking=False)
                else:
                    stream = self._stream(flat.device)
                    stream.wait_event(_recorded(cuda.current_stream(flat.device)))
                    with cuda.use(stream):
                        cuda.copy(entry[0], flat, non_blocking=True)
                        copied = _recorded(stream)
                    cuda.record_stream(flat, stream)
                    copied.synchronize()
        METER.record_staging(device_to_host=flat.numel() * flat.element_size())
        return entry

    def to_device(self, host: torch.Tensor, target: torch.Tensor, entry: list | None = None) -> None:
        """Copy ``host`` into the device tensor ``target`` (same shape); the caller's stream waits for it."""
        cuda = cuda_runtime.CUDA
        if not cuda.is_device(target):
            target.copy_(host)
        else:
            with cuda.on(target.device):
                if staging_mode() == "sync":
                    cuda.copy(target, host, non_blocking=False)
                    cuda.synchronize(target.device)
                else:
                    stream = self._stream(target.device)
                    current = cuda.current_stream(target.device)
                    stream.wait_event(_recorded(current))   # nothing queued before the call still reads target
                    with cuda.use(stream):
                        cuda.copy(target, host, non_blocking=True)
                        done = _recorded(stream)
                    current.wait_event(done)
                    cuda.record_stream(target, stream)
                    if entry is not None:
                        entry[1] = done
        METER.record_staging(host_to_device=target.numel() * target.element_size())


def staging_of(transport, allocate) -> HostStaging:
    """The HostStaging of ``transport``'s communicator, kept in its context (context.py; made on first
    use; ``allocate``: shared regions or None). The context closes it (``HostStaging.close``) before
    the transport closes its regions."""
    context = transport.context
    if context.host_staging is None:
        context.host_staging = HostStaging(allocate)
    return context.host_staging


def in_place(staging: HostStaging, tensor: torch.Tensor, collective: Callable[[torch.Tensor], None]) -> torch.Tensor:
    """An in-place collective (all-reduce, broadcast) of the device ``tensor`` through a host buffer."""
    target = tensor.detach()
    flat = target.reshape(-1) if target.is_contiguous() else target.contiguous().reshape(-1)
    entry = staging.to_host(flat, shared=True)
    collective(entry[0])
    staging.to_device(entry[0], flat, entry)
    if flat.data_ptr() != target.data_ptr() or not target.is_contiguous():
        target.copy_(flat.view_as(target))
    return tensor


def producing(staging: HostStaging, tensor: torch.Tensor,
              collective: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A collective that makes a new tensor (reduce-scatter, all-gather) from the device ``tensor``:
    the result, on ``tensor``'s device."""
    target = tensor.detach()
    flat = target.reshape(-1) if target.is_contiguous() else target.contiguous().reshape(-1)
    entry = staging.to_host(flat, shared=False)   # an all-gather's shards may differ in size
    result = collective(entry[0])
    out = torch.empty(result.shape, dtype=result.dtype, device=tensor.device)
    staging.to_device(result, out)
    return out


class Handoff:
    """gloo's discipline for work issued on the caller's thread and run on another (see the module
    docstring): made when the work is issued; ``running()`` around the work on the worker's thread;
    ``collect()`` on the caller's thread when it takes the result. ``of`` gives None where no tensor
    is on a device (nothing to order)."""

    __slots__ = ("tensors", "devices", "mode", "_streams", "_issued", "_done")

    def __init__(self, tensors: list[torch.Tensor], streams: dict) -> None:
        cuda = cuda_runtime.CUDA
        self.tensors = tensors
        self.devices = list(dict.fromkeys(t.device for t in tensors))
        self.mode = staging_mode()
        self._streams = streams   # device -> side stream, kept by the issuer (a reducer, a process group)
        self._done: dict = {}
        self._issued: dict = {}
        for device in self.devices:
            if self.mode == "sync":
                cuda.synchronize(device)
            else:
                self._issued[device] = _recorded(cuda.current_stream(device))

    @staticmethod
    def of(tensors, streams: dict) -> "Handoff | None":
        """A Handoff for the device tensors among ``tensors``, or None where there are none."""
        cuda = cuda_runtime.CUDA
        on_device = [t for t in tensors if isinstance(t, torch.Tensor) and cuda.is_device(t)]
        return Handoff(on_device, streams) if on_device else None

    @contextlib.contextmanager
    def running(self):
        """Around the work, on the worker's thread: the side streams current (overlap), or the device
        synchronized before and after (sync)."""
        cuda = cuda_runtime.CUDA
        if self.mode == "sync":
            for device in self.devices:
                cuda.synchronize(device)
            try:
                yield
            finally:
                for device in self.devices:
                    cuda.synchronize(device)
            return
        with contextlib.ExitStack() as current:
            for device in self.devices:
                side = self._streams.get(device)
                if side is None:
                    side = self._streams[device] = cuda.new_stream(device)
                side.wait_event(self._issued[device])
                for tensor in self.tensors:   # the caller may drop them before the side stream is done
                    if tensor.device == device:
                        cuda.record_stream(tensor, side)
                current.enter_context(cuda.use(side))
            try:
                yield
            finally:
                for device in self.devices:
                    self._done[device] = _recorded(self._streams[device])

    def collect(self) -> None:
        """On the caller's thread, before it reads the result: its current streams wait for the work."""
        cuda = cuda_runtime.CUDA
        if self.mode == "sync":
            for device in self.devices:
                cuda.synchronize(device)
            return
        for device, done in self._done.items():
            cuda.current_stream(device).wait_event(done)

    def future(self) -> torch.futures.Future:
        """The Future the work's outcome completes: CUDA-aware (overlap), so that a waiter's current
        stream waits for the work as ``collect`` makes it; plain in sync mode (the work synchronized)."""
        return cuda_runtime.CUDA.future(self.devices) if self.mode == "overlap" else torch.futures.Future()
