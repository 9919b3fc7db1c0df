"""When and how a run's checkpoints are written (the strategies that checkpoint during a run; a parameter
server writes one at its end: strategies/ps.py).

At every epoch's end, after each N-th step with --checkpoint-every N (or each span of rank 0's time),
at a preemption and at the run's end. Every rank takes the strategy's state (collective for ZeRO-1;
DiLoCo's ranks each write their replica); rank 0 of the world as it is then snapshots it and writes it
in the background while training goes on (checkpoint.py: a temporary file, then an atomic rename),
or, at a preemption or the end, before returning. A rank 0 that dies while writing leaves the
previous checkpoint whole; in live mode the new rank 0 removes the dead member's temporary file.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import gradsync as gs
from gradsync import checkpoint
from gradsync.train.live_knobs import die_writing
from gradsync.train.resume import CHECKPOINT_NAME


class RunCheckpoints:
    def __init__(self, run) -> None:
        self.run = run
        self.path = Path(run.cfg.out) / CHECKPOINT_NAME
        self.writer = checkpoint.BackgroundWriter()
        self.written: list[int] = []
        """The steps checkpointed, in order."""
        self.seconds = 0.0
        """Time the training thread spent on them (snapshots and waits)."""

    def write(self, final: bool = False) -> None:
        """The checkpoint of the strategy's committed step (module docstring); ``final``: on disk before
        this returns."""
        strategy = self.run.strategy
        started = time.perf_counter()
        state = strategy.state()
        strategy.after_checkpoint(state)
        if gs.world().rank == 0:
            if self.run.kill == (strategy.step, "checkpoint"):
                threading.Thread(target=die_writing, args=(self.path, checkpoint.snapshot(state)), daemon=True).start()
                return
            if final:
                self.writer.wait()
                checkpoint.save(self.path, state)
            else:
                self.writer.submit(self.path, checkpoint.snapshot(state))
        self.written.append(strategy.step)
        self.seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Until the last checkpoint is on disk (before the job reports and exits)."""
        started = time.perf_counter()
        self.writer.wait()
        self.seconds += time.perf_counter() - started

    def after_recovery(self, lost: list[int]) -> None:
        """The new rank 0 removes what the ``lost`` members on this host left half written."""
        if gs.world().rank != 0:
            return
        for pid in self.run.strategy.partial_writes(lost):
            checkpoint.temporary(self.path, pid).unlink(missing_ok=True)

    def summary(self) -> tuple[int, float, float]:
        """(how many, seconds on the training thread, seconds writing in the background)."""
        return len(self.written), self.seconds, self.writer.seconds
