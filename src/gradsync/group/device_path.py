"""Which way a world's CUDA tensors go between its ranks: decided once, at init().

    host    through host memory: each collective copies the tensor to the CPU, reduces it with
            gradsync's CPU algorithms (shared memory within a host, TCP across hosts) and copies the
            result back (comm/host_staging.py), as gloo does with CUDA tensors. The path wherever two
            ranks share a GPU (NCCL refuses two ranks on one device) or NCCL is missing; no NCCL
            communicator is ever made on it. Live fault tolerance stays on it (a dead rank needs no
            NCCL abort when the data path is host memory).
    nccl    NCCL, where every rank has a GPU of its own: algorithm="auto" runs NCCL's own collectives
            (our ring over NCCL stays available by name, algorithm="ring"; band, bor and bxor, which
            NCCL lacks, are staged through host memory: comm/collectives.py).
    None    no CUDA here: CUDA tensors do not exist.

How: before any process group exists, every rank publishes its GPU (the host it is on and the UUID
of its current device, torch.cuda.current_device(): call torch.cuda.set_device(local_rank) before
init() where each rank has its own) on the rendezvous store, and every rank that has one reads all
of them, so all decide alike. GRADSYNC_CUDA_PATH=auto (the default), host or nccl; asking for nccl (or a
backend string with nccl in it) where ranks share a GPU fails here, naming them, before NCCL runs.

Only a rank that has set CUDA up before init() (torch.cuda.set_device, a CUDA tensor made:
torch.cuda.is_initialized(); `gradsync train --device cuda|auto` binds each rank to a GPU first,
GRADSYNC_BIND_GPU) publishes its GPU; any other rank, and one that sees no GPU, publishes "none" and
touches no CUDA here, so `--device cpu` on a GPU machine opens no CUDA context (which fails where
the GPUs are in EXCLUSIVE_PROCESS mode) and no rank waits for one that never publishes (nor does
such a rank wait for the others: its answer does not depend on theirs). A world with such a rank
takes the host path (always right: CUDA tensors made later are staged as gloo
stages them); asking for nccl there fails, naming the ranks. The backend "nccl" alone is made
"cpu:gloo,cuda:nccl": gradsync's own traffic is CPU tensors (the transport between hosts, the
parameter server's messages) and NCCL takes none.

Live fault tolerance (live/) stays on the host path: a process that will run a live world calls
``mark_live()`` before init() (gs.spawn does for its live ranks; a program under torchrun does it
itself), and a rejoin is live by itself.

GRADSYNC_HOST_STAGING=cpu sends CPU tensors through host staging's copies too (to a host buffer and
back, no streams): a machine without a GPU runs that path's bookkeeping in its tests.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.group.bounded_store import within
from gradsync.group.world_info import host_id

PATHS = ("auto", "host", "nccl")
"""GRADSYNC_CUDA_PATH's values."""
ENV = "GRADSYNC_CUDA_PATH"
NO_GPU = "none"
"""What a rank publishes for its GPU where it has none set up (see the module docstring)."""
WITH_CPU = "cpu:gloo,cuda:nccl"
"""What backend="nccl" becomes: NCCL for CUDA tensors and gloo for gradsync's CPU traffic."""

_LIVE = [False]


def mark_live() -> None:
    """This process's next init() makes a live world (live fault tolerance): its CUDA tensors go
    through host memory, and asking for NCCL is refused there (``choose``). Call it before init()."""
    _LIVE[0] = True


def with_cpu_backend(backend: str | None) -> str | None:
    """``backend``, with "nccl" alone made WITH_CPU (see the module docstring)."""
    return WITH_CPU if backend == "nccl" else backend


def requested() -> str:
    """GRADSYNC_CUDA_PATH, checked."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in PATHS:
        raise ValueError(f"{ENV}={os.environ[ENV]!r}: choose one of {', '.join(PATHS)} (auto: nccl where every "
                         f"rank has a GPU of its own, host otherwise)")
    return value


def stage_cpu_tensors() -> bool:
    """GRADSYNC_HOST_STAGING=cpu: CPU tensors take host staging's copies as well (the tests' knob)."""
    value = os.environ.get("GRADSYNC_HOST_STAGING", "").strip().lower()
    if value not in ("", "cpu", "0", "off"):
        raise ValueError(f"GRADSYNC_HOST_STAGING={value!r}: give cpu (CPU tensors through the staging copies, "
                         f"for tests) or leave it unset")
    return value == "cpu"


def bind_gpu() -> None:
    """Under GRADSYNC_BIND_GPU=1 (set by `gradsync train --device cuda|auto` where there is a GPU), make
    GPU LOCAL_RANK mod GPU count this process's current device; init() calls it before it reads the
    device (other programs call torch.cuda.set_device(local_rank) themselves, as torchrun's do)."""
    if os.environ.get("GRADSYNC_BIND_GPU") == "1" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count())


