"""One rank of a `gradsync cluster --time-to-loss` job: train charlm until a target loss, time it, count bytes.

Run by torchrun inside each emulated host (cluster/jobs.py starts it; not meant to be run by hand):

    python -m torch.distributed.run ... -m gradsync.cluster.loss_worker --strategy diloco --target 2.61 \
        --max-steps 240 --out DIR

Vocabulary
    model      train/models.py's CharLM (0.47M parameters, M = 1.88 MB) on stdlib-text windows of 64 bytes
    batch      each worker w draws --batch windows a step from the training set with its own generator
               (seeded seed*1000 + w): for a given W every strategy trains on the same samples in the
               same order
    optimizer  AdamW, lr --lr (constant, no warm-up), weight decay 0.01: each rank's own for ring and
               powersgd, the servers' for ps-sync (on the averaged gradient: the same arithmetic as
               ring DDP), DiLoCo's inner one (lr --inner-lr, by default --lr; its outer: SGD, --outer-lr,
               Nesterov momentum --outer-momentum, plain SGD at 0)
    evaluation every --eval-every steps (= H, right after DiLoCo's outer step, when the replicas agree)
               the evaluating rank (rank 0; ps-sync: the first worker, on the parameters it pulled)
               computes the mean loss over the first --eval-windows windows of the test set, and tells
               every worker whether it is at most --target (a one-byte broadcast among the workers)
    clock      training seconds on the evaluating rank, from the start until each evaluation, the
               evaluations themselves left out (every worker waits in the broadcast meanwhile)
    time to loss   the clock at the first evaluation whose loss is <= target; None if --max-steps
               came first. Without --target the job runs --max-steps steps (the ring's reference run)
    bytes      as worker.py: the meter's payload per rank and each host's link's kernel counters,
               over the training (from a barrier before the first step to one after the last)

Strategies: ring (gradsync DDP, ring all-reduce), ps-sync (one server on its own host, W workers),
powersgd (ring DDP with the PowerSGD hook, rank --powersgd-rank, compressing from step 2), diloco
(no wrapper; gs.DiLoCo with H = --sync-every, ring all-reduce).
Writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.cluster.worker import barrier, link_counters
from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook
from gradsync.train.datasets import stdlib_text
from gradsync.train.models import CharLM

STRATEGIES = ("ring", "ps-sync", "powersgd", "diloco")


def _loss(model, x, y) -> torch.Tensor:
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


class Evaluator:
    """The evaluating rank's test loss and the workers' common verdict (module docstring)."""

    def __init__(self, args, test_set, evaluating: bool, group) -> None:
        self.target, self.evaluating, self.group = args.target, evaluating, group
        self.x, self.y = test_set[list(range(args.eval_windows))]
        self.first_worker = args.servers if args.strategy == "ps-sync" else 0
        self.trained_s, self.since = 0.0, time.perf_counter()
        self.curve: list[dict] = []
        self.reached_s: float | None = None
        self.reached_step: int | None = None

    @torch.no_grad()
    def __call__(self, model: nn.Module, step: int) -> bool:
        """At an evaluation point: whether to stop (the target reached). Collective among the workers."""
        verdict = torch.zeros(1, dtype=torch.uint8)
        if self.evaluating:
            self.trained_s += time.perf_counter() - self.since
            model.eval()
            loss = float(_loss(model, self.x, self.y))
            model.train()
            self.curve.append({"step": step, "trained_s": self.trained_s, "loss": loss})
            if self.target is not None and loss <= self.target and self.reached_s is None:
                self.reached_s, self.reached_step = self.trained_s, step
                verdict[0] = 1
        dist.broadcast(verdict, src=self.first_worker, group=self.group)
        self.since = time.perf_counter()
        return bool(verdict[0])


def _batches(args, train_set, worker: int):
    g = torch.Generator().manual_seed(args.seed * 1000 + worker)
    while True:
        yield train_set[torch.randint(len(train_set), (args.batch,), generator=g).tolist()]


def _build(args, model):
    """ring, powersgd, diloco: (the module to call, its optimizer, DiLoCo or None), made before the
    counters start (the wrapper's and DiLoCo's first broadcast of the parameters stay out of them)."""
    if args.strategy == "diloco":
        inner_lr = args.lr if args.inner_lr is None else args.inner_lr
        optimizer = torch.optim.AdamW(model.parameters(), lr=inner_lr, weight_decay=0.01)
        return model, optimizer, gs.DiLoCo(model, optimizer, outer_lr=args.outer_lr,
                                           outer_momentum=args.outer_momentum, nesterov=args.outer_momentum > 0,
                                           sync_every=args.sync_every, algorithm="ring")
    wrapped = gs.DistributedDataParallel(model, algorithm="ring")
    if args.strategy == "powersgd":
        wrapped.register_comm_hook(PowerSGDState(rank=args.powersgd_rank, start_iter=2, algorithm="ring"),
                                   powersgd_hook)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=args.lr, weight_decay=0.01), None


def _train_ddp_like(args, model, built, batches, evaluate) -> int:
    """ring, powersgd, diloco: every rank trains; returns the steps taken."""
    wrapped, optimizer, diloco = built
    step = 0
    while step < args.max_steps:
        x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        _loss(wrapped, x, y).backward()
        optimizer.step()
        if diloco is not None:
            diloco.step()
        step += 1
        if step % args.eval_every == 0 and evaluate(model, step):
            break
    return step


def _train_ps(args, model, ps, batches, evaluate) -> tuple[int, str]:
    """ps-sync: ranks 0..S-1 serve, the others pull, train and push; returns (steps, role)."""
    if ps.is_server:
        ps.serve()
        return 0, "server"
    step = 0
    while True:
        ps.pull()
        if step and step % args.eval_every == 0 and evaluate(model, step):
            break
        if step == args.max_steps:
            break
        x, y = next(batches)
        _loss(model, x, y).backward()
        ps.push()
        step += 1
    ps.close()
    return step, "worker"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's flags (cluster/jobs.py writes them)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--target", type=float, default=None, help="stop at this test loss (none: run --max-steps)")
    parser.add_argument("--max-steps", type=int, required=True)
    parser.add_argument("--eval-every", type=int, default=8)
    parser.add_argument("--eval-windows", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="windows per worker per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--powersgd-rank", type=int, required=True)
    parser.add_argument("--sync-every", type=int, required=True)
    parser.add_argument("--outer-lr", type=float, required=True)
    parser.add_argument("--outer-momentum", type=float, required=True)
    parser.add_argument("--inner-lr", type=float, default=None, help="diloco's inner lr (none: --lr)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", required=True, help="directory for rank<r>.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    w = gs.init(timeout=args.timeout)
    servers = args.servers if args.strategy == "ps-sync" else 0
    workers = list(range(servers, w.world_size))
    group = dist.new_group(workers)   # every rank takes part in making it, as torch requires
    train_set, test_set = stdlib_text()
    torch.manual_seed(args.seed)
    model = CharLM()
    evaluating = w.rank == workers[0]
    evaluate = Evaluator(args, test_set, evaluating, group if w.rank in workers else None)
    batches = _batches(args, train_set, w.rank - servers) if w.rank in workers else None
    if args.strategy == "ps-sync":
        built = gs.ParameterServer(model, lambda p: torch.optim.AdamW(p, lr=args.lr, weight_decay=0.01),
                                   num_servers=args.servers, mode="sync")
    else:
        built = _build(args, model)
    # the ring's connections are made on first use: once here, so no strategy's clock holds them
    gs.all_reduce(torch.zeros(1), algorithm="ring")
    barrier()
    gs.traffic_reset()
    before = link_counters()
    evaluate.since = started = time.perf_counter()
    if args.strategy == "ps-sync":
        steps, role = _train_ps(args, model, built, batches, evaluate)
    else:
        steps, role = _train_ddp_like(args, model, built, batches, evaluate), "rank"
    wall = time.perf_counter() - started
    barrier()
    after = link_counters()
    meter = gs.traffic()
    result = {"rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank, "role": role,
              "strategy": args.strategy, "params": sum(p.numel() for p in model.parameters()), "steps": steps,
              "wall_s": wall, "target": args.target, "curve": evaluate.curve, "reached_s": evaluate.reached_s,
              "reached_step": evaluate.reached_step, "trained_s": evaluate.trained_s,
              "bytes_sent": meter["bytes_sent"], "bytes_received": meter["bytes_received"],
              "per_peer": meter["per_peer"],
              "link": {k: after[k] - before[k] for k in after} if after else None}
    Path(args.out, f"rank{w.rank}.json").write_text(json.dumps(result))
    gs.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # as worker.py: nothing is left to run (its note on the interpreter's teardown)


if __name__ == "__main__":
    main()
