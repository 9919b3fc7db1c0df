"""float16 and bfloat16 sums travel narrow and are added in float32, rounded once (comm/reduce_ops.py).

The oracle: every rank's input is drawn from its seed (half_sum_fns.wire_values), so the test adds the
N inputs exactly, in float64, and measures each result's distance from that in units of the last
place of the narrow dtype at the exact value. One rounding of the result is at most half a unit, so
the 99th percentile over the elements must be at most 0.5, at every N; a running sum rounded after
every add (gloo's, and GRADSYNC_HALF_SUM=narrow here) drifts further as N grows (p99 8 units at N=4
on these inputs). The bytes each rank sends and receives are the closed forms of the band each call
takes, at the narrow dtype's size: nothing wider goes on the wire.

Both paths run: the native core and the Python path (GRADSYNC_NATIVE=0), in worlds of their own.
"""

import pytest
import torch

import half_sum_fns
from gradsync.comm.allreduce_two_shot import DIRECT_BELOW_BYTES, DIRECT_BELOW_BYTES_BY_RANKS
from gradsync.comm.allreduce_in_place import IN_PLACE_FROM_BYTES

SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}
PATHS = {"native": {}, "python": {"GRADSYNC_NATIVE": "0"}}
SMALL, LARGE = 64 << 10, 512 << 10   # elements: 128 KiB (the direct band at every N), 1 MiB (split, in place)


def ulps(result: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """|result - exact| in units of ``dtype``'s spacing at ``exact`` (2^(e - p) for exact = m 2^e,
    1/2 <= |m| < 1, p significand bits; the subnormal spacing below the normal range)."""
    p = SIGNIFICAND_BITS[dtype]
    _, exponent = torch.frexp(exact)
    spacing = torch.ldexp(torch.ones_like(exact), exponent - p)
    spacing = spacing.clamp(min=torch.finfo(dtype).smallest_normal * 2.0 ** (1 - p))
    return (result.double() - exact).abs() / spacing


def p99(values: torch.Tensor) -> float:
    return float(torch.quantile(values, 0.99))


def band_bytes(world_size: int, nbytes: int, algorithm: str, in_region: bool, rank: int) -> tuple[int, int]:
    """(sent, received) by ``rank`` in one all-reduce of ``nbytes`` (divisible by N): the direct
    shared-memory band reads every other rank's whole tensor, the split and in-place ones and the
    ring 2(N-1)/N of it, naive gathers to rank 0."""
    n = world_size
    if algorithm == "naive":
        return ((n - 1) * nbytes,) * 2 if rank == 0 else (nbytes, nbytes)
    direct = DIRECT_BELOW_BYTES_BY_RANKS.get(n, DIRECT_BELOW_BYTES)
    if algorithm == "auto" and nbytes < direct and not (in_region and nbytes >= IN_PLACE_FROM_BYTES):
        return ((n - 1) * nbytes,) * 2
    return (2 * (n - 1) * nbytes // n,) * 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 4, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("path", list(PATHS))
def test_half_all_reduce_is_one_rounding_of_the_exact_sum_and_sends_narrow_bytes(world_of, world_size, path):
    bf16, fp16 = torch.bfloat16, torch.float16
    cases = [(0, bf16, "sum", SMALL, "auto", False), (1, bf16, "sum", LARGE, "auto", False),
             (2, bf16, "sum", LARGE, "auto", True), (3, fp16, "sum", SMALL, "auto", False),
             (4, bf16, "avg", SMALL, "auto", False), (5, fp16, "avg", LARGE, "auto", True),
             (6, bf16, "sum", SMALL, "ring", False), (7, bf16, "avg", SMALL, "naive", False)]
    answers = world_of(world_size, **PATHS[path]).run(half_sum_fns.all_reduced, cases, case_timeout=300)
    for index, (case, dtype, op, numel, algorithm, in_region) in enumerate(cases):
        label = f"{path} N={world_size} {dtype} {op} {numel} elements, {algorithm}{' in a region' if in_region else ''}"
        exact = sum(half_sum_fns.wire_values(r, numel, dtype, case).double() for r in range(world_size))
        exact = exact / world_size if op == "avg" else exact
        result = answers[0][index][0]
        assert result.dtype == dtype, label
        error = p99(ulps(result, exact, dtype))
        assert error <= 0.5, f"{label}: p99 {error:.2f} units in the last place, more than one rounding"
        for rank in range(world_size):
            assert torch.equal(answers[rank][index][0].view(torch.int16), result.view(torch.int16)), \
                f"{label}: rank {rank} differs from rank 0"
            sent, received = answers[rank][index][1:]
            assert (sent, received) == band_bytes(world_size, numel * 2, algorithm, in_region, rank), \
                f"{label}: rank {rank} sent {sent} and received {received} bytes"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", list(PATHS))
def test_compression_and_mixed_precision_hooks_round_the_sum_once(world_of, path):
    """fp16_compress and bf16_compress send x / N rounded to the narrow dtype; their result is one
    rounding of the exact sum of what was sent. Mixed precision's reduce_in_dtype sends x rounded to
    bfloat16; its result is one rounding of the exact average of that."""
    world_size = 4
    cases = [(0, "bf16", SMALL, "auto"), (1, "fp16", SMALL, "auto"), (2, "bf16", SMALL, "ring"),
             (3, "mixed-bf16", LARGE, "auto")]
    answers = world_of(world_size, **PATHS[path]).run(half_sum_fns.hook_reduced, cases, case_timeout=300)
    for index, (case, hook, numel, algorithm) in enumerate(cases):
        dtype = torch.float16 if hook == "fp16" else torch.bfloat16
        local = [(half_sum_fns.wire_values(r, numel, torch.float64, case) * 10).float() for r in range(world_size)]
        if hook == "mixed-bf16":
            exact = sum(x.to(dtype).double() for x in local) / world_size
        else:
            exact = sum((x / world_size).to(dtype).double() for x in local)
        for rank in range(world_size):
            error = p99(ulps(answers[rank][index], exact, dtype))
            assert error <= 0.5, f"{path} {hook} {algorithm} rank {rank}: p99 {error:.2f} units in the last place"
