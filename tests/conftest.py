import time

import pytest

from world_pool import WorldPool

_POOLS: dict[tuple, WorldPool] = {}


@pytest.fixture(scope="session")
def world_of():
    """world_of(n, **env) -> a WorldPool of n ranks with these environment variables (e.g.
    GRADSYNC_TRANSPORT="tcp"), started once and shared by the whole session."""

    def get(n: int, **env: str) -> WorldPool:
        key = (n, tuple(sorted(env.items())))
        if key not in _POOLS:
            _POOLS[key] = WorldPool(n, env=env)
        return _POOLS[key]

    yield get
    for pool in _POOLS.values():   # every world shuts down at once, and all get the same 3 s
        pool.ask_to_close()
    deadline = time.monotonic() + 3.0
    for pool in _POOLS.values():
        pool.close(deadline)
