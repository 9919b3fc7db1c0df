"""--strategy ps-sync | ps-async | ssp: a parameter server (ps/).

Ranks 0..S-1 serve (they hold the parameters and the optimizer); ranks S..N-1 are the W = N - S
workers:

    pull (the rows the step reads) -> forward and backward of the worker's share -> push      per step

Shares: ps-sync trains each step's global batch G (data.EpochCursor), split over the W workers; the
servers average the W pushes into one version. ps-async and ssp: worker slot i trains slot i's share
of every global step at its own pace (a task (slot, s)); each push is applied on its own, as
gradient / W (server.py), each worker's loss the mean over its own share, so the same learning rate
serves all three modes. The servers' optimizer warms up and follows the schedule per version (pushes
/ W in async and ssp): ``optimizer_fn``.

--clip-grad X (ps/clipping.py): in sync mode the servers clip each version's averaged gradient by its
2-norm over all servers' shards, as one process with the global batch would; in async and ssp each
worker clips the gradient it pushes.

--precision fp16-mixed: a worker unscales the gradient it computed and pushes it with its verdict
(push(nonfinite=...)). async and ssp: the servers skip that push, and the worker updates its own
scale at once. sync: the servers skip a version any push of which was flagged, and say so in its
answers, so every worker updates its scale alike once it has pulled the next version (_after_pull).
The checkpoint keeps each worker's scale (all the same in sync).

Sparse tables (an nn.Embedding / nn.EmbeddingBag with sparse=True, train/sparse_rows.py): a worker
reads its micro-batches first, then pulls only the rows they need and pushes only the rows they
touched (ps/sparse_wire.py).

Preemption (train/preempt.py's signal or Ctrl-C): a worker that received it sets the stop flag on its
next push, a server polls it between messages (ParameterServer.serve(stop)), and the servers' next
answers carry the flag, so sync workers all stop on the same version and async/ssp workers each at
their own clock; nothing pushed is lost. Then every rank gathers the servers' state
(ParameterServer.state_dict: parameters, optimizer state, version, every worker's clock) and rank 0
writes one checkpoint; one is also written at the end. --resume continues it with any number of
servers and the same number of workers: a worker at clock c continues at step c.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync import checkpoint
from gradsync.train.strategies.base import StrategyObject
from gradsync.train.sparse_rows import RowsFinder


def optimizer_fn(run, pushes_per_version: int):
    """The servers' optimizer, with the warm-up and schedule applied per version inside step(). The count
    of steps applied lives in the first param group, so it travels with the optimizer's state_dict."""

    def build(params):
        optimizer = run.optimizer_spec.build(params)
        plain_step = optimizer.step
        optimizer.param_groups[0]["steps_applied"] = 0

        def step(*args, **kwargs):
            applied = optimizer.param_groups[0]["steps_applied"]
            for group in optimizer.param_groups:
                group["lr"] = run.lr_at(applied // pushes_per_version, run.plan.peak_lr)
            optimizer.param_groups[0]["steps_applied"] = applied + 1
            return plain_step(*args, **kwargs)

        optimizer.step = step
        return optimizer

    return build


def tasks_of(first_workers: list[int], steps: int, recoveries) -> dict[int, list[tuple[int, int]]]:
    """async and ssp: each worker's tasks in the order it trains them, a task (slot, s) being slot's
    share of global step s among the W workers the job started with. Worker slot i (member S + i)
    starts with (i, 0) .. (i, T-1); at each recovery a lost worker's tasks from its clock on (the
    pushes some server applied from it count as done) are dealt in turn to the open survivors, after
    their own. Every member computes the same lists from the same agreed records; with no open
    survivor left the lost tasks are not trained.

    Example: T=4, workers 1, 2, 3; member 2 lost at clock 1, 1 and 3 open: member 1 trains
    (0,0)..(0,3), (1,1), (1,3); member 3 (2,0)..(2,3), (1,2)."""
    tasks = {m: [(i, s) for s in range(steps)] for i, m in enumerate(first_workers)}
    for record in recoveries:
        takers = [m for m in record.open_workers if m in tasks]
        for lost in sorted(record.lost_clocks):
            rest = tasks.pop(lost)[record.lost_clocks[lost]:]
            for j, member in enumerate(takers):
                tasks[member] += rest[j::len(takers)]
    return tasks


class ParameterServerStrategy(StrategyObject):
    evaluates_each_epoch = False   # the servers are inside serve() until every worker has closed
    checkpoints_each_epoch = False

    def __init__(self, run) -> None:
        super().__init__(run)
        cfg, saved = run.cfg, run.saved
        self.servers, self.mode = cfg.servers, {"ps-sync": "sync", "ps-async": "async", "ssp": "ssp"}[cfg.strategy]
        self.member = gs.world().rank
        if saved:
            run.model.load_state_dict(saved["model"])
        self.ps = self._make(run)
        if saved:   # after construction, before serving or pulling (ParameterServer.load_state_dict)
            self.ps.load_state_dict(saved["ps"])
        self.serves = self.ps.is_server
        # servers keep their shards on the CPU; a worker computes on its device (pull and push copy between them)
        run.model.to(torch.device("cpu") if self.serves else run.device)
        self.rows = RowsFinder(run.model) if not self.serves else None
        self._first_workers = list(range(self.servers, self.servers + run.plan.workers))
        self._pushed = False   # sync, fp16-mixed: a push whose version's verdict the next pull brings
        clock = saved["ps"]["clocks"][self.trainers()[0]] if saved and not self.serves else 0
        per_epoch = run.steps_per_epoch
        self.start_at(clock, {"epoch": clock // per_epoch, "position": clock % per_epoch * run.plan.global_batch})
        workers = (saved.get("precision") or {}).get("workers") if saved and not self.serves else None
        if workers:   # this worker's own scaler (the same for every worker in sync)
            run.precision.load_state_dict({"precision": saved["precision"]["precision"], **workers[self.trainers()[0]]})

    def _make(self, run):
        return gs.ParameterServer(run.model, optimizer_fn(run, 1 if self.mode == "sync" else run.plan.workers),
                                  num_servers=self.servers, mode=self.mode, staleness=run.cfg.staleness,
                                  max_grad_norm=run.cfg.clip_grad)

    def start_at(self, step: int, progress: dict) -> None:
        """A resumed worker goes on at its clock (sync: the epoch and position of that step)."""
        self._step, self._progress = step, dict(progress)

    # -- the world ---------------------------------------------------------------------------------
    def trainers(self) -> tuple[int, int]:
        w = gs.world()
        return w.rank - self.servers, w.world_size - self.servers

    def tasks(self) -> list[tuple[int, int]]:
        return tasks_of(self._first_workers, self.run.total_steps, self.recoveries)[self.member]

    def where(self, cursor) -> tuple[int, int, int, int]:
        if self.mode == "sync":
            return super().where(cursor)
        slot, step = self.tasks()[self.step]
        per_epoch = cursor.steps_from(0)
        return step // per_epoch, step % per_epoch * cursor.global_batch, slot, len(self._first_workers)

    def more(self, total_steps: int) -> bool:
        return self.step < (total_steps if self.mode == "sync" else len(self.tasks())) and not self.stopping

    # -- serving and training ----------------------------------------------------------------------
    def serve(self, stop) -> None:
        self.ps.serve(stop=stop)

    def run_step(self, work, stop: bool) -> bool:
        chosen = work.choose()
        started = time.perf_counter()
        if self.rows.tables:
            self.ps.pull(rows=self.rows(chosen.batches, lambda batch: work.run.task.loss(self.run.model, batch)))
        else:
            self.ps.pull()
        if self.ps.stopping:   # the servers end the job here: these parameters are the last
            return False
        self._after_pull()
        waited = time.perf_counter() - started
        progress = work.compute(self.run.model, self.no_sync, chosen)
        started = time.perf_counter()
        self.ps.push(stop=stop, nonfinite=self._before_push())
        self.comm_seconds = self.wait_seconds = waited + time.perf_counter() - started
        self.commit(progress)
        return True

    def _before_push(self) -> bool:
        """fp16-mixed: unscale this worker's gradient; whether it holds inf or NaN (the push's flag). async and
        ssp: the servers skip that push alone, so the worker's verdict is the agreed one and the scale moves
        now; sync: the servers' verdict on the version comes with the next pull (_after_pull)."""
        precision = self.run.precision
        found = precision.unscale(self.run.model.parameters())
        if precision.scaler is not None:
            if self.mode == "sync":
                self._pushed = True
            else:
                precision.record(found, self.step + 1)
        return found

    def _after_pull(self) -> None:
        """sync, fp16-mixed: the version just pulled says whether the one this worker pushed to was skipped
        (any worker's flag skips it on every server): the same verdict, and scale, on every worker."""
        if self._pushed:
            self._pushed = False
            self.run.precision.record(self.ps.skipped, self.step)

    @property
    def stopping(self) -> bool:
        return self.ps.stopping

    def finish(self) -> bool:
        if not self.ps.stopping:   # a stopped job's last pull was the one that said so
            self.ps.pull()
        self._after_pull()
        self.ps.close()
        return True

    # -- the end -----------------------------------------------------------------------------------
    def state_at_end(self) -> dict:
        return self.ps.state_dict()

    def save_at_end(self, state: dict) -> None:
        """Rank 0 writes the checkpoint: the model as the servers hold it, and their whole state; the
        other ranks wait until it is on disk (one all-reduce), so no rank reports before it exists."""
        run = self.run
        precision = self._precision_state()
        if gs.world().rank == 0:
            with torch.no_grad():
                for param, value in zip(self.ps.dense, state["params"]):
                    param.copy_(value)
                named = dict(run.model.named_parameters())
                for name, table in state["tables"].items():
                    named[name].copy_(table["rows"])
            from gradsync.train import resume

            step = state["clocks"][0]
            epoch, batch = divmod(step, run.steps_per_epoch)
            checkpoint.save(Path(run.cfg.out) / resume.CHECKPOINT_NAME, {
                "model": run.model.state_dict(), "ps": state, "step": step, "epoch": epoch,
                "position": batch * run.plan.global_batch, "world_size": gs.world().world_size,
                "steps_per_epoch": run.steps_per_epoch, **resume.run_record(run.cfg, run.plan),
                "precision": precision})
        gs.all_reduce(torch.zeros(1))

    def _precision_state(self) -> dict:
        """Collective: --precision, and each worker's scaler (loss_scale, good_steps) in worker order."""
        own = self.run.precision.state_dict()
        mine = torch.tensor([float(own.get("loss_scale", 0.0)), float(own.get("good_steps", 0))], dtype=torch.float64)
        every = gs.all_gather(mine).view(-1, 2)[self.servers:]
        workers = [{"loss_scale": float(scale), "good_steps": int(good)} for scale, good in every.tolist()]
        return {"precision": own["precision"], "workers": workers if self.run.precision.scaler is not None else []}

    def evaluation_ranks(self) -> list[int]:
        return list(range(self.servers, gs.world().world_size))

    def extra_stats(self) -> list[float]:
        histogram = self.ps.stats().get("staleness_histogram", {})
        return [sum(histogram.values()), sum(k * v for k, v in histogram.items()), max(histogram, default=0)]

    def stats(self) -> dict:
        return self.ps.stats()

    def check_replicas(self) -> None:
        """The servers hold the one copy; the workers' last pull gave each the same parameters."""
