"""The shared segments of a ShmTransport (transport.py): their layout, set-up and clean-up (Segments).

Segment layout (rank d's segment; slot i is the ring from local rank i to d)
    [0, 4)                           doorbell (u32): rung by anyone who wrote to d or freed space for d
    [4, 8)                           how many of d's threads sleep on it (u32; doorbell.py)
    [8, 16)                          barrier count (u64): how many barriers d has entered
    64 + i*(128 + C) + 0             head  (u64, stored by the sender)
    64 + i*(128 + C) + 64            tail  (u64, stored by d; its own cache line)
    64 + i*(128 + C) + 128 .. + C    data
    then 2 fingerprint slots of 128 bytes: what d is about to do (agree.py's staged check), and
                                     where its tensor lies for single-copy reads; they alternate,
                                     like the staging halves (staging.py)
    then 2 staging halves of S bytes (GRADSYNC_SHM_STAGE_MB): d's contribution to a collective that
                                     reads every rank's memory directly (allreduce_two_shot.py)

Cleanup: each rank creates its segment, every local peer maps it, and then the name is unlinked at
once, so from then on the memory lives only as long as the mappings: a SIGKILLed job leaves
nothing in /dev/shm. The launcher removes the job's names if ranks die during set-up.

Single-copy reads (single_copy.py): at set-up every rank tries to read a token out of each local
peer's segment through process_vm_readv, and the ranks agree: ``single_copy`` is True only when
every rank can read from every other. Then large reduce-scatters and all-gathers read the peers'
tensors where they lie (reduce_scatter_single_copy.py, all_gather_single_copy.py) instead of
staging them.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import time
from datetime import timedelta

import torch

from gradsync.group import runtime
from gradsync.comm.transport.shm import native, single_copy
from gradsync.comm.transport.shm.doorbell import Doorbell
from gradsync.comm.transport.shm.ring import FRAME, Ring, slot_bytes
from gradsync.comm.transport.shm.waiting import LIVENESS_SLICE
from gradsync.group.liveness import process_alive
from gradsync.comm.transport import PeerError, abandoned

DEFAULT_RING_MB = 2
"""Ring capacity per ordered pair, MiB. Small on purpose: a ring that fits the shared L3 cache
(32 MiB here) is read by the receiver while the sender's bytes are still in cache. Measured, ring
all-reduce medians of 7, N=4 on 2 cores: 16 MiB in 7.4-7.9 ms with 2 MiB rings against 10.6-10.9
ms with 8 MiB; N=2: 2.1-2.2 ms against 2.7-3.4 ms with 32 MiB (docs/studies/shm-ring-size.md)."""
DEFAULT_STAGE_MB = 4
"""Each staging half, MiB: 4 ranks x 2 halves x 4 MiB fill the 32 MiB L3 cache, so what one rank
stages the others read from cache."""
SHM_DIR = "/dev/shm"


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


class Segments:
    """The segments of one ShmTransport (transport.py): where each part of one lies (module docstring),
    creating and mapping them at set-up (``connect``), and unmapping them at ``close``. Holds the
    mappings, this rank's doorbell and its peers', the rings in and out, the barrier counter words
    and the staging halves, as the other parts of the transport read them."""

    def __init__(self, rank: int, local_ranks: tuple[int, ...], timeout: float) -> None:
        self.rank = rank
        self.local_ranks = local_ranks
        self.local_index = {r: i for i, r in enumerate(local_ranks)}
        self.timeout = timeout
        self.capacity = ring_bytes()
        self.stage_bytes = stage_bytes()
        self.mappings: dict[int, mmap.mmap] = {}
        self.pids: dict[int, int] = {}           # local peer -> its process id, once it created its segment
        self.native_problem: str | None = None  # why the native core does not run here (None: it does)
        self.single_copy = False
        self.single_copy_problem: str | None = "not probed"
        self.bell: Doorbell | None = None        # this rank's doorbell
        self.bells: dict[int, Doorbell] = {}     # each peer's doorbell
        self.rings_in: dict[int, Ring] = {}      # peer -> the ring from it, in this rank's segment
        self.rings_out: dict[int, Ring] = {}     # peer -> the ring to it, in its segment
        self.counters: dict[int, ctypes.c_uint64] = {}   # every local rank's barrier counter word
        self.peer_counters: list[ctypes.c_uint64] = []
        self.ordered_peers: list[int] = []
        self.stages: dict[int, torch.Tensor] = {}   # every local rank's two staging halves, uint8

    def segment_bytes(self) -> int:
        return self.stage_offset() + 2 * self.stage_bytes

    def fingerprint_offset(self) -> int:
        return FRAME + len(self.local_ranks) * slot_bytes(self.capacity)

    def stage_offset(self) -> int:
        return self.fingerprint_offset() + 4 * FRAME

    def slot(self, sender: int) -> int:
        return FRAME + self.local_index[sender] * slot_bytes(self.capacity)

    def connect(self, world: runtime.World, job: str):
        """Create this rank's segment, map every local peer's, then unlink ours (see Cleanup); agree
        on single-copy reads and on the native core; make the doorbells, rings, counters and staging
        views. Returns the native core's module where every local rank has it, else None."""
        store, wait = world.store, timedelta(seconds=world.timeout)
        key = f"gradsync/shm/{job}"
        path = os.path.join(SHM_DIR, f"{segment_prefix(job)}{self.rank}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.segment_bytes())
            self.mappings[self.rank] = mmap.mmap(fd, self.segment_bytes())
            os.close(fd)
            fd = -1
            own = self.mappings[self.rank]
            own[self.fingerprint_offset():self.fingerprint_offset() + 16] = secrets.token_bytes(16)
            base = ctypes.addressof(ctypes.c_char.from_buffer(own))
            extension, self.native_problem = native.load()
            store.set(f"{key}/created/{self.rank}",
                      f"{os.getpid()} {self.capacity} {self.stage_bytes} {base} {int(extension is not None)}")
            bases = {}
            for peer in self.local_ranks:
                if peer == self.rank:
                    continue
                created = self.store_get(store, f"{key}/created/{peer}", wait, peer, "create its segment")
                pid, capacity, staging, bases[peer], theirs = (int(v) for v in created.split())
                if not theirs and self.native_problem is None:
                    self.native_problem = f"rank {peer} has no native core"
                if (capacity, staging) != (self.capacity, self.stage_bytes):
                    raise ValueError(f"rank {self.rank}: shared-memory set-up: rank {peer} has {capacity}-byte rings and "
                                     f"{staging}-byte staging halves, this rank {self.capacity} and {self.stage_bytes}; "
                                     f"set GRADSYNC_SHM_RING_MB and GRADSYNC_SHM_STAGE_MB alike on every rank")
                self.pids[peer] = pid
                peer_fd = os.open(os.path.join(SHM_DIR, f"{segment_prefix(job)}{peer}"), os.O_RDWR)
                try:
                    self.mappings[peer] = mmap.mmap(peer_fd, self.segment_bytes())
                finally:
                    os.close(peer_fd)
            problems = [self.probe(peer, bases[peer]) for peer in self.pids]
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
        extension = native.load()[0] if self.native_problem is None else None
        self.bell = Doorbell(self.mappings[self.rank], 0, me, extension)
        self.bells = {peer: Doorbell(self.mappings[peer], 0, me, extension) for peer in self.pids}
        self.rings_in = {peer: Ring(self.mappings[self.rank], self.slot(peer), self.capacity) for peer in self.pids}
        self.rings_out = {peer: Ring(self.mappings[peer], self.slot(self.rank), self.capacity) for peer in self.pids}
        self.counters = {rank: ctypes.c_uint64.from_buffer(self.mappings[rank], 8) for rank in self.local_ranks}
        self.peer_counters = [self.counters[peer] for peer in self.pids]
        self.ordered_peers = sorted(self.pids)
        self.stages = {rank: torch.frombuffer(self.mappings[rank], dtype=torch.uint8, count=2 * self.stage_bytes,
                                              offset=self.stage_offset()) for rank in self.local_ranks}
        if extension is None and self.native_problem is not None and me == 0:
            native.notice(self.native_problem)
        return extension

    def core_addresses(self) -> dict:
        """Where the native core finds each local rank's counter, doorbell, fingerprint slots and staging
        halves (native/module.c's Core), as keyword arguments."""
        ranks = self.local_ranks
        bases = [ctypes.addressof(self.counters[rank]) - 8 for rank in ranks]   # the counter is at byte 8
        return dict(n=len(ranks), me=self.local_index[self.rank], counters=[base + 8 for base in bases], bells=bases,
                    slots=[base + self.fingerprint_offset() + parity * 2 * FRAME for base in bases for parity in (0, 1)],
                    stages=[self.stages[rank].data_ptr() + half * self.stage_bytes for rank in ranks for half in (0, 1)],
                    stage_bytes=self.stage_bytes)

    def probe(self, peer: int, base: int) -> str | None:
        """Why single-copy reads from ``peer`` do not work here (None when they do): read the token at
        the start of its fingerprint slots and compare it with what its mapping shows (single_copy.probe)."""
        offset = self.fingerprint_offset()
        expected = bytes(self.mappings[peer][offset:offset + 16])
        return single_copy.probe(self.pids[peer], base + offset, expected)

    def store_get(self, store, key: str, wait: timedelta, peer: int, what: str) -> str:
        """The value ``peer`` sets under ``key``. Polled (store.check, every 2 ms), not a blocking
        store.wait, so that a peer that dies meanwhile is an error within a liveness slice (its pid
        in /proc, or a live world's abandoned()) rather than after the timeout."""
        started, looked = time.monotonic(), time.monotonic()
        try:
            while not store.check([key]):
                now = time.monotonic()
                if now - started >= wait.total_seconds():
                    raise TimeoutError(f"timed out after {now - started:.1f} s")
                if now - looked >= LIVENESS_SLICE:
                    looked = now
                    pid = self.pids.get(peer)   # known once the peer created its segment
                    why = f"rank {peer} (pid {pid}) exited" if pid is not None and not process_alive(pid) else abandoned()
                    if why is not None:
                        raise RuntimeError(why)
                time.sleep(0.002)
            return store.get(key).decode()
        except Exception as exc:
            raise PeerError(f"rank {self.rank}: shared-memory set-up: rank {peer} did not {what} "
                            f"within {self.timeout:.0f} s ({exc})", rank=self.rank, peer=peer,
                            op="shm/connect") from exc

    def close(self) -> None:
        """Release the rings and doorbells and unmap every segment (their names are already gone)."""
        for ring in [*self.rings_in.values(), *self.rings_out.values()]:
            ring.release()
        for bell in [self.bell, *self.bells.values()]:
            if bell is not None:
                bell.release()
        self.bell = None
        self.rings_in, self.rings_out, self.bells, self.counters, self.stages = {}, {}, {}, {}, {}
        self.peer_counters = []
        for mapping in self.mappings.values():
            try:
                mapping.close()
            except BufferError:  # a tensor view still exists; the mapping goes with the process
                pass
        self.mappings = {}
