"""Every op x dtype x algorithm against torch.distributed's own result and a single-process fold,
N = 1..8, bit-identical on every rank.

One world per setup (see world_pool.py). The explicit product of algorithm, dtype and op (every
pair an op applies to) runs at every N; hypothesis draws one size per case from 0, 1, N-1, N+1 and
0..3000, seeded by N, so each world size sees its own sizes (the same ones on every run). Values are
built so a narrower dtype cannot hold them (cases.WIDE_BASE): a float64 -> float32 or int64 ->
int32 downcast anywhere on the path fails. The pipelined multi-segment path is exercised apart,
with 64-byte segments, since public calls below 1 MiB never cross a segment.
"""

from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

import cases
from gradsync.comm.allreduce_ring import ring_chunks
from gradsync.comm.reduce_ops import DTYPES, REDUCTIONS

ALGORITHMS = ["ring", "halving_doubling", "tree", "naive", "native", "auto", "hierarchical"]
WORLD_SIZES = [1, 2, 3, 4, 5, 6, 7, 8]
FLOATING = [d for d in DTYPES if d.is_floating_point]
assert len(DTYPES) == 9  # float32, float64, float16, bfloat16, int32, int64, bool, uint8, int8


def applicable_ops(dtype: torch.dtype) -> list[str]:
    """Every op gloo takes on this dtype: avg only on floating dtypes, bitwise ops only on the others."""
    return [op for op, r in REDUCTIONS.items()
            if not (r.average and not dtype.is_floating_point) and not (r.bitwise and dtype.is_floating_point)]


def product(algorithms: list[str]) -> list[tuple]:
    return [(algorithm, dtype, op) for algorithm in algorithms for dtype in DTYPES for op in applicable_ops(dtype)]


# No shrinking: one example is a whole batch of cases, and the failing case is named in the message.
# Each test seeds hypothesis with the world size (@seed), so every N draws its own sizes, the same
# on every run.
case_settings = settings(max_examples=2, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate],
                         suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                HealthCheck.data_too_large])


def sizes(world_size: int):
    # 0, 1, fewer than N, not divisible by N, and up to 3000 elements (several chunks per rank)
    return st.one_of(st.sampled_from([0, 1, max(world_size - 1, 0), world_size + 1]), st.integers(0, 3000))


TRANSPORTS = {"auto": {},                                          # shared memory on this host
              "tcp": {"GRADSYNC_TRANSPORT": "tcp"},                  # torch.distributed for every peer
              # 2 KiB rings: messages stream and wrap; 4 KiB staging halves: the shared-memory all-reduce
              # splits what does not fit one half into pieces (allreduce_two_shot.py), the rest is direct
              "tiny-rings": {"GRADSYNC_SHM_RING_MB": "0.002", "GRADSYNC_SHM_STAGE_MB": "0.004"},
              # the shared-memory collectives' Python path, where the native core runs the others
              "python": {"GRADSYNC_NATIVE": "0"},
              "tiny-rings-python": {"GRADSYNC_SHM_RING_MB": "0.002", "GRADSYNC_SHM_STAGE_MB": "0.004",
                                    "GRADSYNC_NATIVE": "0"}}
SETUPS = ([(n, "auto") if n not in (5, 6, 7, 8) else pytest.param(n, "auto", marks=pytest.mark.slow)
           for n in WORLD_SIZES]
          + [(2, "tcp"), (3, "tcp"), pytest.param(5, "tcp", marks=pytest.mark.slow)]
          + [(n, "tiny-rings") for n in (2, 4)]
          + [(2, "python"), (3, "python"), pytest.param(4, "tiny-rings-python", marks=pytest.mark.slow)])
