"""--strategy diloco: the model unwrapped, gs.DiLoCo (diloco.py) stepping it.

Each worker trains its own replica on its own shares with the model's optimizer (the inner one),
unscaled by the number of workers since each steps alone, its loss the mean over its own share.
Every ``--sync-every`` steps, and at every epoch's end (so the epoch's evaluation and checkpoint see
one model), the replicas' average movement takes one outer Nesterov SGD step (``--outer-lr``,
``--outer-momentum``) and every replica restarts from it.

Checkpoints: rank 0's checkpoint.pt holds the model and inner optimizer of rank 0 and DiLoCo's own
state (anchor, outer optimizer, step counts); between outer steps the replicas differ, so every rank
also writes its replica (model and inner optimizer) to replica<r>.pt beside it, tagged with the step.
A resume needs the same number of workers, and every replica file of that step.
"""

from __future__ import annotations

import time
from pathlib import Path

import gradsync as gs
from gradsync import checkpoint
from gradsync.train.strategies.base import StrategyObject


class DiLoCoStrategy(StrategyObject):
    def __init__(self, run) -> None:
        super().__init__(run)
        cfg = run.cfg
        self.optimizer = run.optimizer_spec.build(run.model.parameters())
        self.diloco = gs.DiLoCo(run.model, self.optimizer, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                                sync_every=cfg.sync_every, nesterov=cfg.outer_momentum > 0, algorithm=cfg.algorithm)
        if run.saved:
            self.resume(run.saved)

    def run_step(self, work, stop: bool) -> bool:
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=False)
        progress = work.compute(self.run.model, self.no_sync, work.choose())
        self._finish_step(self._clip)   # a skipped inner step is still counted: every worker skips it
        started = time.perf_counter()
        synced = self.diloco.step()   # every H-th inner step is an outer step, which blocks the step it ends
        self.comm_seconds = self.wait_seconds = time.perf_counter() - started if synced else 0.0
        self.commit(progress)
        return True

    def agree_found_inf(self, found: bool) -> bool:
        """Each worker checks its own replica's gradient: one worker's inf skips the inner step on all
        (one all-reduce of the flag a step, under fp16-mixed only)."""
        return self._agree_by_max(found)

    def end_epoch(self) -> None:
        """An epoch's end is an outer step too (unless one just ran)."""
        if self.diloco.inner_steps % self.diloco.sync_every:
            self.diloco.sync()

    def check_replicas(self) -> None:
        try:
            super().check_replicas()
        except gs.ReplicaMismatchError as exc:
            raise gs.ReplicaMismatchError(f"after DiLoCo's outer step: {exc}") from None

    # -- checkpoints -------------------------------------------------------------------------------
    @staticmethod
    def replica_path(out: str, rank: int) -> Path:
        return Path(out) / f"replica{rank}.pt"

    def state(self) -> dict:
        return {**super().state(), "diloco": self.diloco.state_dict()}

    def after_checkpoint(self, state: dict) -> None:
        """This rank's replica, tagged with the step (every rank; checkpoint.pt holds DiLoCo's state)."""
        replica = {"step": self.step, "model": self.run.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        checkpoint.save(self.replica_path(self.run.cfg.out, gs.world().rank), replica)

    def resume(self, saved: dict) -> None:
        """This rank's replica of the checkpoint ``saved`` (and DiLoCo's state from it)."""
        super().resume(saved)
        w = gs.world()
        if saved["world_size"] != w.world_size:
            raise checkpoint.CheckpointError(
                f"a --strategy diloco checkpoint resumes on the workers that wrote it ({saved['world_size']}; this "
                f"run has {w.world_size}): between outer steps every worker's replica and inner optimizer differ")
        path = self.replica_path(self.run.cfg.out, w.rank)
        replica = checkpoint.load(path)
        if replica["step"] != saved["step"]:
            raise checkpoint.CheckpointError(f"rank {w.rank}: {path} is of step {replica['step']}, the checkpoint of "
                                             f"step {saved['step']}: they were not written together")
        self.run.model.load_state_dict(replica["model"])
        self.optimizer.load_state_dict(replica["optimizer"])
        self.diloco.load_state_dict(saved["diloco"])
