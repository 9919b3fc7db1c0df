"""Shared regions: tensors that every rank of a host can read in every other rank's memory.

The shared-memory all-reduce copies a tensor into a staging half so that the other ranks can read
it (allreduce_two_shot.py). A tensor that already lives in shared memory needs no such copy: a
region is one such tensor per rank, allocated together by all local ranks, the same size on each.
DDP allocates its gradient buckets as regions (ddp/buckets.py), so a bucket's gradients are
readable by the other ranks the moment backward has written them (allreduce_in_place.py).

Vocabulary
    region k     the k-th region this transport allocated; every local rank allocates regions in
                 the same order with the same sizes (a collective call, checked: a size that
                 differs is an error naming both ranks)
    segment      /dev/shm/gradsync-<job>-r<rank>-region<k>, one per rank and region, mapped by every
                 local rank and unlinked once all have mapped it (as the transport's own segments:
                 a killed job leaves nothing behind; the launcher's clean-up matches the same prefix)
    peer view    rank j's copy of a tensor that lies inside one of this rank's regions: the same
                 byte range of rank j's segment of the same region (``views_of``)

Adopted regions: a tensor the program already has (torch DDP's gradient buckets, which torch
allocates itself) becomes a region in place: torch moves its storage into shared memory (the call
torch.multiprocessing makes, ``UntypedStorage._share_fd_cpu_``: a copy into an unlinked /dev/shm
file, and every view of the storage follows it), and the other local ranks map that file through
/proc/<pid>/fd/<fd>. The storage's address changes, so only tensors that nothing outside torch
points into may be adopted (c10d/adoption.py says which). An adopted region lives as long as its
storage: ``views_of`` forgets it once the storage is freed, before an address could be reused.

Space: /dev/shm is memory (tmpfs). A region that would not fit its free space is refused with
``None`` (the caller falls back to ordinary memory), since touching an over-committed tmpfs page
kills the process with SIGBUS.
"""

from __future__ import annotations

import mmap
import os
import weakref
from datetime import timedelta

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gradsync.comm.transport.shm.segment import SHM_DIR