"""N = 5 to 8 on shared memory (larger worlds than 4, which also puts two ranks on a core here),
N = 5 over TCP (odd, as 3), and the Python path through tiny rings (the native one runs them, the
Python one runs N = 2 and 3), run with -m slow."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world_size,transport", SETUPS)
def test_every_op_dtype_and_algorithm_matches_torch_and_a_single_process_fold(world_of, world_size, transport):
    pool = world_of(world_size, **TRANSPORTS[transport])
    expected_kind = "TorchTransport" if transport == "tcp" or world_size == 1 else "ShmTransport"
    assert pool.run(cases.transport_kind) == [expected_kind] * world_size
    algorithms = ALGORITHMS + ([] if expected_kind == "TorchTransport" and world_size > 1 else ["shared_memory"])
    combos = product(algorithms)

    @seed(world_size)
    @case_settings
    @given(numels=st.lists(sizes(world_size), min_size=len(combos), max_size=len(combos)))
    def check(numels):
        batch = [(*combo, numel) for combo, numel in zip(combos, numels)]
        answers = pool.run(cases.op_dtype_algorithm_cases, batch, case_timeout=600)
        for index, (algorithm, dtype, op, numel) in enumerate(batch):
            label = f"{algorithm} {dtype} op={op} n={numel} N={world_size}"
            problems = [answers[rank][index][0] for rank in range(world_size) if answers[rank][index][0]]
            assert not problems, f"{label}: {problems[0]}"
            digests = {answers[rank][index][1] for rank in range(world_size)}
            assert len(digests) == 1, f"{label}: ranks disagree bit for bit: replicas would diverge"

    check()


# From docs/transports.md's direct/split bound up (doc_claims.py: a bound per world size, and at most
# one staging half) a tensor outside a shared region is staged slice by slice (allreduce_two_shot.py);
# the direct all-reduce takes everything below (test_traffic.py checks which path runs on each side). With staging halves of 256 KiB (N=3): every dtype and op
# just over the bound, sizes not divisible by N, and one that spans 2.5 halves (its last piece short).
# With the default halves: float32 just over the bound and over 2.5 halves. Against the fold, gloo and
# across ranks bit for bit. Then sizes on both sides of the bound back to back, with nothing between
# the calls that waits for the other ranks: a split may stage into the half it used last only when
# the call before it was a split too (ShmTransport.split_half; the test fails when it always may).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,stage_mb", [(2, None), (3, None), pytest.param(4, None, marks=pytest.mark.slow),
                                                 (3, "0.25")])
def test_large_shared_memory_all_reduce_staged(world_of, world_size, stage_mb):
    import doc_claims
    from gradsync.comm.transport.shm.segment import stage_bytes

    env = {} if stage_mb is None else {"GRADSYNC_SHM_STAGE_MB": stage_mb}
    pool = world_of(world_size, **env)
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        half = stage_bytes()
    bound = min(doc_claims.direct_below(world_size), half + 1)
    dtypes = DTYPES if stage_mb is not None else (torch.float32,)
    batch = [("shared_memory", dtype, op, -(-bound // dtype.itemsize) + 2 * world_size + 1)
             for dtype in dtypes for op in (applicable_ops(dtype) if stage_mb is not None else ["sum"])]
    batch.append(("shared_memory", torch.float32, "sum", 5 * half // 8 + 3))
    answers = pool.run(cases.op_dtype_algorithm_cases, batch, case_timeout=300)
    for index, (algorithm, dtype, op, numel) in enumerate(batch):
        label = f"{dtype} op={op} n={numel} N={world_size} stage={half}"
        problems = [answers[rank][index][0] for rank in range(world_size) if answers[rank][index][0]]
        assert not problems, f"{label}: {problems[0]}"
        assert len({answers[rank][index][1] for rank in range(world_size)}) == 1, f"{label}: ranks disagree"
    small, over = bound // 4 - 1, bound // 4 + 1
    sizes = [over, over, small, over, 100, 5 * half // 8 + 3, small, 5 * half // 8 + 3, 7, over, over]
    answers = pool.run(cases.back_to_back_sums, sizes, case_timeout=300)
    for index, numel in enumerate(sizes):
        problems = [answers[rank][index][0] for rank in range(world_size) if answers[rank][index][0]]
        assert not problems, f"call {index} of the sequence, N={world_size}: {problems[0]}"
        assert len({answers[rank][index][1] for rank in range(world_size)}) == 1, f"call {index}: ranks disagree"


# The same for reduce-scatter and all-gather: a reduce-scatter input of FROM_BYTES or more is
# read chunk by chunk where it lies (reduce_scatter_single_copy.py); an all-gather shard that large is
# read where it lies and a smaller one through staging, each owner choosing for its own shard
# (all_gather_single_copy.py): the first size gives every rank a large shard, the second only a
# large input; the uneven case mixes large, small and empty shards in one call.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,single_copy", [(2, "1"), (4, "1"), (3, "0")])
def test_large_reduce_scatter_and_all_gather_single_copy_and_staged(world_of, world_size, single_copy):
    import shm_fns
    from gradsync.comm.transport.shm.single_copy import FROM_BYTES

    pool = world_of(world_size, **({} if single_copy == "1" else {"GRADSYNC_SHM_SINGLE_COPY": "0"}))
    states = pool.run(shm_fns.single_copy_state)
    refused = [why for on, why in states if not on and why and any(
        words in why for words in ("Operation not permitted", "Function not implemented", "not available"))]
    if single_copy == "1" and refused:   # the documented fallback: the set-up probe found the kernel refusing
        pytest.skip(f"the kernel refuses process_vm_readv here, so the ranks stage: {refused[0]}")
    assert [on for on, _ in states] == [single_copy == "1"] * world_size, states
    batch = []
    for dtype in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
        elements = FROM_BYTES // dtype.itemsize
        for op in applicable_ops(dtype)[:3]:
            batch += [(dtype, op, world_size * (elements + 2) + 1), (dtype, op, elements + 2 * world_size + 1)]
    answers = pool.run(cases.scatter_gather_closed_cases, batch, case_timeout=300)
    for index, (dtype, op, numel) in enumerate(batch):
        closed = cases.folded(world_size, numel, dtype, op)
        exact = not (op == "product" and dtype.is_floating_point)
        rtol = cases.product_rtol(dtype, world_size) if not exact else 0.0
        chunks = ring_chunks(numel, world_size)
        for rank in range(world_size):
            shard, full, native = answers[rank][index]
            label = f"{dtype} op={op} n={numel} N={world_size} rank {rank} single_copy={single_copy}"
            for name, reference in (("closed form", closed), ("torch.distributed", native)):
                piece = chunks.view(reference, rank)
                if exact:
                    assert torch.equal(shard, piece) and torch.equal(full, reference), f"{label}: differs from {name}"
                else:
                    assert torch.allclose(shard.double(), piece.double(), rtol=rtol), f"{label}: differs from {name}"
                    assert torch.allclose(full.double(), reference.double(), rtol=rtol), f"{label}: differs from {name}"
    large = FROM_BYTES // 8
    sizes = [large + 3, 5, 0, 2 * large + 1][:world_size] if world_size > 2 else [large + 3, 5]
    expected = torch.cat([torch.arange(size, dtype=torch.float64) + 1e9 * rank for rank, size in enumerate(sizes)])
    for rank, (first, second, small) in enumerate(pool.run(cases.uneven_all_gather_case, sizes)):
        assert torch.equal(first, expected) and torch.equal(second, expected * 2), f"uneven shards, rank {rank}"
        assert torch.equal(small, torch.arange(world_size, dtype=torch.float64).repeat_interleave(5)), rank


# On one host "hierarchical" is one group: its cross-host phase (an all-reduce along each rail, one
# rank per host) does nothing, and only test_multihost.py, with namespaces, crosses real hosts. Here
# each rank's transport pretends the ranks sit on several hosts (cases.PretendHosts), so every op
# and dtype goes through the rails: 2 hosts x 2 ranks, 3 hosts x 1, and 2 x 2 interleaved.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,hosts", [(4, ((0, 1), (2, 3))), (4, ((0, 2), (1, 3))), (3, ((0,), (1,), (2,)))])
def test_hierarchical_cross_host_phase_for_every_op_and_dtype(world_of, world_size, hosts):
    pool = world_of(world_size)
    batch = [(dtype, op, numel) for dtype in DTYPES for op in applicable_ops(dtype) for numel in (0, 1, 2 * world_size + 1,
                                                                                                  1001)]
    answers = pool.run(cases.hierarchical_over_pretend_hosts, hosts, batch)
    for index, (dtype, op, numel) in enumerate(batch):
        label = f"{dtype} op={op} n={numel} hosts={hosts}"
        problems = [answers[rank][index][0] for rank in range(world_size) if answers[rank][index][0]]
        assert not problems, f"{label}: {problems[0]}"
        assert len({answers[rank][index][1] for rank in range(world_size)}) == 1, f"{label}: ranks disagree"


def test_hierarchical_refuses_hosts_of_unequal_size(world_of):
    """docs/reliability.md's catalogue #23: the same number of ranks on every host, or an error."""
    answers = world_of(3).run(cases.hierarchical_over_pretend_hosts, ((0, 1), (2,)), [(torch.float32, "sum", 10)])
    for (problem, _), in answers:
        assert problem.startswith("RuntimeError: all_reduce: hierarchical all-reduce needs the same number of ranks "
                                  "on every host; this job has 2, 1 ranks on its 2 hosts"), problem


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size,transport", [(3, "auto"), (4, "tiny-rings"), (3, "tcp")])
def test_ring_pipelined_across_many_segments(world_of, world_size, transport):
    pool = world_of(world_size, **TRANSPORTS[transport])
    for dtype, op in [(torch.float64, "sum"), (torch.float32, "avg"), (torch.int64, "max"), (torch.int32, "bxor"),
                      (torch.float16, "min"), (torch.uint8, "product")]:
        for numel in (1000, 3 * world_size + 1):
            closed = cases.folded(world_size, numel, dtype, op)
            base, extra = divmod(numel, world_size)
            offset = 0
            for rank, (full, shard, gathered) in enumerate(pool.run(cases.segmented_case, numel, dtype, op, 64)):
                size = base + (1 if rank < extra else 0)
                assert torch.equal(full, closed), f"{dtype} {op}: all-reduce differs from the fold"
                assert torch.equal(shard, closed[offset:offset + size]), f"{dtype} {op}: rank {rank}'s shard"
                assert torch.equal(gathered, closed), f"{dtype} {op}: reduce-scatter + all-gather"
                offset += size


