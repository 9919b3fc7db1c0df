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

TorchTransport carries the bytes with torch.distributed point-to-point on the world's group
(runtime.transfer_group: gloo on CPU, NCCL on GPU). When the world spans hosts, the collectives'
own messages (tag 0) from a higher to a lower rank travel on a second gloo group of their own, so
that each direction between two ranks has its own connection: gloo moves one connection's two
directions one after the other (two hosts at 200 Mbit/s exchanging 4 MiB each way: 272 ms on one
group, 173 ms on two, against 168 ms for 4 MiB one way on the wire). Receives on tag 0 name their
source, so both ends know which group a message is on;
ShmTransport (shm.py) carries them through shared memory between ranks of one host and hands the
rest to a TorchTransport. init() builds the world's transport (default_transport), chosen by
GRADSYNC_TRANSPORT (see TRANSPORTS).
Completed transfers are reported to the process-wide TrafficMeter; ``control=True`` marks small
headers, counted apart from payload.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from gradsync import runtime
from gradsync.meter import METER, TrafficMeter

Combine = Callable[[torch.Tensor, torch.Tensor], None]
"""acc <- acc (op) incoming, in place (see reduce_ops.py)."""


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
    segment_bytes: int | None = None
    """The pipelined algorithms' preferred wire unit on this transport (None: their own default)."""

    def isend(self, tensor: torch.Tensor, dst: int, op: str, *, control: bool = False, tag: int = 0) -> Handle:
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor, src: int | None, op: str, *, control: bool = False,
              tag: int = 0) -> Handle:
        raise NotImplementedError

    def irecv_reduce(self, tensor: torch.Tensor, src: int, op: str, *, staging: torch.Tensor,
                     combine: Combine = torch.Tensor.add_) -> Handle:
        """Receive a message shaped like ``tensor`` from ``src`` and reduce it into ``tensor`` with
        ``combine(tensor, incoming)`` (reduce_ops.py; default: add); done when ``wait()`` returns.
        Here: receive into ``staging`` (same size, the caller's reusable buffer), combine on wait. A
        transport that can read the incoming bytes in place (shm.py) skips the copy."""
        return _ReduceOnWait(self.irecv(staging, src, op), tensor, staging, combine)


class _ReduceOnWait(Handle):
    __slots__ = ("_inner", "_target", "_staging", "_combine", "_peer")

    def __init__(self, inner: Handle, target: torch.Tensor, staging: torch.Tensor, combine: Combine) -> None:
        self._inner, self._target, self._staging, self._combine, self._peer = inner, target, staging, combine, None

    def done(self) -> bool:
        return self._peer is not None or self._inner.done()

    def wait(self, timeout: float | None = None) -> int:
        if self._peer is None:
            peer = self._inner.wait(timeout)
            self._combine(self._target, self._staging)
            self._peer = peer
        return self._peer


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
    """Transport over torch.distributed send/recv of the world's process group (runtime.transfer_group;
    CUDA tensors of a joined world over the program's default group, which has NCCL where it was set up)."""

    def __init__(self, world: runtime.World, meter: TrafficMeter = METER) -> None:
        self.rank = world.rank
        self.world_size = world.world_size
        self.hosts = world.hosts
        self.timeout = world.timeout
        self.wait_timeout = timedelta(seconds=world.timeout)
        self.meter = meter
        self.world = world
        self.downward = None   # the group for tag-0 messages to a lower rank (module docstring)
        if len(world.hosts) > 1 and world.store is not None:   # every rank builds one TorchTransport
            self.downward = dist.ProcessGroupGloo(dist.PrefixStore("gloo-downward", world.store), world.rank,
                                                  world.world_size, self.wait_timeout)

    def _group(self, tensor: torch.Tensor, source: int | None, target: int, tag: int) -> dist.ProcessGroup:
        if tensor.is_cuda and self.world.joined:
            return dist.distributed_c10d._get_default_group()
        if self.downward is not None and tag == 0 and source is not None and source > target:
            return self.downward
        return runtime.transfer_group(self.world)

    def _check(self, tensor: torch.Tensor, peer: int | None, op: str) -> None:
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: transport needs a contiguous tensor (got strides {tensor.stride()})")
        if peer is not None and not (0 <= peer < self.world_size and peer != self.rank):
            raise ValueError(f"{op}: peer rank {peer} is not another rank of 0..{self.world_size - 1} "
                             f"(this is rank {self.rank})")

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        self._check(tensor, dst, op)
        work = self._group(tensor, self.rank, dst, tag).send([tensor], dst, tag)
        return _TorchHandle(work, self, dst, op, tensor.numel() * tensor.element_size(), True, control)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        self._check(tensor, src, op)
        group = self._group(tensor, src, self.rank, tag)
        work = group.recv_anysource([tensor], tag) if src is None else group.recv([tensor], src, tag)
        return _TorchHandle(work, self, src, op, tensor.numel() * tensor.element_size(), False, control)


TRANSPORTS = ("auto", "tcp", "shm")
"""GRADSYNC_TRANSPORT: auto (shared memory between ranks of one host where this machine supports
it, torch.distributed otherwise), tcp (torch.distributed for every peer), shm (shared memory between
ranks of one host, an error where unsupported)."""

_TRANSPORTS: dict[int, Transport] = {}


def transport_choice() -> str:
    """The GRADSYNC_TRANSPORT setting, checked."""
    choice = os.environ.get("GRADSYNC_TRANSPORT", "auto").strip().lower() or "auto"
    if choice not in TRANSPORTS:
        raise ValueError(f"GRADSYNC_TRANSPORT={os.environ['GRADSYNC_TRANSPORT']!r} is not a transport; choose one "
                         f"of {', '.join(TRANSPORTS)}")
    return choice


def build(world: runtime.World) -> Transport:
    """A new transport for ``world``'s ranks, chosen by GRADSYNC_TRANSPORT (see TRANSPORTS)."""
    from gradsync.comm.shm import doorbell
    from gradsync.comm.shm import transport as shm  # shm builds on this module

    choice = transport_choice()
    local = world.host_ranks
    if choice == "tcp" or world.world_size == 1:
        return TorchTransport(world)
    unsupported = doorbell.supported()
    if unsupported and choice == "shm":
        raise RuntimeError(f"GRADSYNC_TRANSPORT=shm: {unsupported}; use GRADSYNC_TRANSPORT=tcp or auto")
    if unsupported:
        return TorchTransport(world)
    job = shm.job_token(world)  # every rank takes part: rank 0 publishes it even when alone on its host
    if len(local) == 1:
        return TorchTransport(world)
    return shm.ShmTransport(world, local, job)


def _connect(world: runtime.World) -> None:
    _disconnect()
    _TRANSPORTS[id(world)] = build(world)


def _disconnect() -> None:
    for transport in _TRANSPORTS.values():
        close = getattr(transport, "close", None)
        if close is not None:
            close()
    _TRANSPORTS.clear()


runtime.on_init(_connect)
runtime.on_shutdown(_disconnect)


def default_transport() -> Transport:
    """The transport of the current world, made at init() (see TRANSPORTS for the choice)."""
    w = runtime.world()
    transport = _TRANSPORTS.get(id(w))
    if transport is None:
        _connect(w)
        transport = _TRANSPORTS[id(w)]
    return transport


def wait_all(handles: list[Handle]) -> None:
    """Wait for every handle, in order."""
    for handle in handles:
        handle.wait()
