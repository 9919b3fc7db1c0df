"""Process-group set-up: who this process is, how many ranks there are, how long anyone may wait.

Vocabulary
    rank              this process's index in the job, 0..world_size-1
    world_size        number of ranks (N)
    local_rank        index among the ranks on this host, 0..local_world_size-1
    local_world_size  number of ranks on this host
    timeout           seconds any single wait (a receive, a store lookup) may block before it
                      becomes an error naming the peer and the operation

Where the values come from, first match wins:
    1. explicit arguments to ``init()``;
    2. torchrun's environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
       MASTER_PORT (Kubernetes' PyTorchJob sets the same, without LOCAL_RANK);
    3. Slurm's, where RANK and WORLD_SIZE are unset: a task of an srun step of several tasks is one
       rank (SLURM_PROCID, the step's task count, SLURM_LOCALID, the step's first node and a port
       from the job id: slurm.py); a world Slurm describes partly is an error saying what was found;
    4. nothing set at all: a world of one (rank 0 of 1) on a free loopback port.
Without LOCAL_RANK (and without Slurm's), local_rank and local_world_size are this rank's place
among the ranks the host exchange finds on its host (one process per pod in a PyTorchJob: 0 of 1).

Joining a world the program already made: when torch.distributed is initialised before init() (a
script's own init_process_group, torchrun + Lightning, Accelerate), init() joins that world
instead of making one (join.py): rank, world size, timeout and the rendezvous store come from
torch's default group, which gradsync never destroys. The public entry points (the collectives,
DistributedDataParallel, ShardedOptimizer, ParameterServer) call world(), which joins on first
use; joining is collective, like init_process_group itself.

Backend: gloo when CUDA is absent. With CUDA, decided once here from every rank's GPU
(device_path.py): "cpu:gloo,cuda:nccl" where every rank has a GPU of its own, so CPU tensors travel
over gloo and CUDA tensors over NCCL; gloo where ranks share a GPU, CUDA tensors then staged through
host memory (comm/host_staging.py) and no NCCL communicator made. The rendezvous store is a torch TCPStore on MASTER_ADDR:MASTER_PORT,
hosted by rank 0 unless the launcher already hosts it (gs.spawn sets GRADSYNC_EXTERNAL_STORE=1;
torchrun's agent sets TORCHELASTIC_USE_AGENT_STORE=True).
"""

from __future__ import annotations

import dataclasses
import os
import socket
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from gradsync.group import device_path, join, slurm
from gradsync.observe import stall
from gradsync.group.world_info import DEFAULT_TIMEOUT, World, debug_from_env, exchange_hosts, release_group

BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")


_WORLD: World | None = None
_BEFORE_INIT: list[Callable[[], None]] = []
_ON_INIT: list[Callable[[World], None]] = []
_ON_SHUTDOWN: list[Callable[[], None]] = []


_JOINED = [0]
"""id() of the torch default group gradsync joined: world() notices when the program replaced it."""


def before_init(hook: Callable[[], None]) -> None:
    """Run ``hook()`` at the start of every init(), before the ranks meet (the package loads its public
    names there, so a spawned rank has them before the rendezvous, as its launcher had). Once per hook."""
    if hook not in _BEFORE_INIT:
        _BEFORE_INIT.append(hook)


def on_init(hook: Callable[[World], None]) -> None:
    """Run ``hook(world)`` at the end of every init() (the communication layer connects there)."""
    _ON_INIT.append(hook)


def on_shutdown(hook: Callable[[], None]) -> None:
    """Run ``hook()`` at the start of every shutdown()."""
    _ON_SHUTDOWN.append(hook)


def hooks() -> tuple[list, list, list]:
    """The before-init, init and shutdown hooks of this process, for a launcher to hand to its ranks
    (launch.py)."""
    return list(_BEFORE_INIT), list(_ON_INIT), list(_ON_SHUTDOWN)


