import pytest

from world_pool import WorldPool

_POOLS: dict[int, WorldPool] = {}


@pytest.fixture(scope="session")
def world_of():
    """world_of(n) -> a WorldPool of n ranks, started once and shared by the whole session."""

    def get(n: int) -> WorldPool:
        if n not in _POOLS:
            _POOLS[n] = WorldPool(n)
        return _POOLS[n]

    yield get
    for pool in _POOLS.values():
        pool.close()
