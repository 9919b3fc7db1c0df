"""gradsync train with a parameter server: --strategy ps-sync | ps-async | ssp.

Ranks 0..S-1 serve (they hold the parameters and the optimizer); ranks S..N-1 are the W = N - S
workers, each training on its 1/W of the data:

    ps.pull() -> grad_accum x (forward, backward) -> ps.push()        per step, on every worker

Batch math: global batch = per-worker batch x W x accumulation; the learning rate scales with W as
for ddp. In async and ssp every push is applied on its own, as gradient / W (server.py), so the same
learning rate serves all three modes; the warm-up counts versions (pushes / W in async and ssp).

Sparse tables (word2vec): a model with ``make_sparse()`` trains its embeddings with sparse gradients;
each step a worker reads its micro-batches first, then pulls only the rows they need
(``model.rows_needed``) and pushes only the rows they touched (ps/sparse_wire.py).

Not available here (RuntimeError at configuration): --resume, since the optimizer state lives on
the servers. Evaluation runs once at the end, after every worker has pulled the final parameters;
servers take part only in the final counting collectives.
"""

from __future__ import annotations

import time

import torch

import gradsync as gs
from gradsync.data import DistributedSampler
from gradsync.train.common import build_optimizer, evaluate, loss_of, lr_at, param_digest
from gradsync.train.config import TrainConfig
from gradsync.train.datasets import build_dataset
from gradsync.train.models import build_model
from gradsync.train.report import Reporter

MODE_OF = {"ps-sync": "sync", "ps-async": "async", "ssp": "ssp"}


def _optimizer_fn(cfg: TrainConfig, peak_lr: float, pushes_per_version: int):
    """The servers' optimizer, with the warm-up applied per version inside step()."""

    def build(params):
        optimizer = build_optimizer(cfg, params, peak_lr)
        plain_step = optimizer.step
        applied = [0]

        def step(*args, **kwargs):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(applied[0] // pushes_per_version, peak_lr, cfg.warmup_steps)
            applied[0] += 1
            return plain_step(*args, **kwargs)

        optimizer.step = step
        return optimizer

    return build


def train_ps_rank(cfg: TrainConfig) -> dict:
    """One rank's job under a parameter-server strategy; returns its statistics."""
    w = gs.world()
    torch.manual_seed(cfg.seed)
    servers, mode = cfg.servers, MODE_OF[cfg.strategy]
    workers = w.world_size - servers
    train_set, test_set = build_dataset(cfg.dataset, seed=cfg.seed)
    worker_index = w.rank - servers
    sampler = DistributedSampler(train_set, num_replicas=workers, rank=max(worker_index, 0), shuffle=True,
                                 seed=cfg.seed)
    steps_per_epoch = len(sampler) // (cfg.batch_size * cfg.grad_accum)
    if steps_per_epoch < 1:
        raise ValueError(f"each worker sees {len(sampler)} training samples per epoch, fewer than one step of "
                         f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum}")
    total_steps = cfg.steps or cfg.epochs * steps_per_epoch
    global_batch = cfg.batch_size * workers * cfg.grad_accum
    base_lr = cfg.lr or cfg.default_lr()
    peak_lr = base_lr * (global_batch / cfg.batch_size if cfg.lr_scaling == "linear" else 1.0)
    model = build_model(cfg.model, cfg.dataset)
    if hasattr(model, "make_sparse"):
        model.make_sparse()
    ps = gs.ParameterServer(model, _optimizer_fn(cfg, peak_lr, 1 if mode == "sync" else workers),
                            num_servers=servers, mode=mode, staleness=cfg.staleness)
    report = Reporter(cfg, total_steps, enabled=(w.rank == servers))
    report.start(global_batch, base_lr, peak_lr, steps_per_epoch, resumed_at=None)
    gs.traffic_reset()
    started = time.perf_counter()
    compute_s = 0.0
    if ps.is_server:
        ps.serve()
    else:
        step = 0
        for epoch in range(cfg.epochs if cfg.steps is None else 10**9):
            sampler.set_epoch(epoch)
            order = sampler.indices()
            for batch in range(steps_per_epoch):
                if step >= total_steps:
                    break
                step_started = time.perf_counter()
                micro_batches = []
                for micro in range(cfg.grad_accum):
                    first = (batch * cfg.grad_accum + micro) * cfg.batch_size
                    micro_batches.append(train_set[order[first:first + cfg.batch_size]])
                if hasattr(model, "rows_needed"):
                    ps.pull(rows=model.rows_needed(torch.cat([x for x, _ in micro_batches])))
                else:
                    ps.pull()
                computed = time.perf_counter()
                loss_sum = 0.0
                for x, y in micro_batches:
                    loss = loss_of(cfg.model, model(x), y) / cfg.grad_accum
                    loss.backward()
                    loss_sum += float(loss.detach())
                compute_s += time.perf_counter() - computed
                ps.push()
                step += 1
                report.step(step, epoch, loss_sum, global_batch / (time.perf_counter() - step_started), None)
            if step >= total_steps:
                break
        ps.pull()
        ps.close()
    wall = time.perf_counter() - started
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
    summary = report.finish(wall, total_steps, evaluation, per_rank[:, :5], workers=workers, staleness=staleness)
    return {"summary": summary, "digest": param_digest(model), "ps": stats,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()} if w.world_size <= 8 else None,
            "events": []}