# auto: the shared-memory reduce-scatter and all-gather (one host); tcp: the ring ones; tiny-rings:
# 4 KiB staging halves, so the shared-memory ones go piece by piece
@pytest.mark.timeout(600)
@pytest.mark.parametrize("world_size,transport", [(1, "auto"), (2, "auto"), (3, "auto"),
                                                  pytest.param(5, "auto", marks=pytest.mark.slow),  # odd, as 3
                                                  pytest.param(8, "auto", marks=pytest.mark.slow),  # two ranks a core, as 4
                                                  (3, "tcp"), (4, "tiny-rings")])
def test_reduce_scatter_and_all_gather_against_closed_form_and_torch(world_of, world_size, transport):
    pool = world_of(world_size, **TRANSPORTS[transport])
    combos = [(dtype, op) for dtype in DTYPES for op in applicable_ops(dtype)]

    @seed(world_size)
    @case_settings
    @given(numels=st.lists(sizes(world_size), min_size=len(combos), max_size=len(combos)))
    def check(numels):
        batch = [(*combo, numel) for combo, numel in zip(combos, numels)]
        answers = pool.run(cases.scatter_gather_closed_cases, batch, case_timeout=300)
        for index, (dtype, op, numel) in enumerate(batch):
            closed = cases.folded(world_size, numel, dtype, op)
            exact = not (op == "product" and dtype.is_floating_point)
            rtol = cases.product_rtol(dtype, world_size) if not exact else 0.0
            base, extra = divmod(numel, world_size)
            offset = 0
            for rank in range(world_size):
                shard, full, native = answers[rank][index]
                label = f"{dtype} op={op} n={numel} N={world_size} rank {rank}"
                size = base + (1 if rank < extra else 0)
                assert shard.shape == (size,), f"{label}: documented piece size"
                for name, reference in (("closed form", closed), ("torch.distributed", native)):
                    piece = reference[offset:offset + size]
                    if exact:
                        assert torch.equal(shard, piece), f"{label}: shard differs from the {name}"
                        assert torch.equal(full, reference), f"{label}: all_gather differs from the {name}"
                    else:
                        assert torch.allclose(shard.double(), piece.double(), rtol=rtol, equal_nan=True), label
                        assert torch.allclose(full.double(), reference.double(), rtol=rtol, equal_nan=True), label
                offset += size

    check()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4, pytest.param(7, marks=pytest.mark.slow)])
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


