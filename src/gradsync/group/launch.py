"""spawn(fn, nprocs, args): run fn on N local ranks and bring every rank's return value back.

Recipe
    1. host the rendezvous store in the launcher on a port the kernel picks (no fixed ports, no
       race between choosing a port and binding it);
    2. start N processes; each sets its rank's environment exactly as torchrun would (RANK,
       WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), asks the kernel to
       kill it if its parent dies (PR_SET_PDEATHSIG: no orphans), runs runtime.init()
       (gradsync.init), then fn(*args);
    3. each rank saves its return value with torch.save into a private temporary directory
       (tensors and state dicts arrive intact after the rank exits, on the CPU: load_result) or, if
       fn raised, its traceback;
    4. the launcher watches all processes; the first failure (an exception or a death by signal)
       stops the others (STOP_SIGNAL, then SIGKILL after a grace period) and raises SpawnError naming
       the rank and carrying its traceback;
    5. a stopped rank dumps its Python stack as it dies (faulthandler on STOP_SIGNAL works even while
       the rank is blocked inside a gloo wait), so the error also says what every other rank was
       doing: "rank 1 was in all_reduce <- allreduce_ring <- wait".

Signals (job_signals.py): SIGTERM stays the scheduler's; ``forward_signals`` are relayed to every
rank, held by a rank until it can handle them. Start-up (forkserver.py): ranks are forked from a
forkserver that has imported torch once. A failure (spawn_report.py): one screen naming the rank,
its traceback, and where the stopped ranks were.

Threads: like torchrun, each rank gets max(1, cpu_count // nprocs) intra-op threads unless
OMP_NUM_THREADS is set, so N ranks do not oversubscribe the cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import secrets
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradsync.group import device_path, runtime
from gradsync.group.forkserver import early_output, launcher_state, start_context, take_launcher_state
from gradsync.group.job_signals import REPEATED_SIGNAL_SECONDS, hold_signals, take_back_job_signals, take_held
from gradsync.group.spawn_report import SpawnError, spawn_error  # noqa: F401 - launch.SpawnError, as callers know it

GRACE_SECONDS = 5.0
"""How long a stopped rank gets between STOP_SIGNAL and SIGKILL."""
STOP_SIGNAL = signal.SIGUSR2
"""How the launcher stops the other ranks after a failure (not SIGTERM: that one is the scheduler's)."""


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the launcher exits (no orphan ranks)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return


def _name_process(name: str) -> None:
    """Set the kernel's name for this process (ps -o comm, top, /proc/PID/comm; 15 bytes at most)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        except OSError:
            pass


class NotNeeded(Exception):
    """Raised by a replacement rank (spawn's ``replacements``) whose job finished before it could join:
    its value is None and it is no failure."""


def _rank_main(rank: int, nprocs: int, port: int, fn: Callable, args: tuple, out_dir: str,
               init_kwargs: dict, job: str, forward_signals: tuple[int, ...] = (),
               launcher: dict | None = None, replacement: bool = False, live: bool = False) -> None:
    hold_signals(forward_signals)
    take_back_job_signals(forward_signals, launcher["ignored"] if launcher else ())
    (Path(out_dir) / f"{rank}.ready").touch()
    parent = os.getppid()   # the launcher, or the forkserver it started
    _die_with_parent()
    _name_process(f"gradsync-r{rank}")
    if os.getppid() != parent:  # the parent died before prctl took effect (a forkserver exits with the launcher)
        os._exit(1)
    if launcher is not None:
        take_launcher_state(launcher)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GRADSYNC_EXTERNAL_STORE": "1",
                       "GRADSYNC_JOB_ID": job})
    if not replacement:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(nprocs)})
    if live:   # a live world's CUDA tensors go through host memory: a death needs no NCCL abort (device_path.py)
        device_path.mark_live()
    threads = os.environ.get("OMP_NUM_THREADS", "")
    # torch read OMP_NUM_THREADS when it was imported, which in a forked rank was in the forkserver
    torch.set_num_threads(int(threads) if threads.isdigit() and int(threads) > 0
                          else max(1, (os.cpu_count() or 1) // nprocs))
    out = Path(out_dir)
    stack_file = open(out / f"{rank}.stack", "w")  # noqa: SIM115 - must stay open for the handler
    faulthandler.register(STOP_SIGNAL, file=stack_file, all_threads=True, chain=True)
    try:
        if replacement:   # no world yet: gradsync.live.LiveDDP joins it to the running one
            runtime.expect_replacement(rank, **init_kwargs)
        else:
            runtime.init(**init_kwargs)
        try:
            result = fn(*args)
        except NotNeeded:
            sys.stdout.flush()
            return
        for signum in forward_signals:   # fn is done: a relayed signal now would only lose its result
            signal.signal(signum, signal.SIG_IGN)
        tmp = out / f"{rank}.result.tmp"
        torch.save(result, tmp)
        os.replace(tmp, out / f"{rank}.result")
    except BaseException as exc:  # noqa: BLE001 - everything must reach the launcher
        (out / f"{rank}.error").write_text(
            f"{type(exc).__name__}: {exc}\n\n" + "".join(traceback.format_exception(exc)))
        sys.stderr.flush()
        os._exit(1)
    try:
        runtime.shutdown()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def load_result(path: Path) -> Any:
    """A rank's return value, its tensors on the CPU: a rank's CUDA tensors would otherwise load onto
    the launcher's GPUs (the same index, which may not exist there, and a CUDA context in the launcher)."""
    return torch.load(path, weights_only=False, map_location="cpu")


def _stop(processes: list) -> None:
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        try:
            os.kill(p.pid, STOP_SIGNAL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + GRACE_SECONDS
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()


FAULT_TOLERANCE = ("stop", "live")
"""What spawn does when a rank dies: stop the others (stop), or let them run on (live: the survivors
rebuild their world, gradsync.live)."""


def spawn(fn: Callable, nprocs: int = 2, args: tuple = (), *, backend: str | None = None,
          timeout: float = 60.0, debug: bool | None = None, join_timeout: float | None = None,
          forward_signals: tuple[int, ...] = (), fault_tolerance: str = "stop", replacements: int = 0) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks after gradsync.init(); return values in rank order.

    ``timeout`` is every rank's per-wait timeout (gradsync.init); ``join_timeout`` bounds the whole
    run (None: unbounded). Raises SpawnError if any rank raises or dies; the other ranks are stopped.
    ``forward_signals``: signals the launcher relays to every rank while they run (see module docstring).
    ``fault_tolerance="live"``: a rank killed by a signal is not a failure; the others run on (their
    program rebuilds the world: gradsync.live.LiveDDP) and the dead rank's value is None. A rank that
    raises, or every rank dying, is still a SpawnError.
    ``replacements`` (live only): for each rank killed by a signal while others still run, start a
    replacement process, at most this many in the whole run. Replacement k (0, 1, ...) is member
    ``nprocs + k`` (a new member id: a dead one is never reused) and joins the running world at a
    step boundary when its fn creates gradsync.live.LiveDDP (live/growth.py); it calls no
    gradsync.init() and must create LiveDDP before any other collective. Its return value is
    appended: the result has ``nprocs + started`` entries, entry ``nprocs + k`` being replacement
    k's (None if the job finished before it joined: launch.NotNeeded).
    """
    if not isinstance(replacements, int) or isinstance(replacements, bool) or replacements < 0:
        raise ValueError(f"replacements must be an integer >= 0, got {replacements!r}")
    if replacements and fault_tolerance != "live":
        raise ValueError(f"replacements={replacements} needs fault_tolerance='live' (a replacement joins a world "
                         f"whose survivors ran on), got fault_tolerance={fault_tolerance!r}")
    if fault_tolerance not in FAULT_TOLERANCE:
        raise ValueError(f"fault_tolerance must be one of {', '.join(FAULT_TOLERANCE)}, got {fault_tolerance!r}")
    if not isinstance(nprocs, int) or isinstance(nprocs, bool) or nprocs < 1:
        raise ValueError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except Exception as exc:
        raise ValueError(f"fn must be importable by the child processes (a module-level function, "
                         f"not a lambda or closure): {exc}") from None
    if not isinstance(args, tuple):
        raise TypeError(f"args must be a tuple, got {type(args).__name__}")

    store = dist.TCPStore("127.0.0.1", 0, nprocs + 1, is_master=True, wait_for_workers=False)
    init_kwargs = {"backend": backend, "timeout": timeout, "debug": debug}
    ctx = start_context()
    job = f"{os.getpid()}x{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix=f"gradsync-spawn-{os.getpid()}-") as out_dir:
        launcher = launcher_state()
        def process(rank: int, replacement: bool = False):
            return ctx.Process(target=_rank_main, name=f"gradsync-rank-{rank}",
                               args=(rank, nprocs, store.port, fn, args, out_dir, init_kwargs, job,
                                     tuple(forward_signals), launcher, replacement, fault_tolerance == "live"))

        processes = [process(rank) for rank in range(nprocs)]

        def replace() -> Any:
            if len(processes) - nprocs >= replacements:
                return None
            processes.append(process(len(processes), replacement=True))
            processes[-1].start()
            return processes[-1]

        try:
            for p in processes:
                p.start()
            with _relaying(forward_signals, processes, Path(out_dir)):
                failed = _watch(processes, join_timeout, live=fault_tolerance == "live", replace=replace)
            if failed is not None:
                time.sleep(0.2)  # let ranks that fail because of this one report it first
                exit_codes = {rank: p.exitcode for rank, p in enumerate(processes)}  # before we stop anyone
                _stop(processes)
                raise spawn_error(exit_codes, failed, Path(out_dir), _early_output())
            return [load_result(Path(out_dir) / f"{rank}.result")
                    if processes[rank].exitcode == 0 and (Path(out_dir) / f"{rank}.result").exists() else None
                    for rank in range(len(processes))]
        finally:
            _stop(processes)
            _remove_segments(job)
            del store


def _early_output() -> str:
    """The ranks' output before they took the launcher's stdio (forkserver.early_output), if any."""
    try:
        return early_output().read_text(errors="replace")[-20000:]
    except OSError:
        return ""


@contextlib.contextmanager
def _relaying(signums: tuple[int, ...], processes: list, out_dir: Path):
    """While the ranks run, each of ``signums`` reaching the launcher is sent on to every live rank,
    to a rank that is still starting once it is ready (only the main thread can install handlers;
    elsewhere the signals keep their actions). SIGINT among them: the first is relayed, a second
    raises KeyboardInterrupt here (a second Ctrl-C stops the job at once)."""
    if not signums or threading.current_thread() is not threading.main_thread():
        yield
        return

    def send(p, signum) -> None:
        if p.pid is not None and p.exitcode is None:
            try:
                os.kill(p.pid, signum)
            except ProcessLookupError:
                pass

    def send_when_ready(starting: list[tuple[int, Any]], signum) -> None:
        deadline = time.monotonic() + 600
        while starting and time.monotonic() < deadline:
            for rank, p in list(starting):
                if (out_dir / f"{rank}.ready").exists() or p.exitcode is not None:
                    send(p, signum)
                    starting.remove((rank, p))
            time.sleep(0.01)

    first_interrupt: list[float] = []

    def relay(signum, frame) -> None:
        if signum == signal.SIGINT:
            if first_interrupt and time.monotonic() - first_interrupt[0] >= REPEATED_SIGNAL_SECONDS:
                raise KeyboardInterrupt   # a second Ctrl-C: stop at once (spawn's finally stops the ranks)
            if first_interrupt:
                return
            first_interrupt.append(time.monotonic())
        starting = []
        for rank, p in enumerate(processes):
            if (out_dir / f"{rank}.ready").exists():
                send(p, signum)
            else:
                starting.append((rank, p))
        if starting:
            threading.Thread(target=send_when_ready, args=(starting, signum), daemon=True).start()

    previous = {signum: signal.signal(signum, relay) for signum in signums}
    for signum in signums:   # held by the launcher before it started relaying (hold_signals): relayed once
        if take_held(signum)[0]:
            relay(signum, None)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _remove_segments(job: str) -> None:
    """Unlink the job's shared-memory names. Ranks unlink their own once every peer has mapped
    them (comm/transport/shm/segment.py); this catches a job stopped during that set-up."""
    for leftover in Path("/dev/shm").glob(f"gradsync-{job}*") if Path("/dev/shm").is_dir() else ():
        leftover.unlink(missing_ok=True)


def _watch(processes: list, join_timeout: float | None, live: bool = False, replace: Callable = lambda: None
           ) -> int | None:
    """Wait until all ranks exit; return the first failed rank (None: all succeeded). ``live``: a rank
    killed by a signal is no failure while another rank is still running (spawn's fault_tolerance);
    ``replace()`` then starts a replacement process (appended to ``processes``) or returns None."""
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    running = {p.sentinel: rank for rank, p in enumerate(processes)}
    killed = []
    while running:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            return -1
        ready = mp.connection.wait(list(running), timeout=remaining)
        for sentinel in ready:
            rank = running.pop(sentinel)
            processes[rank].join()
            code = processes[rank].exitcode
            if live and code is not None and code < 0:
                killed.append(rank)
                started = replace() if running else None
                if started is not None:
                    running[started.sentinel] = len(processes) - 1
            elif code != 0:
                return rank
    if killed and len(killed) == len(processes):
        return killed[0]
    return None
