"""Preemption: a signal asks the job to stop; the ranks agree on a step boundary, checkpoint, exit.

Vocabulary
    preemption signal  SIGTERM by default (what schedulers send before killing: Slurm, Kubernetes,
                       spot reclaim), or SIGUSR1 (--preempt-signal); sent to the launcher (which
                       forwards it to every rank, launch.py), to any one rank, or to every process
                       of the job at once (`timeout`, Slurm's scancel, `kill -- -PGID`)
    interrupt          Ctrl-C: SIGINT to every process of the job; handled as a preemption that
                       exits EXIT_INTERRUPTED. A second one stops the job at once (the launcher
                       stops the ranks; the checkpoint on disk is the last one written, whole)
    step boundary      after optimizer.step() on every rank: no collective is in flight
    verdict            what the ranks decide after each step, in ONE all-reduce(max) of two integers:
                       [rank 0's checkpoint clock has run out, the strongest stop code any rank
                       has (STOP_REASONS)]

A signal that arrives while the rank starts up (before the watch is installed) was held
(job_signals.hold_signals) and counts as received: the job stops after its first step.

Sequence: the handler only counts (a rank inside a collective finishes it: the step in flight is
completed, not lost); at the next boundary every rank learns the verdict, so all ranks stop after
the same step S, write one checkpoint (atomic: checkpoint.py), rank 0 prints
``preempted at step S; resume with: <command>`` and the job exits with EXIT_PREEMPTED (after
Ctrl-C: EXIT_INTERRUPTED). A second preemption signal while the checkpoint is written is counted
and ignored: the write finishes, and the previous checkpoint stays intact whatever happens
meanwhile (temporary file, then rename).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import threading
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync.group.job_signals import REPEATED_SIGNAL_SECONDS, take_held
from gradsync.train.config import TrainConfig

EXIT_PREEMPTED = 75
"""Exit status of a job stopped by its preemption signal after writing its checkpoint (EX_TEMPFAIL
in sysexits.h: "temporary failure; the user is invited to retry"): rerun the printed command."""
EXIT_INTERRUPTED = 130
"""Exit status of a job stopped by Ctrl-C (SIGINT), with its checkpoint or, after a second Ctrl-C,
at once: 128 + SIGINT, as a shell reports a command interrupted."""
# The other statuses of a job's end: 2, a bad flag (the command line); 69, a live member cut off from its
# job for --timeout (live/failures.py EXIT_LOST_CONTACT); a live world below --min-workers exits 75 as here.


def signal_number(name: str) -> int | None:
    """The signal --preempt-signal names (None for 'none')."""
    return None if name == "none" else int(getattr(signal, name))


STOP_REASONS = (None, "preempted", "interrupted")
"""What a rank's stop code means (StepBoundary's all-reduce(max) keeps the strongest): 0 go on,
1 the preemption signal, 2 Ctrl-C (SIGINT; the job then exits EXIT_INTERRUPTED)."""


def stop_signals(cfg: TrainConfig) -> tuple[int, ...]:
    """What a training job watches: its preemption signal (unless 'none') and SIGINT (Ctrl-C)."""
    signum = signal_number(cfg.preempt_signal)
    return (signal.SIGINT,) if signum is None else (signum, signal.SIGINT)


def spawned_rank() -> bool:
    """Whether this process is a rank gs.spawn started (its launcher is another process)."""
    return "GRADSYNC_JOB_ID" in os.environ


class PreemptWatch:
    """Counts the preemption signals and the Ctrl-Cs (SIGINT) this process receives (a context
    manager: installs the handlers on entry, restores the previous ones on exit; only the main
    thread can install them). ``interrupt_twice_raises``: in a process that is also the launcher
    (--strategy local, torchrun), a second SIGINT raises KeyboardInterrupt: stop at once; a
    spawned rank only counts it (its launcher stops it, launch.py)."""

    def __init__(self, signal_name: str, interrupt_twice_raises: bool = False) -> None:
        self.signum = signal_number(signal_name)
        self.interrupt_twice_raises = interrupt_twice_raises
        self.received = 0      # preemption signals
        self.interrupts = 0    # SIGINTs
        self.first_at: float | None = None   # time.time() of the first of either
        self._first_interrupt = 0.0           # time.monotonic() of the first SIGINT
        self._previous: dict = {}

    @property
    def active(self) -> bool:
        return bool(self._previous)

    @property
    def requested(self) -> bool:
        return self.received > 0 or self.interrupts > 0

    @property
    def stop_code(self) -> int:
        """This rank's index into STOP_REASONS."""
        return 2 if self.interrupts else 1 if self.received else 0

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            if self.interrupts and time.monotonic() - self._first_interrupt < REPEATED_SIGNAL_SECONDS:
                return   # the same Ctrl-C, received twice (job_signals.REPEATED_SIGNAL_SECONDS)
            self.interrupts += 1
            self._first_interrupt = self._first_interrupt or time.monotonic()
            if self.interrupts >= 2 and self.interrupt_twice_raises:
                raise KeyboardInterrupt
        else:
            self.received += 1
        if self.first_at is None:
            self.first_at = time.time()

    def __enter__(self) -> "PreemptWatch":
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in (signal.SIGINT,) if self.signum is None else (self.signum, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)
            held, first = take_held(signum)   # arrived during start-up (job_signals.hold_signals)
            if signum == signal.SIGINT and held:   # held Ctrl-Cs count as one: their times are not kept
                self.interrupts, self._first_interrupt = 1, time.monotonic()
            elif signum != signal.SIGINT:
                self.received += held
            self.first_at = self.first_at or first
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


