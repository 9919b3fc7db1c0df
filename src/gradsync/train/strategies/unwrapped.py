"""--strategy zero1 and local: the model unwrapped, stepped by its optimizer.

zero1: gs.ShardedOptimizer around the optimizer's class (zero.py): backward is local, and step()
reduce-scatters the gradients, updates this rank's shard and all-gathers the parameters, so all its
communication is exposed in the step. --clip-grad goes through its clip_grad_norm_, which reduces
first (the local .grad is not the average). local: one process, the optimizer alone."""

from __future__ import annotations

import gradsync as gs
from gradsync.train.strategies.base import StrategyObject


class Unwrapped(StrategyObject):
    def __init__(self, run) -> None:
        super().__init__(run)
        self.sharded = run.cfg.strategy == "zero1"
        spec = run.optimizer_spec
        self.optimizer = (gs.ShardedOptimizer(run.model.parameters(), spec.cls, bucket_cap_mb=run.cfg.bucket_mb,
                                              **spec.kwargs)
                          if self.sharded else spec.build(run.model.parameters()))
        if run.saved:
            self.resume(run.saved)

    def agree_found_inf(self, found: bool) -> bool:
        """zero1: each rank unscaled its local gradient, before the reduce-scatter, so one rank's inf is
        its own until every rank is told (one all-reduce of the flag); local: its own."""
        return self._agree_by_max(found) if self.sharded else found

    def _clip_sharded(self) -> None:
        if self.run.cfg.clip_grad is not None:
            self.grad_norm = float(self.optimizer.clip_grad_norm_(self.run.cfg.clip_grad))

    def run_step(self, work, stop: bool) -> bool:
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=False)
        progress = work.compute(self.run.model, self.no_sync, work.choose())
        self._finish_step(self._clip_sharded if self.sharded else self._clip)
        if self.sharded:   # step() blocks on its collectives: all of it is exposed
            self.comm_seconds = self.wait_seconds = self.optimizer.last_comm_seconds
        self.commit(progress)
        return True