def add_hooks(before_hooks: list, init_hooks: list, shutdown_hooks: list) -> None:
    """Register those of ``hooks()``'s lists that are not registered here yet (a module that registers its
    own when imported has already done so when they were unpickled)."""
    _BEFORE_INIT.extend(h for h in before_hooks if h not in _BEFORE_INIT)
    _ON_INIT.extend(h for h in init_hooks if h not in _ON_INIT)
    _ON_SHUTDOWN.extend(h for h in shutdown_hooks if h not in _ON_SHUTDOWN)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0 and read what the kernel chose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _resolve_backend(backend: str | None) -> str:
    """``backend`` checked; None is "auto", which init() settles from the ranks' GPUs (device_path.py);
    "nccl" is "cpu:gloo,cuda:nccl" (gradsync's own traffic is CPU tensors, which NCCL does not take)."""
    if backend is None:
        return "auto" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)} or None (auto)")
    if "nccl" in backend and not torch.cuda.is_available():
        raise RuntimeError(f"backend {backend!r} needs CUDA, and torch.cuda.is_available() is False")
    return device_path.with_cpu_backend(backend)


def _resolve(backend, timeout, rank, world_size, local_rank, local_world_size,
             master_addr, master_port, debug) -> World:
    told = rank is not None or world_size is not None or "RANK" in os.environ or "WORLD_SIZE" in os.environ
    scheduled = None if told else slurm.world_from_env()
    if scheduled is not None:
        rank, world_size = scheduled.rank, scheduled.world_size
    env_world_size = _env_int("WORLD_SIZE")
    world_size = world_size if world_size is not None else env_world_size
    rank = rank if rank is not None else _env_int("RANK")
    if world_size is None:
        world_size, rank = 1, (0 if rank is None else rank)
    if rank is None:
        raise ValueError(f"world_size={world_size} was given but rank was not (pass rank= or set RANK)")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must satisfy 0 <= rank < world_size={world_size}, got {rank!r}")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")

    local_rank = local_rank if local_rank is not None else _env_int("LOCAL_RANK")
    local_world_size = local_world_size if local_world_size is not None else _env_int("LOCAL_WORLD_SIZE")
    if scheduled is not None:
        local_rank = scheduled.local_rank if local_rank is None else local_rank
        local_world_size = scheduled.local_world_size if local_world_size is None else local_world_size
    local_from_hosts = local_rank is None   # settled at the host exchange (_meet)
    if local_rank is None:
        local_rank = rank
    if local_world_size is None:
        local_world_size = world_size
    if not 0 <= local_rank < local_world_size <= world_size:
        raise ValueError(f"need 0 <= local_rank < local_world_size <= world_size, got "
                         f"local_rank={local_rank}, local_world_size={local_world_size}, world_size={world_size}")

    slurm_addr = scheduled.master_addr if scheduled is not None else None
    master_addr = master_addr or os.environ.get("MASTER_ADDR") or slurm_addr or "127.0.0.1"
    master_port = master_port if master_port is not None else _env_int("MASTER_PORT")
    if master_port is None and scheduled is not None:
        master_port = scheduled.master_port
    if master_port is None:
        if world_size > 1:
            raise ValueError(f"world_size={world_size} needs MASTER_PORT (or master_port=) so the ranks can meet")
        master_port = free_port(master_addr)
    if debug is None:
        debug = debug_from_env()
    return World(rank=rank, world_size=world_size, local_rank=local_rank,
                 local_world_size=local_world_size, backend=_resolve_backend(backend),
                 timeout=float(timeout), master_addr=master_addr, master_port=int(master_port),
                 debug=bool(debug), local_from_hosts=local_from_hosts)


