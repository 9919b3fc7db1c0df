import time

import pytest
import torch

from world_pool import WorldPool

_POOLS: dict[tuple, WorldPool] = {}   # in the order they were last asked for
MAX_LIVE_POOLS = 6
"""Worlds kept running at once: each rank holds a few hundred MB (torch), and a session that kept all
its forty-odd worlds up ran this 24 GiB machine out of memory. Past this, the world asked for least
recently is closed; it starts again if a later test asks for it."""


@pytest.fixture(scope="session")
def world_of():
    """world_of(n, **env) -> a WorldPool of n ranks with these environment variables (e.g.
    GRADSYNC_TRANSPORT="tcp"), started on its first case and shared by the whole session (at most
    MAX_LIVE_POOLS running at once)."""

    def get(n: int, **env: str) -> WorldPool:
        key = (n, tuple(sorted(env.items())))
        pool = _POOLS.pop(key, None) or WorldPool(n, env=env)
        _POOLS[key] = pool   # now the most recently asked for
        running = [other for other in _POOLS.values() if other is not pool and other._procs]
        for other in running[:max(0, len(running) - (MAX_LIVE_POOLS - 1))]:
            other.close()
        return pool

    yield get
    for pool in _POOLS.values():   # every world shuts down at once, and all get the same 3 s
        pool.ask_to_close()
    deadline = time.monotonic() + 3.0
    for pool in _POOLS.values():
        pool.close(deadline)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU and ``multigpu`` two: skipped (and shown as skipped) without."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two CUDA GPUs, this machine has {gpus}"))
        elif "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, this machine has none"))
