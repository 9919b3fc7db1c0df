"""gradsync train: N workers train a real model on real data; one summary of what the ranks did.

Runbook
    one process:          gradsync train --strategy local --workers 1
    N local workers:      gradsync train --workers 4
    2 hosts x 2 ranks:    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0,1} \\
                              --master-addr HOST0 --master-port 29500 -m gradsync.train --dataset digits

Per rank, as a recipe: build_data -> plan_batch (resume.py: the checkpoint's global batch on this
world size) -> build_model -> wrap_model -> build_optimizer -> maybe_resume -> train epochs (the
epoch's order from data.EpochCursor, micro-batches with no_sync, warm-up lr, step, the step-boundary
verdict: checkpoint? preempted? -- preempt.py) -> evaluate -> checkpoint -> summarise.

Preemption: SIGTERM (--preempt-signal) to the launcher, any rank or the whole job stops every rank
after the same step with a checkpoint, prints ``preempted at step S; resume with: ...`` and exits 75;
Ctrl-C does the same and exits 130 (a second Ctrl-C: at once). train/preempt.py.

Batch math (printed at start; train/batch_math.py):
    global batch = per-worker batch x workers x accumulation steps
    lr = base lr x k, k = sqrt(global batch / per-worker batch) (--lr-scaling sqrt, the default), the
         ratio itself (linear) or 1 (none); without --epochs, the run keeps lr x steps of 8 epochs of one worker
    clip: g <- g x min(1, X / (||g||_2 + 1e-6))           with --clip-grad X, g the step's averaged gradient
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

import gradsync as gs
from gradsync import checkpoint
from gradsync.observe import trace
from gradsync.group.job_signals import hold_signals
from gradsync.data import EpochCursor
from gradsync.replicas import first_mismatch, gather_strings
from gradsync.train.common import (build_optimizer, clip_gradients, device_record, evaluate, loss_of, lr_at, on,
                                   param_digest, train_device)
from gradsync.train.config import PS_STRATEGIES, TrainConfig
from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook
from gradsync.train.datasets import build_dataset
from gradsync.train.diloco_job import DiLoCoJob
from gradsync.train.loop_ps import MODE_OF, train_ps_rank
from gradsync.train.models import build_model
from gradsync.train.preempt import PreemptWatch, StepBoundary, resume_command, spawned_rank, stop_signals
from gradsync.train.report import Reporter
from gradsync.train.resume import CHECKPOINT_NAME
from gradsync.train import requeue, resume


class _Unwrapped:
    """What the loop needs from a DDP wrapper, for zero1 (which reduces in optimizer.step)."""

    def __init__(self, model: nn.Module, optimizer) -> None:
        self.module, self.optimizer = model, optimizer
        self.last_overlap = None

    def __call__(self, *args):
        return self.module(*args)

    def no_sync(self):
        return contextlib.nullcontext()   # gradients only meet in optimizer.step()

    @property
    def comm_seconds(self) -> float:
        return self.optimizer.last_comm_seconds

    wait_seconds = comm_seconds           # step() blocks on its collectives: all of it is exposed

    def check_replicas(self) -> None:
        mismatch = first_mismatch(list(self.module.parameters()))
        if mismatch is not None:
            raise gs.ReplicaMismatchError(f"replicas diverged at parameter #{mismatch[1]} (rank {mismatch[0]})")

    def close(self) -> None:
        pass


def _layout(model: nn.Module, wrapped) -> dict:
    """Model size, buckets and rank placement (collective: every rank calls it)."""
    w = gs.world()
    hosts = gather_strings([socket.gethostname()])
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            "bucket_bytes": wrapped.bucket_sizes() if hasattr(wrapped, "bucket_sizes") else None,
            "world_size": w.world_size, "hosts": [h[0] if h else "?" for h in hosts]}


def _micro_loss(cfg: TrainConfig, logits, y, ids: list[int], step_size: int, full: bool, workers: int):
    """A full step: the micro-batch's mean loss / a (the plain recipe). The epoch's last, shorter step:
    each sample weighs workers / step_size, so the ranks' averaged gradient is the mean over the
    step's samples however unevenly they fall; a rank with no sample adds zeros (its hooks still fire)."""
    if full:
        return loss_of(cfg.model, logits, y) / cfg.grad_accum
    if not ids:
        return logits.sum() * 0.0
    return loss_of(cfg.model, logits, y) * (len(ids) * workers / step_size)


