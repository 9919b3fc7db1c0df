"""--strategy ddp: gradsync's DistributedDataParallel around the model; the gradients are all-reduced
bucket by bucket inside the step's last backward (the others run under no_sync), with --compress's
hook (fp16, bf16, or PowerSGD's rank-r factors) on the wire, then one optimizer step on every rank."""

from __future__ import annotations

import gradsync as gs
from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook
from gradsync.train.strategies.base import StrategyObject


class DataParallel(StrategyObject):
    def __init__(self, run) -> None:
        super().__init__(run)
        cfg = run.cfg
        self.wrapped = gs.DistributedDataParallel(
            run.model, bucket_cap_mb=cfg.bucket_mb, algorithm=cfg.algorithm,
            comm_hook=None if cfg.compress in ("none", "powersgd") else cfg.compress)
        if cfg.compress == "powersgd":
            self.wrapped.register_comm_hook(PowerSGDState(rank=cfg.powersgd_rank, algorithm=cfg.algorithm),
                                            powersgd_hook)
        self.optimizer = run.optimizer_spec.build(run.model.parameters())
        if run.saved:
            self.resume(run.saved)

    def no_sync(self, last: bool):
        return super().no_sync(last) if last else self.wrapped.no_sync()

    def run_step(self, work, stop: bool) -> bool:
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=False)
        progress = work.compute(self.wrapped, self.no_sync, work.choose())
        self._finish_step(self._clip)   # the all-reduced gradients: every rank finds the same inf (base.py)
        self.comm_seconds, self.wait_seconds = self.wrapped.comm_seconds, self.wrapped.wait_seconds
        self.last_overlap = self.wrapped.last_overlap
        self.commit(progress)
        return True

    def bucket_sizes(self) -> list[int]:
        return self.wrapped.bucket_sizes()

    def check_replicas(self) -> None:
        self.wrapped.check_replicas()

    def close(self) -> None:
        self.wrapped.close()
