"""Shared regions: tensors that every rank of a host can read in every other rank's memory.

The shared-memory all-reduce copies a tensor into a staging half so that the other ranks can read
it (allreduce_shared.py). A tensor that already lives in shared memory needs no such copy: a
region is one such tensor per rank, allocated together by all local ranks, the same size on each.
DDP allocates its gradient buckets as regions (ddp/buckets.py), so a bucket's gradients are
readable by the other ranks the moment backward has written them (allreduce_shared_in_place.py).

Vocabulary
    region k     the k-th region this transport allocated; every local rank allocates regions in
                 the same order with the same sizes (a collective call, checked: a size that
                 differs is an error naming both ranks)
    segment      /dev/shm/gradsync-<job>-r<rank>-region<k>, one per rank and region, mapped by every
                 local rank and unlinked once all have mapped it (as the transport's own segments:
                 a killed job leaves nothing behind; the launcher's clean-up matches the same prefix)
    peer view    rank j's copy of a tensor that lies inside one of this rank's regions: the same
                 byte range of rank j's segment of the same region (``views_of``)

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

from gradsync.comm.shm.segment import SHM_DIR


class SharedRegions:
    """The regions of one shared-memory transport."""

    def __init__(self, transport, store, job_prefix: str) -> None:
        self._transport = transport
        self._store = store
        self._prefix = job_prefix
        self._mappings: list[dict[int, mmap.mmap]] = []
        self._bases: list[tuple[int, int, int]] = []  # (own base address, bytes, region index)
        self._views: dict[tuple, list[torch.Tensor]] = {}

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Region k: a zeroed 1-D tensor of ``numel`` x ``dtype`` in shared memory, or None when every
        local rank agrees that /dev/shm cannot hold it (then no rank allocates). Collective."""
        t = self._transport
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

    def _forget(self, k: int) -> None:
        """Region k's tensor is gone: drop this rank's references to its mappings (each is unmapped
        once nothing else uses it; an address may then be reused by a later region)."""
        self._bases = [entry for entry in self._bases if entry[2] != k]
        self._views = {key: views for key, views in self._views.items() if key[0] != k}
        if k < len(self._mappings):
            self._mappings[k] = {}

    def views_of(self, tensor: torch.Tensor) -> tuple[int, list[torch.Tensor]] | None:
        """(where, every local rank's copy of ``tensor`` in rank order) when ``tensor`` is a contiguous
        CPU tensor inside one of this rank's regions, else None; where = k * 2**40 + byte offset."""
        if not self._bases or tensor.is_cuda or not tensor.is_contiguous():
            return None
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for base, size, k in self._bases:
            if base <= start and start + nbytes <= base + size:
                key = (k, start - base, tensor.numel(), tensor.dtype)
                views = self._views.get(key)
                if views is None:
                    offset = start - base
                    views = [torch.frombuffer(self._mappings[k][r], dtype=torch.uint8, count=nbytes, offset=offset)
                             .view(tensor.dtype) if nbytes else tensor for r in self._transport.local_ranks]
                    if len(self._views) >= 1024:
                        self._views.clear()
                    self._views[key] = views
                return (k << 40) + start - base, views
        return None

    def close(self) -> None:
        """Unmap every region (a tensor view still alive keeps its mapping until the process ends)."""
        self._views.clear()
        self._bases.clear()
        for mappings in self._mappings:
            for mapping in mappings.values():
                try:
                    mapping.close()
                except BufferError:
                    pass
        self._mappings.clear()
