"""ShmTransport: ranks on the same host exchange tensors through shared memory, not TCP loopback.

Vocabulary
    host group   the ranks that share this host (same kernel boot and the same network, IPC, mount
                 and PID namespaces; see runtime.host_id); L of them, local index 0..L-1
    segment      one shared mapping per rank, /dev/shm/gradsync-<job>-r<rank>; it holds that rank's
                 doorbell and one inbound ring per local sender (segment.py)
    ring         a single-producer single-consumer byte ring of C bytes (GRADSYNC_SHM_RING_MB) from
                 one sender to one receiver; frames, head and tail are in ring.py
    progress     copying what fits: pending sends into peers' rings, available frames out of
                 inbound rings. It runs when an operation is posted and inside wait()/done(); a
                 message larger than C streams through the ring in pieces (progress.py)

Matching and fallback: messages between one pair are matched in posting order; a receive from any
rank takes the earliest-posted match among frames waiting at the head of the inbound rings. Tagged
messages, CUDA tensors and peers on other hosts travel over torch.distributed (TorchTransport), so
one ShmTransport serves a whole job; waiting for one of those keeps the shared-memory traffic
moving (waiting.py's Delegated). A receive from any rank on tag 0 needs every rank on this host (it
cannot also listen on TCP); otherwise it raises and asks for a tag.

The transport is assembled from its parts, one file each, along the seams of the segment it runs
on: segment.py (layout, set-up, clean-up), staging.py (fingerprint slots and staging halves, for
the collectives that read each other's memory), progress.py (moving sends and receives through the
rings), waiting.py (sleeping on the doorbell, barriers, liveness and timeouts). This file posts
operations and holds the state they share.
"""

from __future__ import annotations

import collections
import mmap
import os
import threading

import torch

from gradsync.group import runtime
from gradsync.comm.transport.shm.hold import CoreHold
from gradsync.comm.transport.shm.native import Counters
from gradsync.comm.transport.shm.progress import Progress, ShmOp
from gradsync.comm.transport.shm.regions import SharedRegions
from gradsync.comm.transport.shm.ring import FRAME
from gradsync.comm.transport.shm.segment import Segments, ring_bytes, segment_prefix, stage_bytes
from gradsync.comm.transport.shm.staging import Staging
from gradsync.comm.transport.shm.waiting import Delegated, Waiting
from gradsync.comm.transport.tcp import TorchTransport
from gradsync.comm.transport import Transport
from gradsync.observe.meter import METER, TrafficMeter

SEGMENT_BYTES = 1 << 20
"""The ring all-reduce's wire unit on shared memory (the TCP default is 4 MiB): half a ring, so the
sender fills one half while the receiver drains the other."""


def _usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


class ShmTransport(Segments, Staging, Progress, Waiting, Transport):
    """Shared memory between ranks of one host, torch.distributed for everything else."""

    segment_bytes = SEGMENT_BYTES

    def __init__(self, world: runtime.World, local_ranks: tuple[int, ...], job: str,
                 meter: TrafficMeter = METER) -> None:
        self.rank = world.rank
        self.world_size = world.world_size
        self.timeout = world.timeout
        self.meter = meter
        self.hosts = world.hosts
        self.tcp = TorchTransport(world, meter)
        self.local_ranks = local_ranks
        self.local_index = {r: i for i, r in enumerate(local_ranks)}
        self.capacity = ring_bytes()
        self.stage_bytes = stage_bytes()
        self._fingerprint_slots = (self._fingerprint_offset(), self._fingerprint_offset() + 2 * FRAME)
        self.counters = Counters()   # barriers, published, half, split_in_half; the native core's own once connected
        self.core = None             # the native core (native/), where every local rank has it: segment.py
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self.plans: dict[tuple, object] = {}   # small collectives made ready per shape (collectives.py)
        cores = _usable_cores()
        self.ranks_per_core = -(-len(local_ranks) // len(cores))   # sharing a core and its cache
        self.spin_allowed = self.ranks_per_core == 1
        holdable = len(local_ranks) > 1 and hasattr(os, "sched_setaffinity")   # not on every OS
        self.own_core = cores[self.local_index[self.rank] % len(cores)] if holdable else None
        self.hold = CoreHold(self.own_core) if holdable else None
        self._lock = threading.Lock()
        self._sleepers = 0
        self._order = 0
        self._broken: Exception | None = None
        self._sends: dict[int, collections.deque] = {r: collections.deque() for r in local_ranks if r != self.rank}
        self._recvs: dict[int, collections.deque] = {r: collections.deque() for r in local_ranks if r != self.rank}
        self._any: collections.deque = collections.deque()
        self._to_ring: set[int] = set()
        self._mappings: dict[int, mmap.mmap] = {}
        self.single_copy = False
        self.single_copy_problem = "not probed"
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._connect(world, job)
        self.regions = SharedRegions(self, world.store, segment_prefix(job))

    def interrupt(self, why: str) -> None:
        """Transport.interrupt: what travels over TCP is ended there; the shared-memory waits see the same
        verdict through abandoned() within a liveness slice."""
        self.tcp.interrupt(why)

    # --- posting --------------------------------------------------------------------------------
    def _routed_here(self, tensor: torch.Tensor, peer: int | None, tag: int) -> bool:
        if tag != 0 or tensor.is_cuda:
            return False
        if peer is None:
            if len(self.local_ranks) != self.world_size:
                raise ValueError(f"rank {self.rank}: a receive from any rank on tag 0 cannot listen on shared "
                                 f"memory and TCP at once (this job spans several hosts); give the messages a tag "
                                 f"(tagged messages travel over torch.distributed) or set GRADSYNC_TRANSPORT=tcp")
            return True
        return peer in self._sends

    def _post(self, tensor, peer, op, sent, control, combine=None) -> ShmOp:
        self.tcp._check(tensor, peer, op)
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._order += 1
            handle = ShmOp(self, peer, op, tensor, sent, control, self._order, combine)
            if sent:
                self._sends[peer].append(handle)
            elif peer is None:
                self._any.append(handle)
            else:
                self._recvs[peer].append(handle)
            self._progress()
        return handle

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        if not self._routed_here(tensor, dst, tag):
            return Delegated(self.tcp.isend(tensor, dst, op, control=control, tag=tag), self, dst, op)
        return self._post(tensor, dst, op, True, control)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        if not self._routed_here(tensor, src, tag):
            return Delegated(self.tcp.irecv(tensor, src, op, control=control, tag=tag), self, src, op)
        return self._post(tensor, src, op, False, control)

    def pairs_exchanges(self, tensor):
        return tensor.is_cuda and self.tcp.pairs_exchanges(tensor)

    def exchange(self, send, dst, recv, src, op):
        if not self.pairs_exchanges(send):
            return super().exchange(send, dst, recv, src, op)
        return Delegated(self.tcp.exchange(send, dst, recv, src, op), self, src, op)

    def irecv_reduce(self, tensor, src, op, *, staging, combine=torch.Tensor.add_):
        if not self._routed_here(tensor, src, 0):
            return Delegated(self.tcp.irecv_reduce(tensor, src, op, staging=staging, combine=combine), self, src, op)
        return self._post(tensor, src, op, False, False, combine=combine)
