"""gradsync train's loop: one rank's run, for every task and every strategy.

Runbook
    one process:          gradsync train --strategy local --workers 1
    N local workers:      gradsync train --workers 4
    your model:           gradsync train --model my_pkg.models:build --data my_pkg.data:build
    2 hosts x 2 ranks:    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0,1} \\
                              --master-addr HOST0 --master-port 29500 -m gradsync.train

Per rank, as a recipe (Run): build_task (train/task.py: the model factory, the data, the loss) ->
plan_batch (train/resume.py: the checkpoint's global batch on this world size, or a fresh one; the
run's length, warm-up and schedule) -> build_model (on this rank's device; --precision's autocast and
scaler, train/precision.py) -> the strategy's object
(train/strategies/: it wraps the model, builds the optimizer, loads the checkpoint) -> train: step
after step, the strategy's run_step(work) runs this rank's share (train/step.py) and reduces; at
each step boundary the verdict (checkpoint? preempted? train/preempt.py), at each epoch's end an
evaluation and a checkpoint -> the end: the last checkpoint, the final evaluation, the replicas
checked, one summary of what every rank did (train/report.py).

A parameter server's ranks serve instead of stepping (the strategy's serve()); a live world's
changes (a death, a replacement) make run_step return False and the loop re-reads the world: the
batch's cursor, who reports, what the lost members left half written (on_world_change). A change met
in a collective after a step that took this rank's last step back (live/failures.py StepUndone) sends
the loop back to train it.

Preemption: the preemption signal (--preempt-signal) or Ctrl-C to the launcher, any rank or the whole
job stops every rank after the same step with a checkpoint; rank 0 prints ``preempted at step S;
resume with: ...`` and the job exits 75 (Ctrl-C: 130). train/preempt.py.

Batch math (printed at start; train/batch_math.py):
    global batch = per-worker batch x workers x accumulation steps
    lr = base lr x k, k = sqrt(global batch / per-worker batch) (--lr-scaling sqrt, the default), the
         ratio itself (linear) or 1 (none); warm-up, then --lr-schedule (train/optimizers.py)
    clip: g <- g x min(1, X / (||g||_2 + 1e-6))           with --clip-grad X, g the step's averaged gradient
"""

from __future__ import annotations

import dataclasses
import socket
import time

import torch

import gradsync as gs
from gradsync.data import EpochCursor
from gradsync.group import runtime
from gradsync.live.failures import BelowFloor, StepUndone
from gradsync.observe import trace
from gradsync.replicas import gather_strings
from gradsync.train import requeue, resume
from gradsync.train.checkpoints import RunCheckpoints
from gradsync.train.device import device_record, param_digest, train_device
from gradsync.train.evaluation import evaluate
from gradsync.train.live_knobs import die, planted_kill
from gradsync.train.optimizers import lr_at
from gradsync.train.precision import Precision
from gradsync.train.preempt import STOP_REASONS, PreemptWatch, StepBoundary, resume_command, spawned_rank
from gradsync.train.report import Reporter
from gradsync.train.slow_rank import planted_delay
from gradsync.train.sparse_rows import make_dense, sparse_modules
from gradsync.train.step import StepWork, on
from gradsync.train.strategies import strategy as declared_strategy
from gradsync.train.task import Task
from gradsync.train.tracking import run_key


def train_rank(cfg) -> dict:
    """One rank's job for any task and strategy; returns its statistics (module docstring)."""
    with PreemptWatch(cfg.preempt_signal, interrupt_twice_raises=not spawned_rank()) as watch:
        return Run(cfg, watch).train()


