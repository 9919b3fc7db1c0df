"""gradsync: data-parallel training for PyTorch, from parameter server to ring all-reduce.

The public names are loaded on first use (PEP 562), all together: torch imports gradsync.c10d
when torch itself is imported (the "torch.backends" entry point that registers the
torch.distributed backend "gradsync"), and that must stay cheap.
"""

import importlib

from gradsync.c10d import register as _register_backend

_register_backend()  # torch.distributed.init_process_group("gradsync") works after `import gradsync`

__version__ = "0.1.0"

_SOURCES = {
    "init": "gradsync.group.runtime", "shutdown": "gradsync.group.runtime", "world": "gradsync.group.runtime",
    "World": "gradsync.group.world_info", "spawn": "gradsync.group.launch", "SpawnError": "gradsync.group.spawn_report",
    "DistributedDataParallel": "gradsync.ddp.wrapper", "ReplicaMismatchError": "gradsync.ddp.wrapper",
    "DistributedSampler": "gradsync.data", "ParameterServer": "gradsync.ps", "ShardedOptimizer": "gradsync.zero",
    "DiLoCo": "gradsync.diloco",
    "all_reduce": "gradsync.comm.collectives", "reduce_scatter": "gradsync.comm.collectives",
    "all_gather": "gradsync.comm.collectives", "broadcast": "gradsync.comm.collectives",
    "traffic": "gradsync.observe.meter", "traffic_reset": "gradsync.observe.meter",
}

__all__ = list(_SOURCES)


def _load_public_names() -> None:
    from gradsync.group import runtime

    for name, module in _SOURCES.items():
        globals()[name] = getattr(importlib.import_module(module), name)
    # the ranks a launcher holding them spawns load them too, before they meet (runtime.before_init)
    runtime.before_init(_load_public_names)


def __getattr__(name: str):
    if name not in _SOURCES:
        raise AttributeError(f"module 'gradsync' has no attribute {name!r}")
    _load_public_names()
    return globals()[name]


def __dir__():
    return sorted(list(globals()) + __all__)
