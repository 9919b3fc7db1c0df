"""NaN and +-inf through every reduction: the values each rank contributes, the single-process oracle,
and the functions the test worlds run (module level, so child processes can import them).

What NaN does (docs/library.md, "Reductions and NaN"): sum, avg and product follow IEEE arithmetic,
so an element is NaN where any rank's is NaN or where +inf meets -inf (sum) or 0 meets inf
(product); max and min are torch.maximum and torch.minimum, NaN wherever any rank's element is
NaN, on every algorithm and size. torch's gloo agrees with that for sum, avg and product; its max
and min keep or lose a NaN by which rank holds it (on 4 ranks, max(1, NaN, 3, 4) is 1), so there
gloo is the oracle only where no rank holds a NaN, and algorithm="native" (gloo itself) is compared
with gloo alone.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

import gradsync as gs
from cases import FOLD, NATIVE

NAN, INF = float("nan"), float("inf")
FLOATING = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
FLOAT_OPS = ("sum", "avg", "product", "max", "min")


def scenarios(world_size: int) -> list[dict[int, float]]:
    """What the ranks hold at one element, rank -> special value (the others a finite value): a NaN
    on each rank alone (the first, every middle one, the last), +inf and -inf on each rank alone,
    +inf meeting -inf, 0 meeting inf, a NaN beside an inf, a NaN on every rank, and nothing special."""
    last, middle = world_size - 1, world_size // 2
    table = ([{k: NAN} for k in range(world_size)] + [{k: INF} for k in range(world_size)]
             + [{k: -INF} for k in range(world_size)])
    table += [{0: INF, last: -INF}, {0: -INF, last: INF}, {0: 0.0, last: INF}, {0: NAN, last: INF},
              {middle: NAN, last: -INF}, {k: NAN for k in range(world_size)}, {}]
    return table


def nonfinite_contribution(rank: int, world_size: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Rank r's input: element i follows scenario i mod S (scenarios()), so every scenario lands in
    every chunk, piece and size band of a long tensor. Finite values are small and exact in every
    floating dtype, whatever the order of the reduction: (r+1) * (1 + i mod 3), and for product
    powers of two 2^((r + i) mod 3 - 1)."""
    i = torch.arange(numel)
    if op == "product":
        values = torch.pow(2.0, ((rank + i) % 3 - 1).double())
    else:
        values = ((rank + 1) * (1 + i % 3)).double()
    table = scenarios(world_size)
    specials = torch.tensor([s.get(rank, 0.0) for s in table], dtype=torch.float64)
    marked = torch.tensor([rank in s for s in table])
    which = i % len(table)
    values = torch.where(marked[which], specials[which], values)
    return values.to(dtype)


