"""TorchTransport: the Transport (comm/transport/__init__.py) over torch.distributed point-to-point.

TorchTransport carries the bytes with torch.distributed point-to-point on the world's group
(world_info.transfer_group: gloo on CPU, NCCL on GPU). When the world spans hosts, the collectives'
own messages (tag 0) from a higher to a lower rank travel on a second gloo group of their own, so
that each direction between two ranks has its own connection: gloo moves one connection's two
directions one after the other (two hosts at 200 Mbit/s exchanging 4 MiB each way: 272 ms on one
group, 173 ms on two, against 168 ms for 4 MiB one way on the wire). Receives on tag 0 name their
source, so both ends know which group a message is on.

It is the transport between hosts, and the one for every peer under GRADSYNC_TRANSPORT=tcp;
ShmTransport (shm/transport.py) hands it whatever does not travel through shared memory.

CUDA tensors (a world on NCCL) travel on the world's group itself, whatever the direction: the
second group is gloo's, which takes CPU tensors only. NCCL runs one rank's sends and receives to one
peer in the order they were posted, on one stream: two ranks that each post a send to the other
and then a receive both wait in their send, for ever once a message outgrows NCCL's buffers (the
ring with two ranks, halving-doubling's exchanges). ``exchange`` posts such a pair as one group
(torch.distributed.batch_isend_irecv: ncclGroupStart/End), which NCCL progresses together, and the
algorithms use it where ``pairs_exchanges`` says so.

Interrupting waits (live mode, ``interrupt``): a gloo wait cannot be woken from outside. Neither
ProcessGroup.abort() nor shutdown() ends a pending receive (measured: it returned only when its peer
exited), and a wait given a shorter timeout closes every connection of the group (gloo's
unbound_buffer: "Application timeout caused pair closure"). That last rule is the way in: to end
every wait of a world that is over, a receive that no one will answer is posted on each of the
transport's groups and waited for one millisecond, so gloo closes the group's connections and every
pending send and receive fails at once (measured: within 10 ms of the call, where the receive would
otherwise have waited for its timeout). The receive is from each peer in turn until one times out: on
a connection its peer has closed already (another survivor interrupted its own waits first) it fails
at once instead, closing that connection alone.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.group import runtime
from gradsync.group.world_info import transfer_group
from gradsync.comm.transport import Handle, PeerError, Transport
from gradsync.observe.meter import METER, TrafficMeter

INTERRUPT_TAG = 0x6C697665
"""The tag of interrupt()'s receive, which no rank ever sends on."""


def _peer_error(t: "TorchTransport", op: str, peer: int | None, nbytes: int, sent: bool, waited: float,
                exc: Exception) -> PeerError:
    """gloo's failure of a send or receive, posting it or waiting for it, in the transport's words: a
    PeerError (the live world's sign that a member died; live/failures.py) naming both ranks."""
    verb = "send to" if sent else "receive from"
    who = "any rank" if peer is None else f"rank {peer}"
    if t.interrupted is not None:
        return PeerError(f"rank {t.rank}: {op}: {verb} {who} ({nbytes} bytes) abandoned after {waited:.1f} s: "
                         f"{t.interrupted}", rank=t.rank, peer=peer, op=op)
    kind = "timed out" if "imed out" in str(exc) else "failed"
    return PeerError(f"rank {t.rank}: {op}: {verb} {who} ({nbytes} bytes) {kind} after {waited:.1f} s (timeout "
                     f"{t.timeout:.0f} s); rank {peer} may have died or stalled. "
                     f"Cause: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
                     rank=t.rank, peer=peer, op=op)


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
            t.refuse_if_interrupted()
            self._work.wait(t.wait_timeout if timeout is None else timedelta(seconds=timeout))
            if self._peer is None:
                self._peer = self._work._source_rank()
        except Exception as exc:
            raise _peer_error(t, self._op, self._peer, self._nbytes, self._sent, time.monotonic() - started,
                              exc) from exc
        self._done = True
        t.meter.record(peer=self._peer, nbytes=self._nbytes, op=self._op, sent=self._sent,
                       control=self._control)
        return self._peer


class _PairHandle(Handle):
    """The Works of one exchange posted as a group (NCCL gives one Work for the group)."""

    __slots__ = ("_works", "_transport", "_sizes", "_peers", "_op", "_done")

    def __init__(self, works, transport: "TorchTransport", send, dst, recv, src, op) -> None:
        self._works, self._transport, self._op, self._done = list(works), transport, op, False
        self._sizes = (send.numel() * send.element_size(), recv.numel() * recv.element_size())
        self._peers = (dst, src)

    def done(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)

    def wait(self, timeout: float | None = None) -> int:
        t, (dst, src), (sent, received) = self._transport, self._peers, self._sizes
        if not self._done:
            started = time.monotonic()
            try:
                t.refuse_if_interrupted()
                for work in self._works:
                    work.wait(t.wait_timeout if timeout is None else timedelta(seconds=timeout))
            except Exception as exc:
                raise _peer_error(t, self._op, src, sent + received, False, time.monotonic() - started,
                                  exc) from exc
            self._done = True
            if sent:
                t.meter.record(peer=dst, nbytes=sent, op=self._op, sent=True)
            if received:
                t.meter.record(peer=src, nbytes=received, op=self._op, sent=False)
        return src


