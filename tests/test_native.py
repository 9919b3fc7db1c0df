"""The native core (comm/transport/shm/native/) against a fold written here in torch, and against the
Python path it stands in for.

The oracle: every element of a shared-memory all-reduce is computed by a known fold in a known
order (allreduce_two_shot*.py): below the one-shot bound, in[0] (op) in[1] (op) ... in rank order;
above it, and in place, slice j of each piece (ring_chunks) by its owner j, its own first, then the
others in rank order. ``expected`` computes that with torch's own add / maximum / minimum / div; float16
and bfloat16 sums are added in float32 in that order and rounded once (avg: divided first), as the core
must. Both paths must equal it bit for bit
(NaN where it is NaN: NaN's payload bits are the one thing torch itself does not fix), every rank
must hold the same bits, and a second call must give the first's.

Worlds run with 32 KiB staging halves, so that the one-shot bound, the two-shot pieces and their
slices fall at sizes a test can afford; a world with the default halves runs the bands as shipped.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import native_fns
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.allreduce_in_place import IN_PLACE_FROM_BYTES, PIECE_BYTES
from world_pool import RankFailure, WorldPool

SMALL_HALVES = {"GRADSYNC_SHM_STAGE_MB": "0.03125"}   # 32 KiB
NATIVE_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
COMBOS = [(dtype, op) for dtype in NATIVE_DTYPES for op in ("sum", "avg", "max", "min")
          if dtype.is_floating_point or op != "avg"]
# two the core does not take: they run the Python path inside a world whose barriers are the core's
MIXED = [(torch.float64, "product"), (torch.int32, "bxor")]


def test_the_core_is_built_here():
    # every other test here compares the core with the Python path: without the core they would
    # compare the Python path with itself, so a missing build fails here, loudly
    if os.environ.get("GRADSYNC_NATIVE") == "0":
        pytest.skip("GRADSYNC_NATIVE=0: the Python path was asked for")
    from gradsync.comm.transport.shm.native import _core   # noqa: F401 - ImportError is the failure


def combine(acc: torch.Tensor, x: torch.Tensor, op: str) -> torch.Tensor:
    return {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum,
            "product": torch.mul, "bxor": torch.bitwise_xor}[op](acc, x)


def fold(inputs: list[torch.Tensor], order: list[int], op: str) -> torch.Tensor:
    if op in ("sum", "avg") and inputs[0].dtype in (torch.float16, torch.bfloat16):
        wide = sum((inputs[k].double().float() for k in order[1:]), inputs[order[0]].float())
        return (wide / len(inputs) if op == "avg" else wide).to(inputs[0].dtype)
    acc = combine(inputs[order[0]], inputs[order[1]], op)
    for k in order[2:]:
        acc = combine(acc, inputs[k], op)
    return acc / len(inputs) if op == "avg" else acc


def expected(inputs: list[torch.Tensor], op: str, one_shot_below: int, stage_bytes: int, in_place: bool):
    n_ranks, numel, size = len(inputs), inputs[0].numel(), inputs[0].element_size()
    out = torch.empty_like(inputs[0])
    if numel == 0:
        return out
    if not in_place and numel * size < one_shot_below:
        return fold(inputs, list(range(n_ranks)), op)
    owner_first = [[j] + [k for k in range(n_ranks) if k != j] for j in range(n_ranks)]
    region = numel if in_place else min(stage_bytes // n_ranks, PIECE_BYTES) // 64 * 64 // size
    piece = numel if in_place else n_ranks * region
    for start in range(0, numel, piece):
        length = min(piece, numel - start)
        chunks = ring_chunks(length, n_ranks)
        for j in range(n_ranks):
            at = slice(start + chunks.offsets[j], start + chunks.offsets[j] + chunks.sizes[j])
            out[at] = fold([x[at] for x in inputs], owner_first[j], op)
    return out


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, label
    if got.dtype.is_floating_point:
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan), f"{label}: NaN at other places"
        got, want = got[~nan], want[~nan]
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    differ = (got.view(as_int) != want.view(as_int)).nonzero()
    assert differ.numel() == 0, (f"{label}: {differ.numel()} elements differ, first at {differ[0].item()}: "
                                 f"{got[differ[0]].item()!r} against {want[differ[0]].item()!r}")


def check_batch(pool: WorldPool, batch: list[tuple], in_region: bool, path: str) -> None:
    bands = pool.run(native_fns.path_and_bands)
    assert {b[0] for b in bands} == {path}, bands
    _, one_shot_below, stage_bytes = bands[0]
    answers = pool.run(native_fns.all_reduce_cases, batch, in_region, case_timeout=300)
    for index, (case, dtype, op, numel) in enumerate(batch):
        inputs = [answers[rank][index][0] for rank in range(pool.n)]
        in_place = in_region and numel * inputs[0].element_size() >= IN_PLACE_FROM_BYTES
        want = expected(inputs, op, one_shot_below, stage_bytes, in_place)
        for rank in range(pool.n):
            label = f"{path} {dtype} op={op} n={numel} N={pool.n} rank {rank}"
            assert_same_bits(answers[rank][index][1], want, label)
            assert_same_bits(answers[rank][index][2], want, label + " (second call)")


case_settings = settings(max_examples=2, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.data_too_large])


def sizes(world_size: int):
    """Byte counts around each band's edges with 32 KiB halves (the one-shot bound is 32 KiB + 1, a
    two-shot piece N x (16 KiB or less)), every kind of small size, and a few pieces' worth. Drawn
    as bytes; each dtype's element count is that over its size, so sizes fall either side of the
    edges by dtype."""
    region = (32 << 10) // world_size // 64 * 64
    edges = [32 << 10, world_size * region, 2 * world_size * region, 3 * world_size * region]
    near = st.builds(lambda edge, offset: max(0, edge + offset), st.sampled_from(edges), st.integers(-24, 24))
    small = st.sampled_from([0, 8, 8 * (world_size - 1), 8 * (world_size + 1)])
    return st.one_of(near, small, st.integers(0, 5 * world_size * region))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3, *(pytest.param(n, marks=pytest.mark.slow) for n in (4, 8))])
def test_both_paths_equal_the_fold_across_the_bands(world_of, world_size):
    combos = COMBOS + MIXED
    pools = {"native": world_of(world_size, **SMALL_HALVES),
             "python": world_of(world_size, GRADSYNC_NATIVE="0", **SMALL_HALVES)}

    @seed(world_size)
    @case_settings
    @given(nbytes=st.lists(sizes(world_size), min_size=len(combos), max_size=len(combos)))
    def check(nbytes):
        batch = [(case, dtype, op, count // dtype.itemsize)
                 for case, ((dtype, op), count) in enumerate(zip(combos, nbytes))]
        for path, pool in pools.items():
            check_batch(pool, batch, False, path)

    check()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])   # 2 ranks: the test above
def test_both_paths_equal_the_fold_with_the_bands_as_shipped_and_in_place(world_of, world_size):
    # default 4 MiB halves: one-shot up to 2 MiB (N=2) or 512 KiB (N=3), two-shot above; and tensors
    # in shared regions (DDP's buckets), reduced where they lie from 256 KiB up
    for path, env in (("native", {}), ("python", {"GRADSYNC_NATIVE": "0"})):
        pool = world_of(world_size, **env)
        batch = [(1, torch.float32, "sum", 300_000), (2, torch.bfloat16, "avg", 1_500_001),
                 (3, torch.float64, "max", 700_001), (4, torch.float16, "sum", 5_000_003)]
        check_batch(pool, batch, False, path)
        region_batch = [(5, torch.float32, "sum", 70_001), (6, torch.bfloat16, "sum", 400_003),
                        (7, torch.float64, "min", 40_000), (8, torch.float32, "avg", 1_000_000)]
        check_batch(pool, region_batch, True, path)


@pytest.mark.timeout(120)
def test_the_python_path_runs_where_the_extension_is_absent(tmp_path):
    # the package as a machine without a C compiler installs it: every file but the built core
    source = Path(__file__).resolve().parent.parent / "src" / "gradsync"
    shutil.copytree(source, tmp_path / "gradsync", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    script = ("import torch, gradsync as gs\n"
              "def job():\n"
              "    from gradsync.comm.world_transport import default_transport\n"
              "    t = torch.full((1000,), float(gs.world().rank + 1))\n"
              "    gs.all_reduce(t)\n"
              "    return default_transport().core is None, t.tolist()\n"
              "if __name__ == '__main__':\n"
              "    print(gs.spawn(job, nprocs=3))\n")
    (tmp_path / "job.py").write_text(script)   # a file: the spawned ranks import the job from it
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("GRADSYNC_NATIVE", None)
    done = subprocess.run([sys.executable, str(tmp_path / "job.py")], env=env, capture_output=True, text=True,
                          timeout=100, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    results = eval(done.stdout.strip().splitlines()[-1])   # the script's own print of plain values
    assert results == [(True, [6.0] * 1000)] * 3
    notices = [line for line in done.stderr.splitlines() if "the Python path runs" in line]
    assert len(notices) == 1 and "native core is not built" in notices[0], done.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize("victim", [0, 1, 2])
def test_a_rank_killed_while_the_others_wait_in_the_core_is_named_within_a_second(tmp_path, victim):
    pool = WorldPool(3, timeout=30.0)
    report = str(tmp_path / "killed")
    try:
        with pytest.raises(RankFailure):
            pool.run(native_fns.killed_while_waiting_in_the_core, victim, report, case_timeout=60)
    finally:
        pool.close()
    for rank in {0, 1, 2} - {victim}:
        seconds, error = json.loads(Path(f"{report}.{rank}").read_text())
        assert f"rank {victim}" in error and "exited" in error and "all_reduce" in error, error
        assert seconds < 1.0, (rank, seconds, error)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_the_core_holds_its_thread_on_the_ranks_own_core_and_gives_it_back(world_of, n):
    # as test_shm's Python-path test: pinned to its own core once it sleeps in the core's barrier
    # (a late peer), at every size (with the core, 4 MiB is held too: place.holds), its
    # affinity as before after every call
    cores = sorted(os.sched_getaffinity(0))
    for rank, (own_core, before, seen) in enumerate(world_of(n).run(native_fns.affinity_while_in_the_core)):
        assert before == cores and own_core == cores[rank % len(cores)]
        for name, samples, after in seen:
            assert after == cores, (rank, name, after)
            assert all(s in (cores, [own_core]) for s in samples), (rank, name, samples)
            if name in ("late peer", "4 MiB") and rank != n - 1:
                assert [own_core] in samples, (rank, name, samples)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size", [2, 3])
def test_reduce_scatter_and_all_gather_equal_the_fold_on_both_paths(world_of, world_size):
    # shard r is chunk r of the fold with its owner first (the in-place layout of ``expected``), and
    # the all-gather puts the shards back in rank order. Plain inputs take the staged reduce-scatter
    # (over several 32 KiB halves; single-copy reads off, which the core does not run); inputs in a
    # shared region of 256 KiB or more the in-place one, and the all-gather in place
    env = {**SMALL_HALVES, "GRADSYNC_SHM_SINGLE_COPY": "0"}
    plain = [(11, torch.float32, "sum", 0), (12, torch.bfloat16, "avg", 3), (13, torch.float64, "max", 20_011),
             (14, torch.int32, "sum", 100_003), (15, torch.float16, "min", 40_000)]
    in_region = [(16, torch.float32, "avg", 70_001), (17, torch.float64, "sum", 40_000),
                 (18, torch.bfloat16, "max", 200_003)]
    for path, pool in (("native", world_of(world_size, **env)),
                       ("python", world_of(world_size, GRADSYNC_NATIVE="0", **env))):
        assert {b[0] for b in pool.run(native_fns.path_and_bands)} == {path}
        for batch, region in ((plain, False), (in_region, True)):
            answers = pool.run(native_fns.scatter_gather_cases, batch, region, case_timeout=300)
            for index, (case, dtype, op, numel) in enumerate(batch):
                inputs = [answers[rank][index][0] for rank in range(world_size)]
                want = expected(inputs, op, 0, 0, in_place=True)
                chunks = ring_chunks(numel, world_size)
                for rank in range(world_size):
                    label = f"{path} {dtype} op={op} n={numel} N={world_size} rank {rank}"
                    _, shard, full, shard_again, full_again = answers[rank][index]
                    assert_same_bits(shard, chunks.view(want, rank), label + " shard")
                    assert_same_bits(shard_again, chunks.view(want, rank), label + " shard, second call")
                    assert_same_bits(full, want, label + " gathered")
                    assert_same_bits(full_again, want, label + " gathered, second call")
