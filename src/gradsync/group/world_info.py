"""What init() and join.py both build on: the World record of one rank, the host exchange, and
the private process groups that carry gradsync's transfers.

runtime.py makes a world of gradsync's own; join.py joins one the program made. Both describe it
with a World, group the ranks by host here (host_id, exchange_hosts), and look up the torch
ProcessGroup that carries its transfers here (transfer_group). This module is their home: import
them from here (gs.World is this World).
"""

from __future__ import annotations

import atexit
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from gradsync.group.bounded_store import within

DEFAULT_TIMEOUT = 60.0
"""Seconds, when init() is given no timeout and there is no existing group to take one from."""


@dataclass(frozen=True)
class World:
    """The identity of this rank inside an initialised gradsync job."""

    rank: int
    """This process's rank, 0..world_size-1."""
    world_size: int
    """Number of ranks in the job (N)."""
    local_rank: int
    """Index among the ranks on this host."""
    local_world_size: int
    """Number of ranks on this host."""
    backend: str
    """torch.distributed backend string in use ("auto" until init() has decided it: device_path.py)."""
    timeout: float
    """Seconds any single wait may block before it becomes an error."""
    master_addr: str
    """Host of the rendezvous store."""
    master_port: int
    """Port of the rendezvous store."""
    debug: bool = False
    """Full collective fingerprint comparison before every collective (GRADSYNC_DEBUG=1)."""
    store: dist.Store | None = field(default=None, compare=False, repr=False)
    """The rendezvous key-value store shared by all ranks."""
    hosts: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)
    """Ranks grouped by host (see host_id), each group in rank order, groups by their first rank."""
    generation: int = field(default=0, compare=False, repr=False)
    """How many times this process has called init() on this store; ``store`` is prefixed with it,
    so the keys of one init never meet the next's."""
    group_key: str | None = field(default=None, compare=False, repr=False)
    """Which torch ProcessGroup carries gradsync's point-to-point transfers between hosts and the
    "native" baseline (transfer_group): None for torch's default group (gradsync made it), else the
    key of a private gloo group of gradsync's own (it joined the program's world, and its messages
    must never meet the program's)."""
    cuda_path: str | None = field(default=None, compare=False)
    """How CUDA tensors travel between the ranks: "host" (staged through host memory), "nccl", or None
    where there is no CUDA (device_path.py)."""
    joined: bool = field(default=False, compare=False, repr=False)
    """True when the program made torch's default group and gradsync joined it (shutdown() then
    leaves that group alone)."""
    local_from_hosts: bool = field(default=False, compare=False, repr=False)
    """True when nothing said where this rank is on its host (no LOCAL_RANK, no Slurm task): init()
    takes local_rank and local_world_size from the host exchange."""

    @property
    def host_ranks(self) -> tuple[int, ...]:
        """The ranks on this rank's host (this rank included)."""
        return next((group for group in self.hosts if self.rank in group), (self.rank,))

    def settings(self) -> tuple:
        """The user-visible settings, for comparing two init() calls."""
        return (self.rank, self.world_size, self.local_rank, self.local_world_size,
                self.backend, self.timeout, self.master_addr, self.master_port, self.debug)


_PRIVATE_GROUPS: dict[str, dist.ProcessGroup] = {}
"""Private groups by World.group_key. Only this table holds them: a group still referenced when the
interpreter exits is destroyed after its threads are gone and aborts the process, so the table is
emptied by shutdown() and at exit."""


def register_group(key: str, group: dist.ProcessGroup) -> None:
    _PRIVATE_GROUPS[key] = group


def release_group(key: str | None) -> None:
    if key is not None:
        _PRIVATE_GROUPS.pop(key, None)


atexit.register(_PRIVATE_GROUPS.clear)


def transfer_group(w: World) -> dist.ProcessGroup:
    """The torch ProcessGroup that carries ``w``'s transfers (see World.group_key). Looked up on
    every use, never kept, for the reason given at _PRIVATE_GROUPS."""
    if w.group_key is None:
        return dist.distributed_c10d._get_default_group()
    group = _PRIVATE_GROUPS.get(w.group_key)
    if group is None:
        raise RuntimeError(f"rank {w.rank}: gradsync's process group {w.group_key!r} was released "
                           f"(gradsync.shutdown()); call gradsync.init() again")
    return group


def host_id() -> str:
    """What makes two ranks "on the same host": the same kernel boot and the same network, IPC,
    mount and PID namespaces (two network namespaces on one machine are two hosts to gradsync, as
    they are to gloo: they cannot share /dev/shm-backed memory safely or see each other's PIDs)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            parts.append(boot.read().strip())
    except OSError:
        pass
    for namespace in ("net", "ipc", "mnt", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{namespace}"))
        except OSError:
            pass
    return "|".join(parts)


def exchange_hosts(store, rank: int, world_size: int, timeout: float) -> tuple[tuple[int, ...], ...]:
    """Every rank publishes host_id() and reads everyone's; returns the ranks grouped by host. Bounded by
    ``timeout`` even on a store whose host went silent (bounded_store.within: a TCPStore wait would not be)."""
    key = "gradsync/host"  # the store is this init's own (see runtime.init)
    store.set(f"{key}/{rank}", host_id())
    keys = [f"{key}/{r}" for r in range(world_size)]

    def read() -> list[bytes]:
        store.wait(keys, timedelta(seconds=timeout))
        return [store.get(k) for k in keys]

    try:
        hosts = within(timeout + 1.0, f"rank {rank}: the host exchange", read)
    except Exception as exc:
        raise RuntimeError(f"rank {rank}: not every rank published its host within {timeout:.0f} s: {exc}") from exc
    groups: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        groups.setdefault(host.decode(), []).append(r)
    return tuple(tuple(group) for group in sorted(groups.values()))


def debug_from_env() -> bool:
    """GRADSYNC_DEBUG set to anything but empty, 0 or false."""
    return os.environ.get("GRADSYNC_DEBUG", "0") not in ("", "0", "false", "False")
