"""gradsync train --strategy ps-sync|ps-async|ssp --fault-tolerance live: a parameter-server job whose
surviving workers go on when a worker dies.

Per rank, as a recipe: build_data -> plan_batch -> build_model -> LivePS (live/ps.py) -> serve
(ranks 0..S-1) or train (the workers) -> evaluate (the workers) -> summarise. A dead server ends
the job on every rank with live/ps.py's ServerLostError, naming it.

ps-sync: each step's global batch G from data.EpochCursor, split over the workers of the world as
it is now. When a worker dies, the servers roll back to the version every one of them holds, and
the step in flight is trained again by the W - 1 survivors over all its samples: EpochCursor's
position P does not depend on how many workers consumed the first P samples, so no sample is lost
or trained twice. Each worker's loss is its share's summed loss x W / (step's samples), so the
servers' mean over the W pushes is the step's mean loss.

ps-async, ssp: worker slot i trains slot i's share of every global step (EpochCursor.share among
the W workers the job started with), at its own pace. When a worker dies, its steps from its clock
on (the pushes some server applied from it count as done) are dealt in turn to the survivors that
have not closed (tasks_of), after their own; each push's loss is scaled by W' / W, so that the
servers' gradient / W' weighs it 1 / W as before the death. No sample is lost or trained twice
while a survivor is still open; a push some servers applied and others had not (S > 1) counts.

The global batch and the learning rate stay (keep-global, live/policy.py).

Checkpoints and preemption, as the default mode's parameter-server jobs (train/loop_ps.py): the
preemption signal or Ctrl-C, to the launcher, any rank or the whole job, makes the workers ask the
servers to stop (their next answers say so), every rank then gathers the servers' state and rank 0
writes the checkpoint, and the job exits 75 (Ctrl-C: 130); a checkpoint is also written at the end.
--resume continues one in live mode with the same number of workers: each worker at its clock (sync:
the epoch and position of its step), the servers at their version.

What this mode leaves out: --live-batch keep-per-rank, sparse models (word2vec), --clip-grad,
tracing, torchrun.

Test knobs (as train/loop_live.py's): GRADSYNC_SAMPLE_LOG=DIR makes every worker append "step epoch
id id ..." for each step it starts to DIR/live.<pid>.m<member> (a step trained again is written
again: the last line of a step counts; a dead member's lines count up to the step the survivors
resumed from, sync, or its lost clock, async and ssp). GRADSYNC_LIVE_KILL=M:S:forward makes member
M SIGKILL itself in its step S (0-based), after its forward.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync.data import EpochCursor
from gradsync.live.ps import LivePS
from gradsync.train import requeue, resume
from gradsync.train.common import evaluate, loss_of, on, param_digest, train_device
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import build_dataset
from gradsync.train.loop_live import chunks, die, planted_kill
from gradsync.train.loop_ps import MODE_OF, optimizer_fn, save_checkpoint
from gradsync.train.models import build_model
from gradsync.train.preempt import STOP_REASONS, PreemptWatch, resume_command, spawned_rank
from gradsync.train.report import Reporter


def train_ps_live_rank(cfg: TrainConfig) -> dict:
    """One member's job (see the module docstring); returns its statistics and recoveries."""
    with PreemptWatch(cfg.preempt_signal, interrupt_twice_raises=not spawned_rank()) as watch:
        return _train_ps_live_rank(cfg, watch)


