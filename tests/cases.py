"""Functions the test worlds run on every rank (module level, so child processes can import them)."""

import torch

import gradsync as gs


def contribution(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank r contributes (r+1) * (1 + i mod 3) at element i: small integers, exact in every dtype."""
    pattern = 1 + torch.arange(numel) % 3
    return (pattern * (rank + 1)).to(dtype)


def expected_sum(world_size: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Closed form: sum over r of (r+1) * (1 + i mod 3) = N(N+1)/2 * (1 + i mod 3)."""
    return ((1 + torch.arange(numel) % 3) * (world_size * (world_size + 1) // 2)).to(dtype)


def all_reduce_case(numel: int, dtype: torch.dtype, op: str, algorithm: str, repeats: int = 2):
    """Ours (twice in a row) next to torch.distributed's own all_reduce on the same input."""
    w = gs.world()
    ours = []
    for _ in range(repeats):
        t = contribution(w.rank, numel, dtype)
        gs.all_reduce(t, op=op, algorithm=algorithm)
        ours.append(t)
    reference = contribution(w.rank, numel, dtype)
    if w.world_size > 1 and numel > 0 and dtype != torch.bfloat16:  # gloo has no bfloat16 sum
        torch.distributed.all_reduce(reference)
    else:
        reference = expected_sum(w.world_size, numel, dtype)
    if op == "avg":
        reference = reference / w.world_size
    return ours, reference


def scatter_gather_case(numel: int, dtype: torch.dtype, op: str):
    w = gs.world()
    shard = gs.reduce_scatter(contribution(w.rank, numel, dtype), op=op)
    full = gs.all_gather(shard)
    again = gs.all_gather(gs.reduce_scatter(contribution(w.rank, numel, dtype), op=op))
    direct = gs.all_reduce(contribution(w.rank, numel, dtype), op=op, algorithm="ring")
    return shard.numel(), full, again, direct


def traffic_case(numel: int, dtype: torch.dtype, algorithm: str):
    w = gs.world()
    t = contribution(w.rank, numel, dtype)
    gs.traffic_reset()
    gs.all_reduce(t, algorithm=algorithm)
    return gs.traffic()


def scatter_gather_traffic(numel: int):
    """The meter's counts for one reduce_scatter and one all_gather of float64."""
    w = gs.world()
    gs.traffic_reset()
    shard = gs.reduce_scatter(contribution(w.rank, numel, torch.float64))
    scattered = gs.traffic()
    gs.traffic_reset()
    gs.all_gather(shard)
    return scattered, gs.traffic()


def traffic_of_each_collective(numel: int, src: int) -> dict:
    """The meter's counts (gs.traffic(), reset before each) for each collective on ``numel`` float64:
    all_reduce with each of ring, halving_doubling, tree and naive, reduce_scatter, all_gather of its
    shard, broadcast from ``src``."""
    w = gs.world()
    counts = {}
    for algorithm in ("ring", "halving_doubling", "tree", "naive"):
        t = contribution(w.rank, numel, torch.float64)
        gs.traffic_reset()
        gs.all_reduce(t, algorithm=algorithm)
        counts[f"all_reduce/{algorithm}"] = gs.traffic()
    gs.traffic_reset()
    shard = gs.reduce_scatter(contribution(w.rank, numel, torch.float64))
    counts["reduce_scatter"] = gs.traffic()
    gs.traffic_reset()
    gs.all_gather(shard)
    counts["all_gather"] = gs.traffic()
    t = contribution(w.rank, numel, torch.float64)
    gs.traffic_reset()
    gs.broadcast(t, src=src)
    counts["broadcast"] = gs.traffic()
    return counts


def broadcast_case(shape: tuple, src: int, transpose: bool):
    w = gs.world()
    t = torch.full(shape, float(w.rank)) + torch.arange(shape[-1])
    if transpose:
        t = t.t()
    gs.broadcast(t, src=src)
    return t


def all_reduce_layouts_case():
    """all_reduce on each layout it accepts: a plain 1-D tensor (reduced as it is), a 2-D one, a
    transposed (non-contiguous) one, a parameter that requires grad, and a view of it made under
    no_grad (both reduced through a detached alias). Returns them reduced, and untouched copies."""
    rank = gs.world().rank
    base = torch.arange(12, dtype=torch.float64) * (rank + 1)
    parameter = torch.nn.Parameter(base.clone())
    with torch.no_grad():
        view = parameter.view(3, 4)
    layouts = {"1-D": base.clone(), "2-D": base.clone().view(3, 4), "transposed": base.clone().view(3, 4).t(),
               "parameter": parameter}
    for tensor in layouts.values():
        gs.all_reduce(tensor)
    layouts["no_grad view"] = view  # shares the parameter's storage: reduced twice in all
    gs.all_reduce(view)
    return {name: t.detach().clone() for name, t in layouts.items()}


def raise_on(rank: int, fn, *args):
    if gs.world().rank == rank:
        return fn(*args)
    return None


def mismatched_all_reduce(kind: str, algorithm: str, numel: int = 12):
    """Rank 1 disagrees with the others about the tensor's size or dtype."""
    w = gs.world()
    dtype = torch.float32
    if w.rank == 1:
        numel, dtype = (numel + 1, dtype) if kind == "size" else (numel, torch.int32)
    gs.all_reduce(torch.ones(numel, dtype=dtype), algorithm=algorithm)


def odd_rank_at_every_position(calls: list) -> list:
    """For each (collective, kind, algorithm, numel) and each rank in turn as the odd one out (rank
    0, every middle rank, the last): that rank passes ``numel`` + 1 elements (kind "size") or int32
    (kind "dtype") where the others pass ``numel`` float32 (all_gather: shards of 4 + rank elements,
    whose sizes may differ; only the dtype can). Every rank catches the error it gets and goes on, so
    one world sees every position. Per call, the (odd rank, error type, message) seen here in turn,
    then whether a well-formed all-reduce of ``numel`` afterwards gave the closed form."""
    w = gs.world()
    answers = []
    for collective, kind, algorithm, numel in calls:
        seen = []
        for odd in range(w.world_size):
            size, dtype = numel, torch.float32
            if w.rank == odd:
                size, dtype = (numel + 1, dtype) if kind == "size" else (numel, torch.int32)
            try:
                if collective == "all_reduce":
                    gs.all_reduce(torch.ones(size, dtype=dtype), algorithm=algorithm)
                elif collective == "reduce_scatter":
                    gs.reduce_scatter(torch.ones(size, dtype=dtype))
                else:
                    gs.all_gather(torch.ones(4 + w.rank, dtype=dtype))
                seen.append((odd, "no error", ""))
            except Exception as exc:  # noqa: BLE001 - the error is the result
                seen.append((odd, type(exc).__name__, str(exc)))
        t = torch.full((numel,), float(w.rank + 1))
        gs.all_reduce(t, algorithm=algorithm)
        answers.append((seen, bool(torch.all(t == w.world_size * (w.world_size + 1) // 2))))
    return answers


def mismatch_across_the_split_bound(split_numel: int, direct_numel: int) -> list[bool]:
    """Every rank all-reduces ``split_numel`` float32 (the split all-reduce), then rank 1 alone
    ``direct_numel`` (the direct one) while the others repeat the split one: a mismatch every rank
    catches. Then a direct and a split all-reduce on every rank; returns whether each was right."""
    from gradsync.comm.agree import CollectiveMismatchError

    w = gs.world()
    gs.all_reduce(torch.ones(split_numel))
    try:
        gs.all_reduce(torch.ones(direct_numel if w.rank == 1 else split_numel))
    except CollectiveMismatchError:
        pass
    right = []
    for numel in (direct_numel, split_numel):
        t = torch.full((numel,), float(w.rank + 1))
        gs.all_reduce(t)
        right.append(bool(torch.all(t == sum(range(1, w.world_size + 1)))))
    return right


def mismatched_scatter_gather(kind: str):
    """Rank 1 passes int32 where the others pass float32 (all_gather: shard sizes may differ, dtypes not)."""
    dtype = torch.int32 if gs.world().rank == 1 else torch.float32
    if kind == "reduce_scatter":
        gs.reduce_scatter(torch.ones(12, dtype=dtype))
    else:
        gs.all_gather(torch.ones(4 + gs.world().rank, dtype=dtype))


def all_reduce_against_broadcast(numel: int):
    """Rank 1 broadcasts while the others all-reduce (a p2p algorithm against the shared-memory one)."""
    if gs.world().rank == 1:
        gs.broadcast(torch.ones(numel), src=0)
    else:
        gs.all_reduce(torch.ones(numel))


def any_source_case():
    """Rank 0 receives one message from every other rank without naming the sender."""
    from gradsync.comm.world_transport import default_transport
    w, transport = gs.world(), default_transport()
    if w.rank != 0:
        transport.isend(torch.full((3,), float(w.rank)), 0, "test/any").wait()
        return None
    seen = {}
    for _ in range(w.world_size - 1):
        buf = torch.empty(3)
        source = transport.irecv(buf, None, "test/any").wait()
        seen[source] = buf
    return seen, gs.traffic()["per_peer"]


def transport_kind() -> str:
    """The class of the transport this rank's collectives use."""
    from gradsync.comm.world_transport import default_transport
    return type(default_transport()).__name__


# --- every op x dtype x algorithm (test_collectives.py) -------------------------------------------

WIDE_BASE = {torch.float64: 2 ** 40, torch.float32: 2 ** 14, torch.float16: 2 ** 5, torch.bfloat16: 2 ** 3,
             torch.int64: 2 ** 33, torch.int32: 2 ** 17, torch.uint8: 4, torch.int8: 4}
"""B per dtype for wide_contribution: every sum over up to 8 ranks stays exact in the dtype, while the
values need more bits than the next narrower dtype has (float64 ones need > 24 mantissa bits, so a
float64 -> float32 downcast anywhere changes them; int64 ones need > 32 bits; float32 ones > 11)."""

FOLD = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum,
        "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
"""The single-process oracle: torch's own elementwise op for each reduce op."""

NATIVE = {"sum": "SUM", "avg": "AVG", "product": "PRODUCT", "max": "MAX", "min": "MIN", "band": "BAND",
          "bor": "BOR", "bxor": "BXOR"}


def wide_contribution(rank: int, numel: int, dtype: torch.dtype, op: str = "sum") -> torch.Tensor:
    """Rank r contributes (r+1)*B + (1 + i mod 3) at element i (B: WIDE_BASE); bool: (i + r) mod 3 == 0.
    Integers wrap around in int8/uint8 sums and products, identically in every implementation. A
    float16 product takes 1 + (r+1)/8 + (i mod 3)/32 instead: 32 x 64 x 96 is past float16's 65504
    already at N = 3, where every path would give inf and compare equal; these stay below 43 at N = 8."""
    i = torch.arange(numel)
    if dtype == torch.bool:
        return (i + rank) % 3 == 0
    if op == "product" and dtype == torch.float16:
        return (1 + (rank + 1) / 8 + (i % 3) / 32).to(dtype)
    return ((rank + 1) * WIDE_BASE[dtype] + 1 + i % 3).to(dtype)


def folded(world_size: int, numel: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """The reduction over every rank's wide_contribution, folded in rank order in one process; finite
    (an oracle of inf would pass any path that overflows too)."""
    acc = wide_contribution(0, numel, dtype, op)
    for rank in range(1, world_size):
        acc = FOLD[op](acc, wide_contribution(rank, numel, dtype, op))
    acc = acc.div(world_size) if op == "avg" else acc
    assert not dtype.is_floating_point or bool(torch.isfinite(acc).all()), f"{dtype} {op}: the fold overflowed"
    return acc


def product_rtol(dtype: torch.dtype, world_size: int) -> float:
    """How far two orders of N-1 float multiplications may drift apart: each rounds by up to eps/2."""
    return 2 * world_size * torch.finfo(dtype).eps


def _agrees(ours: torch.Tensor, reference: torch.Tensor, exact: bool, world_size: int) -> bool:
    if ours.dtype != reference.dtype or ours.shape != reference.shape:
        return False
    if exact:
        return torch.equal(ours, reference)
    return torch.allclose(ours.double(), reference.double(), rtol=product_rtol(ours.dtype, world_size), atol=0.0,
                          equal_nan=True)


def op_dtype_algorithm_cases(cases: list) -> list:
    """Run each (algorithm, dtype, op, numel) twice through gs.all_reduce and once through
    torch.distributed's gloo on the same input; compare with folded() and with gloo here and return,
    per case, (problem or None, digest of our result) so the test can check every rank agrees
    bit for bit without shipping the tensors back. Float products are compared within product_rtol
    (their rounding depends on the reduction order); everything else exactly."""
    import hashlib

    import torch.distributed as dist

    w = gs.world()
    answers = []
    for algorithm, dtype, op, numel in cases:
        exact = not (op == "product" and dtype.is_floating_point)
        closed = folded(w.world_size, numel, dtype, op)
        native = wide_contribution(w.rank, numel, dtype, op)
        if w.world_size > 1 and numel > 0:
            dist.all_reduce(native, op=getattr(dist.ReduceOp, NATIVE[op]))
        else:
            native = closed
        problem, results = None, []
        for call in range(2):  # twice in a row: both calls right
            t = wide_contribution(w.rank, numel, dtype, op)
            gs.all_reduce(t, op=op, algorithm=algorithm)
            results.append(t)
            if not _agrees(t, closed, exact, w.world_size):
                problem = f"call {call + 1} differs from the single-process fold"
            elif not _agrees(t, native, exact, w.world_size):
                problem = f"call {call + 1} differs from torch.distributed (gloo)"
        if not torch.equal(results[0], results[1]):
            problem = problem or "two calls on the same input differ"
        answers.append((problem, hashlib.sha1(results[0].view(torch.uint8).numpy().tobytes()).hexdigest()))
    return answers


def back_to_back_sums(sizes: list[int]) -> list:
    """All-reduce (sum, float32) one tensor of each size in ``sizes`` straight after the other, with
    nothing between the calls that waits for the other ranks, then compare each with folded(); per
    size, (problem or None, digest of our result)."""
    import hashlib

    w = gs.world()
    tensors = [wide_contribution(w.rank, numel, torch.float32) for numel in sizes]
    for t in tensors:
        gs.all_reduce(t)
    answers = []
    for numel, t in zip(sizes, tensors):
        good = _agrees(t, folded(w.world_size, numel, torch.float32, "sum"), True, w.world_size)
        answers.append((None if good else f"{numel} float32: differs from the single-process fold",
                        hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()))
    return answers


def segmented_case(numel: int, dtype: torch.dtype, op: str, segment_bytes: int):
    """Ring all-reduce and ring reduce-scatter + all-gather with ``segment_bytes`` on the wire, so one
    chunk crosses many segments (the pipelined path), against folded()."""
    from gradsync.comm.allreduce_ring import all_gather_ring, allreduce_ring, reduce_scatter_ring
    from gradsync.comm.reduce_ops import REDUCTIONS
    from gradsync.comm.world_transport import default_transport

    w, transport = gs.world(), default_transport()
    reduction = REDUCTIONS[op]
    t = wide_contribution(w.rank, numel, dtype, op)
    allreduce_ring(t, transport, reduction=reduction, segment_bytes=segment_bytes)
    halves = wide_contribution(w.rank, numel, dtype, op)
    chunks = reduce_scatter_ring(halves, transport, "test/segmented", segment_bytes, reduction.combine)
    reduction.finish(chunks.view(halves, w.rank), w.world_size)
    shard = chunks.view(halves, w.rank).clone()
    all_gather_ring(halves, chunks, transport, "test/segmented", segment_bytes)
    return t, shard, halves


def uneven_all_gather_case(sizes: list[int]) -> list:
    """gs.all_gather of shards of the given sizes (this rank's: sizes[rank]) twice, then once of a
    5-element shard; float64 values that name the rank and the position."""
    w = gs.world()
    shard = torch.arange(sizes[w.rank], dtype=torch.float64) + 1e9 * w.rank
    return [gs.all_gather(shard), gs.all_gather(shard * 2), gs.all_gather(torch.full((5,), float(w.rank)))]


def scatter_gather_closed_cases(cases: list) -> list:
    """For each (dtype, op, numel): gs.reduce_scatter then gs.all_gather, beside torch.distributed's
    all-reduce of the same input."""
    import torch.distributed as dist

    w = gs.world()
    answers = []
    for dtype, op, numel in cases:
        shard = gs.reduce_scatter(wide_contribution(w.rank, numel, dtype, op), op=op)
        full = gs.all_gather(shard)
        native = wide_contribution(w.rank, numel, dtype, op)
        if w.world_size > 1 and numel > 0:
            dist.all_reduce(native, op=getattr(dist.ReduceOp, NATIVE[op]))
        answers.append((shard, full, native))
    return answers


def repeated_small_traffic(numel: int, calls: int, counters_full: bool = False):
    """The same float32 shape all-reduced ``calls`` times (the first keeps a plan, the others run it;
    ``counters_full``: with the meter keeping no more call counters, so each call records itself):
    the meter read after each call, then read once more with no call in between; then one call
    not read before a reset, and a read after one more call. Returns (the reads after each call, the read with no call, the read
    after the reset and one call, whether every result was the closed form)."""
    from gradsync.observe import meter

    w = gs.world()
    expected = expected_sum(w.world_size, numel, torch.float32)
    reads, right = [], True
    kept = meter.MAX_TALLIES
    if counters_full:
        meter.MAX_TALLIES = len(meter.METER._tallies)
    gs.traffic_reset()
    for _ in range(calls):
        t = contribution(w.rank, numel, torch.float32)
        gs.all_reduce(t)
        right = right and torch.equal(t, expected)
        reads.append(gs.traffic())
    again = gs.traffic()
    for reset in (False, True):
        if reset:
            gs.traffic_reset()
        t = contribution(w.rank, numel, torch.float32)
        gs.all_reduce(t)
        right = right and torch.equal(t, expected)
    meter.MAX_TALLIES = kept
    return reads, again, gs.traffic(), right and torch.equal(t, expected)


# --- the hierarchical all-reduce's cross-host phase on one host (test_collectives.py) ---------------

class PretendHosts:
    """This rank's transport with ``hosts`` replaced: the hierarchical all-reduce then runs its rails
    (the cross-host all-reduce) between ranks that in fact share this host, so every op and dtype
    goes through that phase, which on one real host (a single group) is skipped."""

    def __init__(self, base, hosts: tuple) -> None:
        self._base, self.hosts = base, hosts

    def __getattr__(self, name):
        return getattr(self._base, name)


def hierarchical_over_pretend_hosts(hosts: tuple, cases: list) -> list:
    """gs.all_reduce's own path (collectives.all_reduce_in) with algorithm="hierarchical" over ``hosts``
    (a grouping of this world's ranks) for each (dtype, op, numel), against folded(); per case,
    (problem or None, digest). A grouping with unequal hosts gives its error as the problem."""
    import dataclasses
    import hashlib

    from gradsync.comm.collectives import Place, all_reduce_in
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    place = Place(dataclasses.replace(w, hosts=hosts), PretendHosts(default_transport(), hosts))
    answers = []
    for dtype, op, numel in cases:
        exact = not (op == "product" and dtype.is_floating_point)
        t = wide_contribution(w.rank, numel, dtype, op)
        try:
            all_reduce_in(place, t, op, "hierarchical")
        except RuntimeError as exc:
            answers.append((f"{type(exc).__name__}: {exc}", None))
            continue
        good = _agrees(t, folded(w.world_size, numel, dtype, op), exact, w.world_size)
        answers.append((None if good else "differs from the single-process fold",
                        hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()))
    return answers


def stall_records_after_each_entry(hosts: tuple) -> list:
    """Each collective entry point the backend and the strategies call (collectives.*_in), run once,
    then what the stall inspector holds for this rank: (entry, record) where None means back in user
    code. A record left behind makes an idle rank report a stall in an operation it has finished."""
    import dataclasses

    from gradsync.observe import stall
    from gradsync.comm.collectives import Place, all_gather_in, all_reduce_in, broadcast_in, here, reduce_scatter_in
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    pretend = Place(dataclasses.replace(w, hosts=hosts), PretendHosts(default_transport(), hosts))
    calls = [("all_reduce_in (first call)", lambda: all_reduce_in(here(), torch.ones(97), "sum", "auto")),
             ("all_reduce_in (its kept plan)", lambda: all_reduce_in(here(), torch.ones(97), "sum", "auto")),
             ("all_reduce_in (hierarchical)", lambda: all_reduce_in(pretend, torch.ones(97), "sum", "hierarchical")),
             ("reduce_scatter_in", lambda: reduce_scatter_in(here(), torch.ones(8 * w.world_size))),
             ("all_gather_in", lambda: all_gather_in(here(), torch.ones(8))),
             ("broadcast_in", lambda: broadcast_in(here(), torch.ones(8), 0))]
    records = []
    for name, call in calls:
        call()
        records.append((name, stall._NOW[0]))
    return records
