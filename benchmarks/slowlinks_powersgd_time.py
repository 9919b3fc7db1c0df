"""Where a PowerSGD step's time goes on this machine (docs/studies/slow-links.md, section 4).

    PYTHONPATH=src nice -n 10 python benchmarks/slowlinks_powersgd_time.py hook charlm       # the hook alone
    PYTHONPATH=src nice -n 10 python benchmarks/slowlinks_powersgd_time.py step charlm 4     # W=4, loopback

hook: the hook's own arithmetic, one process, every all-reduce an identity (a world of one), per
      bucket holding the whole model; median of 28 calls.
step: ring DDP and DDP with the PowerSGD hook (r=2, from step 2), W ranks on loopback, batch 8,
      AdamW; per step on rank 0: the step's median, the hook's seconds, its all-reduces' seconds and
      count (ReplicaGroup.all_reduce timed on the communication thread).
Model: charlm (train/models.py) or mlp (two Linear(1414, 1414), the cluster's step-time model).
"""

import collections
import sys
import time

import torch
from torch import nn

import gradsync as gs
from gradsync.ddp import powersgd
from gradsync.ddp.replica_group import ReplicaGroup
from gradsync.train.models import CharLM


def model_and_loss(name):
    torch.manual_seed(0)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(1414, 1414), nn.ReLU(), nn.Linear(1414, 1414))
        x = torch.randn(8, 1414)
        return model, lambda m: m(x).square().mean()
    model, tokens = CharLM(), torch.randint(256, (8, 64))
    return model, lambda m: nn.functional.cross_entropy(m(tokens).reshape(-1, 256), tokens.reshape(-1))


class WholeModelBucket:
    """A GradBucket (ddp/grad_bucket.py) holding every parameter's gradient, for the hook alone."""

    def __init__(self, params):
        self.params, self.flat = params, torch.randn(sum(p.numel() for p in params))

    def index(self):
        return 0

    def is_last(self):
        return True

    def buffer(self):
        return self.flat

    def gradients(self):
        views, at = [], 0
        for p in self.params:
            views.append(self.flat[at:at + p.numel()].view_as(p))
            at += p.numel()
        return views


class WorldOfOne:
    size = 1

    def all_reduce(self, tensor, op="sum", algorithm=None):
        return tensor


def hook_alone(name, calls=30):
    torch.set_num_threads(1)
    model, _ = model_and_loss(name)
    bucket = WholeModelBucket(list(model.parameters())[::-1])
    state = powersgd.PowerSGDState(rank=2, start_iter=2, group=WorldOfOne(), iteration=2)
    gradient, times = bucket.flat.clone(), []
    for _ in range(calls):
        bucket.flat.copy_(gradient)
        started = time.perf_counter()
        powersgd.powersgd_hook(state, bucket).wait()
        times.append(time.perf_counter() - started)
    times = sorted(times[2:])
    print(f"{name}: the hook alone {times[len(times) // 2] * 1e3:.2f} ms (median), {bucket.flat.numel()} elements")


def steps(name, strategy, count=40):
    torch.set_num_threads(1)
    spent = collections.defaultdict(float)
    model, loss = model_and_loss(name)
    ddp = gs.DistributedDataParallel(model, algorithm="ring")
    if strategy == "powersgd":
        all_reduce = ReplicaGroup.all_reduce

        def timed_all_reduce(self, tensor, *args, **kwargs):
            started = time.perf_counter()
            result = all_reduce(self, tensor, *args, **kwargs)
            spent["all-reduce ms"] += time.perf_counter() - started
            spent["all-reduces"] += 1
            return result

        def timed_hook(state, bucket):
            started = time.perf_counter()
            result = powersgd.powersgd_hook(state, bucket)
            spent["hook ms"] += time.perf_counter() - started
            return result

        ReplicaGroup.all_reduce = timed_all_reduce
        ddp.register_comm_hook(powersgd.PowerSGDState(rank=2, start_iter=2, algorithm="ring"), timed_hook)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss(ddp).backward()
        optimizer.step()

    for _ in range(4):
        step()
    spent.clear()
    times = []
    for _ in range(count):
        gs.all_reduce(torch.zeros(1), algorithm="ring")
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    times.sort()
    per_step = {k: v / count * (1 if k == "all-reduces" else 1e3) for k, v in spent.items()}
    return times[len(times) // 2], per_step


if __name__ == "__main__":
    if sys.argv[1] == "hook":
        hook_alone(sys.argv[2])
    else:
        for strategy in ("ring", "powersgd"):
            results = gs.spawn(steps, nprocs=int(sys.argv[3]), args=(sys.argv[2], strategy))
            print(f"{sys.argv[2]} W={sys.argv[3]} {strategy}: step {max(r[0] for r in results) * 1e3:.1f} ms (median, "
                  f"slowest rank); rank 0 per step:", {k: round(v, 1) for k, v in results[0][1].items()})
