"""Which all-reduces of the "gradsync" backend make their tensor a shared region: torch DDP's buckets.

gradsync's own DDP wrapper allocates its gradient buckets in shared memory, so the all-reduce reads
the other ranks' gradients where backward wrote them and writes the result straight into their
buckets (comm/allreduce_in_place.py). torch's DDP allocates its buckets itself, in
ordinary memory, so on this backend each bucket went through the staging halves: copied in, reduced,
copied out (comm/allreduce_two_shot.py), (N-1)/N x M bytes each way that the wrapper never moves.
Here the backend adopts such a bucket as a region in place (comm/transport/shm/regions.py, ``adopt``: torch
moves the storage into shared memory, every view of it follows), and from then on the bucket is
all-reduced where it lies, as the wrapper's are.

Moving a storage changes its address, which is safe only for memory nothing outside torch points
into (a NumPy array made by ``t.numpy()`` would keep the old address). So only all-reduces issued
during a backward pass are considered (torch DDP issues its buckets from autograd hooks; a program's
own dist.all_reduce outside backward is never adopted), of one dense CPU tensor of at least
``MIN_BYTES`` that is the whole of a resizable storage (torch marks a storage whose memory it shares
with anything outside torch as not resizable: t.numpy(), from_numpy, frombuffer, DLPack), seen at
the same place of an earlier backward in the same storage (a bucket, not a fresh gradient).

Adoption is collective: every local rank must take part in the same call, or none. What every rank
sees alike decides when: ``place`` = (how many backward-issued all-reduces came before this one in
the same backward, element count, dtype), and the n-th time a place is all-reduced runs an adoption
round when n is 2, 3 or a power of two (torch rebuilds its buckets once, after the first backward,
so the third time is the first a rebuilt bucket is seen again; the powers of two bound the rounds
of a place that is never adopted to log2 of its calls). In a round each rank offers its tensor or
declines, and the tensors are adopted only if every rank offered (regions.adopt).
"""

from __future__ import annotations

import os

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from gradsync.comm.world_transport import IN_PLACE_FROM_BYTES, SHM_DIR, shares_memory

MIN_BYTES = IN_PLACE_FROM_BYTES
"""Smaller tensors are all-reduced by the direct all-reduce whether they lie in a region or not."""

KEEP_PLACES = 1024
"""Places remembered at most (a program whose backward issues more starts counting afresh)."""


class BucketAdoption:
    """One process group's adoption rounds (see the module docstring). ``consider`` runs on the
    thread that issues the all-reduce, in issue order; ``run`` inside the queued operation, before
    its all-reduce."""

    def __init__(self, transport, world_size: int) -> None:
        self._regions = getattr(transport, "regions", None)
        self.enabled = world_size > 1 and self._regions is not None and shares_memory(transport)
        self._task = -1     # the backward pass (autograd graph task) the last all-reduce was issued in
        self._issued = 0    # all-reduces issued in it so far
        self._places: dict[tuple, list] = {}   # place -> [times all-reduced, StorageWeakRef of the last]

    def consider(self, tensor: torch.Tensor) -> bool | None:
        """None: no adoption round for this all-reduce; else a round, True when this rank's tensor
        was all-reduced at the same place before in the same storage."""
        task = torch._C._current_graph_task_id()
        if task == -1 or not self.enabled:
            return None
        if task != self._task:
            self._task, self._issued = task, 0
        index, self._issued = self._issued, self._issued + 1
        if tensor.numel() * tensor.element_size() < MIN_BYTES:
            return None
        place = (index, tensor.numel(), tensor.dtype)
        entry = self._places.get(place)
        if entry is None:
            if len(self._places) >= KEEP_PLACES:
                self._places.clear()
            entry = self._places[place] = [0, None]
        entry[0] += 1
        storage = tensor.untyped_storage()
        seen = entry[1] is not None and not entry[1].expired() and entry[1].cdata == storage._cdata
        entry[1] = StorageWeakRef(storage)
        times = entry[0]
        return seen if times in (2, 3) or (times > 1 and (times & (times - 1)) == 0) else None

    def run(self, tensor: torch.Tensor, seen: bool) -> bool:
        """The adoption round of ``tensor`` (collective); True when it now lies in a shared region."""
        return self._regions.adopt(tensor, seen and self._may_adopt(tensor))

    def _may_adopt(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        nbytes = tensor.numel() * tensor.element_size()
        if (tensor.storage_offset() != 0 or storage.nbytes() != nbytes or not storage.resizable()
                or not tensor.is_contiguous() or self._regions.views_of(tensor) is not None):
            return False
        free = os.statvfs(SHM_DIR)   # a tmpfs page touched past its space kills the process (SIGBUS)
        return free.f_bavail * free.f_frsize >= nbytes * 2