class Run:
    """One rank's run: what it trains, with what, and how far it has come (module docstring)."""

    def __init__(self, cfg, watch: PreemptWatch) -> None:
        self.watch = watch
        self.declared = declared_strategy(cfg.strategy)
        self.live = cfg.fault_tolerance == "live"
        self.joining = joining = runtime.replacement() is not None   # a live replacement: rank 0 sends the state
        torch.manual_seed(cfg.seed)
        self.rank = 0 if joining else gs.world().rank
        if cfg.trace:
            trace.enable(self.rank)
        # build_task
        self.task = Task.of(cfg)
        self.data = self.task.build_data()
        # plan_batch
        world_size = cfg.workers if joining else gs.world().world_size
        trainers = world_size - (cfg.servers if self.declared.serves else 0)
        self.saved = resume.read(cfg) if not joining and resume.agreed(cfg) else None
        spec = self.task.optimizer(cfg)
        if self.saved:
            self.plan = resume.BatchPlan.for_resume(cfg, trainers, self.saved)
        else:
            self.plan = resume.BatchPlan.fresh(cfg, trainers, spec.lr)
        if self.saved and self.declared.serves and self.plan.workers != self.saved["batch"]["workers"]:
            from gradsync import checkpoint

            raise checkpoint.CheckpointError(
                f"the checkpoint was written by {self.saved['batch']['workers']} parameter-server workers, this job "
                f"has {trainers} (--workers {world_size} - --servers {cfg.servers}): each worker's data shard and "
                f"clock are its own, so resume with {self.saved['batch']['workers']} workers; the number of servers "
                f"may change")
        # the tracker run every rank records to, and every checkpoint names (train/tracking.py)
        cfg = dataclasses.replace(cfg, batch_size=self.plan.batch_size, grad_accum=self.plan.grad_accum,
                                  log_run=run_key(cfg, self.saved, joining))
        if self.plan.global_batch > len(self.data.train):
            raise ValueError(f"each worker sees {len(self.data.train) // trainers} training samples per epoch, fewer "
                             f"than one step of --batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}; use "
                             f"fewer workers or a smaller batch")
        self.cursor = EpochCursor(len(self.data.train), self.plan.global_batch, seed=cfg.seed)
        self.steps_per_epoch = self.cursor.steps_from(0)
        self.cfg = cfg = self.plan.scheduled(cfg, self.steps_per_epoch)
        # build_model
        self.model = self.task.build_model()
        self.notes = list(self.plan.changes)
        if not self.declared.serves:
            dense = make_dense(self.model)
            if dense:
                self.notes.append(f"the sparse tables {', '.join(dense)} train dense under --strategy {cfg.strategy} "
                                  f"(their rows travel alone under a parameter server)")
        self.device = train_device(cfg, sparse_rows=self.declared.serves and bool(sparse_modules(self.model)))
        if not self.declared.serves:   # a parameter server places its model itself (its servers keep the CPU)
            self.model.to(self.device)
        self.optimizer_spec = spec.with_lr(self.plan.peak_lr)
        self.precision = Precision(cfg.precision, self.device)
        if self.precision.dtype is not None:
            self.notes.append(self.precision.describe())
        self.kill = None
        self.delay = planted_delay(self.rank)   # the slow-rank test knob (train/slow_rank.py)
        # the strategy's object: wraps the model, builds the optimizer, loads the checkpoint
        self.strategy = self.declared.load(self.live)(self)
        if self.live:
            self.kill = self.kill_of(self.strategy.member)
        self.trains = not self.strategy.serves
        self.first_step = self.strategy.step
        step, progress = self.strategy.step, self.strategy.progress
        if cfg.steps is not None:
            self.total_steps = cfg.steps
        elif progress["epoch"] < cfg.epochs:
            self.total_steps = (step + self.cursor.steps_from(progress["position"])
                                + (cfg.epochs - progress["epoch"] - 1) * self.steps_per_epoch)
        else:
            self.total_steps = step

    # -- what the strategies ask of the run --------------------------------------------------------
    def lr_at(self, step: int, peak: float) -> float:
        plan = self.plan
        return lr_at(step, peak, plan.warmup_steps, plan.schedule, plan.schedule_steps, plan.min_lr)

    def fetch(self, ids: list[int]):
        """The training samples ``ids``, collated, on this rank's device."""
        return on(self.device, self.task.batch(self.data, self.data.train, ids))

    def kill_of(self, member: int) -> tuple[int, str] | None:
        """The live test knob's planted death for ``member`` (train/live_knobs.py)."""
        kill = planted_kill(member) if self.live else None
        if kill is not None and self.declared.serves and kill[1] != "forward":
            raise ValueError(f"GRADSYNC_LIVE_KILL phase {kill[1]!r}: a parameter-server worker dies at 'forward' only")
        return kill

    # -- the run -----------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, strategy = self.cfg, self.strategy
        self.report = report = Reporter(cfg, self.total_steps, enabled=strategy.reporting(),
                                        accuracy_name=self.task.defaults.accuracy)
        for line in self.notes:
            report.note(line)
        report.start(self.plan.global_batch, self.plan.base_lr, self.plan.peak_lr, self.steps_per_epoch,
                     resumed_at=self.saved["step"] if self.saved else None, train_samples=len(self.data.train))
        self.checkpoints = RunCheckpoints(self) if strategy.checkpoints_each_epoch else None
        self.stats = {"compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "hidden_s": 0.0, "bucket_s": 0.0}
        self.evaluation, self.evaluated_at, self.reported = {}, None, len(strategy.recoveries)
        if not self.joining:   # a replacement enters a world that is past its start, at a step boundary
            report.setup(**self.collective(self._layout), **device_record(self.device))
        gs.traffic_reset()
        self.started = time.perf_counter()
        self.window = {"steps": 0, "step_s": 0.0, "wait_s": 0.0, "comm_s": 0.0, "samples": 0}
        if strategy.serves:
            try:
                strategy.serve(stop=lambda: self.watch.requested)
                return self._end()
            finally:
                report.close()
        work = StepWork(self)
        try:
            try:
                while True:
                    try:
                        stopped = self._steps(work)
                        return stopped if stopped is not None else self._end()
                    except StepUndone:   # live: a recovery outside a step took back this rank's last step
                        self.on_world_change()
            except BelowFloor as floor:   # live: the world agreed on is smaller than --min-workers
                self.report.note(str(floor))
                return self._preempted("below --min-workers")
            finally:
                work.close()
        finally:
            report.close()   # after an error: the tracker runs still open are closed

    def _steps(self, work: StepWork) -> dict | None:
        """Step until the run is done; the preempted result if a verdict stopped it."""
        cfg, strategy, report, watch = self.cfg, self.strategy, self.report, self.watch
        boundary = StepBoundary(cfg, watch)
        while True:
            if not strategy.more(self.total_steps):
                if strategy.finish():
                    return None
                self.on_world_change()
                continue
            started = time.perf_counter()
            if self.delay is not None and strategy.step >= self.delay[0]:
                time.sleep(self.delay[1])
            if not strategy.run_step(work, stop=watch.requested):
                if not strategy.stopping:   # the world changed: the step is trained in the new one
                    self.on_world_change()
                continue
            elapsed = time.perf_counter() - started
            chosen = work.chosen
            self._count(elapsed)
            report.step(strategy.step, chosen.epoch, work.loss_sum, chosen.step_size / elapsed, strategy.last_overlap,
                        strategy.grad_norm, lr=self.lr_at(strategy.step - 1, strategy.peak_lr),
                        bytes_sent=gs.traffic()["bytes_sent"] if self.rank == 0 and not self.live else None)
            self._add_to_window(elapsed, chosen.step_size)
            if strategy.step % cfg.log_every == 0:
                self._record_ranks()
            epoch_ended = strategy.progress["epoch"] != chosen.epoch
            if epoch_ended and strategy.evaluates_each_epoch:
                strategy.end_epoch()
                if self.kill == (strategy.step, "evaluate"):
                    die()
                self._evaluate(chosen.epoch)
            if self.checkpoints is None:
                continue
            due, stop = self.collective(lambda: boundary(strategy.step))
            if stop:
                return self._preempted(boundary.reason)
            if epoch_ended or (due and strategy.more(self.total_steps)):
                self.checkpoints.write()

    def _count(self, elapsed: float) -> None:
        strategy, stats = self.strategy, self.stats
        stats["comm_s"] += strategy.comm_seconds
        stats["wait_s"] += strategy.wait_seconds
        stats["compute_s"] += elapsed - strategy.wait_seconds
        if strategy.last_overlap is not None:   # bucket all-reduce seconds before backward ended, and in all
            stats["hidden_s"] += strategy.last_overlap * strategy.comm_seconds
            stats["bucket_s"] += strategy.comm_seconds

    def _add_to_window(self, elapsed: float, samples: int) -> None:
        window, strategy = self.window, self.strategy
        window["steps"] += 1
        window["step_s"] += elapsed
        window["wait_s"] += strategy.wait_seconds
        window["comm_s"] += strategy.comm_seconds
        window["samples"] += samples

    def _record_ranks(self) -> None:
        """A logged step: every rank's mean step, wait and communication seconds over the window since the
        last one, and its bytes sent, all-gathered (one small all-gather, through the strategy's collective
        so that a live world's change survives it) for the reporting rank to record (train/report.py). A
        parameter server's workers keep their own clocks while the servers serve: each has only its own."""
        window = self.window
        steps = max(window["steps"], 1)
        mine = torch.tensor([window["step_s"] / steps, window["wait_s"] / steps, window["comm_s"] / steps,
                             gs.traffic()["bytes_sent"]], dtype=torch.float64)
        samples_per_s = window["samples"] / window["step_s"] if window["step_s"] > 0 else 0.0
        self.window = dict.fromkeys(window, 0)
        if self.declared.serves:
            ranks, per_rank = [gs.world().rank], mine.view(1, -1)
        else:
            per_rank = self.collective(lambda: gs.all_gather(mine).view(gs.world().world_size, -1))
            ranks = list(range(per_rank.shape[0]))
        self.report.ranks(self.strategy.step, steps, ranks, per_rank, samples_per_s)

    def _evaluate(self, epoch: int | None) -> None:
        """Score the test set (every rank, or the strategy's); ``epoch``: report it as that epoch's."""
        self.evaluation = self.collective(lambda: evaluate(self, self.model, self.strategy.evaluation_ranks()))
        self.evaluated_at = self.strategy.step
        if epoch is not None:
            self.report.epoch(epoch, self.strategy.step, self.evaluation)

    def collective(self, fn):
        """The strategy's collective(fn), and the changes of the world it went through followed."""
        value = self.strategy.collective(fn)
        if len(self.strategy.recoveries) > self.reported:
            self.on_world_change()
        return value

    def on_world_change(self) -> None:
        """After the world changed, in a step or in a collective: the cursor for the batch as it is now,
        the new first rank reporting, a record of each change, stale files removed."""
        strategy, report = self.strategy, self.report
        self.cursor = EpochCursor(len(self.data.train), strategy.global_batch, seed=self.cfg.seed)
        report.enabled = strategy.reporting()
        changes = strategy.recoveries[self.reported:]
        for change in changes:
            report.live({"event": "live", **change.__dict__, "world_size": gs.world().world_size,
                         "global_batch": strategy.global_batch, "peak_lr": strategy.peak_lr, "at": time.time()})
        if self.checkpoints is not None:
            self.checkpoints.after_recovery([m for change in changes for m in change.lost])
        self.reported = len(strategy.recoveries)

    def _layout(self) -> dict:
        """Model size, buckets and rank placement (collective: every rank calls it)."""
        w = gs.world()
        hosts = gather_strings([socket.gethostname()])
        params = [p for p in self.model.parameters() if p.requires_grad]
        buckets = getattr(self.strategy, "bucket_sizes", None)
        return {"params": sum(p.numel() for p in params),
                "param_bytes": sum(p.numel() * p.element_size() for p in params),
                "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
                "bucket_bytes": buckets() if buckets else None, "world_size": w.world_size,
                "hosts": [h[0] if h else "?" for h in hosts]}

    # -- the end -----------------------------------------------------------------------------------
    def _preempted(self, reason: str | None) -> dict:
        """Every rank stops after the same step: one checkpoint, rank 0 says how to continue."""
        strategy = self.strategy
        self.checkpoints.write(final=True)
        command = resume_command(self.cfg)
        self.report.preempted(strategy.step, command, signal_at=self.watch.first_at)
        requeue.after_checkpoint(self.cfg, gs.world().rank, reason)
        strategy.close()
        return self._result(None, preempted={"step": strategy.step, "epoch": strategy.progress["epoch"],
                                             "position": strategy.progress["position"], "command": command,
                                             "signals": self.watch.received, "reason": reason})

    def _end(self) -> dict:
        strategy, report = self.strategy, self.report
        if self.trains and strategy.evaluates_each_epoch and self.evaluated_at != strategy.step:
            # the run ended inside an epoch (--steps): its end is an epoch's end for the strategy (DiLoCo's outer
            # step, so the checkpoint and the score see one model), reported as that epoch's (a run that trained
            # nothing, a finished run resumed, only scores)
            strategy.end_epoch()
            self._evaluate(strategy.progress["epoch"] if strategy.step > self.first_step else None)
        if self.checkpoints is not None:
            if self.checkpoints.written[-1:] != [strategy.step]:
                self.checkpoints.write(final=True)
            self.checkpoints.wait()   # the last checkpoint is on disk before the job reports and exits
        else:
            stopped = self._save_at_end()
            if stopped is not None:
                return stopped
        wall = time.perf_counter() - self.started
        if self.evaluated_at != strategy.step or not self.evaluation:   # a parameter server scores at the end only
            self._evaluate(None)
        self.collective(strategy.check_replicas)
        stats = self.stats
        mine = torch.tensor([stats["compute_s"], stats["comm_s"], stats["wait_s"], gs.traffic()["bytes_sent"],
                             stats["hidden_s"] / stats["bucket_s"] if stats["bucket_s"] > 0 else -1.0,
                             *strategy.extra_stats()], dtype=torch.float64)
        per_rank = self.collective(lambda: gs.all_gather(mine).view(gs.world().world_size, -1))
        staleness = None
        if per_rank.shape[1] > 5:   # a parameter server's [updates, weighted staleness, max] per rank
            updates = float(per_rank[:, 5].sum())
            staleness = {"mean": float(per_rank[:, 6].sum()) / updates if updates else 0.0,
                         "max": float(per_rank[:, 7].max()), "updates": updates}
        report.enabled = strategy.reporting()
        if self.precision.scaler is not None:
            report.note(self.precision.verdicts())
        # a parameter-server job's steps are the plan's (every step trains the global batch of the W it started with)
        reached = self.total_steps if self.declared.serves else strategy.step
        summary = report.finish(wall, reached, self.evaluation, per_rank[:, :5],
                                workers=self.plan.workers if self.declared.serves else None, staleness=staleness,
                                checkpoints=self.checkpoints.summary() if self.checkpoints else None,
                                trained=reached - self.first_step)
        strategy.close()
        return self._result(summary)

    def _save_at_end(self) -> dict | None:
        """A parameter server's end: every rank learns whether the job was stopped early, the servers' state is
        gathered and rank 0 writes the checkpoint; the preempted result if it was stopped."""
        strategy = self.strategy
        # [some worker stopped early, the strongest stop code any rank has (preempt.STOP_REASONS)]
        stopped = torch.tensor([int(self.trains and strategy.stopping and strategy.step < self.total_steps),
                                self.watch.stop_code])
        self.collective(lambda: gs.all_reduce(stopped, op="max"))
        state = strategy.state_at_end()
        strategy.save_at_end(state)
        if not bool(stopped[0]):
            return None
        self.report.enabled = strategy.reporting()
        first_worker, reason = state["clocks"][0], STOP_REASONS[int(stopped[1])] or "preempted"
        self.report.preempted(first_worker, resume_command(self.cfg), signal_at=self.watch.first_at)
        requeue.after_checkpoint(self.cfg, gs.world().rank, reason)
        strategy.close()
        return self._result(None, preempted={"step": first_worker, "clocks": state["clocks"],
                                             "signals": self.watch.received, "reason": reason})

    def _result(self, summary: dict | None, preempted: dict | None = None) -> dict:
        strategy = self.strategy
        done = preempted is None
        result = {"summary": summary, "digest": param_digest(self.model) if done else None,
                  "params": ({n: p.detach().cpu().clone() for n, p in self.model.named_parameters()}
                             if done and gs.world().world_size <= 8 else None),
                  "events": trace.disable() if self.cfg.trace else [],
                  "precision": self.precision.summary(),
                  "checkpoints": self.checkpoints.written if self.checkpoints else []}
        if preempted is not None:
            result["preempted"] = preempted
        if self.live:
            result.update(member=strategy.member, recoveries=[r.__dict__ for r in strategy.recoveries])
        if self.declared.serves:
            result["ps"] = strategy.stats()
        return result
