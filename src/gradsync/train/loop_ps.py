"""gradsync train with a parameter server: --strategy ps-sync | ps-async | ssp.

Ranks 0..S-1 serve (they hold the parameters and the optimizer); ranks S..N-1 are the W = N - S
workers, each training on its 1/W of the data:

    ps.pull() -> grad_accum x (forward, backward) -> ps.push()        per step, on every worker

Batch math: global batch = per-worker batch x W x accumulation; the learning rate scales with W as
for ddp. In async and ssp every push is applied on its own, as gradient / W (server.py), so the same
learning rate serves all three modes; the warm-up counts versions (pushes / W in async and ssp).

--clip-grad X (ps/clipping.py): in sync mode the servers clip each version's averaged gradient by its
2-norm over all servers' shards (one scalar from each server to each other per version), as one
process with the global batch would; in async and ssp each worker clips the gradient it pushes.

Sparse tables (word2vec): a model with ``make_sparse()`` trains its embeddings with sparse gradients;
each step a worker reads its micro-batches first, then pulls only the rows they need
(``model.rows_needed``) and pushes only the rows they touched (ps/sparse_wire.py).

Preemption (train/preempt.py's signal or Ctrl-C, to the launcher, any rank or the whole job): a worker that received it sets
the stop flag on its next push, a server polls it between messages (ParameterServer.serve(stop)), and
the servers' next answers carry the flag, so sync workers all stop on the same version and async/ssp
workers each at their own clock; nothing pushed is lost. Then every rank gathers the servers' state
(ParameterServer.state_dict: parameters, optimizer state, version, every worker's clock), rank 0
writes one checkpoint, and the job exits 75 with the resume command. A checkpoint is also written at
the end. --resume continues it with any number of servers and the same number of workers: a worker
at clock c continues at step c (epoch c // steps per epoch), so its data shard goes on where it
stopped. No periodic checkpoints here (--checkpoint-every is ddp, zero1 and local).

Evaluation runs once at the end, after every worker has pulled the final parameters; servers take
part only in the final counting collectives.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync import checkpoint
from gradsync.data import DistributedSampler
from gradsync.train.common import build_optimizer, evaluate, loss_of, lr_at, on, param_digest, train_device
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import build_dataset
from gradsync.train.models import build_model
from gradsync.train.preempt import STOP_REASONS, PreemptWatch, resume_command, spawned_rank
from gradsync.train.report import Reporter
from gradsync.train import requeue, resume

MODE_OF = {"ps-sync": "sync", "ps-async": "async", "ssp": "ssp"}


def optimizer_fn(cfg: TrainConfig, peak_lr: float, pushes_per_version: int):
    """The servers' optimizer, with the warm-up applied per version inside step(). The count of steps
    applied lives in the first param group, so it travels with the optimizer's state_dict."""

    def build(params):
        optimizer = build_optimizer(cfg, params, peak_lr)
        plain_step = optimizer.step
        optimizer.param_groups[0]["steps_applied"] = 0

        def step(*args, **kwargs):
            applied = optimizer.param_groups[0]["steps_applied"]
            for group in optimizer.param_groups:
                group["lr"] = lr_at(applied // pushes_per_version, peak_lr, cfg.warmup_steps)
            optimizer.param_groups[0]["steps_applied"] = applied + 1
            return plain_step(*args, **kwargs)

        optimizer.step = step
        return optimizer

    return build


def train_ps_rank(cfg: TrainConfig) -> dict:
    """One rank's job under a parameter-server strategy; returns its statistics."""
    with PreemptWatch(cfg.preempt_signal, interrupt_twice_raises=not spawned_rank()) as watch:
        return _train_ps_rank(cfg, watch)


def _train_ps_rank(cfg: TrainConfig, watch: PreemptWatch) -> dict:
    w = gs.world()
    torch.manual_seed(cfg.seed)
    servers, mode = cfg.servers, MODE_OF[cfg.strategy]
    workers = w.world_size - servers
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    saved = resume.read(cfg) if resume.agreed(cfg) else None
    plan = resume.BatchPlan.for_resume(cfg, workers, saved) if saved else resume.BatchPlan.fresh(cfg, workers)
    if saved and plan.workers != saved["batch"]["workers"]:
        raise checkpoint.CheckpointError(
            f"the checkpoint was written by {saved['batch']['workers']} parameter-server workers, this job has "
            f"{workers} (--workers {w.world_size} - --servers {servers}): each worker's data shard and clock are "
            f"its own, so resume with {saved['batch']['workers']} workers; the number of servers may change")
    cfg = dataclasses.replace(cfg, batch_size=plan.batch_size, grad_accum=plan.grad_accum)
    worker_index = w.rank - servers
    sampler = DistributedSampler(train_set, num_replicas=workers, rank=max(worker_index, 0), shuffle=True,
                                 seed=cfg.seed)
    steps_per_epoch = len(sampler) // (cfg.batch_size * cfg.grad_accum)
    if steps_per_epoch < 1:
        raise ValueError(f"each worker sees {len(sampler)} training samples per epoch, fewer than one step of "
                         f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}")
    cfg = plan.scheduled(cfg, steps_per_epoch)   # the run's length and warm-up (train/batch_math.py)
    total_steps = cfg.steps or cfg.epochs * steps_per_epoch
    global_batch, peak_lr = plan.global_batch, plan.peak_lr
    model = build_model(cfg.model, cfg.dataset)
    if hasattr(model, "make_sparse"):
        model.make_sparse()
    if saved:
        model.load_state_dict(saved["model"])
    ps = gs.ParameterServer(model, optimizer_fn(cfg, peak_lr, 1 if mode == "sync" else workers),
                            num_servers=servers, mode=mode, staleness=cfg.staleness, max_grad_norm=cfg.clip_grad)
    if saved:
        ps.load_state_dict(saved["ps"])
    # servers keep their shards on the CPU; a worker computes on its device (pull and push copy between them)
    device = torch.device("cpu") if ps.is_server else train_device(cfg)
    model.to(device)
    step = saved["ps"]["clocks"][worker_index] if saved and not ps.is_server else 0
    first_step = step
    report = Reporter(cfg, total_steps, enabled=(w.rank == servers))
    for line in plan.changes:
        report.note(line)
    report.start(global_batch, plan.base_lr, peak_lr, steps_per_epoch, resumed_at=saved["step"] if saved else None,
                 train_samples=len(train_set))
    gs.traffic_reset()
    # Test knob: GRADSYNC_SAMPLE_LOG=DIR makes every worker append "epoch id id ..." per step it trains
    log_dir = os.environ.get("GRADSYNC_SAMPLE_LOG")
    sample_log = open(Path(log_dir) / f"samples.{os.getpid()}.r{w.rank}", "a", buffering=1) \
        if log_dir and not ps.is_server else None  # noqa: SIM115
    started = time.perf_counter()
    compute_s = 0.0
    if ps.is_server:
        ps.serve(stop=lambda: watch.requested)
    else:
        order_epoch, order = None, None
        while step < total_steps:
            epoch, batch = divmod(step, steps_per_epoch)
            if epoch != order_epoch:
                sampler.set_epoch(epoch)
                order_epoch, order = epoch, sampler.indices()
            step_started = time.perf_counter()
            micro_batches = []
            for micro in range(cfg.grad_accum):
                first = (batch * cfg.grad_accum + micro) * cfg.batch_size
                micro_batches.append(order[first:first + cfg.batch_size])
            data = [on(device, train_set[ids]) for ids in micro_batches]
            if hasattr(model, "rows_needed"):
                ps.pull(rows=model.rows_needed(torch.cat([x for x, _ in data])))
            else:
                ps.pull()
            if ps.stopping:   # the servers end the job here: these parameters are the last
                break
            if sample_log is not None:
                sample_log.write(f"{epoch} {' '.join(str(int(i)) for ids in micro_batches for i in ids)}\n")
            computed = time.perf_counter()
            loss_sum = 0.0
            for x, y in data:
                loss = loss_of(cfg.model, model(x), y) / cfg.grad_accum
                loss.backward()
                loss_sum += float(loss.detach())
            compute_s += time.perf_counter() - computed
            ps.push(stop=watch.requested)
            step += 1
            report.step(step, epoch, loss_sum, global_batch / (time.perf_counter() - step_started), None)
        if not ps.stopping:
            ps.pull()
        ps.close()
    if sample_log is not None:
        sample_log.close()
    wall = time.perf_counter() - started
    # [some worker stopped early, the strongest stop code any rank has (preempt.STOP_REASONS)]
    stopped = torch.tensor([int(not ps.is_server and ps.stopping and step < total_steps), watch.stop_code])
    gs.all_reduce(stopped, op="max")
    state = ps.state_dict()
    save_checkpoint(cfg, plan, model, ps, state, steps_per_epoch)
    if bool(stopped[0]):
        first_worker = state["clocks"][0]
        report.preempted(first_worker, resume_command(cfg), signal_at=watch.first_at)
        requeue.after_checkpoint(cfg, w.rank, STOP_REASONS[int(stopped[1])] or "preempted")
        return {"summary": None, "preempted": {"step": first_worker, "clocks": state["clocks"],
                                               "signals": watch.received,
                                               "reason": STOP_REASONS[int(stopped[1])] or "preempted"},
                "digest": None, "params": None, "events": []}
    stats = ps.stats()
    evaluation = evaluate(cfg, model, test_set, ranks=list(range(servers, w.world_size)))
    wait_s = stats.get("pull_wait_seconds", 0.0) + stats.get("push_seconds", 0.0)
    histogram = stats.get("staleness_histogram", {})
    updates = sum(histogram.values())
    weighted = sum(k * v for k, v in histogram.items())
    mine = torch.tensor([compute_s, wait_s, wait_s, gs.traffic()["bytes_sent"], -1.0, updates, weighted,
                         max(histogram, default=0)], dtype=torch.float64)
    per_rank = gs.all_gather(mine).view(w.world_size, -1)
    total_updates = float(per_rank[:, 5].sum())
    staleness = {"mean": float(per_rank[:, 6].sum()) / total_updates if total_updates else 0.0,
                 "max": float(per_rank[:, 7].max()), "updates": total_updates}
    summary = report.finish(wall, total_steps, evaluation, per_rank[:, :5], workers=workers, staleness=staleness,
                            trained=total_steps - first_step)
    return {"summary": summary, "digest": param_digest(model), "ps": stats,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()} if w.world_size <= 8 else None,
            "events": []}


def save_checkpoint(cfg: TrainConfig, plan, model, ps, state: dict, steps_per_epoch: int) -> None:
    """Rank 0 writes the checkpoint: the model as the servers hold it, and their whole state; the
    other ranks wait until it is on disk (one all-reduce), so no rank reports before it exists."""
    w = gs.world()
    if w.rank == 0:
        with torch.no_grad():
            for param, value in zip(ps.dense, state["params"]):
                param.copy_(value)
            named = dict(model.named_parameters())
            for name, table in state["tables"].items():
                named[name].copy_(table["rows"])
        step = state["clocks"][0]
        epoch, batch = divmod(step, steps_per_epoch)
        checkpoint.save(Path(cfg.out) / resume.CHECKPOINT_NAME, {
            "model": model.state_dict(), "ps": state, "step": step, "epoch": epoch,
            "position": batch * plan.global_batch, "world_size": w.world_size, "steps_per_epoch": steps_per_epoch,
            **resume.run_record(cfg, plan)})
    gs.all_reduce(torch.zeros(1))
