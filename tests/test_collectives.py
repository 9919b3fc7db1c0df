"""Every algorithm against torch.distributed's own result and a closed form, N = 1..8.

One world per N (see world_pool.py); hypothesis draws the cases inside it.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cases

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
ALGORITHMS = ["ring", "halving_doubling", "tree", "naive", "native", "auto", "hierarchical"]
WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]

case_settings = settings(max_examples=25, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.function_scoped_fixture])


def sizes(world_size: int):
    # 0, 1, fewer than N, not divisible by N, and larger sizes that cross several ring segments
    return st.one_of(st.sampled_from([0, 1, max(world_size - 1, 0), world_size + 1]),
                     st.integers(0, 3000))


TRANSPORTS = {"auto": {},                                          # shared memory on this host
              "tcp": {"GRADSYNC_TRANSPORT": "tcp"},                  # torch.distributed for every peer
              "tiny-rings": {"GRADSYNC_SHM_RING_MB": "0.002"}}       # 2 KiB rings: messages stream and wrap
SETUPS = ([(n, "auto") for n in WORLD_SIZES] + [(n, "tcp") for n in (2, 3, 5)]
          + [(n, "tiny-rings") for n in (2, 4)])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size,transport", SETUPS)
def test_all_reduce_matches_torch_and_closed_form(world_of, world_size, transport):
    pool = world_of(world_size, **TRANSPORTS[transport])
    expected_kind = "TorchTransport" if transport == "tcp" or world_size == 1 else "ShmTransport"
    assert pool.run(cases.transport_kind) == [expected_kind] * world_size

    algorithms = ALGORITHMS + ([] if expected_kind == "TorchTransport" and world_size > 1 else ["shared_memory"])

    @case_settings
    @given(numel=sizes(world_size), dtype=st.sampled_from(DTYPES),
           algorithm=st.sampled_from(algorithms), op=st.sampled_from(["sum", "avg"]))
    def check(numel, dtype, algorithm, op):
        if op == "avg" and not dtype.is_floating_point:
            op = "sum"
        results = pool.run(cases.all_reduce_case, numel, dtype, op, algorithm)
        closed = cases.expected_sum(world_size, numel, dtype)
        if op == "avg":
            closed = closed / world_size
        first_rank = results[0][0][0]
        for ours, reference in results:
            for t in ours:  # called twice in a row: both calls right
                assert t.dtype == dtype and t.shape == (numel,)
                assert torch.equal(t, reference), f"{algorithm}: differs from torch.distributed"
                assert torch.equal(t, closed), f"{algorithm}: differs from the closed form"
                assert torch.equal(t, first_rank), "ranks disagree: replicas would diverge"

    check()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_reduce_scatter_then_all_gather_is_all_reduce(world_of, world_size):
    pool = world_of(world_size)

    @case_settings
    @given(numel=sizes(world_size), dtype=st.sampled_from(DTYPES), op=st.sampled_from(["sum", "avg"]))
    def check(numel, dtype, op):
        if op == "avg" and not dtype.is_floating_point:
            op = "sum"
        results = pool.run(cases.scatter_gather_case, numel, dtype, op)
        base, extra = divmod(numel, world_size)
        for rank, (shard_numel, full, again, direct) in enumerate(results):
            assert shard_numel == base + (1 if rank < extra else 0), "documented piece size"
            assert torch.equal(full, direct) and torch.equal(again, direct)

    check()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4, 7])
def test_broadcast_any_source_and_non_contiguous(world_of, world_size):
    pool = world_of(world_size)
    for src in range(world_size):
        for transpose in (False, True):
            results = pool.run(cases.broadcast_case, (3, 5), src, transpose)
            expected = torch.full((3, 5), float(src)) + torch.arange(5)
            if transpose:
                expected = expected.t()
            for t in results:
                assert torch.equal(t, expected)
