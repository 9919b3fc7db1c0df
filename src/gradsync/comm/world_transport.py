"""The transport of a world: which Transport carries its ranks' bytes, made at init() with its context.

Above both implementations, so that neither the interface (transport/__init__.py) nor an
implementation imports this choice: it registers with runtime.on_init, so init() connects the
world's transport (and shutdown() closes it), and default_transport() hands it to the collectives.
Each transport it builds gets a new CommContext (context.py): the communicator's own state.

    GRADSYNC_TRANSPORT=auto   shared memory between ranks of one host where this machine supports
                              it (transport/shm/doorbell.py says), torch.distributed otherwise (the default)
    GRADSYNC_TRANSPORT=tcp    torch.distributed for every peer (transport/torch_distributed.py)
    GRADSYNC_TRANSPORT=shm    shared memory between ranks of one host, an error where unsupported

A world of one rank, or a rank alone on its host, gets a TorchTransport. Every rank takes part in
the shared-memory job token (transport/shm/segment.py's job_token) first, even one alone on its host: rank 0
publishes it.

The public surface: code outside comm/ asks these, never the transports' internals.
    carrier(transport)          "shm" or "tcp": what carries the world's bytes
    shares_memory(transport)    every rank on this host over shared memory (the intra-host algorithms run)
    direct_below(n_ranks)       the shared-memory all-reduce's one-shot band: messages below it
    IN_PLACE_FROM_BYTES, SHM_DIR
"""

from __future__ import annotations

import os
from types import SimpleNamespace

from gradsync.group import device_path, runtime
from gradsync.comm.context import CommContext
from gradsync.comm.reduce_ops import half_sum
from gradsync.comm.transport.shm import doorbell, segment
from gradsync.comm.allreduce_two_shot import direct_below as _direct_below
from gradsync.comm.allreduce_in_place import IN_PLACE_FROM_BYTES
from gradsync.comm.transport.shm.segment import SHM_DIR, job_token
from gradsync.comm.transport.shm.transport import ShmTransport
from gradsync.comm.transport import Transport
from gradsync.comm.transport.torch_distributed import TorchTransport

__all__ = ["IN_PLACE_FROM_BYTES", "SHM_DIR", "TRANSPORTS", "build", "carrier", "default_transport",
           "direct_below", "shares_memory", "transport_choice"]


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
    """A new transport for ``world``'s ranks, chosen by GRADSYNC_TRANSPORT (see TRANSPORTS); under
    GRADSYNC_HOST_STAGING=cpu its CPU tensors go through host staging's copies (device_path.py), the
    "gradsync" backend's groups as the world's."""
    return _chosen(world, CommContext(stage_cpu=device_path.stage_cpu_tensors()))


def _chosen(world: runtime.World, context: CommContext) -> Transport:
    choice = transport_choice()
    local = world.host_ranks
    if choice == "tcp" or world.world_size == 1:
        return TorchTransport(world, context=context)
    unsupported = doorbell.supported()
    if unsupported and choice == "shm":
        raise RuntimeError(f"GRADSYNC_TRANSPORT=shm: {unsupported}; use GRADSYNC_TRANSPORT=tcp or auto")
    if unsupported:
        return TorchTransport(world, context=context)
    job = job_token(world)  # every rank takes part: rank 0 publishes it even when alone on its host
    if len(local) == 1:
        return TorchTransport(world, context=context)
    return ShmTransport(world, local, job, context=context, narrow_half_sums=half_sum() == "narrow")


def _connect(world: runtime.World) -> None:
    _disconnect()
    _TRANSPORTS[id(world)] = build(world)


def _disconnect() -> None:
    for transport in _TRANSPORTS.values():
        transport.close()
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


def carrier(transport: Transport | None = None) -> str:
    """What carries the bytes of ``transport`` (default: the current world's): "shm" where shared memory
    connects the ranks of a host, "tcp" where torch.distributed carries them all."""
    return "shm" if isinstance(transport or default_transport(), ShmTransport) else "tcp"


def shares_memory(transport: Transport) -> bool:
    """Whether every rank of ``transport`` is on this host over shared memory, so that the intra-host
    algorithms (and shared regions, and the transport's own barrier) serve it."""
    return transport.shares_memory


def direct_below(n_ranks: int) -> int:
    """Messages of fewer bytes than this take the shared-memory all-reduce's one-shot (direct) path
    with ``n_ranks`` ranks on one host, at this process's staging size."""
    return _direct_below(SimpleNamespace(world_size=n_ranks, stage_bytes=segment.stage_bytes()))
