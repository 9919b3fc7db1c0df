"""Host staging: a CUDA tensor's collective runs on a host copy, by the CPU algorithms, as gloo does.

For worlds whose CUDA path is "host" (device_path.py: ranks that share a GPU, no NCCL, live mode).
Each collective copies the device tensor into a host buffer, runs the same collective on that
buffer as on any CPU tensor (shared memory within a host, TCP across hosts; fingerprints compared on
the host side, so a mismatch is still named on every rank), and copies the result back.

Vocabulary
    device tensor   the caller's tensor on a GPU (or, under GRADSYNC_HOST_STAGING=cpu, a CPU tensor
                    sent the same way: the copies and their bookkeeping without streams)
    host buffer     where its bytes go: for an all-reduce or a broadcast, a shared region of the
                    transport (every local rank reads it where it lies, so an all-reduce of 256 KiB
                    or more needs no staging copy: allreduce_shared_in_place.py) registered with CUDA (cudaHostRegister: page-locked,
                    so both copies are DMA and asynchronous); else (a reduce-scatter's or an
                    all-gather's, whose sizes may differ by rank) pinned private memory; kept per
                    (dtype, element count), as DDP's buckets repeat the same few
    copy stream     one per device; the copies run there, not on the caller's stream

Phases, for a collective on a device tensor t of M bytes
    in       an event recorded on the caller's current stream (t's producers are queued there before
             the call); the copy stream waits for it and copies t into the host buffer; the CPU
             waits for that copy alone (its event), not for the whole device
    reduce   the CPU collective on the host buffer
    out      the copy stream copies the result back; the caller's current stream waits for that copy
             (an event), so later kernels read the result, and the CPU goes on at once
    reuse    a host buffer is written again only after its last copy out has finished

Copies counted: M to the host and M (an all-gather: N x M) back per rank, beside the wire's bytes:
the meter records them apart (TrafficMeter.record_staging). What it costs: the two copies over the
bus plus the host collective of the same bytes; the copy of a DDP bucket waits for the event the
reducer records when the bucket is ready (``produced_by``), so it overlaps the rest of backward.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable

import torch

from gradsync.observe.meter import METER

KEEP_BUFFERS = 64
"""Host buffers kept per transport (a program with more shapes allocates afresh)."""

_PRODUCED = threading.local()


@contextlib.contextmanager
def produced_by(event):
    """Within it, this thread's next copy to the host waits for ``event`` (a CUDA event recorded where
    the tensor became final: DDP's reducer records one when a bucket is ready), not for everything
    queued on the current stream when the collective starts. None: no change."""
    _PRODUCED.event = event
    try:
        yield
    finally:
        _PRODUCED.event = None


class HostStaging:
    """The host buffers and copy streams of one transport (``staging_of``)."""

    def __init__(self, allocate) -> None:
        self._allocate = allocate          # shared regions (collectives.shared_allocator), or None
        # (dtype, numel, cuda) -> [host tensor, event of its last copy out], shared regions and private
        # buffers apart: every local rank looks up the shared ones in the same order (their sizes agree),
        # so each keeps and drops them alike, as a region's allocation is collective; private ones' sizes
        # differ by rank (an all-gather's shards), and so may their keeping
        self._buffers: dict[bool, dict[tuple, list]] = {True: {}, False: {}}
        self._streams: dict[torch.device, object] = {}

    # -- buffers and streams ------------------------------------------------------------------
    def _buffer(self, numel: int, dtype: torch.dtype, cuda: bool, shared: bool) -> list:
        key, buffers = (dtype, numel, cuda), self._buffers[shared]
        entry = buffers.get(key)
        if entry is None:
            host = self._allocate(numel, dtype) if shared and self._allocate is not None and numel else None
            if host is None:
                host = torch.empty(numel, dtype=dtype, pin_memory=cuda)
            elif cuda:
                _register(host)
            if len(buffers) >= KEEP_BUFFERS:
                buffers.clear()
            entry = buffers[key] = [host, None]
        if entry[1] is not None:   # its last copy out must be over before it is written again
            entry[1].synchronize()
            entry[1] = None
        return entry

    def _stream(self, device: torch.device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    # -- the copies ---------------------------------------------------------------------------
    def to_host(self, flat: torch.Tensor, shared: bool) -> list:
        """A host buffer entry holding ``flat``'s values, the copy finished. ``shared``: a shared region
        (allocated by every local rank alike: only for collectives whose tensors are the same size on
        every rank)."""
        entry = self._buffer(flat.numel(), flat.dtype, flat.is_cuda, shared)
        host = entry[0]
        if flat.is_cuda:
            stream = self._stream(flat.device)
            ready = getattr(_PRODUCED, "event", None)
            _PRODUCED.event = None
            if ready is None:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(flat.device))
            with torch.cuda.stream(stream):
                stream.wait_event(ready)
                host.copy_(flat, non_blocking=True)
                copied = torch.cuda.Event()
                copied.record(stream)
            flat.record_stream(stream)
            copied.synchronize()
        else:
            host.copy_(flat)
        METER.record_staging(device_to_host=flat.numel() * flat.element_size())
        return entry

    def to_device(self, host: torch.Tensor, target: torch.Tensor, entry: list | None = None) -> None:
        """Copy ``host`` into the device tensor ``target`` (same shape); the caller's stream waits for it."""
        if target.is_cuda:
            stream = self._stream(target.device)
            current = torch.cuda.current_stream(target.device)
            free = torch.cuda.Event()   # nothing queued before the call still reads target
            free.record(current)
            with torch.cuda.stream(stream):
                stream.wait_event(free)
                target.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            current.wait_event(done)
            target.record_stream(stream)
            if entry is not None:
                entry[1] = done
        else:
            target.copy_(host)
        METER.record_staging(host_to_device=target.numel() * target.element_size())


def _register(host: torch.Tensor) -> None:
    """Page-lock a shared region for CUDA's copies (cudaHostRegister); left pageable where CUDA refuses."""
    if host.numel():
        torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)


def staging_of(transport, allocate) -> HostStaging:
    """The transport's HostStaging (made on first use; ``allocate``: shared regions or None)."""
    staging = getattr(transport, "host_staging", None)
    if staging is None:
        staging = transport.host_staging = HostStaging(allocate)
    return staging


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