def train_worker(cfg: TrainConfig) -> dict:
    """One rank's job; returns its statistics (and timeline events when tracing)."""
    with PreemptWatch(cfg.preempt_signal, interrupt_twice_raises=not spawned_rank()) as watch:
        return _train_worker(cfg, watch)


def _train_worker(cfg: TrainConfig, watch: PreemptWatch) -> dict:
    w = gs.world()
    torch.manual_seed(cfg.seed)
    if cfg.trace:
        trace.enable(w.rank)
    # build_data, plan_batch
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    saved = resume.read(cfg) if resume.agreed(cfg) else None
    plan = resume.BatchPlan.for_resume(cfg, w.world_size, saved) if saved else resume.BatchPlan.fresh(cfg, w.world_size)
    cfg = dataclasses.replace(cfg, batch_size=plan.batch_size, grad_accum=plan.grad_accum)
    global_batch, peak_lr = plan.global_batch, plan.peak_lr
    if global_batch > len(train_set):
        raise ValueError(f"each worker sees {len(train_set) // w.world_size} training samples per epoch, fewer than "
                         f"one step of --batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}; use fewer "
                         f"workers or a smaller batch")
    cursor = EpochCursor(len(train_set), global_batch, seed=cfg.seed)
    steps_per_epoch = cursor.steps_from(0)
    cfg = plan.scheduled(cfg, steps_per_epoch)   # the run's length and warm-up (train/batch_math.py)
    # build_model (on this rank's device), wrap_model, build_optimizer
    device = train_device(cfg)
    model = build_model(cfg.model, cfg.dataset).to(device)
    if cfg.strategy == "zero1":
        optimizer = build_optimizer(cfg, model.parameters(), peak_lr)
        wrapped = _Unwrapped(model, optimizer)
    elif cfg.strategy == "diloco":
        optimizer = build_optimizer(cfg, model.parameters(), peak_lr)
        wrapped = DiLoCoJob(cfg, model, optimizer)
    else:
        wrapped = gs.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb, algorithm=cfg.algorithm,
                                             comm_hook=None if cfg.compress in ("none", "powersgd") else cfg.compress)
        if cfg.compress == "powersgd":
            wrapped.register_comm_hook(PowerSGDState(rank=cfg.powersgd_rank, algorithm=cfg.algorithm), powersgd_hook)
        optimizer = build_optimizer(cfg, model.parameters(), peak_lr)
    step, epoch, position = resume.apply(saved, model, optimizer) if saved else (0, 0, 0)
    if saved and cfg.strategy == "diloco":
        wrapped.load_replica(cfg.out, saved)
    if cfg.steps is not None:
        total_steps = cfg.steps
    elif epoch < cfg.epochs:
        total_steps = step + cursor.steps_from(position) + (cfg.epochs - epoch - 1) * steps_per_epoch
    else:
        total_steps = step

    first_step = step
    report = Reporter(cfg, total_steps, enabled=(w.rank == 0))
    for line in plan.changes:
        report.note(line)
    report.start(global_batch, plan.base_lr, peak_lr, steps_per_epoch, resumed_at=step if saved else None,
                 train_samples=len(train_set))
    report.setup(**_layout(model, wrapped), **device_record(device))
    gs.traffic_reset()
    # overlap: bucket all-reduce seconds before backward ended, and in all (steps that reduced in backward)
    stats = {"compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "hidden_s": 0.0, "bucket_s": 0.0, "checkpoint_s": 0.0,
             "checkpoints": 0}
    evaluation = {}
    started = time.perf_counter()
    boundary = StepBoundary(cfg, watch)
    # Test knob: GRADSYNC_SAMPLE_LOG=DIR makes every rank append "epoch id id ..." per step it trains
    log_dir = os.environ.get("GRADSYNC_SAMPLE_LOG")
    sample_log = open(Path(log_dir) / f"samples.{os.getpid()}.r{w.rank}", "a", buffering=1) if log_dir else None  # noqa: SIM115

    writer = checkpoint.BackgroundWriter()

    def save(step: int, epoch: int, position: int, background: bool = True) -> None:
        """Checkpoint: rank 0 snapshots the state and writes it in the background while training goes
        on; ``background`` False (preemption: the job exits next) writes it before returning."""
        written = time.perf_counter()
        state = resume.state_of(cfg, plan, model, optimizer, step, epoch, position, w.world_size)  # collective for zero1
        if cfg.strategy == "diloco":   # the replicas differ between outer steps: each rank saves its own
            state["diloco"] = wrapped.diloco.state_dict()
            wrapped.save_replica(cfg.out, step)
        if w.rank == 0 and background:
            writer.submit(Path(cfg.out) / CHECKPOINT_NAME, checkpoint.snapshot(state))
        elif w.rank == 0:
            writer.wait()
            checkpoint.save(Path(cfg.out) / CHECKPOINT_NAME, state)
        stats["checkpoint_s"] += time.perf_counter() - written
        stats["checkpoints"] += 1

    while step < total_steps:
        order = cursor.order(epoch)
        while position < cursor.n and step < total_steps:
            step_started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, peak_lr, cfg.warmup_steps)
            optimizer.zero_grad(set_to_none=False)
            share = cursor.share(order, position, w.world_size, w.rank)
            step_size = cursor.step_size(position)
            if sample_log is not None:
                sample_log.write(f"{epoch} {' '.join(map(str, share))}\n")
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                ids = share[micro * cfg.batch_size:(micro + 1) * cfg.batch_size]
                x, y = on(device, train_set[ids])
                with wrapped.no_sync() if micro < cfg.grad_accum - 1 else contextlib.nullcontext():
                    loss = _micro_loss(cfg, wrapped(x), y, ids, step_size, step_size == global_batch, w.world_size)
                    loss.backward()
                loss_sum += float(loss.detach())
            grad_norm = clip_gradients(cfg, model, optimizer)
            with trace.span("optimizer step", "compute"):
                optimizer.step()
            if cfg.strategy == "diloco":
                wrapped.after_step()
            step += 1
            position += step_size
            elapsed = time.perf_counter() - step_started
            stats["comm_s"] += wrapped.comm_seconds
            stats["wait_s"] += wrapped.wait_seconds
            stats["compute_s"] += elapsed - wrapped.wait_seconds
            if wrapped.last_overlap is not None:
                stats["hidden_s"] += wrapped.last_overlap * wrapped.comm_seconds
                stats["bucket_s"] += wrapped.comm_seconds
            report.step(step, epoch, loss_sum, step_size / elapsed, wrapped.last_overlap, grad_norm,
                        bytes_sent=gs.traffic()["bytes_sent"] if w.rank == 0 else None)
            due, stop = boundary(step)
            if stop:
                return _preempted(cfg, report, watch, lambda *at: save(*at, background=False), wrapped, step, epoch,
                                  position, boundary.reason)
            if due and step < total_steps and position < cursor.n:  # at an epoch's end the epoch's save follows
                save(step, epoch, position)
        finished_epoch = position >= cursor.n
        if cfg.strategy == "diloco":
            wrapped.end_epoch()
        evaluation = evaluate(cfg, model, test_set)
        report.epoch(epoch, step, evaluation)
        if finished_epoch:
            epoch, position = epoch + 1, 0
        save(step, epoch, position)
    waited = time.perf_counter()
    writer.wait()   # the last checkpoint is on disk before the job reports and exits
    stats["checkpoint_s"] += time.perf_counter() - waited
    wall = time.perf_counter() - started
    if not evaluation:  # resumed from a checkpoint with no step left: still report the model's score
        evaluation = evaluate(cfg, model, test_set)
    wrapped.check_replicas()
    mine = torch.tensor([stats["compute_s"], stats["comm_s"], stats["wait_s"], gs.traffic()["bytes_sent"],
                         stats["hidden_s"] / stats["bucket_s"] if stats["bucket_s"] > 0 else -1.0],
                        dtype=torch.float64)
    per_rank = gs.all_gather(mine).view(w.world_size, -1)
    summary = report.finish(wall, step, evaluation, per_rank,
                            checkpoints=(stats["checkpoints"], stats["checkpoint_s"], writer.seconds),
                            trained=step - first_step)
    wrapped.close()
    if sample_log is not None:
        sample_log.close()
    return {"summary": summary, "digest": param_digest(model),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()} if w.world_size <= 8 else None,
            "events": trace.disable() if cfg.trace else []}