def gpu_identity() -> str:
    """This rank's GPU as the other ranks can compare it: host and the current device's UUID (its index
    where the UUID is not known)."""
    device = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{host_id()}#{uuid if uuid is not None else f'cuda:{device}'}"


def sharing(identities: list[str | None]) -> list[list[int]]:
    """Groups of two or more ranks with the same GPU, in rank order (ranks with none left out)."""
    by_gpu: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        if identity is not None:
            by_gpu.setdefault(identity, []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def _ranks(groups: list[list[int]]) -> str:
    return ", ".join(" and ".join(map(str, group)) for group in groups)


def choose(identities: list[str | None] | None, backend: str | None, wanted: str, nccl_available: bool,
           live: bool = False) -> tuple[str | None, str]:
    """(path, backend string) for a world whose ranks have these GPUs (None for a rank: it has none
    set up; None for the list: no CUDA here), given the backend asked of init() (None: auto) and
    GRADSYNC_CUDA_PATH. Raises where nccl is asked for and cannot be: ranks share a GPU or have none,
    NCCL is missing, or the world is live."""
    backend = with_cpu_backend(backend)
    if identities is None:
        return None, backend or "gloo"
    shared, without = sharing(identities), [r for r, identity in enumerate(identities) if identity is None]
    forced_nccl = wanted == "nccl" or (backend is not None and "nccl" in backend)
    if forced_nccl:
        why = (f"ranks {_ranks(shared)} share a GPU (NCCL refuses two ranks on one device)" if shared
               else f"rank{'s' if len(without) > 1 else ''} {_ranks([without])} set up no GPU before init() "
                    f"(or see none)" if without
               else "this torch has no NCCL" if not nccl_available
               else "live fault tolerance runs on host staging (a dead rank needs no NCCL abort there)" if live
               else None)
        if why is not None:
            asked = f"backend={backend!r}" if backend is not None and "nccl" in backend else f"{ENV}=nccl"
            raise RuntimeError(f"{asked}: {why}; use {ENV}=host (CUDA tensors through host memory, as gloo) or "
                               f"give each rank a GPU of its own (torch.cuda.set_device(local_rank) before init)")
        return "nccl", backend if backend is not None and "nccl" in backend else WITH_CPU
    if (wanted == "host" or shared or without or not nccl_available or live
            or (backend is not None and "nccl" not in backend)):
        return "host", backend or "gloo"
    return "nccl", backend or WITH_CPU


def _publishes_gpu(backend: str | None) -> bool:
    """Whether this rank publishes its GPU: it has one, and has set CUDA up before init() or asks for
    NCCL (module docstring). Asking whether a GPU exists opens no context; asking which one may."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.is_initialized() or requested() == "nccl" or (backend is not None and "nccl" in backend)


def settle(store, rank: int, world_size: int, timeout: float, backend: str | None, live: bool = False):
    """Publish this rank's GPU on ``store`` (or NO_GPU), and choose (see ``choose``). A rank that
    publishes NO_GPU needs no one else's answer: with it in the world the path is host (no CUDA path
    where it has no CUDA) and the backend gloo, unless one was given; a rank that asks for NCCL then
    fails on the others, naming it. A rank that publishes its GPU reads every rank's."""
    key = "gradsync/gpu"   # the store is this init's own (runtime._meet)
    if not _publishes_gpu(backend):
        store.set(f"{key}/{rank}", NO_GPU)
        return ("host" if torch.cuda.is_available() else None), with_cpu_backend(backend) or "gloo"
    store.set(f"{key}/{rank}", gpu_identity())
    keys = [f"{key}/{r}" for r in range(world_size)]

    def read() -> list[str]:   # bounded even on a store whose host went silent (bounded_store.within)
        store.wait(keys, timedelta(seconds=timeout))
        return [store.get(k).decode() for k in keys]

    try:
        identities = within(timeout + 1.0, f"rank {rank}: the GPU exchange", read)
    except Exception as exc:
        raise RuntimeError(f"rank {rank}: not every rank published its GPU within {timeout:.0f} s: {exc}") from exc
    return choose([None if identity == NO_GPU else identity for identity in identities], backend, requested(),
                  dist.is_nccl_available(), live or _LIVE[0])
