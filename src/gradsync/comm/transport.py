"""Transport: non-blocking send and receive of contiguous tensors between ranks, metered.

Every collective in gradsync is written against this small interface:

    handle = transport.isend(tensor, dst, op)        # op: a label such as "all_reduce/ring"
    handle = transport.irecv(tensor, src, op)        # src=None: receive from any rank
    peer = handle.wait()                             # blocks at most world.timeout seconds

Messages between one pair of ranks are matched in the order they were posted, so two ranks that
post the same sequence of sends and receives never need tags. A ``tag`` keeps two streams apart
(the parameter server receives headers from any rank on one tag and payloads on another).

A failed or timed-out wait raises PeerError naming this rank, the peer, the operation and the byte
count; nothing waits forever.

TorchTransport carries the bytes with torch.distributed point-to-point (gloo on CPU, NCCL on GPU).
Completed transfers are reported to the process-wide TrafficMeter; ``control=True`` marks small
headers, counted apart from payload.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync import runtime
from gradsync.meter import METER, TrafficMeter


class PeerError(RuntimeError):
    """A transfer with another rank failed or timed out. ``peer`` is the other rank (None: any)."""

    def __init__(self, message: str, *, rank: int, peer: int | None, op: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.peer = peer
        self.op = op


class Handle:
    """A posted transfer; ``wait()`` completes it and returns the peer rank."""

    def wait(self, timeout: float | None = None) -> int:  # pragma: no cover - interface
        """Complete the transfer within ``timeout`` seconds (default: the world's timeout)."""
        raise NotImplementedError

    def done(self) -> bool:  # pragma: no cover - interface
        """True when ``wait()`` would return at once."""
        raise NotImplementedError


class Transport:
    """Point-to-point interface the collectives are written against."""

    rank: int
    world_size: int

    def isend(self, tensor: torch.Tensor, dst: int, op: str, *, control: bool = False, tag: int = 0) -> Handle:
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, src: int | None, op: str, *, control: bool = False,
              tag: int = 0) -> Handle:
        raise NotImplementedError


class _TorchHandle(Handle):
    __slots__ = ("_work", "_transport", "_peer", "_op", "_nbytes", "_sent", "_control", "_done")

    def __init__(self, work, transport: "TorchTransport", peer, op, nbytes, sent, control):
        self._work = work
        self._transport = transport
        self._peer = peer
        self._op = op
        self._nbytes = nbytes
        self._sent = sent
        self._control = control
        self._done = False

    def done(self) -> bool:
        return self._done or self._work.is_completed()

    def wait(self, timeout: float | None = None) -> int:
        if self._done:
            return self._peer
        t = self._transport
        started = time.monotonic()
        try:
            self._work.wait(t.wait_timeout if timeout is None else timedelta(seconds=timeout))
            if self._peer is None:
                self._peer = self._work._source_rank()
        except Exception as exc:
            waited = time.monotonic() - started
            verb = "send to" if self._sent else "receive from"
            who = "any rank" if self._peer is None else f"rank {self._peer}"
            kind = "timed out" if "imed out" in str(exc) else "failed"
            raise PeerError(
                f"rank {t.rank}: {self._op}: {verb} {who} ({self._nbytes} bytes) {kind} after "
                f"{waited:.1f} s (timeout {t.timeout:.0f} s); rank {self._peer} may have died or stalled. "
                f"Cause: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
                rank=t.rank, peer=self._peer, op=self._op) from exc
        self._done = True
        t.meter.record(peer=self._peer, nbytes=self._nbytes, op=self._op, sent=self._sent,
                       control=self._control)
        return self._peer


class TorchTransport(Transport):
    """Transport over torch.distributed isend/irecv of the default process group."""

    def __init__(self, world: runtime.World, meter: TrafficMeter = METER) -> None:
        self.rank = world.rank
        self.world_size = world.world_size
        self.timeout = world.timeout
        self.wait_timeout = timedelta(seconds=world.timeout)
        self.meter = meter

    def _check(self, tensor: torch.Tensor, peer: int | None, op: str) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: transport needs a contiguous tensor (got strides {tensor.stride()})")
        if peer is not None and not (0 <= peer < self.world_size and peer != self.rank):
            raise ValueError(f"{op}: peer rank {peer} is not another rank of 0..{self.world_size - 1} "
                             f"(this is rank {self.rank})")

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        self._check(tensor, dst, op)
        work = dist.isend(tensor, dst, tag=tag)
        return _TorchHandle(work, self, dst, op, tensor.numel() * tensor.element_size(), True, control)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        self._check(tensor, src, op)
        work = dist.irecv(tensor, src, tag=tag)
        return _TorchHandle(work, self, src, op, tensor.numel() * tensor.element_size(), False, control)


_TRANSPORTS: dict[int, Transport] = {}


def default_transport() -> Transport:
    """The transport for the current world (created on first use, dropped at shutdown)."""
    w = runtime.world()
    key = id(w)
    transport = _TRANSPORTS.get(key)
    if transport is None:
        _TRANSPORTS.clear()
        transport = _TRANSPORTS[key] = TorchTransport(w)
    return transport


def wait_all(handles: list[Handle]) -> None:
    """Wait for every handle, in order."""
    for handle in handles:
        handle.wait()
