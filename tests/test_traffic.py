"""The meter's counts equal the closed forms (contract item 3)."""

import math

import pytest
import torch

import cases
from gradsync.comm.allreduce_ring import ring_bytes_sent, ring_chunks


def test_ring_chunks_worked_examples():
    assert ring_chunks(10, 3).sizes == (4, 3, 3) and ring_chunks(10, 3).offsets == (0, 4, 7)
    assert ring_chunks(2, 4).sizes == (1, 1, 0, 0)
    assert ring_chunks(0, 5).sizes == (0,) * 5


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, pytest.param(8, marks=pytest.mark.slow)])
def test_ring_sends_exactly_2_n_minus_1_over_n_times_m(world_of, world_size):
    pool = world_of(world_size)
    numel = 1024 * world_size * 3  # divisible by N (each chunk fits one segment; test_collectives crosses many)
    for dtype in (torch.float32, torch.float16):
        m_bytes = numel * torch.tensor([], dtype=dtype).element_size()
        for rank, t in enumerate(pool.run(cases.traffic_case, numel, dtype, "ring")):
            assert t["bytes_sent"] == 2 * (world_size - 1) * m_bytes // world_size
            assert t["bytes_received"] == t["bytes_sent"]
            right = (rank + 1) % world_size
            if dtype == torch.float32:
                assert set(t["per_peer"]) == {right, (rank - 1) % world_size}
                assert t["per_peer"][right]["sent"] == t["bytes_sent"]
            else:   # a float16 sum reduce-scatters straight to each chunk's owner (reduce_scatter_direct.py):
                # one chunk to every peer, then the all-gather's N-1 chunks to the right neighbour
                chunk = m_bytes // world_size
                others = [peer for peer in range(world_size) if peer != rank]
                assert {peer: v["sent"] for peer, v in t["per_peer"].items()} == {
                    peer: chunk + (world_size - 1) * chunk * (peer == right) for peer in others}
            assert t["per_op"]["all_reduce/ring"]["sent"] == t["bytes_sent"]
            assert t["control_bytes_sent"] > 0  # the agreement fingerprint, kept apart from payload


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [3, 4, pytest.param(7, marks=pytest.mark.slow)])
def test_ring_uneven_chunking_formula(world_of, world_size):
    pool = world_of(world_size)
    for numel in (1, world_size - 1, 10 * world_size + 3):
        results = pool.run(cases.traffic_case, numel, torch.float64, "ring")
        sizes = ring_chunks(numel, world_size).sizes
        for rank, t in enumerate(results):
            by_hand = (2 * numel - sizes[rank] - sizes[(rank + 1) % world_size]) * 8
            assert t["bytes_sent"] == by_hand == ring_bytes_sent(numel, world_size, rank, 8)
            assert t["bytes_received"] == (2 * numel - sizes[(rank - 1) % world_size] - sizes[rank]) * 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4, 5])
def test_naive_is_the_parameter_server_pattern(world_of, world_size):
    pool = world_of(world_size)
    numel = 777
    m_bytes = numel * 4
    results = pool.run(cases.traffic_case, numel, torch.float32, "naive")
    assert results[0]["bytes_received"] == (world_size - 1) * m_bytes
    assert results[0]["bytes_sent"] == (world_size - 1) * m_bytes
    for t in results[1:]:
        assert t["bytes_sent"] == t["bytes_received"] == m_bytes


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_halving_doubling_and_tree_traffic(world_of, world_size):
    pool = world_of(world_size)
    numel = 64 * world_size
    m_bytes = numel * 4
    for t in pool.run(cases.traffic_case, numel, torch.float32, "halving_doubling"):
        assert t["bytes_sent"] == 2 * (world_size - 1) * m_bytes // world_size
    tree = pool.run(cases.traffic_case, numel, torch.float32, "tree")
    levels = int(math.log2(world_size))
    assert tree[0]["bytes_sent"] == levels * m_bytes  # the root feeds one child per level
    assert sum(t["bytes_sent"] for t in tree) == 2 * (world_size - 1) * m_bytes  # each tree edge twice