def nonfinite_fold(world_size: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The oracle: every rank's input folded in rank order with torch's own elementwise op in one
    process (NaN-propagating torch.maximum/minimum for max/min), divided by N for avg."""
    acc = nonfinite_contribution(0, world_size, numel, dtype, op)
    for rank in range(1, world_size):
        acc = FOLD[op](acc, nonfinite_contribution(rank, world_size, numel, dtype, op))
    return acc.div(world_size) if op == "avg" else acc


def nan_anywhere(world_size: int, numel: int) -> torch.Tensor:
    """Where some rank's input is NaN (the elements where gloo's max and min are not an oracle)."""
    table = scenarios(world_size)
    has_nan = torch.tensor([any(v != v for v in s.values()) for s in table])
    return has_nan[torch.arange(numel) % len(table)]


def same_values(ours: torch.Tensor, reference: torch.Tensor, where: torch.Tensor | None = None) -> bool:
    """NaN at the same elements, the same values (infinities with their signs) elsewhere; NaN bit
    patterns may differ. ``where``: compare only these elements."""
    if ours.dtype != reference.dtype or ours.shape != reference.shape:
        return False
    if where is not None:
        ours, reference = ours[where], reference[where]
    nan = torch.isnan(ours)
    return torch.equal(nan, torch.isnan(reference)) and torch.equal(ours[~nan], reference[~nan])


def against_gloo(ours: torch.Tensor, gloo: torch.Tensor, op: str, native: bool, clean: torch.Tensor) -> str | None:
    """Why ``ours`` differs from gloo's result on the same inputs, or None (module docstring).
    ``native``: ours is gloo's own (algorithm="native"); ``clean``: the elements where no rank holds
    a NaN (nan_anywhere's complement)."""
    if native or op not in ("max", "min"):
        return None if same_values(ours, gloo) else "differs from torch.distributed (gloo)"
    if not bool(torch.isnan(ours[torch.isnan(gloo)]).all()):
        return "is finite where gloo gives NaN"
    return None if same_values(ours, gloo, clean) else "differs from gloo where no rank holds a NaN"


def gloo_all_reduce(rank: int, world_size: int, numel: int, dtype: torch.dtype, op: str, group=None) -> torch.Tensor:
    """torch.distributed's all-reduce of these inputs on ``group`` (default: the world's gloo group)."""
    reference = nonfinite_contribution(rank, world_size, numel, dtype, op)
    if numel:
        dist.all_reduce(reference, op=getattr(dist.ReduceOp, "SUM" if op == "avg" else NATIVE[op]), group=group)
    return reference.div_(world_size) if op == "avg" else reference


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


_REGIONS: dict[int, torch.Tensor] = {}


def shared_region(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` in a shared region (allocated once per world, the same on every
    rank: allocation is collective); a tensor viewed out of its start is all-reduced in place."""
    from gradsync.comm.world_transport import default_transport

    if nbytes not in _REGIONS:
        _REGIONS[nbytes] = default_transport().regions.allocate(nbytes, torch.uint8)
    return _REGIONS[nbytes]


def all_reduce_cases(cases: list) -> list:
    """Each (algorithm, dtype, op, numel, in_region) twice through gs.all_reduce (``in_region``: the
    tensor lies in a shared region, so the shared-memory all-reduce runs in place from
    IN_PLACE_FROM_BYTES), against nonfinite_fold() and gloo's all-reduce of the same inputs. Per case,
    (problem or None, digest of our result) so the test can check that every rank agrees bit for bit."""
    w = gs.world()
    answers = []
    for algorithm, dtype, op, numel, in_region in cases:
        fold = nonfinite_fold(w.world_size, numel, dtype, op)
        gloo = gloo_all_reduce(w.rank, w.world_size, numel, dtype, op)
        clean = ~nan_anywhere(w.world_size, numel)
        problem, results = None, []
        for call in range(2):   # twice in a row: a kept plan runs the second
            t = nonfinite_contribution(w.rank, w.world_size, numel, dtype, op)
            if in_region:
                region = shared_region(numel * dtype.itemsize).view(dtype)
                region.copy_(t)
                t = region
            gs.all_reduce(t, op=op, algorithm=algorithm)
            results.append(t.clone())
            if algorithm != "native" and not same_values(t, fold):
                problem = problem or f"call {call + 1} differs from the single-process fold (NaN and inf as torch)"
            why = against_gloo(t, gloo, op, algorithm == "native", clean)
            if why:
                problem = problem or f"call {call + 1} {why}"
        if not torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8)):
            problem = problem or "two calls on the same input differ"
        answers.append((problem, digest(results[0])))
    return answers


def scatter_gather_cases(cases: list) -> list:
    """Each (dtype, op, numel, in_region) twice through gs.reduce_scatter then gs.all_gather
    (``in_region``: the input lies in a shared region, as ShardedOptimizer's gradients do), against
    nonfinite_fold() and gloo's all-reduce; per case (problem or None, digest of the gathered result)."""
    from gradsync.comm.allreduce_ring import ring_chunks

    w = gs.world()
    answers = []
    for dtype, op, numel, in_region in cases:
        fold = nonfinite_fold(w.world_size, numel, dtype, op)
        gloo = gloo_all_reduce(w.rank, w.world_size, numel, dtype, op)
        own = ring_chunks(numel, w.world_size).view(fold, w.rank)
        problem, results = None, []
        for call in range(2):
            t = nonfinite_contribution(w.rank, w.world_size, numel, dtype, op)
            if in_region:
                region = shared_region(numel * dtype.itemsize).view(dtype)
                region.copy_(t)
                t = region
            shard = gs.reduce_scatter(t, op=op)
            full = gs.all_gather(shard)
            results.append(full)
            why = ("this rank's shard differs from the single-process fold" if not same_values(shard, own)
                   else "the gathered result differs from the single-process fold" if not same_values(full, fold)
                   else against_gloo(full, gloo, op, False, ~nan_anywhere(w.world_size, numel)))
            if why:
                problem = problem or f"call {call + 1}: {why}"
        if not torch.equal(results[0].view(torch.uint8), results[1].view(torch.uint8)):
            problem = problem or "two calls on the same input differ"
        answers.append((problem, digest(results[0])))
    return answers


_GROUP: list = []


def backend_cases(cases: list) -> list:
    """Each (dtype, op, numel) through the "gradsync" torch.distributed backend (a group of this
    world's ranks made once): dist.all_reduce, and dist.reduce_scatter_tensor of N pieces of numel,
    against nonfinite_fold() and the same call's all-reduce on the world's gloo group. Per case,
    (problem or None, digest of the all-reduce's result)."""
    if not _GROUP:
        _GROUP.append(dist.new_group(backend="gradsync"))
    group = _GROUP[0]
    w = gs.world()
    n = w.world_size
    answers = []
    for dtype, op, numel in cases:
        reduce_op = getattr(dist.ReduceOp, NATIVE[op])
        fold = nonfinite_fold(n, n * numel, dtype, op)
        gloo = gloo_all_reduce(w.rank, n, n * numel, dtype, op)
        clean = ~nan_anywhere(n, n * numel)
        mine = slice(w.rank * numel, (w.rank + 1) * numel)
        problem, results = None, []
        for call in range(2):
            t = nonfinite_contribution(w.rank, n, n * numel, dtype, op)
            dist.all_reduce(t, op=reduce_op, group=group)
            results.append(t)
            why = (None if same_values(t, fold) else "differs from the single-process fold") \
                or against_gloo(t, gloo, op, False, clean)
            if why:
                problem = problem or f"all_reduce call {call + 1} {why}"
            piece = torch.empty(numel, dtype=dtype)
            dist.reduce_scatter_tensor(piece, nonfinite_contribution(w.rank, n, n * numel, dtype, op), op=reduce_op,
                                       group=group)
            why = (None if same_values(piece, fold[mine]) else "differs from the single-process fold") \
                or against_gloo(piece, gloo[mine], op, False, clean[mine])
            if why:
                problem = problem or f"reduce_scatter_tensor call {call + 1} {why}"
        answers.append((problem, digest(results[0])))
    return answers


def hierarchical_cases(hosts: tuple, cases: list) -> list:
    """Each (dtype, op, numel) through algorithm="hierarchical" with this world's ranks pretending to
    sit on ``hosts`` (cases.PretendHosts: the cross-host phase runs, which one real host skips),
    against nonfinite_fold(); per case (problem or None, digest)."""
    import dataclasses

    from cases import PretendHosts
    from gradsync.comm.collectives import Place, all_reduce_in
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    place = Place(dataclasses.replace(w, hosts=hosts), PretendHosts(default_transport(), hosts))
    answers = []
    for dtype, op, numel in cases:
        t = nonfinite_contribution(w.rank, w.world_size, numel, dtype, op)
        all_reduce_in(place, t, op, "hierarchical")
        good = same_values(t, nonfinite_fold(w.world_size, numel, dtype, op))
        answers.append((None if good else "differs from the single-process fold (NaN and inf as torch)", digest(t)))
    return answers
