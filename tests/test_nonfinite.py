"""NaN and +-inf through every reduce op, algorithm and shared-memory size band, the reduce-scatter
paths and the "gradsync" torch.distributed backend, against a single-process fold with torch's own
elementwise ops and against torch.distributed's gloo on the same inputs (nonfinite_cases.py says
what each contributes and where gloo is an oracle), bit-identical on every rank.

Every element of an input follows one of a fixed table of scenarios (a NaN on the first, a middle or
the last rank; +inf or -inf on each rank; +inf meeting -inf; 0 meeting inf; ...), repeated along the
tensor, so each scenario lands in every chunk, piece and size band. Nothing is drawn: the sizes
are chosen at each band's edges.

``check_nonfinite(pool, world_size, env, shared_memory)`` runs every case on one world: a setup here
is a world size and the environment its ranks start with (SETUPS), so another path selected by an
environment variable set before the ranks start is one more entry there.
"""

import pytest
import torch

import cases
import nonfinite_cases as nf
import doc_claims
from gradsync.comm.allreduce_in_place import IN_PLACE_FROM_BYTES
from gradsync.comm.transport.shm.single_copy import FROM_BYTES

ALGORITHMS = ["ring", "halving_doubling", "tree", "naive", "native", "auto", "hierarchical"]
TINY_STAGE_MB = "0.004"

SETUPS = {   # name: (world size, environment of every rank, every rank on one host over shared memory)
    "shm-3": (3, {}, True),
    # 2 KiB rings and 4 KiB staging halves: the split all-reduce from 4 KiB, in many pieces
    "shm-4-tiny": (4, {"GRADSYNC_SHM_RING_MB": "0.002", "GRADSYNC_SHM_STAGE_MB": TINY_STAGE_MB}, True),
    "tcp-3": (3, {"GRADSYNC_TRANSPORT": "tcp"}, False),
    "shm-2": (2, {}, True),
    # the shared-memory collectives' Python path, where the native core runs the others
    "shm-3-python": (3, {"GRADSYNC_NATIVE": "0"}, True),
}


