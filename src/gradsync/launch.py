"""spawn(fn, nprocs, args): run fn on N local ranks and bring every rank's return value back.

Recipe
    1. host the rendezvous store in the launcher on a port the kernel picks (no fixed ports, no
       race between choosing a port and binding it);
    2. start N processes; each sets its rank's environment exactly as torchrun would (RANK,
       WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), asks the kernel to
       kill it if its parent dies (PR_SET_PDEATHSIG: no orphans), runs runtime.init()
       (gradsync.init), then fn(*args);
    3. each rank saves its return value with torch.save into a private temporary directory
       (tensors and state dicts arrive intact after the rank exits) or, if fn raised, its
       traceback;
    4. the launcher watches all processes; the first failure (an exception or a death by signal)
       stops the others (STOP_SIGNAL, then SIGKILL after a grace period) and raises SpawnError naming
       the rank and carrying its traceback;
    5. a stopped rank dumps its Python stack as it dies (faulthandler on STOP_SIGNAL works even while
       the rank is blocked inside a gloo wait), so the error also says what every other rank was
       doing: "rank 1 was in all_reduce <- allreduce_ring <- wait".

Signals: the launcher stops ranks with its own STOP_SIGNAL (SIGUSR2), so that SIGTERM stays the
scheduler's: ``forward_signals`` (gradsync train passes its preemption signal) are relayed from
the launcher to every rank instead of killing the launcher, and a rank that handles one (stop at
the next step with a checkpoint, train/preempt.py) is never mistaken for a stopped one. A rank
holds them from its first line (hold_signals: counted, not acted on) and says so with a file
{rank}.ready; until then the launcher keeps a relayed signal back and delivers it once the file is
there, so a signal during start-up (interpreter, imports, rendezvous) is not a kill. Whoever handles
the signal later takes the held count (take_held). A signal to the whole job at once (JOB_SIGNALS:
`timeout`, Slurm, `kill -- -PGID`, Ctrl-C) reaches the launcher, which relays it, and every rank
directly, which counts it once more; the forkserver, the ranks' parent, ignores it. With SIGINT
among ``forward_signals`` a second one to the launcher stops the ranks at once (KeyboardInterrupt).

Threads: like torchrun, each rank gets max(1, cpu_count // nprocs) intra-op threads unless
OMP_NUM_THREADS is set, so N ranks do not oversubscribe the cores.

Start-up: on Linux the ranks are forked from a multiprocessing forkserver that has imported torch
and gradsync once (START_PRELOAD), so a rank starts in a fraction of a second instead of
importing torch again (about 2 s of CPU each); elsewhere they are spawned. A forked rank takes
the launcher's environment, working directory, sys.path, stdout and stderr as they are at the
call (as a spawned one would), not as they were when the forkserver started, and the launcher's
init hooks (passed by reference, so their modules are imported in the rank): runtime.init() then
loads the package's public names before the ranks meet (runtime.before_init) and connects the
world's transport (runtime.on_init) in every rank, as in the launcher. Its parent is the
forkserver, which exits when the launcher does, so PR_SET_PDEATHSIG still leaves no orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import multiprocessing.reduction
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

from gradsync import runtime

GRACE_SECONDS = 5.0
"""How long a stopped rank gets between STOP_SIGNAL and SIGKILL."""
STOP_SIGNAL = signal.SIGUSR2
"""How the launcher stops the other ranks after a failure (not SIGTERM: that one is the scheduler's)."""


START_PRELOAD = ["torch", "torch.distributed", "gradsync"]
"""What the forkserver imports once, before it forks any rank."""
JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals a scheduler or a terminal sends to every process of a job at once (SIGTERM: `timeout`,
Slurm's scancel, `kill -- -PGID`; SIGINT: Ctrl-C; SIGUSR1: --preempt-signal SIGUSR1). The
forkserver ignores them (_ensure_forkserver_without_stdio); a rank takes them back as it starts."""
REPEATED_SIGNAL_SECONDS = 0.1
"""Two SIGINTs closer than this are one Ctrl-C received twice, not a second one: `timeout -s INT`
signals the command and then its whole process group, the command included."""


def _context():
    """The forkserver (preloading START_PRELOAD) where the platform has one, else spawn."""
    if sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(START_PRELOAD)
        _ensure_forkserver_without_stdio()
        return ctx
    return mp.get_context("spawn")


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _ensure_forkserver_without_stdio() -> None:
    """Start the forkserver, if it is not running, with /dev/null for stdout and stderr: it outlives
    each call and exits only after the launcher, and whoever reads the launcher's output (a pipe)
    would otherwise wait for it too (ranks get the launcher's stdio at each call instead). Once
    started, it is left alone: stdout is not touched again (should it have died, multiprocessing
    starts another, with the launcher's stdio).

    It is started with JOB_SIGNALS ignored and blocked (both survive its exec): a signal to the
    whole job (module docstring) must not kill the ranks' parent. The launcher blocks them only
    while it starts the forkserver, so one arriving meanwhile waits and then reaches its handler."""
    if getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None:
        return
    _flush_stdio()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_RDWR)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    actions = {signum: signal.signal(signum, signal.SIG_IGN) for signum in JOB_SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)
        for signum, action in actions.items():
            signal.signal(signum, action)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _InheritedFd:
    """A file descriptor of the launcher, passed to a rank as it starts (the rank's stdout/stderr)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _InheritedFd._rebuild, (multiprocessing.reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> "_InheritedFd":
        return _InheritedFd(dup.detach())


def _launcher_state() -> dict:
    """What a rank takes from the launcher at the call: its environment, stdout, stderr and init hooks
    (pickled apart: they are unpickled, importing their modules, once the environment is taken)."""
    _flush_stdio()
    return {"environ": dict(os.environ), "stdio": (_InheritedFd(1), _InheritedFd(2)),
            "hooks": pickle.dumps(runtime.hooks()),
            "ignored": tuple(s for s in JOB_SIGNALS if signal.getsignal(s) is signal.SIG_IGN)}


def _take_launcher_state(state: dict) -> None:
    forkserver = getattr(multiprocessing.forkserver, "_forkserver", None)
    alive_fd = getattr(forkserver, "_forkserver_alive_fd", None)
    if alive_fd is not None:
        # A forked child holds the launcher's end of the pipe whose closing tells the forkserver
        # that the launcher is gone; let go of it, or a dead launcher's forkserver, and with it
        # its ranks (PR_SET_PDEATHSIG), would live on
        os.close(alive_fd)
        forkserver._forkserver_alive_fd = forkserver._forkserver_address = forkserver._forkserver_pid = None
    os.environ.clear()
    os.environ.update(state["environ"])
    runtime.add_hooks(*pickle.loads(state["hooks"]))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:   # if the forkserver drew it, forked ranks would share its global stream
        numpy_random.seed()
    for target, inherited in zip((1, 2), state["stdio"]):
        if inherited.fd != target:
            os.dup2(inherited.fd, target)
            os.close(inherited.fd)


_HELD: dict[int, list] = {}
"""signal number -> [times received while held, time.time() of the first]."""


def _count_held(signum, frame) -> None:
    entry = _HELD.setdefault(signum, [0, time.time()])
    entry[0] += 1


def hold_signals(signums: tuple[int, ...]) -> None:
    """Count ``signums`` instead of acting on them, until a handler takes them over (main thread only)."""
    if threading.current_thread() is threading.main_thread():
        for signum in signums:
            signal.signal(signum, _count_held)


def take_held(signum: int) -> tuple[int, float | None]:
    """(how many times ``signum`` arrived while held, when the first did), and forget them."""
    count, first = _HELD.pop(signum, [0, None])
    return count, first


class SpawnError(RuntimeError):
    """A rank raised or died. ``rank`` is the first rank that failed; ``tracebacks`` maps rank -> text."""

    def __init__(self, message: str, rank: int, tracebacks: dict[int, str]) -> None:
        super().__init__(message)
        self.rank = rank
        self.tracebacks = tracebacks


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


def _take_back_job_signals(forward_signals: tuple[int, ...], ignored: tuple[int, ...]) -> None:
    """A rank forked by the forkserver starts with JOB_SIGNALS blocked and ignored (its parent's).
    Those it does not hold (forward_signals) get the launcher's actions back: ignored where the
    launcher ignores them (``ignored``), else their defaults (SIGINT: KeyboardInterrupt); then
    they are unblocked."""
    if threading.current_thread() is not threading.main_thread():
        return
    for signum in JOB_SIGNALS:
        if signum in ignored:
            signal.signal(signum, signal.SIG_IGN)
        elif signum not in forward_signals:
            signal.signal(signum, signal.default_int_handler if signum == signal.SIGINT else signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)


def _rank_main(rank: int, nprocs: int, port: int, fn: Callable, args: tuple, out_dir: str,
               init_kwargs: dict, job: str, forward_signals: tuple[int, ...] = (),
               launcher: dict | None = None, replacement: bool = False, live: bool = False) -> None:
    hold_signals(forward_signals)
    _take_back_job_signals(forward_signals, launcher["ignored"] if launcher else ())
    (Path(out_dir) / f"{rank}.ready").touch()
    parent = os.getppid()   # the launcher, or the forkserver it started
    _die_with_parent()
    _name_process(f"gradsync-r{rank}")
    if os.getppid() != parent:  # the parent died before prctl took effect (a forkserver exits with the launcher)
        os._exit(1)
    if launcher is not None:
        _take_launcher_state(launcher)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "GRADSYNC_EXTERNAL_STORE": "1",
                       "GRADSYNC_JOB_ID": job})
    if not replacement:
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(nprocs)})
    if live:   # a live world's CUDA tensors go through host memory: a death needs no NCCL abort (device_path.py)
        os.environ.setdefault("GRADSYNC_CUDA_PATH", "host")
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


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


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
    ctx = _context()
    job = f"{os.getpid()}x{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory(prefix=f"gradsync-spawn-{os.getpid()}-") as out_dir:
        launcher = _launcher_state()
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
                raise _spawn_error(exit_codes, failed, Path(out_dir))
            return [torch.load(Path(out_dir) / f"{rank}.result", weights_only=False)
                    if processes[rank].exitcode == 0 and (Path(out_dir) / f"{rank}.result").exists() else None
                    for rank in range(len(processes))]
        finally:
            _stop(processes)
            _remove_segments(job)
            del store


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


_TRANSPORT_DIR = "gradsync/comm/transport/"
_ALGORITHM_FILES = ("allreduce_", "reduce_scatter_", "all_gather_")


def _transport_internal(path: str) -> bool:
    """A frame of a transport's own machinery (anything under comm/transport/ but the intra-host
    algorithms' files): a stack names the collective that waited, not these."""
    return _TRANSPORT_DIR in path and not Path(path).name.startswith(_ALGORITHM_FILES)


def _where(stack_path: Path) -> str | None:
    """Where a rank's main thread was, from its faulthandler dump: the innermost frames of gradsync
    and of the user's code (not the launcher, multiprocessing, torch or transport internals),
    innermost first."""
    try:
        text = stack_path.read_text()
    except OSError:
        return None
    # faulthandler writes each thread's frames innermost first; the main thread is the last block
    blocks = [b for b in text.split("\n\n") if "File " in b]
    if not blocks:
        return None
    frames = []
    for line in blocks[-1].splitlines():
        line = line.strip()
        if not line.startswith("File "):
            continue
        path = line.split('"')[1]
        if any(part in path for part in ("gradsync/launch.py", "/multiprocessing/", "/threading.py",
                                         "/site-packages/torch/", "<frozen", "<string>")) or _transport_internal(path):
            continue
        name = line.rsplit(" in ", 1)[-1]
        short = path.rsplit("gradsync/", 1)[-1] if "/gradsync/" in path else Path(path).name
        frames.append(f"{name} ({short}:{line.split('line ')[1].split(' ')[0]})")
    if not frames:
        return None
    return " <- ".join(frames[:4]) + (" <- ..." if len(frames) > 4 else "")


def _first_line(traceback_text: str) -> str:
    # A rank stopped while writing its error file leaves it empty or partial.
    lines = traceback_text.strip().splitlines()
    return lines[0] if lines else "an error (its report was cut short when the rank was stopped)"


def _spawn_error(exit_codes: dict[int, int | None], failed: int, out_dir: Path) -> SpawnError:
    if failed == -1:
        return SpawnError("spawn: the ranks did not finish within join_timeout; all were stopped", -1, {})
    tracebacks = {rank: (out_dir / f"{rank}.error").read_text()
                  for rank in exit_codes if (out_dir / f"{rank}.error").exists()}
    # Prefer the root cause: a rank that died (no traceback) beats one that raised because its peer died.
    died = [r for r, code in exit_codes.items() if code not in (None, 0) and r not in tracebacks]
    primary = failed if failed not in tracebacks or not died else died[0]
    if primary in tracebacks:
        what = f"rank {primary} raised {_first_line(tracebacks[primary])}"
    else:
        what = f"rank {primary} {_describe_exit(exit_codes[primary])}"
    others = [f"  rank {r}: {_first_line(tb)}" for r, tb in sorted(tracebacks.items()) if r != primary]
    message = f"spawn: {what}; the other ranks were stopped."
    if others:
        message += "\nother ranks reported:\n" + "\n".join(others)
    doing = [f"  rank {r}: {where}" for r in sorted(exit_codes) if r != primary and r not in tracebacks
             for where in [_where(out_dir / f"{r}.stack")] if where]
    if doing:
        message += "\nwhen stopped, the other ranks were in:\n" + "\n".join(doing)
    if primary in tracebacks:
        message += f"\n\nrank {primary} traceback:\n{tracebacks[primary]}"
    return SpawnError(message, primary, tracebacks)
