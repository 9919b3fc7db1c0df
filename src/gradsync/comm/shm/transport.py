"""ShmTransport: ranks on the same host exchange tensors through shared memory, not TCP loopback.

Vocabulary
    host group   the ranks that share this host (same kernel boot and the same network, IPC, mount
                 and PID namespaces; see runtime.host_id); L of them, local index 0..L-1
    segment      one shared mapping per rank, /dev/shm/gradsync-<job>-r<rank>; it holds that rank's
                 doorbell and one inbound ring per local sender
    ring         a single-producer single-consumer byte ring of C bytes (GRADSYNC_SHM_RING_MB) from
                 one sender to one receiver; frames, head and tail are in shm_ring.py
    progress     copying what fits: pending sends into peers' rings, available frames out of
                 inbound rings. It runs when an operation is posted and inside wait()/done(); a
                 message larger than C streams through the ring in pieces

Segment layout (rank d's segment; slot i is the ring from local rank i to d)
    [0, 4)                           doorbell (u32): rung by anyone who wrote to d or freed space for d
    [4, 8)                           how many of d's threads sleep on it (u32; doorbell.py)
    [8, 16)                          barrier count (u64): how many barriers d has entered
    64 + i*(128 + C) + 0             head  (u64, stored by the sender)
    64 + i*(128 + C) + 64            tail  (u64, stored by d; its own cache line)
    64 + i*(128 + C) + 128 .. + C    data
    then 2 fingerprint slots of 128 bytes: what d is about to do (agree.py's staged check), and
                                     where its tensor lies for single-copy reads; they alternate,
                                     like the staging halves
    then 2 staging halves of S bytes (GRADSYNC_SHM_STAGE_MB): d's contribution to a collective that
                                     reads every rank's memory directly (allreduce_shared.py)

Bytes copied: a send copies the payload once into the receiver's ring; a receive copies it once
out (irecv) or reduces it straight from the ring into its target (irecv_reduce: the reduction reads the
shared segment, so a reduced byte is written once, not copied then added). TCP loopback copies each
byte twice through the kernel besides the reduction.

Matching and fallback: messages between one pair are matched in posting order; a receive from any
rank takes the earliest-posted match among frames waiting at the head of the inbound rings. Tagged
messages, CUDA tensors and peers on other hosts travel over torch.distributed (TorchTransport), so
one ShmTransport serves a whole job; waiting for one of those keeps the shared-memory traffic
moving (_Delegated). A receive from any rank on tag 0 needs every rank on this host (it cannot
also listen on TCP); otherwise it raises and asks for a tag.

Cleanup: each rank creates its segment, every local peer maps it, and then the name is unlinked at
once, so from then on the memory lives only as long as the mappings: a SIGKILLed job leaves
nothing in /dev/shm. The launcher removes the job's names if ranks die during set-up.

Single-copy reads (single_copy.py): at set-up every rank tries to read a token out of each local
peer's segment through process_vm_readv, and the ranks agree: ``single_copy`` is True only when
every rank can read from every other. Then large reduce-scatters and all-gathers read the peers'
tensors where they lie (reduce_scatter_single_copy.py, all_gather_single_copy.py) instead of
staging them.

No busy-wait: a waiting rank sleeps on its doorbell (doorbell.py) in slices of LIVENESS_SLICE
seconds; after each slice it checks that the peers it waits for are still alive (same host, so
/proc tells), which turns a dead peer into an error within a fraction of a second. The one
exception is a barrier the caller marks ``spin`` (collectives.py's ``_spins``: where sleeping and
being woken costs more than the wait): while every local rank can have a core of its own
(``spin_allowed``) it polls for at most SPIN_SECONDS before it sleeps (BACKGROUND_SPIN_SECONDS on a
thread other than the main one, which shares its core with the main thread's work); with more ranks
than cores a spinning rank would take the core its peer needs, so it polls for at most YIELD_SECONDS
and yields its core after every poll. The caller's thread is held on one core while it is in a collective
(``own_core``: local rank i on core i mod C, collectives.py's ``_on_own_core``), as Open MPI binds
its ranks to cores: with a core per rank no two polling ranks land on one core (where the one
polling holds the core its peer needs to arrive; collectives below 4 MiB only, where that costs
more than the hold); with more ranks than cores the ranks that share a core yield to each other
instead of following each other across cores. Held lazily: pinned only when found elsewhere or
about to sleep (hold.py).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
import secrets
import struct
import threading
import time
from datetime import timedelta

import torch

from gradsync import runtime
from gradsync.comm.shm import single_copy
from gradsync.comm.agree import FINGERPRINT_BYTES
from gradsync.comm.shm.doorbell import Doorbell
from gradsync.comm.shm.hold import CoreHold
from gradsync.comm.shm.regions import SharedRegions
from gradsync.comm.shm.ring import FRAME, Ring, slot_bytes
from gradsync.comm.transport import Handle, PeerError, TorchTransport, Transport
from gradsync.meter import METER, TrafficMeter

POLL_SLICE = 0.0005
"""Longest nap between looks at a torch.distributed transfer while shared-memory work is pending."""
LIVENESS_SLICE = 0.2
"""Seconds a waiting rank sleeps before checking that its peers are alive."""
DEFAULT_RING_MB = 2
"""Ring capacity per ordered pair, MiB. Small on purpose: a ring that fits the shared L3 cache
(32 MiB here) is read by the receiver while the sender's bytes are still in cache. Measured, ring
all-reduce medians of 7, N=4 on 2 cores: 16 MiB in 7.4-7.9 ms with 2 MiB rings against 10.6-10.9
ms with 8 MiB; N=2: 2.1-2.2 ms against 2.7-3.4 ms with 32 MiB (docs/benchmarks.md)."""
DEFAULT_STAGE_MB = 4
"""Each staging half, MiB: 4 ranks x 2 halves x 4 MiB fill the 32 MiB L3 cache, so what one rank
stages the others read from cache."""
SEGMENT_BYTES = 1 << 20
"""The ring all-reduce's wire unit on shared memory (the TCP default is 4 MiB): half a ring, so the
sender fills one half while the receiver drains the other."""
SPIN_SECONDS = 200e-6
"""Longest a ``spin`` wait polls on the main thread before it sleeps: about what a futex sleep and
wake-up cost here, so a peer that arrives later than this costs one wake-up more than it would have
anyway. Measured (2026-12-02, a /tmp probe, 2 ranks, the waker 2 ms late, 190 wake-ups each run):
from the waker's barrier to the sleeper's return 173-176 us median, 107-122 us p10, 233-235 us p90.
In-world A/B against 30 us (2 ranks, blocks of 10 calls alternating, the bench's loop, slowest
rank, medians; two runs, us): 64 KiB 39 -> 36 and 41 -> 37, 256 KiB 115 -> 93 and 138 -> 142,
1 MiB 322 -> 282 and 424 -> 375, 4 MiB 1,013 -> 935 and 1,559 -> 1,498, 16 MiB 4,957 -> 5,179,
7,577 -> 6,954 and 6,146 -> 5,611; 4 KiB level (docs/benchmarks.md)."""
BACKGROUND_SPIN_SECONDS = 30e-6
"""Longest a ``spin`` wait polls on any other thread: DDP's reducer and the c10d backend run their
collectives on a communication thread while the main thread computes backward on the same core, and
a longer poll takes that core from backward (DDP's step with 200 us on its thread, in-world A/B:
1.171-1.207x of the no-communication floor against 1.169-1.199x with 30 us)."""
YIELD_SECONDS = 1e-3
"""With more local ranks than cores, a ``spin`` wait polls this long, giving its core away between
polls (sched_yield): the rank it waits for is likely queued on the same core, and a yield hands it
the core at once where a futex sleep costs a wake-up (4 ranks on 2 cores, 64 KiB: 0.24-0.30 ms
a call against 0.34-0.49 ms)."""
SHM_DIR = "/dev/shm"


def poll_seconds(spin_allowed: bool) -> float:
    """How long a ``spin`` wait polls before it sleeps: YIELD_SECONDS (yielding the core between
    polls) where local ranks outnumber the cores, else SPIN_SECONDS on the main thread and
    BACKGROUND_SPIN_SECONDS on any other."""
    if not spin_allowed:
        return YIELD_SECONDS
    return SPIN_SECONDS if threading.current_thread() is threading.main_thread() else BACKGROUND_SPIN_SECONDS


_FINGERPRINT = struct.Struct(f"{FINGERPRINT_BYTES // 8}q")
"""A fingerprint slot: up to 8 int64 values (agree.Fingerprint.values)."""
_ADDRESS = struct.Struct("Q")
"""Beside it, one FRAME further: where the rank's tensor lies (single-copy reads)."""


