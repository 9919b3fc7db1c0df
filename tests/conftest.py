import time

import pytest
import torch

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


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a GPU and ``multigpu`` two: skipped (and shown as skipped) without."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs two CUDA GPUs, this machine has {gpus}"))
        elif "cuda" in item.keywords and gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU, this machine has none"))