def init(backend: str | None = None, timeout: float | None = None, *, rank: int | None = None,
         world_size: int | None = None, local_rank: int | None = None,
         local_world_size: int | None = None, master_addr: str | None = None,
         master_port: int | None = None, debug: bool | None = None) -> World:
    """Join the job and return this rank's World; see the module docstring for where values come from.

    ``timeout``: seconds any single wait may block; None means DEFAULT_TIMEOUT in a world of
    gradsync's own and the existing group's timeout when joining one.
    Calling init() again with the same settings returns the same World; with different settings it
    raises, because two process groups with different shapes cannot both be right.
    """
    global _WORLD
    for hook in list(_BEFORE_INIT):
        hook()
    if _WORLD is None and dist.is_initialized():
        _WORLD = join.join_default_group(backend=backend, timeout=timeout, rank=rank, world_size=world_size,
                                         local_rank=local_rank, local_world_size=local_world_size, debug=debug)
        _JOINED[0] = id(dist.GroupMember.WORLD)
        _connect_or_undo(_WORLD)
        return _WORLD
    if _WORLD is not None and _WORLD.joined:
        join.check_same(_WORLD, backend=backend, timeout=timeout, rank=rank, world_size=world_size)
        return _WORLD
    wanted = _resolve(backend, DEFAULT_TIMEOUT if timeout is None else timeout, rank, world_size, local_rank,
                      local_world_size, master_addr, master_port, debug)
    if _WORLD is not None:
        if wanted.backend == "auto":   # settled at the first init() from the ranks' GPUs
            wanted = dataclasses.replace(wanted, backend=_WORLD.backend)
        if wanted.local_from_hosts:   # settled at the first init()'s host exchange
            wanted = dataclasses.replace(wanted, local_rank=_WORLD.local_rank,
                                         local_world_size=_WORLD.local_world_size)
        explicit_port = master_port is not None or "MASTER_PORT" in os.environ
        same = wanted.settings() == _WORLD.settings() or (
            not explicit_port and wanted.settings()[:-2] == _WORLD.settings()[:-2]
            and wanted.debug == _WORLD.debug)
        if same:
            return _WORLD
        raise RuntimeError(f"gradsync.init() was already called with {_describe(_WORLD)}; "
                           f"now called with {_describe(wanted)}. Call gradsync.shutdown() first.")

    # torchrun's agent already hosts the store on MASTER_PORT; its workers join it as clients under
    # a per-restart prefix, exactly as torch's own env:// rendezvous does.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    host_store = wanted.rank == 0 and os.environ.get("GRADSYNC_EXTERNAL_STORE") != "1" and not agent_store
    wait = timedelta(seconds=wanted.timeout)
    try:
        store = dist.TCPStore(wanted.master_addr, wanted.master_port, wanted.world_size,
                              is_master=host_store, timeout=wait, wait_for_workers=False)
        if agent_store:
            store = dist.PrefixStore(f"/worker/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    except Exception as exc:
        raise RuntimeError(f"rank {wanted.rank}: could not reach the rendezvous store at "
                           f"{wanted.master_addr}:{wanted.master_port} within {wanted.timeout:.0f} s: {exc}") from exc
    # Every init() of this process gets keys of its own: a second init() on the same store (after
    # shutdown()) would otherwise meet the first one's rendezvous keys and hang.
    generation = int(store.add(f"gradsync/init/{wanted.rank}", 1))
    return _meet(wanted, store, f"gradsync/world{generation}", generation)


def _meet(wanted: World, store, prefix: str, generation: int, live: bool = False) -> World:
    """Make torch's default group and this rank's World on ``store`` under ``prefix``, then connect;
    the CUDA path and the backend are settled first, from every rank's GPU (device_path.py)."""
    global _WORLD
    store = dist.PrefixStore(prefix, store)
    device_path.bind_gpu()
    cuda_path, backend = device_path.settle(store, wanted.rank, wanted.world_size, wanted.timeout,
                                            None if wanted.backend == "auto" else wanted.backend, live)
    wanted = dataclasses.replace(wanted, backend=backend, cuda_path=cuda_path)
    dist.init_process_group(wanted.backend, store=store, rank=wanted.rank,
                            world_size=wanted.world_size, timeout=timedelta(seconds=wanted.timeout))
    try:
        hosts = ((0,),) if wanted.world_size == 1 else exchange_hosts(
            store, wanted.rank, wanted.world_size, wanted.timeout)
    except BaseException:
        dist.destroy_process_group()
        raise
    _WORLD = World(**{**wanted.__dict__, **_place_on_host(wanted, hosts), "store": store, "hosts": hosts,
                      "generation": generation})
    _connect_or_undo(_WORLD)
    return _WORLD


def _place_on_host(wanted: World, hosts: tuple[tuple[int, ...], ...]) -> dict:
    """local_rank and local_world_size from the host exchange, where nothing gave them (no LOCAL_RANK)."""
    if not wanted.local_from_hosts:
        return {}
    host = next(group for group in hosts if wanted.rank in group)
    return {"local_rank": host.index(wanted.rank), "local_world_size": len(host)}


def rejoin(previous: World, job_store, rank: int, world_size: int, local_rank: int, local_world_size: int,
           prefix: str, generation: int | None = None) -> World:
    """Form a new world from the survivors of ``previous`` (live fault tolerance, live/): after shutdown(),
    every member calls this with its new dense ``rank`` of ``world_size`` and the same ``prefix``, a
    namespace of ``job_store`` (the store the old world's keys lived in) that no world used before.
    Backend, timeout and rendezvous address stay those of ``previous``; ``generation`` (the World's,
    which names its shared-memory segments) too unless given: every member must pass the same (a
    replacement rank that never called init() has none of its own)."""
    if _WORLD is not None:
        raise RuntimeError(f"rank {previous.rank}: rejoin() needs the old world shut down first (gradsync.shutdown())")
    if previous.joined:
        raise RuntimeError("live fault tolerance needs a world of gradsync's own (gradsync.init(), gs.spawn, "
                           "torchrun), not one joined from the program's torch.distributed.init_process_group()")
    wanted = dataclasses.replace(previous, rank=rank, world_size=world_size, local_rank=local_rank,
                                 local_world_size=local_world_size, store=None, hosts=(), group_key=None,
                                 local_from_hosts=False)
    return _meet(wanted, job_store, prefix, previous.generation if generation is None else generation, live=True)


_REPLACEMENT: list[tuple[int, World]] = []
"""(member id, settings) of a replacement process that is to join a live world (expect_replacement)."""


def expect_replacement(member: int, backend: str | None = None, timeout: float | None = None,
                       debug: bool | None = None) -> None:
    """Mark this process as a replacement rank of a live job (gs.spawn's ``replacements``): it calls no
    init(); gradsync.live.LiveDDP joins it to the running world as member ``member`` (live/growth.py),
    with these settings and the rendezvous address of the environment (MASTER_ADDR, MASTER_PORT)."""
    for hook in list(_BEFORE_INIT):
        hook()
    settings = _resolve(backend, DEFAULT_TIMEOUT if timeout is None else timeout, 0, 1, 0, 1, None, None, debug)
    _REPLACEMENT[:] = [(member, settings)]


def replacement() -> tuple[int, World] | None:
    """(member id, settings) when this process is a replacement not yet joined (expect_replacement), else None."""
    return _REPLACEMENT[0] if _REPLACEMENT and _WORLD is None else None


def connect_store(settings: World):
    """A client of the job's rendezvous store at ``settings``' address (a replacement rank's way in)."""
    try:
        return dist.TCPStore(settings.master_addr, settings.master_port, 1, is_master=False,
                             timeout=timedelta(seconds=settings.timeout), wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(f"could not reach the rendezvous store at {settings.master_addr}:{settings.master_port} "
                           f"within {settings.timeout:.0f} s: {exc}") from exc


def _connect_or_undo(new: World) -> None:
    """Run the init hooks (the transport connects) and start the stall inspector; on failure leave
    nothing behind: no World, and no default group if gradsync made it."""
    global _WORLD
    try:
        for hook in _ON_INIT:
            hook(new)
    except BaseException:
        _WORLD = None
        release_group(new.group_key)
        if not new.joined and dist.is_initialized():
            dist.destroy_process_group()
        raise
    stall.start(new)


def _describe(w: World) -> str:
    return (f"rank={w.rank}, world_size={w.world_size}, backend={w.backend!r}, timeout={w.timeout}, "
            f"master={w.master_addr}:{w.master_port}, debug={w.debug}")


def world() -> World:
    """This rank's World. Where torch.distributed is initialised but gradsync is not, joins it
    (init(); collective: every rank must get here); otherwise raises if init() has not been called."""
    if _WORLD is not None and _WORLD.joined and id(dist.GroupMember.WORLD) != _JOINED[0]:
        shutdown()  # the program destroyed the world gradsync joined (and may have made another)
    if _WORLD is None:
        if dist.is_initialized():
            return init()
        raise RuntimeError("gradsync is not initialised: call gradsync.init() (or run under gradsync.spawn / torchrun), "
                           "or torch.distributed.init_process_group(), first")
    return _WORLD


def rank_and_size() -> tuple[int, int]:
    """(rank, world_size) without joining anything: gradsync's world, else torch's default group."""
    if _WORLD is None and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    w = world()
    return w.rank, w.world_size


def is_initialized() -> bool:
    """True between init() and shutdown()."""
    return _WORLD is not None


def shutdown() -> None:
    """Leave the job: close gradsync's transport and threads, and destroy torch's default group if
    gradsync made it (a joined program's group stays, for its own destroy_process_group()). Safe to
    call when not initialised."""
    global _WORLD
    if _WORLD is None:
        return
    leaving, _WORLD = _WORLD, None
    stall.stop()
    for hook in _ON_SHUTDOWN:
        hook()
    release_group(leaving.group_key)
    if not leaving.joined and dist.is_initialized():
        dist.destroy_process_group()