def _env_bytes(name: str, what: str, default_mb: float, smallest: int) -> int:
    """The size in the environment variable ``name`` (MiB, a positive number), rounded down to 64
    bytes and at least ``smallest``."""
    value = os.environ.get(name, str(default_mb))
    try:
        megabytes = float(value)
    except ValueError:
        megabytes = -1.0
    if not megabytes > 0:
        raise ValueError(f"{name}={value!r}: give the {what} size in MiB, a positive number (default {default_mb})")
    return max(smallest, int(megabytes * (1 << 20)) // FRAME * FRAME)


def ring_bytes() -> int:
    """Capacity C of every ring, from GRADSYNC_SHM_RING_MB."""
    return _env_bytes("GRADSYNC_SHM_RING_MB", "ring", DEFAULT_RING_MB, FRAME * 4)


def stage_bytes() -> int:
    """Bytes S of each staging half, from GRADSYNC_SHM_STAGE_MB."""
    return _env_bytes("GRADSYNC_SHM_STAGE_MB", "staging", DEFAULT_STAGE_MB, FRAME)


def segment_prefix(job: str) -> str:
    """Names of a job's segments start with this (the launcher removes leftovers by it)."""
    return f"gradsync-{job}-r"


def _usable_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b") ", 1)[1][:1]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class _ShmOp(Handle):
    """A posted shared-memory send or receive; progress is made by the transport."""

    __slots__ = ("transport", "peer", "op", "nbytes", "data", "reduce_into", "combine", "control", "sent", "order",
                 "header_done", "offset", "finished")

    def __init__(self, transport, peer, op, tensor, sent, control, order, combine=None):
        self.transport = transport
        self.peer = peer
        self.op = op
        self.nbytes = tensor.numel() * tensor.element_size()
        flat = tensor.reshape(-1)
        self.data = flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat
        self.reduce_into = flat if combine is not None else None
        self.combine = combine
        self.sent = sent
        self.control = control
        self.order = order
        self.header_done = False
        self.offset = 0
        self.finished = False

    def done(self) -> bool:
        if not self.finished:
            self.transport._progress_locked()
        return self.finished

    def wait(self, timeout: float | None = None) -> int:
        if not self.finished:
            self.transport._wait_for(self, timeout)
        return self.peer


