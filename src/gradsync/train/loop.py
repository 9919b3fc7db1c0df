"""gradsync train: N workers train a real model on real data; one summary of what the ranks did.

Runbook
    one process:          gradsync train --strategy local --workers 1
    N local workers:      gradsync train --workers 4
    2 hosts x 2 ranks:    torchrun --nnodes 2 --nproc-per-node 2 --node-rank {0,1} \\
                              --master-addr HOST0 --master-port 29500 -m gradsync.train --dataset digits

Per rank, as a recipe: build_data -> build_model -> wrap_model -> build_optimizer -> maybe_resume ->
train epochs (sampler.set_epoch, micro-batches with no_sync, warm-up lr, step) -> evaluate ->
checkpoint -> summarise.

Batch math (printed at start):
    global batch = per-worker batch x workers x accumulation steps
    lr = base lr x (global batch / per-worker batch)      with --lr-scaling linear
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gradsync as gs
from gradsync import checkpoint, trace
from gradsync.data import DistributedSampler
from gradsync.replicas import first_mismatch, gather_strings
from gradsync.train.common import build_optimizer, evaluate, loss_of, lr_at, param_digest
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import build_dataset
from gradsync.train.loop_ps import MODE_OF, train_ps_rank
from gradsync.train.models import build_model
from gradsync.train.report import Reporter

CHECKPOINT_NAME = "checkpoint.pt"


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


def _checkpoint_state(cfg, model, optimizer, step, epoch, batch_in_epoch) -> dict:
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
            "batch_in_epoch": batch_in_epoch, "world_size": gs.world().world_size,
            "identity": {k: getattr(cfg, k) for k in ("model", "dataset", "batch_size", "grad_accum", "strategy", "seed")},
            "rng_torch": torch.get_rng_state()}


class _CheckpointClock:
    """When --checkpoint-every asks for a checkpoint after a step: every N steps (every rank knows
    the step), or once rank 0's clock has passed the interval since the last one (broadcast, so every
    rank takes the same step: the state gather is collective for zero1)."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.steps, self.seconds = cfg.checkpoint_interval()
        self.last = time.monotonic()

    def __call__(self, step: int) -> bool:
        if self.steps is not None:
            return step % self.steps == 0
        if self.seconds is None:
            return False
        flag = torch.tensor([1 if time.monotonic() - self.last >= self.seconds else 0], dtype=torch.int64)
        gs.broadcast(flag, src=0)
        if flag.item():
            self.last = time.monotonic()
        return bool(flag.item())


def _resume(cfg: TrainConfig, model, optimizer) -> tuple[int, int, int]:
    state = checkpoint.load(Path(cfg.out) / CHECKPOINT_NAME)
    w = gs.world()
    if state["world_size"] != w.world_size:
        raise checkpoint.CheckpointError(f"the checkpoint was written by {state['world_size']} workers and this run has "
                                         f"{w.world_size}; resume with --workers {state['world_size']}")
    identity = {k: getattr(cfg, k) for k in state["identity"]}
    if identity != state["identity"]:
        differing = {k: (state["identity"][k], identity[k]) for k in identity if identity[k] != state["identity"][k]}
        raise checkpoint.CheckpointError(f"the checkpoint belongs to a different run: (checkpoint, now) = {differing}")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_torch"])
    return state["step"], state["epoch"], state["batch_in_epoch"]


def _layout(model: nn.Module, wrapped) -> dict:
    """Model size, buckets and rank placement (collective: every rank calls it)."""
    w = gs.world()
    hosts = gather_strings([socket.gethostname()])
    params = [p for p in model.parameters() if p.requires_grad]
    return {"params": sum(p.numel() for p in params), "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "param_dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
            "bucket_bytes": wrapped.bucket_sizes() if hasattr(wrapped, "bucket_sizes") else None,
            "world_size": w.world_size, "hosts": [h[0] if h else "?" for h in hosts]}


