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
