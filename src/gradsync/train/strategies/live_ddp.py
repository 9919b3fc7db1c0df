"""--strategy ddp --fault-tolerance live: DDP training whose survivors go on when ranks die (LiveDDP,
live/ddp.py).

When a member dies, LiveDDP rebuilds the world from the survivors and the step in flight is trained
again by them: EpochCursor's position P does not depend on how many ranks consumed the first P
samples, so the epoch's remaining samples are re-shared over the survivors with none lost or
repeated (the step's share is read from live.progress and live.world each time it is tried).

With --max-restarts K the launcher starts a replacement for a dead rank (at most K): it joins the
running world at a step boundary (live/growth.py) and receives the parameters, the optimizer state,
the epoch position and the batch policy's global batch and learning rate from rank 0.

Batch and learning rate after a resize (--live-batch, live/policy.py): keep-global keeps the global
batch G (each survivor's share grows to about G / W'), keep-per-rank keeps each rank's batch and
scales the learning rate by the --lr-scaling rule for W' / W (back up when the world grows). The
checkpoint records the batch as it is then, so --resume continues it, in this mode or the default one.

Test knobs (train/live_knobs.py): GRADSYNC_LIVE_KILL=M:S:optimizer kills member M in step S after the
all-reduce, before its optimizer step; GRADSYNC_LIVE_AWAIT_JOINER=1 makes the members, after a
recovery from a death and one step in the shrunk world, wait (at most 60 s) until a replacement asks
to join, so that it joins a short run before it ends.
"""

from __future__ import annotations

import contextlib
import os

from gradsync.live import LiveDDP, resized
from gradsync.train import resume
from gradsync.train.live_knobs import die
from gradsync.train.strategies.base import StrategyObject


class LiveDataParallel(StrategyObject):
    def __init__(self, run) -> None:
        super().__init__(run)
        cfg, plan = run.cfg, run.plan
        self.optimizer = run.optimizer_spec.build(run.model.parameters())
        progress = {"epoch": 0, "position": 0}
        if run.saved:
            self.resume(run.saved)
            progress = self._progress
        self.batch = {"global": plan.global_batch, "peak_lr": plan.peak_lr}   # a replacement receives rank 0's
        run.precision.keep_in(self.batch)   # and fp16-mixed's scale with it

        def on_resize(live: LiveDDP, old_world: int) -> None:
            self.batch["global"], self.batch["peak_lr"] = resized(
                cfg.live_batch, self.batch["global"], self.batch["peak_lr"], old_world, live.world.world_size,
                scaling=cfg.lr_scaling)

        # a replacement joins the running world here, receiving the state, the progress and the batch
        self.live = LiveDDP(run.model, self.optimizer, on_resize=on_resize, progress=progress, shared=self.batch,
                            admit_joiners=cfg.max_restarts > 0,   # --max-restarts K: up to K replacements
                            min_workers=cfg.min_workers,
                            bucket_cap_mb=cfg.bucket_mb, algorithm=cfg.algorithm,
                            comm_hook=None if cfg.compress == "none" else cfg.compress)
        if run.saved:
            self.live.step = self._step
        self.member = self.live.member
        kill = run.kill_of(self.member)
        if kill is not None and kill[1] == "optimizer":
            self.optimizer.register_step_pre_hook(lambda *_: die() if self.live.step == kill[0] else None)
        self.await_joiner = os.environ.get("GRADSYNC_LIVE_AWAIT_JOINER", "") not in ("", "0")

    @property
    def step(self) -> int:
        return self.live.step

    @property
    def progress(self) -> dict:
        return self.live.progress

    @property
    def recoveries(self) -> list:
        return self.live.recoveries

    @property
    def global_batch(self) -> int:
        return self.batch["global"]

    @property
    def peak_lr(self) -> float:
        return self.batch["peak_lr"]

    def plan_now(self):
        """The batch as it is now: the world whose global batch it is, the learning rate after a resize."""
        cfg, plan = self.run.cfg, self.run.plan
        workers = self.batch["global"] // (cfg.batch_size * cfg.grad_accum)
        return resume.BatchPlan(cfg.batch_size, cfg.grad_accum, workers, plan.base_lr, self.batch["peak_lr"],
                                epochs=plan.epochs, warmup_steps=plan.warmup_steps, schedule=plan.schedule,
                                schedule_steps=plan.schedule_steps, min_lr=plan.min_lr)

    def run_step(self, work, stop: bool) -> bool:
        live = self.live
        if self.await_joiner and live.recoveries and not live.recoveries[-1].joined \
                and live.step > live.recoveries[-1].step:
            live.await_joiner(60.0)
            self.await_joiner = False

        def train_step(ddp) -> dict:
            lr = self.run.lr_at(live.step, self.batch["peak_lr"])
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            return work.compute(ddp, lambda last: contextlib.nullcontext() if last else ddp.no_sync(), work.choose())

        def apply() -> None:   # the all-reduced gradients: every member finds the same inf (precision.py)
            self.run.precision.step(self.run.model.parameters(), self.optimizer.step, step_number=live.step + 1)

        if not live.run_step(train_step, apply):   # the world changed (a death or a joiner): the step is trained next
            return False
        model = live.model
        self.comm_seconds, self.wait_seconds, self.last_overlap = (model.comm_seconds, model.wait_seconds,
                                                                   model.last_overlap)
        return True

    def collective(self, fn):
        return self.live.collective(fn)

    def check_replicas(self) -> None:
        self.live.check_replicas()

    def partial_writes(self, lost: list[int]) -> list[int]:
        pids = []
        for member in lost:
            where = self.live.membership.location(member)
            if where is not None and where[0] == self.live.membership.me:
                pids.append(where[1])
        return pids

    def close(self) -> None:
        self.live.close()