@pytest.mark.timeout(120)
def test_all_reduce_of_every_tensor_layout_it_accepts(world_of):
    # 1-D tensors that need no grad are reduced as they are; every other layout through a detached,
    # flattened alias. Each must come back as the closed form, in its own shape.
    world_size = 3
    pool = world_of(world_size)
    total = sum(range(1, world_size + 1))
    once = torch.arange(12, dtype=torch.float64) * total
    for result in pool.run(cases.all_reduce_layouts_case):
        assert torch.equal(result["1-D"], once)
        assert torch.equal(result["2-D"], once.view(3, 4))
        assert torch.equal(result["transposed"], once.view(3, 4).t())
        assert torch.equal(result["parameter"], once * world_size)  # the view's all-reduce summed it again
        assert torch.equal(result["no_grad view"], (once * world_size).view(3, 4))



def test_barriers_poll_at_every_size_only_while_each_rank_has_a_core():
    """place.spins: with a core per local rank (comm/transport/shm/transport.py's spin_allowed) every collective polls
    briefly before it sleeps; with more ranks than cores those on the main thread do, and on another
    thread (a communication thread beside backward) only those below SPIN_BELOW_BYTES."""
    import threading
    from types import SimpleNamespace

    from gradsync.comm.agree import Fingerprint
    from gradsync.comm.place import SPIN_BELOW_BYTES, spins
    from gradsync.comm.transport import Transport

    small = Fingerprint("all_reduce", 1, 16, torch.float32, "sum", "shared_memory")
    large = Fingerprint("all_reduce", 1, SPIN_BELOW_BYTES // 4, torch.float32, "sum", "shared_memory")
    own_cores, shared_cores = SimpleNamespace(spin_allowed=True), SimpleNamespace(spin_allowed=False)
    assert spins(own_cores, small) and spins(own_cores, large)
    assert spins(shared_cores, small) and spins(shared_cores, large)   # on the main thread
    answers = []
    thread = threading.Thread(target=lambda: answers.extend(
        [spins(own_cores, large), spins(shared_cores, small), spins(shared_cores, large),
         spins(Transport(), large)]))
    thread.start()
    thread.join(30)
    # off the main thread: a transport that offers no shared memory (the interface's default, TCP's) goes by size alone
    assert answers == [True, True, False, False]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_avg_finish_equals_dividing_by_n_bit_for_bit(dtype):
    """reduce_ops.Reduction.finish for avg (a power-of-two N multiplies by 1/N) against torch's division
    by N, N = 1..8: every float16 and bfloat16 value; for float32 and float64 random bit patterns with
    the subnormals, the largest finite values and the infinities beside them."""
    bits = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
            torch.float64: torch.int64}[dtype]
    if bits is torch.int16:
        values = torch.arange(-2 ** 15, 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        info = torch.iinfo(bits)
        drawn = torch.randint(info.min, info.max, (200_000,), dtype=bits, generator=torch.Generator().manual_seed(5))
        tiny, big = torch.finfo(dtype).smallest_normal, torch.finfo(dtype).max
        edges = torch.tensor([tiny, tiny / 2, tiny / 3, -tiny / 7, big, -big, float("inf"), float("-inf")],
                             dtype=dtype)
        values = torch.cat([drawn.view(dtype), edges, torch.nextafter(edges, torch.zeros_like(edges))])
    for n in range(1, 9):
        finished = values.clone()
        REDUCTIONS["avg"].finish(finished, n)
        divided = values / n
        same = (finished.view(bits) == divided.view(bits)) | (finished.isnan() & divided.isnan())
        assert bool(same.all()), f"{dtype}, N={n}: {int((~same).sum())} values differ from x / N"


def test_the_stall_record_is_cleared_after_every_entry_point(world_of):
    """An entry point that leaves its record behind makes an idle rank report, every few seconds, a
    stall in an operation it finished long ago (seen: "waiting 254 s in all_reduce (hierarchical)")."""
    for rank, records in enumerate(world_of(4).run(cases.stall_records_after_each_entry, ((0, 1), (2, 3)))):
        left = [(name, record) for name, record in records if record is not None]
        assert not left, f"rank {rank}: still recorded after {left[0][0]}: {left[0][1]}"


def test_a_collective_inside_another_gives_the_stall_record_back_to_the_outer_one():
    from gradsync.observe import stall

    @stall.tracked
    def inner():
        stall.entered(SimpleNamespace(sequence=8))

    @stall.tracked
    def outer():
        stall.entered(SimpleNamespace(sequence=7))
        inner()
        return stall._NOW[0]

    assert outer()[1] == 7 and stall._NOW[0] is None