class StepBoundary:
    """After each step: (checkpoint now?, stop now?), the same on every rank.

    --checkpoint-every N needs no communication (every rank knows the step); a time interval is
    rank 0's clock, and a preemption may reach any one rank: both travel in one 2-element
    all-reduce(max) per step, skipped when neither can happen."""

    def __init__(self, cfg: TrainConfig, watch: PreemptWatch) -> None:
        self.steps, self.seconds = cfg.checkpoint_interval()
        self.watch = watch
        self.last = time.monotonic()
        self.reason: str | None = None
        """Why the job stops (STOP_REASONS), once a verdict said so."""

    def __call__(self, step: int) -> tuple[bool, bool]:
        if self.steps is not None:
            due = step % self.steps == 0
        else:
            due = self.seconds is not None and time.monotonic() - self.last >= self.seconds
        if self.seconds is None and not self.watch.active:
            return due, False
        w = gs.world()
        verdict = torch.tensor([int(due and w.rank == 0) if self.seconds is not None else int(due),
                                self.watch.stop_code], dtype=torch.int64)
        if w.world_size > 1:
            gs.all_reduce(verdict, op="max")
        due, self.reason = bool(verdict[0]), STOP_REASONS[int(verdict[1])]
        if due and self.seconds is not None:
            self.last = time.monotonic()
        return due, self.reason is not None


def _launcher_command() -> list[str] | None:
    """The torchrun command line this rank's agent (its parent) was started with, if any."""
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    argv = [a.decode(errors="replace") for a in argv if a]
    if any(a.endswith("torchrun") or a == "torch.distributed.run" or a.endswith("torch/distributed/run.py")
           for a in argv[:3]):
        return argv
    return None


def resume_command(cfg: TrainConfig) -> str:
    """The exact command that continues this job: under torchrun the agent's own command line with
    --resume; in an srun task that is a rank, srun and the task's own command line with --resume;
    otherwise `gradsync train` with every flag that differs from its default, and --resume."""
    torchrun = _launcher_command()
    if torchrun is not None:
        return shlex.join(torchrun + ([] if "--resume" in torchrun else ["--resume"]))
    if "SLURM_STEP_ID" in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ and not spawned_rank():
        # this process is the srun task itself
        argv = [a.decode(errors="replace") for a in Path("/proc/self/cmdline").read_bytes().split(b"\0") if a]
        return shlex.join(["srun", *argv] + ([] if "--resume" in argv else ["--resume"]))
    argv = ["gradsync", "train"]
    defaults = TrainConfig.defaults()
    for field in dataclasses.fields(TrainConfig):
        value = getattr(cfg, field.name)
        flag = "--" + field.name.replace("_", "-")
        # the tracker run's key (--log-run) is the checkpoint's: the resume reads it there
        if field.name in ("resume", "overwrite", "workers", "out", "log_run") or value == defaults[field.name]:
            continue
        if isinstance(value, dict):   # --model-args, --data-args
            value = ",".join(f"{k}={v!r}" for k, v in value.items())
        argv += [flag] if value is True else [flag, str(value)]
    return shlex.join(argv + ["--workers", str(cfg.workers), "--out", cfg.out, "--resume"])