def bands(world_size: int, env: dict, itemsize: int) -> list[int]:
    """Element counts at the shared-memory all-reduce's edges: 1 (fewer than N) and 97 (every
    scenario, some twice; not divisible by N: the direct all-reduce); just over the direct/split bound
    docs/transports.md states (capped at one staging half), not divisible by N either."""
    stage = int(float(env.get("GRADSYNC_SHM_STAGE_MB", "0")) * (1 << 20)) or None
    bound = doc_claims.direct_below(world_size) if stage is None else min(doc_claims.direct_below(world_size),
                                                                            stage + 1)
    return [1, 97, -(-bound // itemsize) + 2 * world_size + 1]


def assert_answers(answers: list, batch: list, world_size: int, what: str) -> None:
    for index, case in enumerate(batch):
        label = f"{what} {case} N={world_size}"
        problems = [(rank, answers[rank][index][0]) for rank in range(world_size) if answers[rank][index][0]]
        assert not problems, f"{label}: rank {problems[0][0]}'s result {problems[0][1]}"
        assert len({answers[rank][index][1] for rank in range(world_size)}) == 1, f"{label}: ranks disagree bit for bit"


def check_nonfinite(pool, world_size: int, env: dict, shared_memory: bool) -> None:
    """Every floating dtype and op through every algorithm at the size bands, through the in-place
    all-reduce and reduce-scatter of a tensor in a shared region (shared memory only), the
    reduce-scatter and all-gather (staged, and read where it lies from single_copy.FROM_BYTES), the
    "gradsync" backend's all_reduce and reduce_scatter_tensor, and with 4 ranks the hierarchical
    all-reduce across pretended hosts."""
    algorithms = ALGORITHMS + (["shared_memory"] if shared_memory else [])
    # over TCP the algorithms combine with the same torch ops as on shared memory, where every dtype
    # runs: there a 4-byte and a 2-byte one
    dtypes = nf.FLOATING if shared_memory else (torch.float32, torch.bfloat16)
    batch = []
    for dtype in dtypes:
        for op in nf.FLOAT_OPS:
            sizes = bands(world_size, env, dtype.itemsize)
            batch += [(algorithm, dtype, op, numel, False) for algorithm in algorithms for numel in sizes[:2]]
            # past the direct/split bound: the split shared-memory all-reduce, and the ring beside it
            batch += [(algorithm, dtype, op, sizes[2], False)
                      for algorithm in (["shared_memory", "ring"] if shared_memory else ["ring", "auto"])]
            if shared_memory:   # in a shared region: in place from IN_PLACE_FROM_BYTES, direct below it
                batch += [("shared_memory", dtype, op, IN_PLACE_FROM_BYTES // dtype.itemsize + 2 * world_size + 1,
                           True), ("auto", dtype, op, 97, True)]
    assert_answers(pool.run(nf.all_reduce_cases, batch, case_timeout=600), batch, world_size, "all_reduce")

    batch = []
    for dtype in dtypes:
        for op in nf.FLOAT_OPS:
            # large: read where it lies from single_copy.FROM_BYTES; with tiny staging halves, staged in
            # many pieces instead (the single-copy path is the same whatever the halves)
            large = (bands(world_size, env, dtype.itemsize)[2] if "GRADSYNC_SHM_STAGE_MB" in env
                     else FROM_BYTES // dtype.itemsize + 2 * world_size + 1)
            batch += [(dtype, op, numel, False) for numel in (1, world_size + 1, 97, large)]
            if shared_memory:
                batch.append((dtype, op, IN_PLACE_FROM_BYTES // dtype.itemsize + 2 * world_size + 1, True))
    assert_answers(pool.run(nf.scatter_gather_cases, batch, case_timeout=600), batch, world_size,
                   "reduce_scatter + all_gather")

    batch = [(dtype, op, numel) for dtype in nf.FLOATING for op in nf.FLOAT_OPS for numel in (1, 97)]
    batch += [(torch.float32, op, bands(world_size, env, 4)[2] // world_size + 1) for op in nf.FLOAT_OPS]
    assert_answers(pool.run(nf.backend_cases, batch, case_timeout=600), batch, world_size, "gradsync backend")

    if world_size == 4:   # the hierarchical all-reduce's cross-host phase, over 2 pretended hosts of 2
        batch = [(dtype, op, numel) for dtype in nf.FLOATING for op in nf.FLOAT_OPS for numel in (1, 97)]
        for hosts in (((0, 1), (2, 3)), ((0, 2), (1, 3))):
            assert_answers(pool.run(nf.hierarchical_cases, hosts, batch), batch, world_size, f"hierarchical on {hosts}")


@pytest.mark.timeout(600)
# with -m slow: tiny rings (test_collectives.py runs every op through them), the Python path (test_collectives.py's
# [3-python] runs every op through it) and a world of 2
@pytest.mark.parametrize("setup", ["shm-3", "tcp-3",
                                   *(pytest.param(s, marks=pytest.mark.slow) for s in ("shm-4-tiny", "shm-3-python",
                                                                                      "shm-2"))])
def test_nan_and_inf_through_every_op_algorithm_and_path_match_torch_and_gloo(world_of, setup):
    world_size, env, shared_memory = SETUPS[setup]
    pool = world_of(world_size, **env)
    kind = pool.run(cases.transport_kind)
    assert kind == ["ShmTransport" if shared_memory else "TorchTransport"] * world_size, kind
    check_nonfinite(pool, world_size, env, shared_memory)


def test_the_scenarios_put_a_nan_on_the_first_a_middle_and_the_last_rank():
    """The table itself (N=3, one element per scenario, float32): scenario k < N is a NaN on rank k
    alone, and each op's fold gives what IEEE arithmetic and torch.maximum/minimum say."""
    world_size = 3
    table = nf.scenarios(world_size)
    for rank in range(world_size):
        assert list(table[rank]) == [rank] and torch.isnan(torch.tensor(table[rank][rank]))
    folds = {op: nf.nonfinite_fold(world_size, len(table), torch.float32, op) for op in nf.FLOAT_OPS}
    for rank in range(world_size):
        for op in nf.FLOAT_OPS:
            assert torch.isnan(folds[op][rank]), f"a NaN on rank {rank} must survive {op}"
    opposite = next(k for k, s in enumerate(table) if s.get(0) == nf.INF and s.get(world_size - 1) == -nf.INF)
    assert torch.isnan(folds["sum"][opposite]) and folds["max"][opposite] == nf.INF
    assert folds["min"][opposite] == -nf.INF
    zero_times_inf = next(k for k, s in enumerate(table) if s.get(0) == 0.0)
    assert torch.isnan(folds["product"][zero_times_inf])
    assert bool(torch.isfinite(folds["sum"][table.index({})]))
