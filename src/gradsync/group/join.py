"""Joining a torch.distributed world that the program made itself.

Most training programs own their set-up: a script calls ``init_process_group("gloo")`` under
torchrun, Lightning and Accelerate do it for theirs. gradsync joins that world instead of making
one, so the program changes one import and keeps its set-up:

    torch.distributed.init_process_group("gloo")       # the program's own line, unchanged
    model = gradsync.DistributedDataParallel(model)    # joins here (or at gradsync.init())
    ...
    gradsync.shutdown()                                # optional: closes gradsync's transport only
    torch.distributed.destroy_process_group()          # the program's own line, still works

Where each value comes from
    rank, world_size   torch's default group (an explicit init() argument must agree with it)
    timeout            init(timeout=...) if given, else the default group's own timeout
    store              the default group's store (torch keeps it), under a prefix of gradsync's own,
                       gradsync/join<g>/, with g counting this rank's joins, so a second join after
                       shutdown() never meets the first one's keys
    local_rank, local_world_size
                       LOCAL_RANK / LOCAL_WORLD_SIZE (torchrun sets them), else this rank's place among
                       the ranks that share its host (the host exchange every init() does)
    backend            the default group's backend string, for the record

Transfers: gradsync makes a private gloo group on the same store (gradsync/join<g>/gloo/) for its
point-to-point messages between hosts and for the "native" baseline. Its messages then never meet
the program's own sends and receives on the default group, whatever tags either uses. CUDA tensors
go through the default group (it has NCCL where the program set it up). Ranks that share a host
use the shared-memory transport exactly as in a world of gradsync's own.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.group import world_info
from gradsync.group.world_info import World

CPU = torch.device("cpu")


def group_timeout(group: dist.ProcessGroup) -> float | None:
    """Seconds of ``group``'s own timeout on CPU, or None where the backend does not say."""
    try:
        return group._get_backend(CPU).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return None


def _contradiction(name: str, given, existing) -> RuntimeError:
    return RuntimeError(f"gradsync.init({name}={given!r}) contradicts the torch.distributed world this program "
                        f"already set up ({name}={existing!r}); pass nothing (gradsync joins that world as it is) "
                        f"or call torch.distributed.destroy_process_group() first")


def _check_explicit(*, backend, rank, world_size, existing_backend: str, existing_rank: int,
                    existing_size: int) -> None:
    if world_size is not None and world_size != existing_size:
        raise _contradiction("world_size", world_size, existing_size)
    if rank is not None and rank != existing_rank:
        raise _contradiction("rank", rank, existing_rank)
    if backend is not None and backend != existing_backend:
        raise _contradiction("backend", backend, existing_backend)


def check_same(existing: World, *, backend, timeout, rank, world_size) -> None:
    """A repeated init() in a joined world: explicit settings must agree with the first."""
    _check_explicit(backend=backend, rank=rank, world_size=world_size, existing_backend=existing.backend,
                    existing_rank=existing.rank, existing_size=existing.world_size)
    if timeout is not None and float(timeout) != existing.timeout:
        raise RuntimeError(f"gradsync.init(timeout={timeout!r}): already joined with timeout={existing.timeout}; "
                           f"call gradsync.shutdown() first")


def join_default_group(*, backend, timeout, rank, world_size, local_rank, local_world_size, debug) -> World:
    """The World of this rank inside torch's default group (see the module docstring)."""
    default = dist.distributed_c10d._get_default_group()
    existing_backend = str(dist.get_backend())
    my_rank, n_ranks = dist.get_rank(), dist.get_world_size()
    _check_explicit(backend=backend, rank=rank, world_size=world_size, existing_backend=existing_backend,
                    existing_rank=my_rank, existing_size=n_ranks)
    if timeout is None:
        timeout = group_timeout(default) or world_info.DEFAULT_TIMEOUT
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
    timeout = float(timeout)
    base = dist.distributed_c10d._get_default_store()
    generation = int(base.add(f"gradsync/join/{my_rank}", 1))
    store = dist.PrefixStore(f"gradsync/join{generation}", base)
    return world_on_store(store, my_rank, n_ranks, timeout, backend=existing_backend, generation=generation,
                          group_key=f"join{generation}", local_rank=_env_int(local_rank, "LOCAL_RANK"),
                          local_world_size=_env_int(local_world_size, "LOCAL_WORLD_SIZE"), debug=debug,
                          master_addr=os.environ.get("MASTER_ADDR", ""),
                          master_port=int(os.environ.get("MASTER_PORT", "0") or 0))


def world_on_store(store, rank: int, size: int, timeout: float, *, backend: str, generation: int, group_key: str,
                   local_rank: int | None = None, local_world_size: int | None = None, debug: bool | None = None,
                   master_addr: str = "", master_port: int = 0) -> World:
    """A World of ``size`` ranks met through ``store`` (already private to it) in a program's
    torch.distributed: hosts exchanged, a private gloo group registered under ``group_key`` for
    transfers between hosts. local_rank / local_world_size default to this rank's place on its host.
    Used by join_default_group and by the backend's process groups (c10d/)."""
    hosts = ((0,),) if size == 1 else world_info.exchange_hosts(store, rank, size, timeout)
    host = next(group for group in hosts if rank in group)
    world_info.register_group(group_key, dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size,
                                                               timedelta(seconds=timeout)))
    return World(
        rank=rank, world_size=size, local_rank=host.index(rank) if local_rank is None else local_rank,
        local_world_size=len(host) if local_world_size is None else local_world_size, backend=backend,
        timeout=timeout, master_addr=master_addr, master_port=master_port,
        debug=world_info.debug_from_env() if debug is None else bool(debug), store=store, hosts=hosts,
        generation=generation, group_key=group_key, joined=True, cuda_path=joined_cuda_path(backend))


def joined_cuda_path(backend: str) -> str | None:
    """The CUDA path of a world joined from the program's torch.distributed (device_path.py): the
    program's NCCL where its backend has it, host staging otherwise (the "gradsync" backend takes CUDA
    tensors as gloo does), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return "nccl" if "nccl" in backend else "host"


def _env_int(given: int | None, variable: str) -> int | None:
    if given is not None:
        return given
    value = os.environ.get(variable)
    return int(value) if value not in (None, "") else None