class _Delegated(Handle):
    """A transfer carried by torch.distributed on behalf of a ShmTransport.

    Waiting for it must not stall this rank's shared-memory traffic: shared-memory sends and
    receives move only when their rank makes progress, and a flat ring across hosts mixes both
    (rank 0 blocked on a TCP receive from rank 3 while rank 1 waits for the rest of rank 0's
    shared-memory send would wait forever). So while shared-memory operations are pending, the
    wait polls: progress, then a nap of at most POLL_SLICE on the doorbell, then a look at the TCP
    transfer. With nothing pending it is torch's own blocking wait.
    """

    __slots__ = ("inner", "transport", "peer", "op")

    def __init__(self, inner: Handle, transport: "ShmTransport", peer, op) -> None:
        self.inner, self.transport, self.peer, self.op = inner, transport, peer, op

    def done(self) -> bool:
        return self.inner.done()

    def wait(self, timeout: float | None = None) -> int:
        t = self.transport
        limit = t.timeout if timeout is None else timeout
        started = time.monotonic()
        while t.has_pending() and not self.inner.done():
            waited = time.monotonic() - started
            if waited >= limit:
                who = "any rank" if self.peer is None else f"rank {self.peer}"
                raise t._broken_by(PeerError(f"rank {t.rank}: {self.op}: transfer with {who} over torch.distributed "
                                             f"timed out after {waited:.1f} s (timeout {limit:.0f} s)",
                                             rank=t.rank, peer=self.peer, op=self.op))
            t.nap(min(POLL_SLICE, limit - waited))
        return self.inner.wait(None if timeout is None else max(0.0, limit - (time.monotonic() - started)))