@pytest.mark.timeout(120)
def test_receive_from_any_source_names_the_sender(world_of):
    import gradsync as gs

    world_size = 4
    pool = world_of(world_size)
    pool.run(gs.traffic_reset)   # the pool's ranks have metered earlier cases
    results = pool.run(cases.any_source_case)
    seen, per_peer = results[0]
    assert sorted(seen) == [1, 2, 3]
    for source, values in seen.items():
        assert torch.equal(values, torch.full((3,), float(source))), "the payload came from the rank reported"
        assert per_peer[source]["received"] == 12, "3 float32 from each sender, metered against that sender"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_shared_memory_direct_and_split_traffic(world_of, world_size):
    # the bound between the two is docs/transports.md's (doc_claims.py; the default 4 MiB staging halves
    # are above it): one float32 below it the direct all-reduce reads all of every other rank's
    # tensor after a single barrier, from it up the split one moves slices, two barriers a piece
    # (with two ranks both read M bytes: only the barriers tell them apart). 4 KB is far below it.
    import doc_claims
    import shm_fns

    pool = world_of(world_size)
    bound = doc_claims.direct_below(world_size)
    for numel, direct in ((1000, True), (bound // 4 - 1, True), (bound // 4, False)):
        m_bytes = numel * 4
        sizes = ring_chunks(numel, world_size).sizes
        for rank, (t, barriers) in enumerate(pool.run(shm_fns.all_reduce_traffic_and_barriers, numel)):
            assert (barriers == 1) if direct else (barriers >= 2 and barriers % 2 == 0), (numel, rank, barriers)
            if direct:
                expected = (world_size - 1) * m_bytes
                per_peer = {peer: m_bytes for peer in range(world_size) if peer != rank}
            else:  # slice r from each other rank, and slice j written by its owner j (the split one's bytes)
                expected = ((world_size - 1) * sizes[rank] + numel - sizes[rank]) * 4
                per_peer = {peer: (sizes[rank] + sizes[peer]) * 4 for peer in range(world_size) if peer != rank}
            assert t["bytes_received"] == t["bytes_sent"] == expected, (numel, rank)
            assert {peer: c["received"] for peer, c in t["per_peer"].items()} == per_peer
            # the staged agreement: one 64-byte fingerprint slot read from each other rank
            assert t["control_bytes_received"] == t["control_bytes_sent"] == 64 * (world_size - 1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3])
def test_shared_memory_reduce_scatter_and_all_gather_traffic(world_of, world_size):
    numel = 1000 * world_size + 1  # uneven chunks
    sizes = ring_chunks(numel, world_size).sizes
    for rank, (scattered, gathered) in enumerate(world_of(world_size).run(cases.scatter_gather_traffic, numel)):
        # reduce-scatter: this rank's chunk from each other rank; each other rank j reads chunk j from it
        assert {p: c["received"] for p, c in scattered["per_peer"].items()} == {
            p: sizes[rank] * 8 for p in range(world_size) if p != rank}
        assert {p: c["sent"] for p, c in scattered["per_peer"].items()} == {
            p: sizes[p] * 8 for p in range(world_size) if p != rank}
        # all-gather: every other rank's shard from its owner
        assert {p: c["received"] for p, c in gathered["per_peer"].items()} == {
            p: sizes[p] * 8 for p in range(world_size) if p != rank}
        assert gathered["bytes_sent"] == (world_size - 1) * sizes[rank] * 8


@pytest.mark.timeout(300)
@pytest.mark.parametrize("counters_full", [False, True])
def test_a_small_all_reduce_run_from_its_plan_is_metered_as_its_first_call(world_of, counters_full):
    # 3 ranks, 1,000 float32 reduced four times: the first call keeps a plan, the other three run it
    # and count their calls for the meter to multiply when read (TrafficMeter.tally). After each
    # call the counts grow by one call's closed form: the whole 4 KB from each other rank, one
    # 64-byte fingerprint each way with each; a second read adds nothing, and a reset drops every
    # call made before it, read or not. With the meter's counters all taken (MAX_TALLIES), each call
    # records itself, to the same counts
    world_size, numel = 3, 1000 + counters_full
    m_bytes = numel * 4
    for rank, (reads, again, after_reset, right) in enumerate(
            world_of(world_size).run(cases.repeated_small_traffic, numel, 4, counters_full)):
        assert right, rank
        peers = [peer for peer in range(world_size) if peer != rank]
        for calls, t in enumerate(reads + [after_reset], start=1):
            calls = 1 if t is after_reset else calls
            assert t["bytes_received"] == t["bytes_sent"] == calls * (world_size - 1) * m_bytes, (rank, calls)
            assert t["per_peer"] == {peer: {"sent": calls * m_bytes, "received": calls * m_bytes} for peer in peers}
            assert t["per_op"] == {"all_reduce/shared_memory": {"sent": calls * (world_size - 1) * m_bytes,
                                                                "received": calls * (world_size - 1) * m_bytes}}
            assert t["control_bytes_received"] == t["control_bytes_sent"] == calls * 64 * (world_size - 1)
        assert again == reads[-1]
