"""gradsync: data-parallel training for PyTorch, from parameter server to ring all-reduce."""

from gradsync.comm.collectives import all_gather, all_reduce, broadcast, reduce_scatter
from gradsync.data import DistributedSampler
from gradsync.ddp.wrapper import DistributedDataParallel, ReplicaMismatchError
from gradsync.launch import SpawnError, spawn
from gradsync.meter import traffic, traffic_reset
from gradsync.ps import ParameterServer
from gradsync.runtime import World, init, shutdown, world
from gradsync.zero import ShardedOptimizer

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "world", "World", "spawn", "SpawnError",
    "DistributedDataParallel", "ReplicaMismatchError", "DistributedSampler", "ParameterServer",
    "ShardedOptimizer",
    "all_reduce", "reduce_scatter", "all_gather", "broadcast", "traffic", "traffic_reset",
]
