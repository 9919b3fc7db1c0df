"""Parameters -> gradient buckets.

Vocabulary
    bucket           a flat 1-D buffer holding the gradients of several parameters back to back;
                     one all-reduce per bucket instead of one per parameter
    bucket_cap_bytes the most gradient bytes a bucket may hold (one larger parameter gets a bucket
                     of its own)
    first cap        the first bucket is capped at 1 MiB (as torch DDP does) so communication
                     starts as soon as the last layers' gradients exist

Order: parameters are taken in reverse registration order, because backward produces the last
layer's gradients first. Every rank builds the same buckets from the same parameter list (the
wrapper verifies the lists agree), so bucket i means the same thing everywhere.

Where the flat buffers live: ``allocate(numel, dtype)`` may put them in shared memory (the
wrapper does when every rank is on this host: comm/shm_regions.py), so the other ranks read a
bucket's gradients where backward wrote them and the all-reduce copies nothing in
(comm/allreduce_shared_in_place.py); otherwise, or when it returns None, ordinary zeroed memory.

Example: four float32 parameters of 1, 2, 3 and 4 MiB registered in that order, cap 5 MiB:
    reversed: 4, 3, 2, 1 MiB -> first bucket [4] (alone: already over the 1 MiB first cap),
    then [3, 2] (3+2 = 5 fits), then [1] (5+1 > 5).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

FIRST_BUCKET_CAP_BYTES = 1 << 20


@dataclass
class Bucket:
    """A group of parameters reduced together through one flat buffer."""

    index: int
    params: list[torch.nn.Parameter]
    names: list[str]
    offsets: list[int]
    numels: list[int]
    flat: torch.Tensor
    ready: list[bool] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def grad_view(self, slot: int) -> torch.Tensor:
        """The part of the flat buffer that holds parameter ``slot``'s gradient, shaped like it."""
        return self.flat.narrow(0, self.offsets[slot], self.numels[slot]).view_as(self.params[slot])


def build_buckets(params: list[torch.nn.Parameter], names: list[str], bucket_cap_bytes: int,
                  first_bucket_cap_bytes: int = FIRST_BUCKET_CAP_BYTES,
                  allocate: Callable[[int, torch.dtype], torch.Tensor | None] | None = None) -> list[Bucket]:
    """Group ``params`` (registration order) into buckets, last parameter first; see module docstring."""
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {bucket_cap_bytes}")
    groups: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        cap = first_bucket_cap_bytes if not groups else bucket_cap_bytes
        cap = min(cap, bucket_cap_bytes)
        same_kind = not current or (params[current[0]].dtype, params[current[0]].device) == (p.dtype, p.device)
        if current and (current_bytes + nbytes > cap or not same_kind):
            groups.append(current)
            current, current_bytes = [], 0
        current.append(i)
        current_bytes += nbytes
    if current:
        groups.append(current)

    buckets = []
    for index, members in enumerate(groups):
        numels = [params[i].numel() for i in members]
        offsets = [sum(numels[:k]) for k in range(len(members))]
        first = params[members[0]]
        flat = allocate(sum(numels), first.dtype) if allocate is not None and first.device.type == "cpu" else None
        if flat is None:
            flat = torch.zeros(sum(numels), dtype=first.dtype, device=first.device)
        buckets.append(Bucket(index, [params[i] for i in members], [names[i] for i in members],
                              offsets, numels, flat, [False] * len(members)))
    return buckets
