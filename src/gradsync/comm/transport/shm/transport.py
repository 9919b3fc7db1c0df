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

The transport owns its parts as objects, one file each, along the seams of the segment it runs on:
``segments`` (segment.py: layout, set-up, clean-up), ``staging`` (staging.py: fingerprint slots and
staging halves, for the collectives that read each other's memory), ``progress`` (progress.py: the
sends and receives in flight and moving them through the rings), ``waits`` (waiting.py: sleeping on
the doorbell, barriers, liveness and timeouts). This file makes them, posts operations, and offers
what the Transport interface declares (comm/transport/__init__.py), each from the part that keeps it.
"""

from __future__ import annotations

import os
import threading

import torch

from gradsync.group import runtime
from gradsync.comm.transport.shm import native
from gradsync.comm.transport.shm.hold import CoreHold
from gradsync.comm.transport.shm.native import Counters
from gradsync.comm.transport.shm.progress import Progress, ShmOp
from gradsync.comm.transport.shm.regions import SharedRegions
from gradsync.comm.transport.shm.segment import Segments, segment_prefix
from gradsync.comm.transport.shm.staging import Staging
from gradsync.comm.transport.shm.waiting import (BACKGROUND_SPIN_SECONDS, LIVENESS_SLICE, SPIN_SECONDS, YIELD_SECONDS,
                                                 Delegated, Waits)
from gradsync.comm.transport.torch_distributed import TorchTransport
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


class ShmTransport(Transport):
    """Shared memory between ranks of one host, torch.distributed for everything else."""

    segment_bytes = SEGMENT_BYTES

    def __init__(self, world: runtime.World, local_ranks: tuple[int, ...], job: str, *, context,
                 meter: TrafficMeter = METER, narrow_half_sums: bool = False) -> None:
        """``context``: the communicator's (comm/context.py), made at init; ``narrow_half_sums``: the
        native core rounds float16/bfloat16 sums after every add, as the Python path does under
        GRADSYNC_HALF_SUM=narrow (comm/reduce_ops.py)."""
        self.rank = world.rank
        self.world_size = world.world_size
        self.timeout = world.timeout
        self.meter = meter
        self.hosts = world.hosts
        self.context = context
        self.tcp = TorchTransport(world, context=context, meter=meter)
        self.local_ranks = local_ranks
        self.shares_memory = len(local_ranks) == world.world_size
        # holding and polling: where this rank's thread runs, and whether a wait may poll (waiting.py)
        cores = _usable_cores()
        self.ranks_per_core = -(-len(local_ranks) // len(cores))   # sharing a core and its cache
        self.spin_allowed = self.ranks_per_core == 1
        holdable = len(local_ranks) > 1 and hasattr(os, "sched_setaffinity")   # not on every OS
        self.own_core = cores[local_ranks.index(self.rank) % len(cores)] if holdable else None
        self.hold = CoreHold(self.own_core) if holdable else None
        self.core = None               # the native core (native/), where every local rank has it
        self.counters = Counters()     # barriers, published, half, split_in_half; the native core's own once it runs
        # the parts
        self.segments = Segments(self.rank, local_ranks, self.timeout)
        extension = self.segments.connect(world, job)
        self.stage_bytes = self.segments.stage_bytes
        self.single_copy = self.segments.single_copy
        self.single_copy_problem = self.segments.single_copy_problem
        self.progress = Progress(self.rank, self.segments, meter)
        self.waits = Waits(self.rank, self.timeout, self.segments, self.progress, self.counters, self.hold,
                           self.spin_allowed)
        if extension is not None:
            self._start_core(extension, narrow_half_sums)
        self.staging = Staging(self.rank, self.segments, self.counters, meter)
        self.regions = SharedRegions(self.segments, world.store, segment_prefix(job))
        # the shared-memory offers the Transport interface declares, bound to the parts that keep them
        # (bound once: a small collective calls several of them, and a forwarding call costs as much)
        staging, waits = self.staging, self.waits
        self.publish, self.first_differing, self.published = staging.publish, staging.first_differing, staging.published
        self.published_address, self.read_from, self.scratch = (staging.published_address, staging.read_from,
                                                                staging.scratch)
        self.next_half, self.split_half, self.restart_halves = (staging.next_half, staging.split_half,
                                                                staging.restart_halves)
        self.stage, self.staged_views = staging.stage, staging.staged_views
        self.barrier, self.native, self.dead_peers = waits.barrier, waits.native, waits.dead_peers

    def _start_core(self, extension, narrow_half_sums: bool) -> None:
        """The native core over this transport's memory (native/module.c's Core); it keeps the counters
        and the hold from now on, so that both paths share them."""
        extension.set_narrow_half_sums(narrow_half_sums)
        self.core = extension.Core(
            **self.segments.core_addresses(), spin_allowed=self.spin_allowed, spin_seconds=SPIN_SECONDS,
            background_spin_seconds=BACKGROUND_SPIN_SECONDS, yield_seconds=YIELD_SECONDS,
            slice_seconds=LIVENESS_SLICE, main_thread=threading.main_thread().ident,
            own_core=-1 if self.own_core is None else self.own_core, on_slice=self.waits.on_slice)
        self.counters = self.core
        if self.hold is not None:
            self.hold = native.NativeHold(self.core, self.own_core)
        self.waits.use_core(self.core, self.hold)

    def interrupt(self, why: str) -> None:
        """Transport.interrupt: what travels over TCP is ended there; the shared-memory waits see the same
        verdict through abandoned() within a liveness slice."""
        self.tcp.interrupt(why)

    def close(self) -> None:
        """Close the context first (host staging's page-locked regions go before the regions are
        unmapped; kept native plans hold the core's addresses), then the regions and the segments;
        every later operation raises."""
        self.context.close()
        progress = self.progress
        with progress.lock:
            self.regions.close()
            self.staging.close()
            self.core = self.waits.core = None   # its addresses go with the mappings
            self.segments.close()
            progress.broken = progress.broken or RuntimeError("the shared-memory transport was closed "
                                                              "(gradsync.shutdown)")

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
        return self.progress.local(peer)

    def _post(self, tensor, peer, op, sent, control, combine=None) -> ShmOp:
        self.tcp.check(tensor, peer, op)
        return self.progress.post(self, tensor, peer, op, sent, control, combine)

    def isend(self, tensor, dst, op, *, control=False, tag=0):
        if not self._routed_here(tensor, dst, tag):
            return Delegated(self.tcp.isend(tensor, dst, op, control=control, tag=tag), self.waits, dst, op)
        return self._post(tensor, dst, op, True, control)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        if not self._routed_here(tensor, src, tag):
            return Delegated(self.tcp.irecv(tensor, src, op, control=control, tag=tag), self.waits, src, op)
        return self._post(tensor, src, op, False, control)

    def pairs_exchanges(self, tensor):
        return tensor.is_cuda and self.tcp.pairs_exchanges(tensor)

    def exchange(self, send, dst, recv, src, op):
        if not self.pairs_exchanges(send):
            return super().exchange(send, dst, recv, src, op)
        return Delegated(self.tcp.exchange(send, dst, recv, src, op), self.waits, src, op)

    def irecv_reduce(self, tensor, src, op, *, staging, combine=torch.Tensor.add_):
        if not self._routed_here(tensor, src, 0):
            return Delegated(self.tcp.irecv_reduce(tensor, src, op, staging=staging, combine=combine), self.waits,
                             src, op)
        return self._post(tensor, src, op, False, False, combine=combine)