class ShmTransport(Transport):
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
        self._barriers = 0
        self._half = 0
        self._split_in_half = False   # the last piece in _half was allreduce_shared's split
        self._published = 0
        self._mine = b""   # this rank's last published fingerprint, packed
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

    # --- set-up -------------------------------------------------------------------------------
    def _segment_bytes(self) -> int:
        return self._stage_offset() + 2 * self.stage_bytes

    def _fingerprint_offset(self) -> int:
        return FRAME + len(self.local_ranks) * slot_bytes(self.capacity)

    def _stage_offset(self) -> int:
        return self._fingerprint_offset() + 4 * FRAME

    def _slot(self, sender: int) -> int:
        return FRAME + self.local_index[sender] * slot_bytes(self.capacity)

    def _connect(self, world: runtime.World, job: str) -> None:
        """Create this rank's segment, map every local peer's, then unlink ours (see Cleanup)."""
        store, wait = world.store, timedelta(seconds=world.timeout)
        key = f"gradsync/shm/{job}"
        path = os.path.join(SHM_DIR, f"{segment_prefix(job)}{self.rank}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self._segment_bytes())
            self._mappings[self.rank] = mmap.mmap(fd, self._segment_bytes())
            os.close(fd)
            fd = -1
            own = self._mappings[self.rank]
            own[self._fingerprint_offset():self._fingerprint_offset() + 16] = secrets.token_bytes(16)
            base = ctypes.addressof(ctypes.c_char.from_buffer(own))
            store.set(f"{key}/created/{self.rank}", f"{os.getpid()} {self.capacity} {self.stage_bytes} {base}")
            self.pids, bases = {}, {}
            for peer in self.local_ranks:
                if peer == self.rank:
                    continue
                created = self.store_get(store, f"{key}/created/{peer}", wait, peer, "create its segment")
                pid, capacity, staging, bases[peer] = (int(v) for v in created.split())
                if (capacity, staging) != (self.capacity, self.stage_bytes):
                    raise ValueError(f"rank {self.rank}: shared-memory set-up: rank {peer} has {capacity}-byte rings and "
                                     f"{staging}-byte staging halves, this rank {self.capacity} and {self.stage_bytes}; "
                                     f"set GRADSYNC_SHM_RING_MB and GRADSYNC_SHM_STAGE_MB alike on every rank")
                self.pids[peer] = pid
                peer_fd = os.open(os.path.join(SHM_DIR, f"{segment_prefix(job)}{peer}"), os.O_RDWR)
                try:
                    self._mappings[peer] = mmap.mmap(peer_fd, self._segment_bytes())
                finally:
                    os.close(peer_fd)
            problems = [self._probe(peer, bases[peer]) for peer in self.pids]
            mine = next((f"rank {self.rank}: {p}" for p in problems if p), "")
            store.set(f"{key}/opened/{self.rank}", f"1 {mine}")
            theirs = [self.store_get(store, f"{key}/opened/{peer}", wait, peer, "map its segment")[2:]
                      for peer in self.pids]
            self.single_copy_problem = next((p for p in [mine, *theirs] if p), None)
            self.single_copy = self.single_copy_problem is None
        finally:
            if fd >= 0:
                os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        me = self.local_index[self.rank]
        self._bell = Doorbell(self._mappings[self.rank], 0, me)
        self._bells = {peer: Doorbell(self._mappings[peer], 0, me) for peer in self.pids}
        self._in = {peer: Ring(self._mappings[self.rank], self._slot(peer), self.capacity) for peer in self.pids}
        self._out = {peer: Ring(self._mappings[peer], self._slot(self.rank), self.capacity) for peer in self.pids}
        self._counters = {rank: ctypes.c_uint64.from_buffer(self._mappings[rank], 8) for rank in self.local_ranks}
        self._peer_counters = [self._counters[peer] for peer in self.pids]
        self._ordered_peers = sorted(self.pids)
        self._stages = {rank: torch.frombuffer(self._mappings[rank], dtype=torch.uint8, count=2 * self.stage_bytes,
                                               offset=self._stage_offset()) for rank in self.local_ranks}

    def _probe(self, peer: int, base: int) -> str | None:
        """Why single-copy reads from ``peer`` do not work here (None when they do): read the token at
        the start of its fingerprint slots and compare it with what its mapping shows (single_copy.probe)."""
        offset = self._fingerprint_offset()
        expected = bytes(self._mappings[peer][offset:offset + 16])
        return single_copy.probe(self.pids[peer], base + offset, expected)

    def store_get(self, store, key: str, wait: timedelta, peer: int, what: str) -> str:
        try:
            store.wait([key], wait)
            return store.get(key).decode()
        except Exception as exc:
            raise PeerError(f"rank {self.rank}: shared-memory set-up: rank {peer} did not {what} "
                            f"within {self.timeout:.0f} s ({exc})", rank=self.rank, peer=peer,
                            op="shm/connect") from exc

    def close(self) -> None:
        """Unmap every segment (their names are already gone)."""
        with self._lock:
            if hasattr(self, "regions"):
                self.regions.close()
            for ring in list(getattr(self, "_in", {}).values()) + list(getattr(self, "_out", {}).values()):
                ring.release()
            for bell in [getattr(self, "_bell", None), *getattr(self, "_bells", {}).values()]:
                if bell is not None:
                    bell.release()
            self._in, self._out, self._bells, self._counters, self._stages = {}, {}, {}, {}, {}
            self._views, self.plans, self._peer_counters = {}, {}, []
            for mapping in self._mappings.values():
                try:
                    mapping.close()
                except BufferError:  # a tensor view still exists; the mapping goes with the process
                    pass
            self._mappings = {}
            self._broken = self._broken or RuntimeError("the shared-memory transport was closed (gradsync.shutdown)")

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

    def _post(self, tensor, peer, op, sent, control, combine=None) -> _ShmOp:
        self.tcp._check(tensor, peer, op)
        with self._lock:
            if self._broken is not None:
                raise self._broken
            self._order += 1
            handle = _ShmOp(self, peer, op, tensor, sent, control, self._order, combine)
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
            return _Delegated(self.tcp.isend(tensor, dst, op, control=control, tag=tag), self, dst, op)
        return self._post(tensor, dst, op, True, control)

    def irecv(self, tensor, src, op, *, control=False, tag=0):
        if not self._routed_here(tensor, src, tag):
            return _Delegated(self.tcp.irecv(tensor, src, op, control=control, tag=tag), self, src, op)
        return self._post(tensor, src, op, False, control)

    def irecv_reduce(self, tensor, src, op, *, staging, combine=torch.Tensor.add_):
        if not self._routed_here(tensor, src, 0):
            return _Delegated(self.tcp.irecv_reduce(tensor, src, op, staging=staging, combine=combine), self, src, op)
        return self._post(tensor, src, op, False, False, combine=combine)

    # --- progress -------------------------------------------------------------------------------
    def _progress_locked(self) -> None:
        with self._lock:
            self._advance()

    def _advance(self) -> int:
        """Lock held: fail if broken, move what can move, wake our other sleeping threads; returns the
        doorbell value read before moving anything (what a following sleep must compare against)."""
        if self._broken is not None:
            raise self._broken
        seen = self._bell.read()
        if self._progress() and self._sleepers:
            self._bell.ring()  # another thread sleeps on our bell and its operation may be done
        return seen

    def _progress(self) -> int:
        """Move every byte that can move now; returns how many operations finished. Lock held."""
        finished = 0
        try:
            for peer, queue in self._sends.items():
                while queue and self._push(queue[0]):
                    finished += self._finish(queue.popleft())
            for peer, ring in self._in.items():
                while True:
                    if ring.current is None and not self._match(peer, ring):
                        break
                    if not self._pull(ring.current, ring):
                        break
                    finished += self._finish(ring.current)
                    ring.current = None
        except PeerError as exc:
            self._broken = exc
            raise
        finally:
            for peer in self._to_ring:
                self._bells[peer].ring()
            self._to_ring.clear()
        return finished

    def _finish(self, handle: _ShmOp) -> int:
        handle.finished = True
        self.meter.record(peer=handle.peer, nbytes=handle.nbytes, op=handle.op, sent=handle.sent,
                          control=handle.control)
        return 1

    def _push(self, handle: _ShmOp) -> bool:
        """Write as much of ``handle`` into the peer's ring as fits; True when all of it is in."""
        moved, done = self._out[handle.peer].write(handle)
        if moved:
            self._to_ring.add(handle.peer)
        return done

    def _match(self, peer: int, ring: Ring) -> bool:
        """Give the frame at the tail of ``peer``'s ring to the earliest-posted receive that takes it."""
        if not ring.has_header():
            return False
        mine = self._recvs[peer][0] if self._recvs[peer] else None
        anyone = self._any[0] if self._any else None
        if mine is None and anyone is None:
            return False
        if mine is None or (anyone is not None and anyone.order < mine.order):
            handle = self._any.popleft()
            handle.peer = peer
        else:
            handle = self._recvs[peer].popleft()
        found = ring.accept(handle)
        if found is not None:
            raise PeerError(f"rank {self.rank}: {handle.op}: receive from rank {peer} expected {handle.nbytes} bytes, "
                            f"rank {peer} sent {found}. Every rank must post matching sends and receives "
                            f"in the same order", rank=self.rank, peer=peer, op=handle.op)
        self._to_ring.add(peer)
        return True

    def _pull(self, handle: _ShmOp, ring: Ring) -> bool:
        """Copy (or add) what has arrived of ``handle``'s frame; True when all of it has."""
        moved, done = ring.read(handle)
        if moved:
            self._to_ring.add(handle.peer)
        return done

    # --- waiting --------------------------------------------------------------------------------
    def has_pending(self) -> bool:
        """True while any shared-memory send or receive of this rank is unfinished."""
        return (any(self._sends.values()) or any(self._recvs.values()) or bool(self._any)
                or any(ring.current is not None for ring in self._in.values()))

    def nap(self, seconds: float) -> None:
        """Make what progress there is, then sleep on the doorbell for at most ``seconds``."""
        with self._lock:
            seen = self._advance()
        if self.hold is not None:
            self.hold.before_sleep()
        self._bell.sleep(seen, seconds)

    def _wait_for(self, handle: _ShmOp, timeout: float | None) -> None:
        peers = [handle.peer] if handle.peer is not None else list(self.pids)
        self._wait_until(lambda: handle.finished, timeout, peers,
                         lambda waited, limit, what: self._stuck(handle, waited, limit, what))

    def _wait_until(self, is_done, timeout: float | None, peers: list[int], stuck, spin: bool = False) -> None:
        """Make progress and sleep on our doorbell until ``is_done()``; a dead peer among ``peers`` or
        the timeout raises ``stuck(waited, limit, what)``. ``spin``: first poll ``is_done`` alone, for
        ``poll_seconds``, moving nothing (for conditions the other ranks make true, as a barrier's; a
        poll that also moved traffic under the lock cost 4 ranks on 2 cores 8-10% of a 64 KiB call)."""
        if spin and is_done():   # nothing to wait for (other traffic moves in the next wait that needs it)
            return
        limit = self.timeout if timeout is None else timeout
        started = time.monotonic()
        if spin:
            until = time.perf_counter() + poll_seconds(self.spin_allowed)
            while time.perf_counter() < until:
                if not self.spin_allowed:
                    os.sched_yield()
                if is_done():
                    return
        while True:
            with self._lock:
                seen = self._advance()
                if is_done():
                    return
                self._sleepers += 1
            waited = time.monotonic() - started
            try:
                if waited >= limit:
                    raise self._broken_by(stuck(waited, limit, "timed out"))
                if self.hold is not None:
                    self.hold.before_sleep()
                self._bell.sleep(seen, min(LIVENESS_SLICE, limit - waited))
                if time.monotonic() - started >= LIVENESS_SLICE:
                    for peer in peers:
                        if not _alive(self.pids[peer]):
                            raise self._broken_by(stuck(time.monotonic() - started, limit,
                                                        f"failed: rank {peer} (pid {self.pids[peer]}) exited"))
            finally:
                with self._lock:
                    self._sleepers -= 1

    def _broken_by(self, error: PeerError) -> PeerError:
        with self._lock:
            self._broken = error
        return error

    def _stuck(self, handle: _ShmOp, waited: float, limit: float, what: str) -> PeerError:
        verb = "send to" if handle.sent else "receive from"
        who = "any rank" if handle.peer is None else f"rank {handle.peer}"
        why = f"; {who} may have died or stalled" if what == "timed out" else ""
        return PeerError(f"rank {self.rank}: {handle.op}: {verb} {who} ({handle.nbytes} bytes, shared memory) {what} "
                         f"after {waited:.1f} s (timeout {limit:.0f} s){why}",
                         rank=self.rank, peer=handle.peer, op=handle.op)

    # --- what allreduce_shared.py builds on -----------------------------------------------------
    def barrier(self, op: str, spin: bool = False) -> None:
        """Return once every local rank has entered as many barriers as this one (with the timeout
        and liveness checks of any wait; ``spin``: see the module docstring)."""
        self._barriers += 1
        count = self._barriers
        self._counters[self.rank].value = count
        for bell in self._bells.values():
            bell.ring()
        counters = self._peer_counters
        if spin and all(c.value >= count for c in counters):   # all here: none of the wait's set-up
            return

        def stuck(waited, limit, what):
            behind = [peer for peer in self.pids if self._counters[peer].value < count]
            return PeerError(f"rank {self.rank}: {op}: barrier {count} on shared memory {what} after {waited:.1f} s "
                             f"(timeout {limit:.0f} s); not arrived: {', '.join(f'rank {p}' for p in behind)}",
                             rank=self.rank, peer=behind[0] if behind else None, op=op)

        self._wait_until(lambda: all(c.value >= count for c in counters), None, list(self.pids), stuck, spin)

    def publish(self, values: tuple[int, ...], address: int = 0) -> None:
        """Write this rank's fingerprint for the next barrier into its next slot (the slots alternate:
        a slot is rewritten two agreements later, after every rank has passed the barrier in between
        and so has read it), and ``address``: where its tensor lies, for single-copy reads."""
        self._published += 1
        offset = self._fingerprint_slots[self._published & 1]   # _published_offset(), one call less
        self._mine = (_FINGERPRINT.pack(*values) if len(values) == 8
                      else _FINGERPRINT.pack(*values, *(0,) * (8 - len(values))))
        own = self._mappings[self.rank]
        own[offset:offset + _FINGERPRINT.size] = self._mine
        _ADDRESS.pack_into(own, offset + FRAME, address)

    def first_differing(self, op: str, metered: bool = True) -> int | None:
        """The lowest local rank whose fingerprint for the agreement this rank last published differs
        from this rank's, byte for byte; None when all are equal. Metered as ``published``, once for
        every peer (unless ``metered`` is False: the caller counts those bytes itself)."""
        if metered:
            self.meter.record_exchanges(((peer, _FINGERPRINT.size) for peer in self.pids), op=op, control=True)
        start = self._published_offset()
        end, mine = start + _FINGERPRINT.size, self._mine
        for peer in self._ordered_peers:
            if self._mappings[peer][start:end] != mine:
                return peer
        return None

    def published(self, rank: int, op: str) -> tuple[int, ...]:
        """Local rank ``rank``'s fingerprint for the agreement this rank last published (read it after
        the barrier that follows ``publish``). Metered as control bytes read out of ``rank``'s memory
        and, by symmetry (``rank`` reads ours), as many sent."""
        self.meter.record_exchange(peer=rank, received=_FINGERPRINT.size, sent=_FINGERPRINT.size, op=op, control=True)
        return _FINGERPRINT.unpack_from(self._mappings[rank], self._published_offset())

    def published_address(self, rank: int, op: str) -> int:
        """The address local rank ``rank`` published with its last fingerprint (metered as control
        bytes, like the fingerprint)."""
        self.meter.record_exchange(peer=rank, received=_ADDRESS.size, sent=_ADDRESS.size, op=op, control=True)
        return _ADDRESS.unpack_from(self._mappings[rank], self._published_offset() + FRAME)[0]

    def read_from(self, rank: int, address: int, into: torch.Tensor, op: str) -> None:
        """Single-copy read of ``into``'s size from ``address`` in local rank ``rank``'s memory."""
        try:
            single_copy.read(self.pids[rank], address, into)
        except single_copy.SingleCopyError as exc:
            gone = "" if _alive(self.pids[rank]) else f" (rank {rank} has exited)"
            raise PeerError(f"rank {self.rank}: {op}: reading rank {rank}'s tensor failed{gone}: {exc}",
                            rank=self.rank, peer=rank, op=op) from exc

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A private buffer of at least ``nbytes``, kept between calls (uint8)."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _published_offset(self) -> int:
        return self._fingerprint_slots[self._published & 1]

    def next_half(self) -> int:
        """The staging half the next piece uses: they alternate, across calls too, so a rank may
        fill one half while slower ranks still read the other (allreduce_shared.py)."""
        self._half ^= 1
        self._split_in_half = False
        return self._half

    def restart_halves(self) -> None:
        """After a collective mismatch, which every rank raises after the same barrier: ranks that took
        different algorithms may have moved to different halves, so every one starts again from half 0
        (nothing staged is read after a mismatch, and everything staged before it was read before
        that barrier)."""
        self._half = 0
        self._split_in_half = False

    def split_half(self) -> int:
        """The staging half for the split all-reduce's pieces: the last one when the split used it last
        (its regions lie at fixed places, so a split may follow a split in the same half:
        allreduce_shared.py), else the next."""
        if not self._split_in_half:
            self._half ^= 1
            self._split_in_half = True
        return self._half

    def stage(self, rank: int, half: int) -> torch.Tensor:
        """Local rank ``rank``'s staging half ``half`` (S bytes, uint8), readable and writable here."""
        return self._stages[rank].narrow(0, half * self.stage_bytes, self.stage_bytes)

    def staged_views(self, half: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The first ``nbytes`` of every local rank's staging half ``half`` as ``dtype``, in rank order;
        cached per (half, bytes, dtype), since small collectives repeat the same few shapes and making
        the views costs more than the copy."""
        key = (half, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            views = [self.stage(r, half)[:nbytes].view(dtype) for r in self.local_ranks]
            self._views[key] = views
        return views


def job_token(world: runtime.World) -> str:
    """The name shared by this world's segments: the launcher's GRADSYNC_JOB_ID (or one rank 0 draws),
    then this process's init count, so a second init() in the same job never meets the first's names."""
    token = os.environ.get("GRADSYNC_JOB_ID")
    if not token:
        key = "gradsync/shm/token"  # world.store is this init's own
        if world.rank == 0:
            world.store.set(key, f"{os.getpid()}x{secrets.token_hex(4)}")
        world.store.wait([key], timedelta(seconds=world.timeout))
        token = world.store.get(key).decode()
    return f"{token}i{world.generation}"
