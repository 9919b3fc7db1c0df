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
@pytest.mark.parametrize("world_size", [2, 3, 4, *(pytest.param(n, marks=pytest.mark.slow) for n in (5, 8))])
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
@pytest.mark.parametrize("world_size", [2, 4, pytest.param(5, marks=pytest.mark.slow)])   # 5: a larger world
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


def _ring_sizes(numel: int, world_size: int) -> list[int]:
    """The ring's chunks: the first numel mod N one element longer (allreduce_ring.py's docstring)."""
    return [numel // world_size + (c < numel % world_size) for c in range(world_size)]


def _binomial_links(world_size: int, root: int, rank: int) -> tuple[list[int], list[int]]:
    """(parent, children) of ``rank`` in the binomial tree on ranks relative to ``root`` (broadcast.py's
    docstring): relative rank v > 0 hangs under v - lowbit(v); its children are v + m for the powers of
    two m below lowbit(v) (for the root: below N) that stay below N."""
    v = (rank - root) % world_size
    lowbit = v & -v
    below = lowbit if v else world_size
    children = [(v + m + root) % world_size for m in (1 << k for k in range(world_size.bit_length()))
                if m < below and v + m < world_size]
    return ([] if v == 0 else [(v - lowbit + root) % world_size]), children


def _tcp_closed_forms(world_size: int, rank: int, numel: int, src: int) -> dict[str, dict]:
    """Per collective, {peer: (bytes sent to it, bytes received from it)} of float64 ``numel``, from each
    algorithm's docstring. ``numel`` must be a multiple of the halving-doubling's power of two."""
    m_bytes, n_ranks = numel * 8, world_size
    sizes = _ring_sizes(numel, n_ranks)
    left, right = (rank - 1) % n_ranks, (rank + 1) % n_ranks
    forms: dict[str, dict] = {}

    def add(name: str, peer: int, sent: int, received: int) -> None:
        before = forms.setdefault(name, {}).get(peer, (0, 0))
        forms[name][peer] = (before[0] + sent, before[1] + received)

    # ring: the reduce-scatter sends every chunk but its own and receives every chunk but its left
    # neighbour's; the all-gather sends every chunk but its right neighbour's and receives every one but its own
    add("all_reduce/ring", right, (2 * numel - sizes[rank] - sizes[right]) * 8, 0)
    add("all_reduce/ring", left, 0, (2 * numel - sizes[left] - sizes[rank]) * 8)
    add("reduce_scatter", right, (numel - sizes[rank]) * 8, 0)
    add("reduce_scatter", left, 0, (numel - sizes[left]) * 8)
    add("all_gather", right, (numel - sizes[right]) * 8, 0)
    add("all_gather", left, 0, (numel - sizes[rank]) * 8)
    # halving-doubling: p = the largest power of two <= N; ranks 0..2(N-p)-1 pair up, the even one folding
    # its whole tensor into the odd one and getting the result back; of the p others, partners at
    # distance m exchange the range of that level (2m/p of the tensor) in the halving and again in the doubling
    p = 1 << (n_ranks.bit_length() - 1)
    extra = n_ranks - p
    if rank < 2 * extra:
        add("all_reduce/halving_doubling", rank + 1 if rank % 2 == 0 else rank - 1, m_bytes, m_bytes)
    if rank >= 2 * extra or rank % 2 == 1:
        newrank = rank // 2 if rank < 2 * extra else rank - extra
        m = 1
        while m < p:
            partner = newrank ^ m
            peer = 2 * partner + 1 if partner < extra else partner + extra
            add("all_reduce/halving_doubling", peer, m_bytes * 2 * m // p, m_bytes * 2 * m // p)
            m <<= 1
    # tree: the reduce up the binomial tree rooted at 0, the broadcast down it: M each way on every link
    parent, children = _binomial_links(n_ranks, 0, rank)
    for peer in parent + children:
        add("all_reduce/tree", peer, m_bytes, m_bytes)
    # naive: everything through rank 0
    for peer in (range(1, n_ranks) if rank == 0 else [0]):
        add("all_reduce/naive", peer, m_bytes, m_bytes)
    # broadcast: M from the parent, M to each child
    parent, children = _binomial_links(n_ranks, src, rank)
    for peer in parent:
        add("broadcast", peer, 0, m_bytes)
    for peer in children:
        add("broadcast", peer, m_bytes, 0)
    return forms


OPERATION = {"reduce_scatter": "reduce_scatter/ring", "all_gather": "all_gather/ring",
             "broadcast": "broadcast/binomial"}
"""The meter's per-operation label of each collective that is not an all-reduce (those are their own)."""


def test_the_closed_forms_worked_examples():
    """The tree and the halving-doubling as drawn in their docstrings, N = 5."""
    assert [_binomial_links(5, 0, r) for r in range(5)] == [([], [1, 2, 4]), ([0], []), ([0], [3]), ([2], []),
                                                         ([0], [])]
    assert _binomial_links(5, 3, 3) == ([], [4, 0, 2]) and _binomial_links(5, 3, 0) == ([3], [1])
    forms = {r: _tcp_closed_forms(5, r, 8, 0)["all_reduce/halving_doubling"] for r in range(5)}
    # rank 0 folds into rank 1; ranks 1..4 run on 4: distance 2 the whole 64 bytes, distance 1 half of them
    assert forms[0] == {1: (64, 64)} and forms[1] == {0: (64, 64), 2: (32, 32), 3: (64, 64)}
    assert forms[4] == {3: (32, 32), 2: (64, 64)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 3, pytest.param(5, marks=pytest.mark.slow)])
def test_tcp_bytes_received_equal_the_closed_forms(world_of, world_size):
    """Over the TCP transport, for every collective (all-reduce by each algorithm, reduce-scatter,
    all-gather, broadcast from a non-zero root), every rank's bytes received and sent equal the closed
    form in total, per peer and per operation. Two sizes: one not a multiple of N (uneven ring chunks),
    one whose ring chunks span two 4 MiB segments."""
    pool = world_of(world_size, GRADSYNC_TRANSPORT="tcp")
    assert pool.run(cases.transport_kind) == ["TorchTransport"] * world_size
    src = world_size - 1
    for numel in (1004, (1 << 19) * world_size + 4):
        for rank, counts in enumerate(pool.run(cases.traffic_of_each_collective, numel, src)):
            forms = _tcp_closed_forms(world_size, rank, numel, src)
            assert set(counts) == set(forms)
            for name, per_peer in forms.items():
                t, where = counts[name], f"{name}, {numel} float64, rank {rank} of {world_size}"
                expected = {peer: {"sent": sent, "received": received} for peer, (sent, received) in per_peer.items()
                            if sent or received}
                assert t["per_peer"] == expected, where
                received = sum(c["received"] for c in expected.values())
                sent = sum(c["sent"] for c in expected.values())
                assert (t["bytes_received"], t["bytes_sent"]) == (received, sent), where
                assert t["per_op"] == {OPERATION.get(name, name): {"sent": sent, "received": received}}, where
