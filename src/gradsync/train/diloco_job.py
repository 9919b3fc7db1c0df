"""--strategy diloco in `gradsync train`: the model unwrapped, gs.DiLoCo (diloco.py) stepping it.

Each worker trains its own replica on its own shards with the model's optimizer (the inner one:
AdamW for charlm, SGD with momentum for the image models), unscaled by the number of workers since
each steps alone. Every ``--sync-every`` steps, and at every epoch's end (so the epoch's evaluation
and checkpoint see one model), the replicas' average movement takes one outer Nesterov SGD step
(``--outer-lr``, ``--outer-momentum``) and every replica restarts from it.

Checkpoints: rank 0's checkpoint.pt holds the model and inner optimizer of rank 0 and DiLoCo's own
state (anchor, outer optimizer, step counts); between outer steps the replicas differ, so every rank
also writes its replica (model and inner optimizer) to replica<r>.pt beside it, tagged with the step.
A resume needs the same number of workers, and every replica file of that step.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import gradsync as gs
from gradsync import checkpoint
from gradsync.replicas import first_mismatch
from gradsync.train.config import TrainConfig


class DiLoCoJob:
    """What the training loop needs from a wrapper, for DiLoCo (module docstring)."""

    def __init__(self, cfg: TrainConfig, model, optimizer) -> None:
        self.module, self.optimizer = model, optimizer
        self.diloco = gs.DiLoCo(model, optimizer, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                                sync_every=cfg.sync_every, nesterov=cfg.outer_momentum > 0, algorithm=cfg.algorithm)
        self.last_overlap = None
        self.comm_seconds = 0.0

    def __call__(self, *args):
        return self.module(*args)

    def no_sync(self):
        return contextlib.nullcontext()   # nothing is reduced in backward

    @property
    def wait_seconds(self) -> float:
        return self.comm_seconds          # an outer step blocks the step it ends

    def after_step(self) -> None:
        """After the inner optimizer's step: count it; every H-th is an outer step."""
        started = time.perf_counter()
        synced = self.diloco.step()
        self.comm_seconds = time.perf_counter() - started if synced else 0.0

    def end_epoch(self) -> None:
        """An epoch's end is an outer step too (unless one just ran)."""
        if self.diloco.inner_steps % self.diloco.sync_every:
            self.diloco.sync()

    def check_replicas(self) -> None:
        mismatch = first_mismatch(list(self.module.parameters()))
        if mismatch is not None:
            raise gs.ReplicaMismatchError(f"replicas differ after DiLoCo's outer step at parameter #{mismatch[1]} "
                                          f"(rank {mismatch[0]})")

    def close(self) -> None:
        pass

    # -- checkpoints -------------------------------------------------------------------------------
    @staticmethod
    def replica_path(out: str, rank: int) -> Path:
        return Path(out) / f"replica{rank}.pt"

    def save_replica(self, out: str, step: int) -> None:
        """This rank's replica, tagged with ``step`` (every rank; checkpoint.pt holds DiLoCo's state)."""
        state = {"step": step, "model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}
        checkpoint.save(self.replica_path(out, gs.world().rank), state)

    def load_replica(self, out: str, saved: dict) -> None:
        """This rank's replica of the checkpoint ``saved`` (and DiLoCo's state from it)."""
        w = gs.world()
        if saved["world_size"] != w.world_size:
            raise checkpoint.CheckpointError(
                f"a --strategy diloco checkpoint resumes on the workers that wrote it ({saved['world_size']}; this "
                f"run has {w.world_size}): between outer steps every worker's replica and inner optimizer differ")
        path = self.replica_path(out, w.rank)
        replica = checkpoint.load(path)
        if replica["step"] != saved["step"]:
            raise checkpoint.CheckpointError(f"rank {w.rank}: {path} is of step {replica['step']}, the checkpoint of "
                                             f"step {saved['step']}: they were not written together")
        self.module.load_state_dict(replica["model"])
        self.optimizer.load_state_dict(replica["optimizer"])
        self.diloco.load_state_dict(saved["diloco"])