def _train_ps_live_rank(cfg: TrainConfig, watch: PreemptWatch) -> dict:
    w = gs.world()
    torch.manual_seed(cfg.seed)
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    workers = w.world_size - cfg.servers
    saved = resume.read(cfg) if resume.agreed(cfg) else None
    plan = resume.BatchPlan.for_resume(cfg, workers, saved) if saved else resume.BatchPlan.fresh(cfg, workers)
    cfg = dataclasses.replace(cfg, batch_size=plan.batch_size, grad_accum=plan.grad_accum)
    cursor = EpochCursor(len(train_set), plan.global_batch, seed=cfg.seed)
    cfg = plan.scheduled(cfg, cursor.steps_from(0))   # the run's length and warm-up (train/batch_math.py)
    model = build_model(cfg.model, cfg.dataset)
    if saved:
        model.load_state_dict(saved["model"])
    mode = MODE_OF[cfg.strategy]
    live = LivePS(model, optimizer_fn(cfg, plan.peak_lr, 1 if mode == "sync" else plan.workers),
                  num_servers=cfg.servers, mode=mode, staleness=cfg.staleness)
    if saved:   # after construction, before serving or pulling (ParameterServer.load_state_dict)
        live.ps.load_state_dict(saved["ps"])
    model.to(torch.device("cpu") if live.is_server else train_device(cfg))   # servers stay on the CPU
    first_step = saved["ps"]["clocks"][w.rank - cfg.servers] if saved and not live.is_server else 0
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * cursor.steps_from(0)
    report = Reporter(cfg, total_steps, enabled=w.rank == cfg.servers)
    for line in plan.changes:
        report.note(line)
    report.start(plan.global_batch, plan.base_lr, plan.peak_lr, cursor.steps_from(0),
                 resumed_at=saved["step"] if saved else None, train_samples=len(train_set))
    started = time.perf_counter()
    compute_s = 0.0
    if live.is_server:
        live.serve(stop=lambda: watch.requested)
    else:
        compute_s = _train(cfg, live, train_set, cursor, total_steps, report, plan, watch, first_step)
    wall = time.perf_counter() - started
    # [some worker stopped early, the strongest stop code any rank has (preempt.STOP_REASONS)]
    stopped = torch.tensor([int(not live.is_server and live.stopping and live.step < total_steps), watch.stop_code])
    live.collective(lambda: gs.all_reduce(stopped, op="max"))
    state = live.collective(live.ps.state_dict)
    live.collective(lambda: save_checkpoint(cfg, plan, model, live.ps, state, cursor.steps_from(0)))
    if bool(stopped[0]):
        report.enabled = live.world.rank == cfg.servers
        first_worker = state["clocks"][0]
        report.preempted(first_worker, resume_command(cfg), signal_at=watch.first_at)
        requeue.after_checkpoint(cfg, live.world.rank, STOP_REASONS[int(stopped[1])] or "preempted")
        live.close()
        return {"summary": None, "preempted": {"step": first_worker, "clocks": state["clocks"],
                                               "signals": watch.received,
                                               "reason": STOP_REASONS[int(stopped[1])] or "preempted"},
                "digest": None, "member": live.member, "recoveries": [r.__dict__ for r in live.recoveries],
                "params": None, "events": []}
    report.enabled = live.world.rank == cfg.servers   # the first worker may have died: the new one reports
    evaluation = live.collective(lambda: evaluate(cfg, model, test_set,
                                                  ranks=list(range(cfg.servers, live.world.world_size))))
    stats = live.stats()
    wait_s = stats.get("pull_wait_seconds", 0.0) + stats.get("push_seconds", 0.0)
    histogram = stats.get("staleness_histogram", {})
    mine = torch.tensor([compute_s, wait_s, wait_s, gs.traffic()["bytes_sent"], -1.0, sum(histogram.values()),
                         sum(k * v for k, v in histogram.items()), max(histogram, default=0)], dtype=torch.float64)
    per_rank = live.collective(lambda: gs.all_gather(mine).view(live.world.world_size, -1))
    updates = float(per_rank[:, 5].sum())
    staleness = {"mean": float(per_rank[:, 6].sum()) / updates if updates else 0.0,
                 "max": float(per_rank[:, 7].max()), "updates": updates}
    # workers=W at the start: every step of the plan trains the global batch G = b x accumulation x W
    summary = report.finish(wall, total_steps, evaluation, per_rank[:, :5], workers=plan.workers,
                            staleness=staleness, trained=total_steps - first_step)
    live.close()
    return {"summary": summary, "digest": param_digest(model), "member": live.member, "ps": stats,
            "recoveries": [r.__dict__ for r in live.recoveries], "params": None, "events": []}


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


