"""Rank functions for test_backend.py's world_of tests (module level: the pool's ranks import them).

Each runs torch.distributed's own calls twice: on a group of the "gradsync" backend over this world's
ranks and on a gloo group over the same ranks (the oracle), on copies of the same inputs, and says
where the two differ. The values make every reduction exact in its dtype, so the two must agree bit
for bit whatever order each combines the ranks in.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

import gradsync as gs

_GROUPS: dict[str, object] = {}

SUM_BOUND = {torch.float16: 1 << 8, torch.bfloat16: 1 << 5, torch.float32: 1 << 20, torch.float64: 1 << 40,
             torch.int8: 20, torch.uint8: 40, torch.int32: 1 << 26, torch.int64: 1 << 55}
"""Largest magnitude drawn for sums, max and min: integers that up to 8 ranks add exactly in the
dtype (float32's past float16's range, float64's past float32's 2^24 integers, int64's past 2^53)."""

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
              "min": dist.ReduceOp.MIN}


GROUP_TIMEOUT = timedelta(seconds=20)
"""Both groups' timeout (torch's default is 30 minutes): a rank that raised leaves the others waiting
in the call it skipped, and they raise after this, naming it, rather than hang the test."""


def _groups() -> tuple[object, object]:
    """(the gradsync group, the gloo group) over every rank of this world, made once per world."""
    if not _GROUPS:
        _GROUPS["gradsync"] = dist.new_group(backend="gradsync", timeout=GROUP_TIMEOUT)
        _GROUPS["gloo"] = dist.new_group(backend="gloo", timeout=GROUP_TIMEOUT)
    return _GROUPS["gradsync"], _GROUPS["gloo"]


def values(shape: tuple[int, ...], dtype: torch.dtype, seed: int, op: str = "sum") -> torch.Tensor:
    """Values whose reduction is exact in ``dtype``: for product, signed powers of two from 2^-2 to
    2^2 (floats; a product of 5 stays within float16's normal range) or integers in [-2, 2] ([0, 2]
    unsigned); otherwise integers within SUM_BOUND (signed; uint8 from 0)."""
    g = torch.Generator().manual_seed(seed)
    if op == "product":
        if dtype.is_floating_point:
            signs = torch.randint(0, 2, shape, generator=g) * 2 - 1
            return (signs * torch.pow(2.0, torch.randint(-2, 3, shape, generator=g).double())).to(dtype)
        return torch.randint(0 if dtype == torch.uint8 else -2, 3, shape, generator=g).to(dtype)
    bound = SUM_BOUND[dtype]
    return torch.randint(0 if dtype == torch.uint8 else -bound, bound + 1, shape, generator=g,
                         dtype=torch.int64).to(dtype)


def _differs(ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> bool:
    return len(ours) != len(theirs) or not all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
                                               for a, b in zip(ours, theirs))


def rooted_and_list_collectives(cases: list[tuple[str, tuple[int, ...], str]]) -> int:
    """For each (dtype name, shape, op) and, for gather and scatter, each root 0..N-1: dist.reduce_scatter
    of a list of N tensors, dist.all_gather into a list, dist.all_to_all, dist.gather and dist.scatter,
    each called twice in a row on fresh outputs, on the gradsync group and on the gloo group. Raises at
    the first call whose outputs differ or that raised on one group, naming the rank, the op and the
    case; returns how many calls it compared."""
    ours_group, gloo_group = _groups()
    rank, n = gs.world().rank, gs.world().world_size
    compared = 0

    def both(what: str, call, outputs_of) -> None:
        """call(group, outputs) on each group with fresh outputs from outputs_of(), twice; compare."""
        nonlocal compared
        for attempt in range(2):
            results = []
            for name, group in (("gradsync", ours_group), ("gloo", gloo_group)):
                outputs = outputs_of()
                try:
                    call(group, outputs)
                except Exception as exc:
                    raise RuntimeError(f"rank {rank}: {what}, call {attempt + 1}, raised on {name}: "
                                       f"{type(exc).__name__}: {exc}") from exc
                results.append(outputs)
            if _differs(*results):
                raise RuntimeError(f"rank {rank}: {what}, call {attempt + 1}: gradsync's outputs differ from gloo's")
            compared += 1

    for case, (dtype_name, shape, op) in enumerate(cases):
        dtype = getattr(torch, dtype_name)
        label = f"{dtype_name} {list(shape)} op={op} (N={n})"
        seed = 10_000 * case + 100 * rank
        # piece j of rank r goes to rank j: distinct values per (rank, piece)
        pieces = [values(shape, dtype, seed + j, op) for j in range(n)]
        mine = values(shape, dtype, seed + 99, op)

        both(f"reduce_scatter {label}",
             lambda g, out: dist.reduce_scatter(out[0], pieces, op=REDUCE_OPS[op], group=g),
             lambda: [torch.full(shape, 7, dtype=dtype)])
        both(f"all_gather {label}", lambda g, out: dist.all_gather(out, mine, group=g),
             lambda: [torch.full(shape, 7, dtype=dtype) for _ in range(n)])
        both(f"all_to_all {label}", lambda g, out: dist.all_to_all(out, pieces, group=g),
             lambda: [torch.full(shape, 7, dtype=dtype) for _ in range(n)])
        for root in range(n):
            both(f"gather root={root} {label}",
                 lambda g, out: dist.gather(mine, out if rank == root else None, dst=root, group=g),
                 lambda: [torch.full(shape, 7, dtype=dtype) for _ in range(n)] if rank == root else [])
            both(f"scatter root={root} {label}",
                 lambda g, out: dist.scatter(out[0], pieces if rank == root else None, src=root, group=g),
                 lambda: [torch.full(shape, 7, dtype=dtype)])
    return compared
