"""How spawn starts its ranks.

On Linux the ranks are forked from a multiprocessing forkserver that has imported torch
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

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.forkserver
import multiprocessing.reduction
import os
import pickle
import signal
import sys
import tempfile
import threading
from pathlib import Path

from gradsync.group import runtime
from gradsync.group.job_signals import JOB_SIGNALS

START_PRELOAD = ["torch", "torch.distributed", "gradsync"]
"""What the forkserver imports once, before it forks any rank."""


def start_context():
    """The forkserver (preloading START_PRELOAD) where the platform has one, else spawn."""
    if sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(START_PRELOAD)
        ensure_forkserver_without_stdio()
        return ctx
    return mp.get_context("spawn")


def flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def early_output() -> Path:
    """The file the forkserver's stdout and stderr go to: what a rank prints before it takes the launcher's
    (a failure while it imports the launcher's script or unpickles fn) ends up here, and the launcher quotes
    its last lines when a rank exits without a report (spawn_report.py)."""
    return Path(tempfile.gettempdir()) / f"gradsync-forkserver-{os.getpid()}.log"


def ensure_forkserver_without_stdio() -> None:
    """Start the forkserver, if it is not running, with early_output() for stdout and stderr, not the
    launcher's: it outlives each call and exits only after the launcher, and whoever reads the
    launcher's output (a pipe) would otherwise wait for it too (ranks get the launcher's stdio at each
    call instead). Once started, it is left alone: stdout is not touched again (should it have died,
    multiprocessing starts another, with the launcher's stdio).

    It is started with JOB_SIGNALS ignored and blocked (both survive its exec): a signal to the
    whole job (module docstring) must not kill the ranks' parent. The launcher blocks them only
    while it starts the forkserver, so one arriving meanwhile waits and then reaches its handler."""
    if getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is not None:
        return
    flush_stdio()
    saved = [os.dup(1), os.dup(2)]
    log = early_output()
    sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
    atexit.register(log.unlink, missing_ok=True)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    actions = {signum: signal.signal(signum, signal.SIG_IGN) for signum in JOB_SIGNALS} \
        if threading.current_thread() is threading.main_thread() else {}
    try:
        os.dup2(sink, 1)
        os.dup2(sink, 2)
        multiprocessing.forkserver.ensure_running()
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, sink):
            os.close(fd)
        for signum, action in actions.items():
            signal.signal(signum, action)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class InheritedFd:
    """A file descriptor of the launcher, passed to a rank as it starts (the rank's stdout/stderr)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return InheritedFd._rebuild, (multiprocessing.reduction.DupFd(self.fd),)

    @staticmethod
    def _rebuild(dup) -> "InheritedFd":
        return InheritedFd(dup.detach())


def launcher_state() -> dict:
    """What a rank takes from the launcher at the call: its environment, stdout, stderr and init hooks
    (pickled apart: they are unpickled, importing their modules, once the environment is taken)."""
    flush_stdio()
    return {"environ": dict(os.environ), "stdio": (InheritedFd(1), InheritedFd(2)),
            "hooks": pickle.dumps(runtime.hooks()),
            "ignored": tuple(s for s in JOB_SIGNALS if signal.getsignal(s) is signal.SIG_IGN)}


def take_launcher_state(state: dict) -> None:
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
