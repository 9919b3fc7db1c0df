"""Ranks that disagree about a collective get a clear error naming both ranks, never a hang or garbage."""

import pytest

import cases
from world_pool import RankFailure


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["size", "dtype"])
@pytest.mark.parametrize("algorithm", ["ring", "tree", "native"])
def test_mismatched_tensors_raise_naming_ranks(world_of, kind, algorithm):
    pool = world_of(3)
    with pytest.raises(RankFailure) as info:
        pool.run(cases.mismatched_all_reduce, kind, algorithm, case_timeout=30)
    errors = info.value.errors
    assert 1 in errors, "the odd rank out must fail too"
    for rank, (name, message) in errors.items():
        assert name == "CollectiveMismatchError"
        assert "rank 1" in message and "collective mismatch between" in message
        assert ("13 float32" in message) if kind == "size" else ("int32" in message)