class SharedRegions:
    """The regions of one shared-memory transport, made over its segments (segment.py's Segments:
    the local ranks, their process ids, the store reads that notice a dead peer)."""

    def __init__(self, segments, store, job_prefix: str) -> None:
        self._segments = segments
        self._store = store
        self._prefix = job_prefix
        self._mappings: list[dict[int, mmap.mmap]] = []
        self._bases: list[tuple[int, int, int]] = []  # (own base address, bytes, region index)
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self._adopted: dict[int, StorageWeakRef] = {}  # region index -> the adopted storage

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Region k: a zeroed 1-D tensor of ``numel`` x ``dtype`` in shared memory, or None when every
        local rank agrees that /dev/shm cannot hold it (then no rank allocates). Collective."""
        t = self._segments
        k = len(self._mappings)
        used = numel * torch.empty((), dtype=dtype).element_size()
        nbytes = max(1, used)  # a mapping cannot be empty
        key = f"gradsync/shm/{self._prefix}region{k}"
        wait = timedelta(seconds=t.timeout)
        free = os.statvfs(SHM_DIR)
        fits = free.f_bavail * free.f_frsize >= nbytes * len(t.local_ranks) * 2  # headroom for the others
        self._store.set(f"{key}/fits/{t.rank}", f"{int(fits)} {nbytes}")
        answers = {peer: t.store_get(self._store, f"{key}/fits/{peer}", wait, peer, "size a region").split()
                   for peer in t.local_ranks if peer != t.rank}
        for peer, (_, theirs) in answers.items():
            if int(theirs) != nbytes:
                raise ValueError(f"rank {t.rank}: shared region {k}: rank {peer} allocates {theirs} bytes, this rank "
                                 f"{nbytes}; every local rank must allocate the same regions in the same order")
        if not fits or not all(int(ok) for ok, _ in answers.values()):
            self._mappings.append({})
            return None
        path = os.path.join(SHM_DIR, f"{self._prefix}{t.rank}-region{k}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        mappings: dict[int, mmap.mmap] = {}
        try:
            os.ftruncate(fd, nbytes)
            mappings[t.rank] = mmap.mmap(fd, nbytes)
            self._store.set(f"{key}/created/{t.rank}", "1")
            for peer in t.local_ranks:
                if peer != t.rank:
                    t.store_get(self._store, f"{key}/created/{peer}", wait, peer, "create its region")
                    peer_fd = os.open(os.path.join(SHM_DIR, f"{self._prefix}{peer}-region{k}"), os.O_RDWR)
                    try:
                        mappings[peer] = mmap.mmap(peer_fd, nbytes)
                    finally:
                        os.close(peer_fd)
            self._store.set(f"{key}/opened/{t.rank}", "1")
            for peer in t.local_ranks:
                if peer != t.rank:
                    t.store_get(self._store, f"{key}/opened/{peer}", wait, peer, "map its region")
        finally:
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        self._mappings.append(mappings)
        own = torch.frombuffer(mappings[t.rank], dtype=torch.uint8, count=nbytes)
        self._bases.append((own.data_ptr(), nbytes, k))
        tensor = own[:used].view(dtype)
        weakref.finalize(tensor, self._forget, k)
        return tensor

    def adopt(self, tensor: torch.Tensor, offer: bool) -> bool:
        """Region k made of ``tensor`` itself, on every local rank or on none. Collective: every local
        rank calls it for the same call of the same program, ``offer`` saying whether its tensor may be
        adopted (a 1-D contiguous CPU tensor that is the whole of its storage). True when every rank
        offered and mapped every other rank's storage; then ``tensor`` lies in shared memory, at a new
        address, with every view of its storage (see the module docstring)."""
        t = self._segments
        k = len(self._mappings)
        key = f"gradsync/shm/{self._prefix}region{k}"
        wait = timedelta(seconds=t.timeout)
        nbytes = tensor.numel() * tensor.element_size()
        mine = "0"
        if offer and nbytes > 0:
            try:
                fd, size = tensor.untyped_storage()._share_fd_cpu_()
                mine = f"1 {os.getpid()} {fd} {size}"
            except RuntimeError:  # a storage torch cannot move (shared by file name already, say)
                pass
        self._store.set(f"{key}/adopt/{t.rank}", mine)
        offers = {peer: t.store_get(self._store, f"{key}/adopt/{peer}", wait, peer, "offer its tensor").split()
                  for peer in t.local_ranks if peer != t.rank}
        mappings: dict[int, mmap.mmap] = {}
        if mine != "0" and all(answer[0] == "1" and int(answer[3]) == nbytes for answer in offers.values()):
            try:
                for peer, (_, pid, fd, size) in offers.items():
                    mappings[peer] = _map_descriptor(f"/proc/{pid}/fd/{fd}", int(size))
                mappings[t.rank] = _map_descriptor(f"/proc/self/fd/{mine.split()[2]}", nbytes)
            except OSError:
                mappings = {}
        # the owners keep their descriptors open until every rank has mapped (or failed to)
        self._store.set(f"{key}/mapped/{t.rank}", "1" if mappings else "0")
        mapped = [t.store_get(self._store, f"{key}/mapped/{peer}", wait, peer, "map an adopted tensor")
                  for peer in t.local_ranks if peer != t.rank]
        if not mappings or mapped.count("1") != len(mapped):
            self._mappings.append({})
            return False
        self._mappings.append(mappings)
        storage = tensor.untyped_storage()
        self._bases.append((storage.data_ptr(), nbytes, k))
        self._adopted[k] = StorageWeakRef(storage)
        return True

    def _forget(self, k: int) -> None:
        """Region k's tensor is gone: drop this rank's references to its mappings (each is unmapped
        once nothing else uses it; an address may then be reused by a later region)."""
        self._bases = [entry for entry in self._bases if entry[2] != k]
        self._views = {key: views for key, views in self._views.items() if key[0] != k}
        self._adopted.pop(k, None)
        if k < len(self._mappings):
            self._mappings[k] = {}

    def views_of(self, tensor: torch.Tensor) -> tuple[int, list[torch.Tensor]] | None:
        """(where, every local rank's copy of ``tensor`` in rank order) when ``tensor`` is a contiguous
        CPU tensor inside one of this rank's regions, else None; where = k * 2**40 + byte offset."""
        if not self._bases or tensor.is_cuda or not tensor.is_contiguous():
            return None
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for base, size, k in list(self._bases):
            if base <= start and start + nbytes <= base + size:
                adopted = self._adopted.get(k)
                if adopted is not None and adopted.expired():   # freed: a later region may lie at its address
                    self._forget(k)
                    continue
                key = (k, start - base, tensor.numel(), tensor.dtype)
                views = self._views.get(key)
                if views is None:
                    offset = start - base
                    views = [torch.frombuffer(self._mappings[k][r], dtype=torch.uint8, count=nbytes, offset=offset)
                             .view(tensor.dtype) if nbytes else tensor for r in self._segments.local_ranks]
                    if len(self._views) >= 1024:
                        self._views.clear()
                    self._views[key] = views
                return (k << 40) + start - base, views
        return None

    def close(self) -> None:
        """Unmap every region (a tensor view still alive keeps its mapping until the process ends)."""
        self._views.clear()
        self._adopted.clear()
        self._bases.clear()
        for mappings in self._mappings:
            for mapping in mappings.values():
                try:
                    mapping.close()
                except BufferError:
                    pass
        self._mappings.clear()


def _map_descriptor(path: str, nbytes: int) -> mmap.mmap:
    """A shared mapping of the file open as ``path`` (a /proc/<pid>/fd/<fd> link)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
