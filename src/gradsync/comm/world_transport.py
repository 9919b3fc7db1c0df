"""The transport of a world: which Transport carries its ranks' bytes, made at init().

Above both implementations, so that neither the interface (transport.py) nor an implementation
imports this choice: it registers with runtime.on_init, so init() connects the world's transport
(and shutdown() closes it), and default_transport() hands it to the collectives.

    GRADSYNC_TRANSPORT=auto   shared memory between ranks of one host where this machine supports
                              it (shm/doorbell.py says), torch.distributed otherwise (the default)
    GRADSYNC_TRANSPORT=tcp    torch.distributed for every peer (tcp.py)
    GRADSYNC_TRANSPORT=shm    shared memory between ranks of one host, an error where unsupported

A world of one rank, or a rank alone on its host, gets a TorchTransport. Every rank takes part in
the shared-memory job token (shm/segment.py's job_token) first, even one alone on its host: rank 0
publishes it.
"""

from __future__ import annotations

import os

from gradsync import runtime
from gradsync.comm.shm import doorbell
from gradsync.comm.shm.segment import job_token
from gradsync.comm.shm.transport import ShmTransport
from gradsync.comm.tcp import TorchTransport
from gradsync.comm.transport import Transport


TRANSPORTS = ("auto", "tcp", "shm")
"""GRADSYNC_TRANSPORT: auto (shared memory between ranks of one host where this machine supports
it, torch.distributed otherwise), tcp (torch.distributed for every peer), shm (shared memory between
ranks of one host, an error where unsupported)."""

_TRANSPORTS: dict[int, Transport] = {}


def transport_choice() -> str:
    """The GRADSYNC_TRANSPORT setting, checked."""
    choice = os.environ.get("GRADSYNC_TRANSPORT", "auto").strip().lower() or "auto"
    if choice not in TRANSPORTS:
        raise ValueError(f"GRADSYNC_TRANSPORT={os.environ['GRADSYNC_TRANSPORT']!r} is not a transport; choose one "
                         f"of {', '.join(TRANSPORTS)}")
    return choice


def build(world: runtime.World) -> Transport:
    """A new transport for ``world``'s ranks, chosen by GRADSYNC_TRANSPORT (see TRANSPORTS)."""
    choice = transport_choice()
    local = world.host_ranks
    if choice == "tcp" or world.world_size == 1:
        return TorchTransport(world)
    unsupported = doorbell.supported()
    if unsupported and choice == "shm":
        raise RuntimeError(f"GRADSYNC_TRANSPORT=shm: {unsupported}; use GRADSYNC_TRANSPORT=tcp or auto")
    if unsupported:
        return TorchTransport(world)
    job = job_token(world)  # every rank takes part: rank 0 publishes it even when alone on its host
    if len(local) == 1:
        return TorchTransport(world)
    return ShmTransport(world, local, job)


def _connect(world: runtime.World) -> None:
    _disconnect()
    _TRANSPORTS[id(world)] = build(world)


def _disconnect() -> None:
    for transport in _TRANSPORTS.values():
        close = getattr(transport, "close", None)
        if close is not None:
            close()
    _TRANSPORTS.clear()


runtime.on_init(_connect)
runtime.on_shutdown(_disconnect)


def default_transport() -> Transport:
    """The transport of the current world, made at init() (see TRANSPORTS for the choice)."""
    w = runtime.world()
    transport = _TRANSPORTS.get(id(w))
    if transport is None:
        _connect(w)
        transport = _TRANSPORTS[id(w)]
    return transport