def _preempted(cfg, report, watch, save, wrapped, step: int, epoch: int, position: int, reason: str) -> dict:
    """Every rank stops after the same step: one checkpoint, rank 0 says how to continue."""
    save(step, epoch, position)
    command = resume_command(cfg)
    report.preempted(step, command, signal_at=watch.first_at)
    requeue.after_checkpoint(cfg, gs.world().rank, reason)
    wrapped.close()
    return {"summary": None, "preempted": {"step": step, "epoch": epoch, "position": position, "command": command,
                                           "signals": watch.received, "reason": reason},
            "digest": None, "params": None, "events": trace.disable() if cfg.trace else []}


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_PORT" in os.environ


def train_rank(cfg: TrainConfig) -> dict:
    """One rank's job for any strategy."""
    if cfg.strategy in MODE_OF:
        return train_ps_rank(cfg)
    return train_worker(cfg)


def _spawn_with_restarts(cfg: TrainConfig) -> list[dict]:
    """gs.spawn, and after a failure up to ``cfg.max_restarts`` more attempts, each resuming from the
    newest checkpoint this job wrote (an older one in --out, from another run, is never used)."""
    started = time.time()
    checkpoint_path = Path(cfg.out) / CHECKPOINT_NAME
    for attempt in range(cfg.max_restarts + 1):
        try:
            return gs.spawn(train_rank, nprocs=cfg.workers, args=(cfg,), timeout=cfg.timeout,
                            forward_signals=stop_signals(cfg))
        except gs.SpawnError as exc:
            if attempt == cfg.max_restarts:
                raise
            ours = checkpoint_path.exists() and checkpoint_path.stat().st_mtime >= started
            cfg = dataclasses.replace(cfg, resume=ours or cfg.resume)
            print(f"gradsync train: {str(exc).splitlines()[0]}\ngradsync train: restart {attempt + 1} of "
                  f"{cfg.max_restarts}, from {'the last checkpoint' if cfg.resume else 'the beginning'}",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def _remove_partial_writes(out: Path) -> None:
    """The temporary files (checkpoint.save's .NAME.tmp-PID) of ranks that were stopped while writing."""
    for partial in out.glob(".*.tmp-*"):
        pid = partial.name.rsplit("-", 1)[-1]
        try:
            os.kill(int(pid), 0)
        except (ValueError, ProcessLookupError):
            partial.unlink(missing_ok=True)
        except PermissionError:   # alive, another user's
            pass


def run(cfg: TrainConfig) -> list[dict]:
    """Run the job: under torchrun in this process, else ``cfg.workers`` local processes. Ctrl-C is
    this job's while it runs (train/preempt.py) and the caller's again when it returns."""
    interrupt = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    try:
        return _run(cfg)
    finally:
        if interrupt is not None:
            signal.signal(signal.SIGINT, interrupt)


def _run(cfg: TrainConfig) -> list[dict]:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    hold_signals(stop_signals(cfg))   # a preemption during start-up stops the job after its first step
    if _under_torchrun() and cfg.fault_tolerance == "live":
        from gradsync.train.loop_live import train_live_rank

        if cfg.strategy in PS_STRATEGIES:
            raise RuntimeError(f"--strategy {cfg.strategy} --fault-tolerance live runs under gradsync's own launcher "
                               f"(gradsync train --workers N), not under torchrun")
        if cfg.max_restarts:
            raise RuntimeError("--fault-tolerance live --max-restarts starts replacement ranks from gradsync's own "
                               "launcher (gradsync train --workers N); under torchrun a lost node is not replaced: "
                               "drop --max-restarts (and keep torchrun's own --max-restarts at 0)")
        gs.init(timeout=cfg.timeout)
        try:
            return [train_live_rank(cfg)]
        finally:
            gs.shutdown()
    if _under_torchrun() or cfg.strategy == "local":
        gs.init(timeout=cfg.timeout)
        try:
            results = [train_rank(cfg)]
        finally:
            gs.shutdown()
        if cfg.trace:
            trace.write(Path(cfg.out) / f"trace.rank{int(os.environ.get('RANK', 0))}.json", results[0]["events"])
        return results
    if cfg.fault_tolerance == "live":
        from gradsync.train.loop_live import train_live_rank, workers_summary
        from gradsync.train.loop_ps_live import train_ps_live_rank

        ps = cfg.strategy in PS_STRATEGIES
        results = gs.spawn(train_ps_live_rank if ps else train_live_rank, nprocs=cfg.workers, args=(cfg,),
                           timeout=cfg.timeout, fault_tolerance="live", replacements=cfg.max_restarts,
                           forward_signals=stop_signals(cfg))
        print(f"gradsync train: {workers_summary(results)}", file=sys.stderr, flush=True)
        return results
    try:
        results = _spawn_with_restarts(cfg)
    except KeyboardInterrupt:   # a second Ctrl-C: the ranks were stopped at once, maybe mid-write
        _remove_partial_writes(Path(cfg.out))
        raise
    if cfg.trace:
        trace.write(Path(cfg.out) / "trace.json", [e for r in results for e in r["events"]])
    return results