def train_worker(cfg: TrainConfig) -> dict:
    """One rank's whole job; returns its statistics (and timeline events when tracing)."""
    w = gs.world()
    torch.manual_seed(cfg.seed)
    if cfg.trace:
        trace.enable(w.rank)
    # build_data
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed)
    micro_per_epoch = len(sampler) // cfg.batch_size
    steps_per_epoch = micro_per_epoch // cfg.grad_accum
    if steps_per_epoch < 1:
        raise ValueError(f"each worker sees {len(sampler)} training samples per epoch, fewer than one step of "
                         f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}; use fewer workers or a smaller batch")
    total_steps = cfg.steps or cfg.epochs * steps_per_epoch
    # build_model, wrap_model, build_optimizer
    model = build_model(cfg.model, cfg.dataset)
    global_batch = cfg.batch_size * w.world_size * cfg.grad_accum
    base_lr = cfg.lr or cfg.default_lr()
    peak_lr = base_lr * (global_batch / cfg.batch_size if cfg.lr_scaling == "linear" else 1.0)
    if cfg.strategy == "zero1":
        optimizer = build_optimizer(cfg, model.parameters(), peak_lr)
        wrapped = _Unwrapped(model, optimizer)
    else:
        wrapped = gs.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_mb, algorithm=cfg.algorithm,
                                             comm_hook=None if cfg.compress == "none" else cfg.compress)
        optimizer = build_optimizer(cfg, model.parameters(), peak_lr)
    step, epoch, skip = _resume(cfg, model, optimizer) if cfg.resume else (0, 0, 0)

    report = Reporter(cfg, total_steps, enabled=(w.rank == 0))
    report.start(global_batch, base_lr, peak_lr, steps_per_epoch, resumed_at=step if cfg.resume else None)
    report.setup(**_layout(model, wrapped))
    gs.traffic_reset()
    stats = {"compute_s": 0.0, "comm_s": 0.0, "wait_s": 0.0, "overlaps": [], "checkpoint_s": 0.0, "checkpoints": 0}
    evaluation = {}
    started = time.perf_counter()
    due = _CheckpointClock(cfg)

    def save(step: int, epoch: int, batch_in_epoch: int) -> None:
        written = time.perf_counter()
        state = _checkpoint_state(cfg, model, optimizer, step, epoch, batch_in_epoch)   # collective for zero1
        if w.rank == 0:
            checkpoint.save(Path(cfg.out) / CHECKPOINT_NAME, state)
        stats["checkpoint_s"] += time.perf_counter() - written
        stats["checkpoints"] += 1

    while step < total_steps:
        sampler.set_epoch(epoch)
        order = sampler.indices()
        batch_in_epoch = skip
        for batch_in_epoch in range(skip, steps_per_epoch):
            if step >= total_steps:
                break
            step_started = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, peak_lr, cfg.warmup_steps)
            optimizer.zero_grad(set_to_none=False)
            loss_sum = 0.0
            for micro in range(cfg.grad_accum):
                first = (batch_in_epoch * cfg.grad_accum + micro) * cfg.batch_size
                x, y = train_set[order[first:first + cfg.batch_size]]
                if micro < cfg.grad_accum - 1:
                    with wrapped.no_sync():
                        loss = loss_of(cfg.model, wrapped(x), y) / cfg.grad_accum
                        loss.backward()
                else:
                    loss = loss_of(cfg.model, wrapped(x), y) / cfg.grad_accum
                    loss.backward()
                loss_sum += float(loss.detach())
            with trace.span("optimizer step", "compute"):
                optimizer.step()
            step += 1
            elapsed = time.perf_counter() - step_started
            stats["comm_s"] += wrapped.comm_seconds
            stats["wait_s"] += wrapped.wait_seconds
            stats["compute_s"] += elapsed - wrapped.wait_seconds
            if wrapped.last_overlap is not None:
                stats["overlaps"].append(wrapped.last_overlap)
            report.step(step, epoch, loss_sum, global_batch / elapsed, wrapped.last_overlap)
            if due(step) and step < total_steps:  # mid-epoch: resume after this batch
                save(step, epoch, batch_in_epoch + 1)
        else:
            batch_in_epoch = steps_per_epoch
        skip = 0
        evaluation = evaluate(cfg, model, test_set)
        report.epoch(epoch, step, evaluation)
        finished_epoch = batch_in_epoch >= steps_per_epoch
        save(step, epoch + 1 if finished_epoch else epoch, 0 if finished_epoch else batch_in_epoch)
        if finished_epoch:
            epoch += 1
    wall = time.perf_counter() - started
    if not evaluation:  # resumed from a checkpoint with no step left: still report the model's score
        evaluation = evaluate(cfg, model, test_set)
    wrapped.check_replicas()
    mine = torch.tensor([stats["compute_s"], stats["comm_s"], stats["wait_s"], gs.traffic()["bytes_sent"],
                         statistics.fmean(stats["overlaps"]) if stats["overlaps"] else -1.0], dtype=torch.float64)
    per_rank = gs.all_gather(mine).view(w.world_size, -1)
    summary = report.finish(wall, step, evaluation, per_rank,
                            checkpoints=(stats["checkpoints"], stats["checkpoint_s"]))
    wrapped.close()
    return {"summary": summary, "digest": param_digest(model),
            "params": {n: p.detach().clone() for n, p in model.named_parameters()} if w.world_size <= 8 else None,
            "events": trace.disable() if cfg.trace else []}


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
            return gs.spawn(train_rank, nprocs=cfg.workers, args=(cfg,), timeout=cfg.timeout)
        except gs.SpawnError as exc:
            if attempt == cfg.max_restarts:
                raise
            ours = checkpoint_path.exists() and checkpoint_path.stat().st_mtime >= started
            cfg = dataclasses.replace(cfg, resume=ours or cfg.resume)
            print(f"gradsync train: {str(exc).splitlines()[0]}\ngradsync train: restart {attempt + 1} of "
                  f"{cfg.max_restarts}, from {'the last checkpoint' if cfg.resume else 'the beginning'}",
                  file=sys.stderr, flush=True)
    raise AssertionError("unreachable")


def run(cfg: TrainConfig) -> list[dict]:
    """Run the job: under torchrun in this process, else ``cfg.workers`` local processes."""
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    if _under_torchrun() or cfg.strategy == "local":
        gs.init(timeout=cfg.timeout)
        try:
            results = [train_rank(cfg)]
        finally:
            gs.shutdown()
        if cfg.trace:
            trace.write(Path(cfg.out) / f"trace.rank{int(os.environ.get('RANK', 0))}.json", results[0]["events"])
        return results
    results = _spawn_with_restarts(cfg)
    if cfg.trace:
        trace.write(Path(cfg.out) / "trace.json", [e for r in results for e in r["events"]])
    return results
