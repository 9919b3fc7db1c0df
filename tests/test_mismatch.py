"""Ranks that disagree about a collective get a clear error naming both ranks, never a hang or garbage."""

import pytest

import cases
from world_pool import RankFailure


# On shared memory (the default on one host) every rank compares every rank's fingerprint after one
# barrier, and the shared-memory all-reduce carries its fingerprint with the data (agree.py, staged);
# over TCP neighbours exchange fingerprints. Both must turn a mismatch into an error on every rank.
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,algorithm,transport,numel", [
    ("size", "ring", "shm", 12), ("dtype", "tree", "shm", 12), ("dtype", "native", "shm", 12),
    ("size", "shared_memory", "shm", 12),      # direct all-reduce: the fingerprint staged with the data
    ("dtype", "shared_memory", "shm", 12),
    ("size", "shared_memory", "shm", 600_000),  # split all-reduce (2.4 MB): the fingerprint with the first piece
    ("size", "ring", "tcp", 12), ("dtype", "native", "tcp", 12)])
def test_mismatched_tensors_raise_naming_ranks(world_of, kind, algorithm, transport, numel):
    pool = world_of(3, **({"GRADSYNC_TRANSPORT": "tcp"} if transport == "tcp" else {}))
    with pytest.raises(RankFailure) as info:
        pool.run(cases.mismatched_all_reduce, kind, algorithm, numel, case_timeout=30)
    errors = info.value.errors
    assert 1 in errors, "the odd rank out must fail too"
    if transport == "shm":
        assert set(errors) == {0, 1, 2}, "the staged check raises on every rank"
    for rank, (name, message) in errors.items():
        assert name == "CollectiveMismatchError", (rank, name, message)
        assert "rank 1" in message and "collective mismatch between" in message
        assert (f"{numel + 1} float32" in message) if kind == "size" else ("int32" in message)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("numel", [12, 600_000])
def test_a_broadcast_against_a_shared_memory_all_reduce_is_an_error_on_every_rank(world_of, numel):
    pool = world_of(3)
    with pytest.raises(RankFailure) as info:
        pool.run(cases.all_reduce_against_broadcast, numel, case_timeout=30)
    errors = info.value.errors
    assert set(errors) == {0, 1, 2}
    for rank, (name, message) in errors.items():
        assert name == "CollectiveMismatchError", (rank, name, message)
        assert "rank 1 called broadcast" in message and "all_reduce" in message and "shared_memory" in message


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_shared_memory_reduce_scatter_and_all_gather_mismatches(world_of, kind):
    pool = world_of(3)
    with pytest.raises(RankFailure) as info:
        pool.run(cases.mismatched_scatter_gather, kind, case_timeout=30)
    assert set(info.value.errors) == {0, 1, 2}
    for rank, (name, message) in info.value.errors.items():
        assert name == "CollectiveMismatchError", (rank, name, message)
        assert "rank 1" in message and "int32" in message and kind in message


@pytest.mark.timeout(120)
def test_collectives_after_a_mismatch_across_the_split_bound_are_right(world_of):
    # rank 1 takes the direct all-reduce where the others take the split one, which leaves their
    # staging halves elsewhere than rank 1's; after the mismatch every rank must stage and read in the
    # same half again, or the next all-reduces read what another call staged
    answers = world_of(3).run(cases.mismatch_across_the_split_bound, 600_000, 1000)
    assert answers == [[True, True]] * 3, answers


ODD_RANK_CALLS = {   # world: (collective, kind, algorithm, numel) the odd rank out gets wrong
    # shared memory: the staged check, with the data (direct and split all-reduce) or alone (ring)
    "shm-3": [("all_reduce", "size", "shared_memory", 12), ("all_reduce", "size", "shared_memory", 600_000),
              ("all_reduce", "dtype", "ring", 12), ("reduce_scatter", "dtype", "auto", 12),
              ("all_gather", "dtype", "auto", 12)],
    "shm-4": [("all_reduce", "size", "auto", 12), ("all_reduce", "dtype", "tree", 12)],
    # TCP: each rank compares with its ring neighbours, which with 3 ranks are all the others
    "tcp-3": [("all_reduce", "size", "ring", 12), ("all_reduce", "dtype", "native", 12),
              ("reduce_scatter", "size", "auto", 12), ("all_gather", "dtype", "auto", 12)],
    # TCP with GRADSYNC_DEBUG=1: every rank compares every rank's fingerprint, neighbours or not
    "tcp-debug-4": [("all_reduce", "size", "ring", 12), ("all_reduce", "dtype", "native", 12),
                    ("reduce_scatter", "size", "auto", 12)],
}
ODD_RANK_WORLDS = {"shm-3": (3, {}), "shm-4": (4, {}), "tcp-3": (3, {"GRADSYNC_TRANSPORT": "tcp"}),
                   "tcp-debug-4": (4, {"GRADSYNC_TRANSPORT": "tcp", "GRADSYNC_DEBUG": "1"})}


# The odd rank out is every rank in turn (the first, each middle one, the last), on each way ranks
# agree: a check that stops one rank short, or starts one late, misses an end. Every rank must
# raise naming the odd rank, and the world must stay usable (each rank caught its error).
@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", list(ODD_RANK_CALLS))
def test_the_odd_rank_out_at_every_position_is_named_on_every_rank(world_of, setup):
    world_size, env = ODD_RANK_WORLDS[setup]
    calls = ODD_RANK_CALLS[setup]
    answers = world_of(world_size, **env).run(cases.odd_rank_at_every_position, calls, case_timeout=60)
    for index, (collective, kind, algorithm, numel) in enumerate(calls):
        for rank in range(world_size):
            seen, right = answers[rank][index]
            assert [odd for odd, _, _ in seen] == list(range(world_size))
            for odd, name, message in seen:
                label = f"{setup} {collective} {kind} {algorithm}: rank {odd} odd, rank {rank}'s error"
                assert name == "CollectiveMismatchError", f"{label}: {name} {message}"
                assert f"rank {odd}" in message and "collective mismatch between" in message, f"{label}: {message}"
                assert collective in message, f"{label}: {message}"
                assert (f"{numel + 1} float32" in message) if kind == "size" else ("int32" in message), \
                    f"{label}: {message}"
            assert right, f"{setup} {collective} {kind}: an all-reduce after the mismatches was wrong on rank {rank}"
