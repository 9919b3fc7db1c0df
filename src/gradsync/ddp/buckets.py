"""Parameters -> gradient buckets, as torch's reducer assigns them.

Vocabulary
    bucket           a flat 1-D buffer holding the gradients of several parameters back to back;
                     one reduction per bucket instead of one per parameter
    order            the parameters (indices into the wrapper's list) in the order their gradients
                     are expected: at construction the reverse of registration order (backward
                     produces the last layer's gradients first); after the first backward the
                     order they really became ready in (the reducer rebuilds the buckets once,
                     as torch's ``_rebuild_buckets`` does)
    limits           [first cap, cap]: the first bucket of each dtype closes at ``first cap``
                     (1 MiB, so communication starts as soon as the first gradients exist), every
                     later one at ``bucket_cap_bytes`` (``default_limits``); torch's
                     ``bucket_cap_mb_list`` gives one limit per bucket instead, the last repeating
    kind             (dtype, device): parameters of different kinds never share a bucket

Assignment (torch's ``compute_bucket_assignment_by_size``): walk ``order``; each parameter joins
the open bucket of its kind; once that bucket holds at least its limit in bytes it closes (so a
bucket may exceed the cap by one parameter, and a parameter larger than the cap is alone). Open
buckets left at the end close in the order their kinds first appeared.

Every rank must build the same buckets, so bucket i means the same thing everywhere: at
construction they follow from the parameter list (the wrapper verifies the lists agree); when
rebuilt, every rank takes rank 0's ready order (ddp/reducer.py).

Where the flat buffers live: ``allocate(numel, dtype)`` may put them in shared memory (the
wrapper does when every rank is on this host and the reduction is gradsync's own:
comm/transport/shm/regions.py), so the other ranks read a bucket's gradients where backward wrote them and
the all-reduce copies nothing in (comm/allreduce_in_place.py); otherwise, or when it
returns None, ordinary zeroed memory.

Example: four float32 parameters of 1, 2, 3 and 4 MiB registered in that order, cap 5 MiB:
    order 3, 2, 1, 0 (4, 3, 2, 1 MiB) -> [4] (4 >= the 1 MiB first cap), then [3, 2] (5 >= 5),
    then [1] (left open at the end).
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
    positions: list[int] = field(default_factory=list)
    """Each parameter's index in the wrapper's parameter list."""
    ready: list[bool] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()

    def grad_view(self, slot: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """The part of ``flat`` (default: the bucket's buffer) that holds parameter ``slot``'s
        gradient, shaped like the parameter."""
        flat = self.flat if flat is None else flat
        return flat.narrow(0, self.offsets[slot], self.numels[slot]).view(self.params[slot].shape)


def assign(order: list[int], nbytes: list[int], kinds: list[tuple], limits: list[int]) -> list[list[int]]:
    """Group the indices in ``order`` into buckets (see the module docstring): ``nbytes[i]`` and
    ``kinds[i]`` describe parameter i; ``limits`` are the successive caps of one kind's buckets,
    the last repeating."""
    if not limits or any(limit <= 0 for limit in limits):
        raise ValueError(f"bucket caps must be > 0 bytes, got {limits}")
    open_buckets: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    closed_count: dict[tuple, int] = {}
    result: list[list[int]] = []
    for i in order:
        kind = kinds[i]
        members = open_buckets.setdefault(kind, [])
        members.append(i)
        sizes[kind] = sizes.get(kind, 0) + nbytes[i]
        limit = limits[min(closed_count.get(kind, 0), len(limits) - 1)]
        if sizes[kind] >= limit:
            result.append(members)
            open_buckets[kind], sizes[kind] = [], 0
            closed_count[kind] = closed_count.get(kind, 0) + 1
    result.extend(members for members in open_buckets.values() if members)
    return result


def default_limits(bucket_cap_bytes: int) -> list[int]:
    """[first cap, cap]: the 1 MiB first bucket, then ``bucket_cap_bytes`` (a smaller cap wins)."""
    if bucket_cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {bucket_cap_bytes}")
    return [min(FIRST_BUCKET_CAP_BYTES, bucket_cap_bytes), bucket_cap_bytes]


def build_buckets(params: list[torch.nn.Parameter], names: list[str], limits: list[int],
                  allocate: Callable[[int, torch.dtype], torch.Tensor | None] | None = None,
                  order: list[int] | None = None, dtype: torch.dtype | None = None) -> list[Bucket]:
    """Buckets for ``params`` (the wrapper's list) taken in ``order`` (default: reverse registration
    order), closed at ``limits`` (bytes, the last repeating; see ``assign``); ``dtype`` overrides the
    floating parameters' dtype (mixed precision's param_dtype)."""
    order = list(reversed(range(len(params)))) if order is None else list(order)
    if sorted(order) != list(range(len(params))):
        raise ValueError(f"a bucket order must list each of the {len(params)} parameters once, got {order}")

    def dtype_of(p: torch.Tensor) -> torch.dtype:
        return dtype if dtype is not None and p.is_floating_point() else p.dtype

    nbytes = [p.numel() * torch.empty((), dtype=dtype_of(p)).element_size() for p in params]
    kinds = [(dtype_of(p), p.device) for p in params]
    buckets = []
    for index, members in enumerate(assign(order, nbytes, kinds, limits)):
        numels = [params[i].numel() for i in members]
        offsets = [sum(numels[:k]) for k in range(len(members))]
        first = params[members[0]]
        flat_dtype = dtype_of(first)
        flat = (allocate(sum(numels), flat_dtype)
                if allocate is not None and first.device.type == "cpu" else None)
        if flat is None:
            flat = torch.zeros(sum(numels), dtype=flat_dtype, device=first.device)
        buckets.append(Bucket(index, [params[i] for i in members], [names[i] for i in members],
                              offsets, numels, flat, list(members), [False] * len(members)))
    return buckets
