"""Preemption: a signal asks the job to stop; the ranks agree on a step boundary, checkpoint, exit.

Vocabulary
    preemption signal  SIGTERM by default (what schedulers send before killing: Slurm, Kubernetes,
                       spot reclaim), or SIGUSR1 (--preempt-signal); sent to the launcher (which
                       forwards it to every rank, launch.py) or to any one rank
    step boundary      after optimizer.step() on every rank: no collective is in flight
    verdict            what the ranks decide after each step, in ONE all-reduce(max) of two integers:
                       [rank 0's checkpoint clock has run out, some rank received the signal]

A signal that arrives while the rank starts up (before the watch is installed) was held
(launch.hold_signals) and counts as received: the job stops after its first step.

Sequence: the handler only counts (a rank inside a collective finishes it: the step in flight is
completed, not lost); at the next boundary every rank learns the verdict, so all ranks stop after
the same step S, write one checkpoint (atomic: checkpoint.py), rank 0 prints
``preempted at step S; resume with: <command>`` and the job exits with EXIT_PREEMPTED. A second
signal while the checkpoint is written is counted and ignored: the write finishes, and the previous
checkpoint stays intact whatever happens meanwhile (temporary file, then rename).
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
from gradsync.launch import take_held
from gradsync.train.config import TrainConfig

EXIT_PREEMPTED = 75
"""Exit status of a job stopped by its preemption signal after writing its checkpoint (EX_TEMPFAIL
in sysexits.h: "temporary failure; the user is invited to retry"): rerun the printed command."""


def signal_number(name: str) -> int | None:
    """The signal --preempt-signal names (None for 'none')."""
    return None if name == "none" else int(getattr(signal, name))


class PreemptWatch:
    """Counts the preemption signals this process receives (a context manager: installs the handler
    on entry, restores the previous one on exit; only the main thread can install one)."""

    def __init__(self, signal_name: str) -> None:
        self.signum = signal_number(signal_name)
        self.received = 0
        self.first_at: float | None = None   # time.time() of the first signal
        self._previous = None

    @property
    def active(self) -> bool:
        return self._previous is not None

    @property
    def requested(self) -> bool:
        return self.received > 0

    def _on_signal(self, signum, frame) -> None:
        self.received += 1
        if self.first_at is None:
            self.first_at = time.time()

    def __enter__(self) -> "PreemptWatch":
        if self.signum is not None and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(self.signum, self._on_signal)
            held, first = take_held(self.signum)   # arrived during start-up (launch.hold_signals)
            self.received += held
            self.first_at = self.first_at or first
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(self.signum, self._previous)
            self._previous = None


class StepBoundary:
    """After each step: (checkpoint now?, stop now?), the same on every rank.

    --checkpoint-every N needs no communication (every rank knows the step); a time interval is
    rank 0's clock, and a preemption may reach any one rank: both travel in one 2-element
    all-reduce(max) per step, skipped when neither can happen."""

    def __init__(self, cfg: TrainConfig, watch: PreemptWatch) -> None:
        self.steps, self.seconds = cfg.checkpoint_interval()
        self.watch = watch
        self.last = time.monotonic()

    def __call__(self, step: int) -> tuple[bool, bool]:
        if self.steps is not None:
            due = step % self.steps == 0
        else:
            due = self.seconds is not None and time.monotonic() - self.last >= self.seconds
        if self.seconds is None and not self.watch.active:
            return due, False
        w = gs.world()
        verdict = torch.tensor([int(due and w.rank == 0) if self.seconds is not None else int(due),
                                int(self.watch.requested)], dtype=torch.int64)
        if w.world_size > 1:
            gs.all_reduce(verdict, op="max")
        due, stop = bool(verdict[0]), bool(verdict[1])
        if due and self.seconds is not None:
            self.last = time.monotonic()
        return due, stop


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
    --resume; otherwise `gradsync train` with every flag that differs from its default, and --resume."""
    torchrun = _launcher_command()
    if torchrun is not None:
        return shlex.join(torchrun + ([] if "--resume" in torchrun else ["--resume"]))
    argv = ["gradsync", "train"]
    for field in dataclasses.fields(TrainConfig):
        value = getattr(cfg, field.name)
        flag = "--" + field.name.replace("_", "-")
        if field.name in ("resume", "workers", "out") or value == field.default:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return shlex.join(argv + ["--workers", str(cfg.workers), "--out", cfg.out, "--resume"])
