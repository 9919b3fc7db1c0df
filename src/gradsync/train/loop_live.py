"""gradsync train --fault-tolerance live: DDP training whose survivors go on when ranks die.

Per rank, as a recipe: build_data -> plan_batch -> build_model -> LiveDDP (live/ddp.py) -> train
epochs (the epoch's order from data.EpochCursor; each step's global batch split over the ranks of
the world as it is now) -> evaluate -> summarise. When a member dies, LiveDDP rebuilds the world
from the survivors and the step in flight is trained again by them: EpochCursor's position P does
not depend on how many ranks consumed the first P samples, so the epoch's remaining samples are
re-sharded over the survivors with none lost or repeated.

With --max-restarts K the launcher starts a replacement for a dead rank (at most K): it joins the
running world at a step boundary (live/growth.py) and receives the parameters, the optimizer state,
the epoch position and the batch policy's global batch and learning rate from rank 0; the world
grows back and the next step's samples are split over it the same way.

Batch and learning rate after a resize (--live-batch, live/policy.py): keep-global keeps the global
batch G (each survivor's share grows to about G / W'), keep-per-rank keeps each rank's batch and
scales the learning rate by W' / W (back up when the world grows). Each rank's loss is its share's
summed loss x W / (step's samples), so the ranks' average is the step's mean loss however unevenly
the share falls.

Checkpoints, as in the default mode: at each epoch's end, or with --checkpoint-every N (steps only)
after each N-th committed step, the rank 0 of the world as it is then snapshots the state and writes
it in the background (checkpoint.py: a temporary file, then an atomic rename), and again at the end.
A rank 0 that dies while writing leaves the previous checkpoint whole; the new rank 0 removes the
dead member's temporary file and writes the next one. The checkpoint records the batch as it is then
(the world size whose global batch it is, the learning rate after a resize), so --resume continues
it, in this mode or in the default one.

Preemption (train/preempt.py): the preemption signal or Ctrl-C, to the launcher, any member or the
whole job, stops every member after the same committed step (one all-reduce(max) of the members'
stop codes per step, run again if a member dies during it), rank 0 writes the checkpoint and says
how to resume, and the job exits 75 (Ctrl-C: 130).

What this mode leaves out: tracing, --clip-grad, --compress powersgd and every strategy but ddp and
the parameter-server ones (train/config.py says why for each).

Test knobs: GRADSYNC_SAMPLE_LOG=DIR makes every member append "step epoch id id ..." for each step
it starts to DIR/live.<pid>.m<member> (a step tried again after a recovery is written again: the last
line of a step number is the one that counts, and a dead member's count up to the step the survivors
resumed from). GRADSYNC_LIVE_KILL=M:S:PHASE makes member M SIGKILL itself
in step S (0-based) at PHASE: forward (after its forward, before its backward: the others wait for
its gradients in the all-reduce), optimizer (after the all-reduce, before its optimizer step) or
checkpoint (member M, rank 0 then, writes half of step S's checkpoint, S a multiple of N, and dies)
or evaluate (step S the last of an epoch: as the evaluation after it starts; the others wait for M
in the evaluation's collectives, outside any step).
GRADSYNC_LIVE_AWAIT_JOINER=1 makes the members, after a recovery from a death and one step in the
shrunk world, wait (at most 60 s) until a replacement asks to join, so that it joins a short run
before it ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import statistics
import threading
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync import checkpoint
from gradsync.group import runtime
from gradsync.data import EpochCursor
from gradsync.live import LiveDDP, resized
from gradsync.train import requeue, resume
from gradsync.train.resume import CHECKPOINT_NAME
from gradsync.train.common import build_optimizer, evaluate, loss_of, lr_at, on, param_digest, train_device
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import build_dataset
from gradsync.train.models import build_model
from gradsync.train.preempt import PreemptWatch, resume_command, spawned_rank, STOP_REASONS
from gradsync.train.report import Reporter


def chunks(ids: list[int], parts: int) -> list[list[int]]:
    """``ids`` in ``parts`` contiguous pieces whose sizes differ by at most one (10 in 3: 4, 3, 3)."""
    size, extra = divmod(len(ids), parts)
    bounds = [m * size + min(m, extra) for m in range(parts + 1)]
    return [ids[bounds[m]:bounds[m + 1]] for m in range(parts)]


KILL_PHASES = ("forward", "optimizer", "checkpoint", "evaluate")


def planted_kill(member: int) -> tuple[int, str] | None:
    """(step, phase) at which this member kills itself (GRADSYNC_LIVE_KILL), or None."""
    text = os.environ.get("GRADSYNC_LIVE_KILL", "")
    if not text:
        return None
    try:
        who, step, phase = text.split(":")
        who, step = int(who), int(step)
    except ValueError:
        raise ValueError(f"GRADSYNC_LIVE_KILL={text!r}: give MEMBER:STEP:PHASE, e.g. 1:5:forward") from None
    if phase not in KILL_PHASES:
        raise ValueError(f"GRADSYNC_LIVE_KILL phase {phase!r} is not one of {', '.join(KILL_PHASES)}")
    return (step, phase) if who == member else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _die_writing(path: Path, state: dict) -> None:
    """The checkpoint kill: half of the checkpoint's temporary file written, then SIGKILL."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open(checkpoint.temporary(path, os.getpid()), "wb") as f:
        f.write(buffer.getvalue()[:buffer.tell() // 2])
        f.flush()
        os.fsync(f.fileno())
    die()


class LiveCheckpoints:
    """--checkpoint-every N in a live world (see the module docstring)."""

    def __init__(self, cfg: TrainConfig, plan: resume.BatchPlan, kill: tuple[int, str] | None) -> None:
        self.cfg, self.every = cfg, cfg.checkpoint_interval()[0]
        self.path = Path(cfg.out) / CHECKPOINT_NAME
        self.base_lr, self.kill = plan.base_lr, kill
        self.writer = checkpoint.BackgroundWriter()
        self.written: list[int] = []

    def _state(self, live: LiveDDP, batch: dict) -> dict:
        cfg = self.cfg
        workers = batch["global"] // (cfg.batch_size * cfg.grad_accum)   # the world whose global batch it is
        plan = resume.BatchPlan(cfg.batch_size, cfg.grad_accum, workers, self.base_lr, batch["peak_lr"],
                                epochs=cfg.epochs, warmup_steps=cfg.warmup_steps)
        return resume.state_of(cfg, plan, live.module, live.optimizer, live.step, live.progress["epoch"],
                               live.progress["position"], live.world.world_size)

    def after_step(self, live: LiveDDP, batch: dict, final: bool = False, epoch_ended: bool = False) -> None:
        """Write a checkpoint if one is due (rank 0 alone; the others hold the same state): every N-th
        step with --checkpoint-every N, else at each epoch's end; ``final`` (the job's end or its
        preemption): now, before returning."""
        due = live.step % self.every == 0 if self.every is not None else epoch_ended
        if live.world.rank != 0 or not (final or due) or (final and live.step in self.written[-1:]):
            if final and live.world.rank == 0:
                self.writer.wait()
            return
        state = checkpoint.snapshot(self._state(live, batch))
        if self.kill == (live.step, "checkpoint"):
            threading.Thread(target=_die_writing, args=(self.path, state), daemon=True).start()
            return
        if final:
            self.writer.wait()
            checkpoint.save(self.path, state)
        else:
            self.writer.submit(self.path, state)
        self.written.append(live.step)

    def after_recovery(self, live: LiveDDP, lost: list[int]) -> None:
        """The new rank 0 removes what the ``lost`` members on this host left half written."""
        if live.world.rank != 0:
            return
        for member in lost:
            where = live.membership.location(member)
            if where is not None and where[0] == live.membership.me:
                checkpoint.temporary(self.path, where[1]).unlink(missing_ok=True)


def train_live_rank(cfg: TrainConfig) -> dict:
    """One member's job (see the module docstring); returns its statistics and recoveries."""
    with PreemptWatch(cfg.preempt_signal, interrupt_twice_raises=not spawned_rank()) as watch:
        return _train_live_rank(cfg, watch)


def _stop_code(watch: PreemptWatch) -> int:
    """The strongest stop code of the members (preempt.STOP_REASONS): collective."""
    code = torch.tensor([watch.stop_code], dtype=torch.int64)
    if gs.world().world_size > 1:
        gs.all_reduce(code, op="max")
    return int(code[0])


def _train_live_rank(cfg: TrainConfig, watch: PreemptWatch) -> dict:
    torch.manual_seed(cfg.seed)
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    joining = runtime.replacement() is not None   # a replacement receives the state from rank 0 instead
    saved = resume.read(cfg) if not joining and resume.agreed(cfg) else None
    plan = resume.BatchPlan.for_resume(cfg, cfg.workers, saved) if saved else resume.BatchPlan.fresh(cfg, cfg.workers)
    cfg = dataclasses.replace(cfg, batch_size=plan.batch_size, grad_accum=plan.grad_accum)
    batch = {"global": plan.global_batch, "peak_lr": plan.peak_lr}   # a replacement receives rank 0's
    device = train_device(cfg)
    model = build_model(cfg.model, cfg.dataset).to(device)
    optimizer = build_optimizer(cfg, model.parameters(), plan.peak_lr)
    step, epoch, position = resume.apply(saved, model, optimizer) if saved else (0, 0, 0)

    def on_resize(live: LiveDDP, old_world: int) -> None:
        batch["global"], batch["peak_lr"] = resized(cfg.live_batch, batch["global"], batch["peak_lr"], old_world,
                                                    live.world.world_size, scaling=cfg.lr_scaling)

    # a replacement joins the running world here, receiving the state, the progress and the batch
    live = LiveDDP(model, optimizer, on_resize=on_resize, progress={"epoch": epoch, "position": position}, shared=batch,
                   admit_joiners=cfg.max_restarts > 0,   # --max-restarts K: the launcher starts up to K replacements
                   bucket_cap_mb=cfg.bucket_mb, algorithm=cfg.algorithm,
                   comm_hook=None if cfg.compress == "none" else cfg.compress)
    if saved:
        live.step = step
    w = live.world
    cursor = EpochCursor(len(train_set), batch["global"], seed=cfg.seed)
    kill = planted_kill(live.member)
    if kill is not None and kill[1] == "optimizer":
        optimizer.register_step_pre_hook(lambda *_: die() if live.step == kill[0] else None)
    cfg = plan.scheduled(cfg, cursor.steps_from(0))   # the run's length and warm-up (train/batch_math.py)
    checkpoints = LiveCheckpoints(cfg, plan, kill)
    total_steps = cfg.steps if cfg.steps is not None else cfg.epochs * cursor.steps_from(0)
    report = Reporter(cfg, total_steps, enabled=w.rank == 0)
    for line in plan.changes:
        report.note(line)
    report.start(batch["global"], plan.base_lr, batch["peak_lr"], cursor.steps_from(0),
                 resumed_at=live.step if saved else None, train_samples=len(train_set))
    log_dir = os.environ.get("GRADSYNC_SAMPLE_LOG")
    sample_log = (open(Path(log_dir) / f"live.{os.getpid()}.m{live.member}", "a", buffering=1)  # noqa: SIM115
                  if log_dir else None)
    stats = {"compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0}
    evaluation: dict = {}
    started = time.perf_counter()
    current = {}

    def train_step(ddp) -> dict:
        epoch, position = live.progress["epoch"], live.progress["position"]
        world = live.world
        for group in optimizer.param_groups:
            group["lr"] = lr_at(live.step, batch["peak_lr"], cfg.warmup_steps)
        step_size = cursor.step_size(position)
        share = cursor.share(cursor.order(epoch), position, world.world_size, world.rank)
        current.update(share=share, epoch=epoch, step_size=step_size, loss=0.0)
        if sample_log is not None:   # before the step: a member that dies after its all-reduce trained these
            sample_log.write(f"{live.step + 1} {epoch} {' '.join(map(str, share))}\n")
        for micro, ids in enumerate(chunks(share, cfg.grad_accum)):
            with ddp.no_sync() if micro < cfg.grad_accum - 1 else contextlib.nullcontext():
                x, y = on(device, train_set[ids])
                logits = ddp(x)
                if kill == (live.step, "forward"):
                    die()
                loss = (loss_of(cfg.model, logits, y) * (len(ids) * world.world_size / step_size) if ids
                        else logits.sum() * 0.0)
                loss.backward()
            current["loss"] += float(loss.detach())
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    def more() -> bool:
        return live.step < cfg.steps if cfg.steps is not None else live.progress["epoch"] < cfg.epochs

    reported = 0   # changes of the world recorded so far

    def on_changes() -> None:
        """After the world changed, in a step or in a collective (an evaluation): the cursor for the
        batch as it is now, the new rank 0 reporting, a record of each change, stale files removed."""
        nonlocal cursor, reported
        cursor = EpochCursor(len(train_set), batch["global"], seed=cfg.seed)
        report.enabled = live.world.rank == 0   # rank 0 may have died: the new rank 0 reports
        for change in live.recoveries[reported:]:
            report.live({"event": "live", **change.__dict__, "world_size": live.world.world_size,
                         "global_batch": batch["global"], "peak_lr": batch["peak_lr"], "at": time.time()})
        checkpoints.after_recovery(live, [m for change in live.recoveries[reported:] for m in change.lost])
        reported = len(live.recoveries)

    def collective(fn):
        """live.collective(fn), and the changes of the world it went through recorded."""
        value = live.collective(fn)
        if len(live.recoveries) > reported:
            on_changes()
        return value

    await_joiner = os.environ.get("GRADSYNC_LIVE_AWAIT_JOINER", "") not in ("", "0")
    while more():
        if await_joiner and live.recoveries and not live.recoveries[-1].joined and live.step > live.recoveries[-1].step:
            live.await_joiner(60.0)
            await_joiner = False
        step_started = time.perf_counter()
        if not live.run_step(train_step):   # the world changed (a death or a joiner): the step is trained next
            on_changes()
            continue
        elapsed = time.perf_counter() - step_started
        stats["comm_s"] += live.model.comm_seconds
        stats["wait_s"] += live.model.wait_seconds
        stats["compute_s"] += elapsed - live.model.wait_seconds
        report.step(live.step, current["epoch"], current["loss"], current["step_size"] / elapsed,
                    live.model.last_overlap)
        epoch_ended = live.progress["epoch"] != current["epoch"]
        checkpoints.after_step(live, batch, epoch_ended=epoch_ended)
        if epoch_ended:   # the epoch's last step
            if kill == (live.step, "evaluate"):
                die()
            evaluation = collective(lambda: evaluate(cfg, model, test_set))
            report.epoch(current["epoch"], live.step, evaluation)
        reason = STOP_REASONS[collective(lambda: _stop_code(watch))] if watch.active else None
        if reason is not None:
            checkpoints.after_step(live, batch, final=True)
            command = resume_command(cfg)
            report.preempted(live.step, command, signal_at=watch.first_at)
            requeue.after_checkpoint(cfg, live.world.rank, reason)
            live.close()
            return {"summary": None, "preempted": {"step": live.step, "command": command, "reason": reason,
                                                   "signals": watch.received},
                    "digest": None, "member": live.member, "recoveries": [r.__dict__ for r in live.recoveries],
                    "params": None, "events": [], "checkpoints": checkpoints.written}
    wall = time.perf_counter() - started
    if not evaluation:
        evaluation = collective(lambda: evaluate(cfg, model, test_set))
    collective(live.check_replicas)
    mine = torch.tensor([stats["compute_s"], stats["comm_s"], stats["wait_s"], gs.traffic()["bytes_sent"], -1.0],
                        dtype=torch.float64)
    per_rank = collective(lambda: gs.all_gather(mine).view(gs.world().world_size, -1))
    checkpoints.after_step(live, batch, final=True)
    summary = report.finish(wall, live.step, evaluation, per_rank, trained=live.step - (step if saved else 0))
    live.close()
    if sample_log is not None:
        sample_log.close()
    return {"summary": summary, "digest": param_digest(model), "member": live.member,
            "recoveries": [r.__dict__ for r in live.recoveries], "params": None, "events": [],
            "checkpoints": checkpoints.written}


def workers_summary(results: list[dict | None]) -> str:
    """One line for the launcher: which members finished and what the recoveries cost."""
    finished = [r for r in results if r is not None]
    changes = finished[0]["recoveries"] if finished else []
    seconds = [r["seconds"] for r in changes if not r["joined"]]
    joins = [r for r in changes if r["joined"]]
    return (f"live: {len(finished)} of {len(results)} members finished; {len(seconds)} recovery(ies)"
            + (f", median {statistics.median(seconds):.3f} s from the error to the rebuilt world" if seconds else "")
            + (f"; {len(joins)} replacement(s) joined" if joins else ""))
