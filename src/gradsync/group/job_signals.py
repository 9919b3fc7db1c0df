"""The signals of a spawned job: held while a rank starts, relayed by the launcher, taken by
whoever handles them.

The launcher stops ranks with its own STOP_SIGNAL (SIGUSR2), so that SIGTERM stays the
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
"""

from __future__ import annotations

import signal
import threading
import time

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""Signals a scheduler or a terminal sends to every process of a job at once (SIGTERM: `timeout`,
Slurm's scancel, `kill -- -PGID`; SIGINT: Ctrl-C; SIGUSR1: --preempt-signal SIGUSR1). The
forkserver ignores them (ensure_forkserver_without_stdio); a rank takes them back as it starts."""
REPEATED_SIGNAL_SECONDS = 0.1
"""Two SIGINTs closer than this are one Ctrl-C received twice, not a second one: `timeout -s INT`
signals the command and then its whole process group, the command included."""


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


def take_back_job_signals(forward_signals: tuple[int, ...], ignored: tuple[int, ...]) -> None:
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
