"""gradsync train --strategy ps-sync --fault-tolerance live: a parameter-server job whose surviving
workers go on when a worker dies.

Per rank, as a recipe: build_data -> plan_batch -> build_model -> LivePS (live/ps.py) -> serve
(ranks 0..S-1) or train (the workers: each step's global batch G from data.EpochCursor, split over
the workers of the world as it is now) -> evaluate (the workers) -> summarise. When a worker dies,
the servers roll back to the version every one of them holds, and the step in flight is trained
again by the W - 1 survivors over all its samples: EpochCursor's position P does not depend on how
many workers consumed the first P samples, so no sample is lost or trained twice. The global batch
and the learning rate stay (keep-global, live/policy.py); each worker's loss is its share's summed
loss x W / (step's samples), so the servers' mean over the W pushes is the step's mean loss. A dead
server ends the job on every rank with live/ps.py's ServerLostError, naming it.

What this mode leaves out: ps-async and ssp (train/config.py says why), --live-batch keep-per-rank,
sparse models (word2vec), checkpoints, preemption, --clip-grad, tracing.

Test knobs (as train/loop_live.py's): GRADSYNC_SAMPLE_LOG=DIR makes every worker append "step epoch
id id ..." for each step it starts to DIR/live.<pid>.m<member> (a step trained again is written
again: the last line of a step counts, and a dead member's lines up to the step the survivors
resumed from). GRADSYNC_LIVE_KILL=M:S:forward makes member M SIGKILL itself in step S (0-based),
after its forward.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync.data import EpochCursor
from gradsync.live.ps import LivePS
from gradsync.train import resume
from gradsync.train.common import evaluate, loss_of, param_digest
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import build_dataset
from gradsync.train.loop_live import _chunks, _die, _planted_kill
from gradsync.train.loop_ps import _optimizer_fn
from gradsync.train.models import build_model
from gradsync.train.report import Reporter


def train_ps_live_rank(cfg: TrainConfig) -> dict:
    """One member's job (see the module docstring); returns its statistics and recoveries."""
    w = gs.world()
    torch.manual_seed(cfg.seed)
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    plan = resume.BatchPlan.fresh(cfg, w.world_size - cfg.servers)
    cursor = EpochCursor(len(train_set), plan.global_batch, seed=cfg.seed)
    model = build_model(cfg.model, cfg.dataset)
    live = LivePS(model, _optimizer_fn(cfg, plan.peak_lr, 1), num_servers=cfg.servers, mode="sync")
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * cursor.steps_from(0)
    report = Reporter(cfg, total_steps, enabled=w.rank == cfg.servers)
    report.start(plan.global_batch, plan.base_lr, plan.peak_lr, cursor.steps_from(0), resumed_at=None)
    started = time.perf_counter()
    compute_s = 0.0
    if live.is_server:
        live.serve()
    else:
        compute_s = _train(cfg, live, train_set, cursor, total_steps, report, plan.peak_lr)
    wall = time.perf_counter() - started
    report.enabled = live.world.rank == cfg.servers   # the first worker may have died: the new one reports
    evaluation = live.collective(lambda: evaluate(cfg, model, test_set,
                                                  ranks=list(range(cfg.servers, live.world.world_size))))
    stats = live.stats()
    wait_s = stats.get("pull_wait_seconds", 0.0) + stats.get("push_seconds", 0.0)
    updates = sum(stats.get("staleness_histogram", {}).values())   # sync: every push at staleness 0
    mine = torch.tensor([compute_s, wait_s, wait_s, gs.traffic()["bytes_sent"], -1.0, updates], dtype=torch.float64)
    per_rank = live.collective(lambda: gs.all_gather(mine).view(live.world.world_size, -1))
    # workers=W at the start: with keep-global every step trains the global batch G = b x accumulation x W
    summary = report.finish(wall, total_steps, evaluation, per_rank[:, :5], workers=plan.workers,
                            staleness={"mean": 0.0, "max": 0.0, "updates": float(per_rank[:, 5].sum())})
    live.close()
    return {"summary": summary, "digest": param_digest(model), "member": live.member, "ps": stats,
            "recoveries": [r.__dict__ for r in live.recoveries], "params": None, "events": []}


def _train(cfg: TrainConfig, live: LivePS, train_set, cursor: EpochCursor, total_steps: int, report,
           peak_lr: float) -> float:
    """The worker's loop: steps until ``total_steps``, then the final pull and close; its compute seconds."""
    kill = _planted_kill(live.member)
    if kill is not None and kill[1] != "forward":
        raise ValueError(f"GRADSYNC_LIVE_KILL phase {kill[1]!r}: a parameter-server worker dies at 'forward' only")
    log_dir = os.environ.get("GRADSYNC_SAMPLE_LOG")
    sample_log = (open(Path(log_dir) / f"live.{os.getpid()}.m{live.member}", "a", buffering=1)  # noqa: SIM115
                  if log_dir else None)
    live.progress = {"epoch": 0, "position": 0}
    current = {"compute_s": 0.0}

    def train_step(model) -> dict:
        epoch, position = live.progress["epoch"], live.progress["position"]
        world, servers = live.world, cfg.servers
        workers, index = world.world_size - servers, world.rank - servers
        step_size = cursor.step_size(position)
        share = cursor.share(cursor.order(epoch), position, workers, index)
        current.update(epoch=epoch, step_size=step_size, loss=0.0)
        if sample_log is not None:   # before the step: a member that dies after its push trained these
            sample_log.write(f"{live.step + 1} {epoch} {' '.join(map(str, share))}\n")
        computed = time.perf_counter()
        for ids in _chunks(share, cfg.grad_accum):
            x, y = train_set[ids]
            logits = model(x)
            if kill == (live.step, "forward"):
                _die()
            loss = (loss_of(cfg.model, logits, y) * (len(ids) * workers / step_size) if ids
                    else logits.sum() * 0.0)
            loss.backward()
            current["loss"] += float(loss.detach())
        current["compute_s"] += time.perf_counter() - computed
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    recoveries = 0
    while True:
        step_started = time.perf_counter()
        if live.step < total_steps:
            if live.run_step(train_step):
                report.step(live.step, current["epoch"], current["loss"],
                            current["step_size"] / (time.perf_counter() - step_started), None)
        elif live.finish():
            break
        if len(live.recoveries) > recoveries:
            recoveries = len(live.recoveries)
            report.enabled = live.world.rank == cfg.servers
            report.live({"event": "live", **live.recoveries[-1].__dict__, "world_size": live.world.world_size,
                         "global_batch": cursor.global_batch, "peak_lr": peak_lr, "at": time.time()})
    if sample_log is not None:
        sample_log.close()
    return current["compute_s"]