def _train(cfg: TrainConfig, live: LivePS, train_set, cursor: EpochCursor, total_steps: int, report,
           plan: resume.BatchPlan, watch: PreemptWatch, first_step: int) -> float:
    """The worker's loop: steps until ``total_steps``, then the final pull and close; its compute seconds."""
    kill = planted_kill(live.member)
    if kill is not None and kill[1] != "forward":
        raise ValueError(f"GRADSYNC_LIVE_KILL phase {kill[1]!r}: a parameter-server worker dies at 'forward' only")
    log_dir = os.environ.get("GRADSYNC_SAMPLE_LOG")
    sample_log = (open(Path(log_dir) / f"live.{os.getpid()}.m{live.member}", "a", buffering=1)  # noqa: SIM115
                  if log_dir else None)
    # a resumed worker goes on at its clock (sync: the epoch and position of that step; async and ssp
    # index their tasks by it)
    live.step = first_step
    per_epoch = cursor.steps_from(0)
    live.progress = {"epoch": first_step // per_epoch, "position": first_step % per_epoch * cursor.global_batch}
    current = {"compute_s": 0.0}

    first_workers = list(range(cfg.servers, cfg.servers + plan.workers))

    def tasks() -> list[tuple[int, int]]:
        return ([] if live.mode == "sync" else tasks_of(first_workers, total_steps, live.recoveries)[live.member])

    def train_step(model) -> dict:
        world, servers = live.world, cfg.servers
        workers = world.world_size - servers
        if live.mode == "sync":   # the step's samples over the workers there are now
            epoch, position = live.progress["epoch"], live.progress["position"]
            step_size = cursor.step_size(position)
            share = cursor.share(cursor.order(epoch), position, workers, world.rank - servers)
            scale = workers / step_size   # the servers' mean over the W pushes is the step's mean loss
        else:   # a slot's share among the W the job started with; the servers divide each push by W'
            slot, step = tasks()[live.step]
            epoch, position = step // cursor.steps_from(0), step % cursor.steps_from(0) * cursor.global_batch
            step_size = cursor.step_size(position)
            share = cursor.share(cursor.order(epoch), position, plan.workers, slot)
            scale = workers / (plan.workers * max(len(share), 1))   # each push worth 1/W of a step
        current.update(epoch=epoch, step_size=step_size, loss=0.0)
        if sample_log is not None:   # before the step: a member that dies after its push trained these
            sample_log.write(f"{live.step + 1} {epoch} {' '.join(map(str, share))}\n")
        computed = time.perf_counter()
        for ids in chunks(share, cfg.grad_accum):
            x, y = on(next(model.parameters()).device, train_set[ids])
            logits = model(x)
            if kill == (live.step, "forward"):
                die()
            loss = loss_of(cfg.model, logits, y) * (len(ids) * scale) if ids else logits.sum() * 0.0
            loss.backward()
            current["loss"] += float(loss.detach())
        current["compute_s"] += time.perf_counter() - computed
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    recoveries = 0
    while True:
        step_started = time.perf_counter()
        if live.step < (total_steps if live.mode == "sync" else len(tasks())) and not live.stopping:
            if live.run_step(train_step, stop=watch.requested):
                report.step(live.step, current["epoch"], current["loss"],
                            current["step_size"] / (time.perf_counter() - step_started), None)
        elif live.finish():
            break
        if len(live.recoveries) > recoveries:
            recoveries = len(live.recoveries)
            report.enabled = live.world.rank == cfg.servers
            report.live({"event": "live", **live.recoveries[-1].__dict__, "world_size": live.world.world_size,
                         "global_batch": cursor.global_batch, "peak_lr": plan.peak_lr, "at": time.time()})
    if sample_log is not None:
        sample_log.close()
    return current["compute_s"]