class TorchTransport(Transport):
    """Transport over torch.distributed send/recv of the world's process group (world_info.transfer_group;
    CUDA tensors of a joined world over the program's default group, which has NCCL where it was set up)."""

    def __init__(self, world: runtime.World, *, context, meter: TrafficMeter = METER) -> None:
        """``context``: the communicator's (comm/context.py), made at init."""
        self.rank = world.rank
        self.world_size = world.world_size
        self.hosts = world.hosts
        self.timeout = world.timeout
        self.wait_timeout = timedelta(seconds=world.timeout)
        self.meter = meter
        self.context = context
        self.world = world
        self.interrupted: str | None = None
        """Why interrupt() ended this transport's waits (None while it has not)."""
        self.downward = None   # the group for tag-0 messages to a lower rank (module docstring)
        if len(world.hosts) > 1 and world.store is not None:   # every rank builds one TorchTransport
            self.downward = dist.ProcessGroupGloo(dist.PrefixStore("gloo-downward", world.store), world.rank,
                                                  world.world_size, self.wait_timeout)

    def _group(self, tensor: torch.Tensor, source: int | None, target: int, tag: int) -> dist.ProcessGroup:
        if tensor.is_cuda:   # NCCL: the program's default group where gradsync joined it, else the world's
            return dist.distributed_c10d._get_default_group() if self.world.joined else transfer_group(self.world)
        if self.downward is not None and tag == 0 and source is not None and source > target:
            return self.downward
        return transfer_group(self.world)

    def check(self, tensor: torch.Tensor, peer: int | None, op: str) -> None:
        """Raise ValueError where ``tensor`` cannot travel to or from ``peer`` here (ShmTransport asks
        it too, for what it carries itself)."""
        if tensor.is_cuda and self.world.cuda_path != "nccl":
            raise ValueError(f"{op}: a CUDA tensor sent point-to-point in a world whose CUDA tensors go through host "
                             f"memory (device_path.py: ranks share a GPU, or no NCCL); copy it to the CPU first "
                             f"(the collectives stage CUDA tensors themselves)")
        if not tensor.is_contiguous():
            raise ValueError(f"{op}: transport needs a contiguous tensor (got strides {tensor.stride()})")
        if peer is not None and not (0 <= peer < self.world_size and peer != self.rank):
            raise ValueError(f"{op}: peer rank {peer} is not another rank of 0..{self.world_size - 1} "
                             f"(this is rank {self.rank})")

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        self.check(tensor, dst, op)
        group = self._group(tensor, self.rank, dst, tag)
        return self._posted(lambda: group.send([tensor], dst, tag), tensor, dst, op, True, control)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        self.check(tensor, src, op)
        group = self._group(tensor, src, self.rank, tag)
        return self._posted(lambda: (group.recv_anysource([tensor], tag) if src is None
                                     else group.recv([tensor], src, tag)), tensor, src, op, False, control)

    def pairs_exchanges(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda   # a CUDA tensor here travels on NCCL (check refuses it otherwise)

    def refuse_if_interrupted(self) -> None:
        """After interrupt(), a transfer posted or waited for fails at once: one posted after gloo closed its
        connections would otherwise wait out its whole timeout (measured: 60 s), since nothing wakes it."""
        if self.interrupted is not None:
            raise RuntimeError("the transport was interrupted")

    def interrupt(self, why: str) -> None:
        """End every wait on this transport's groups (module docstring, "Interrupting waits")."""
        if self.world_size == 1 or self.interrupted is not None:
            return
        self.interrupted = why   # first: a transfer posted from now on fails at once (refuse_if_interrupted)
        try:
            groups = [transfer_group(self.world)] + ([self.downward] if self.downward is not None else [])
        except RuntimeError:   # the world was shut down meanwhile: its groups are gone with their waits
            return
        for group in groups:
            for step in range(1, self.world_size):   # until one times out: a connection a peer closed fails at once,
                peer = (self.rank + step) % self.world_size   # and on its own (another survivor interrupted first)
                try:
                    group.recv([torch.empty(1)], peer, INTERRUPT_TAG).wait(timedelta(milliseconds=1))
                except Exception as exc:   # noqa: BLE001 - the timeout is the point: gloo closed every connection
                    if "imed out" in str(exc):
                        break

    def exchange(self, send, dst, recv, src, op):
        if not self.pairs_exchanges(send):
            return super().exchange(send, dst, recv, src, op)
        self.check(send, dst, op)
        self.check(recv, src, op)
        group = self._group(send, self.rank, dst, 0)
        # an empty tensor is not posted at all: its peer's counterpart is empty too (the same chunk)
        pair = [dist.P2POp(operation, tensor, group=group, group_peer=peer)
                for operation, tensor, peer in ((dist.isend, send, dst), (dist.irecv, recv, src)) if tensor.numel()]
        nbytes = send.numel() * send.element_size() + recv.numel() * recv.element_size()
        try:
            self.refuse_if_interrupted()
            works = dist.batch_isend_irecv(pair) if pair else []
        except RuntimeError as exc:
            raise _peer_error(self, op, src, nbytes, False, 0.0, exc) from exc
        return _PairHandle(works, self, send, dst, recv, src, op)

    def _posted(self, post, tensor, peer, op, sent, control) -> _TorchHandle:
        """post()'s Work in a handle; gloo refuses to post on a connection a dead peer closed, and that
        is the same PeerError as a failed wait."""
        nbytes = tensor.numel() * tensor.element_size()
        try:
            self.refuse_if_interrupted()
            work = post()
        except RuntimeError as exc:
            raise _peer_error(self, op, peer, nbytes, sent, 0.0, exc) from exc
        return _TorchHandle(work, self, peer, op, nbytes, sent, control)
