"""Steps to ring DDP's charlm loss for DiLoCo H=8 settings, and the compute a step costs on this
machine (docs/studies/slow-links.md, section 4). Steps do not depend on the machine's load.

    PYTHONPATH=src nice -n 10 python benchmarks/slowlinks_diloco_steps.py ring 1e-3 0 0 80
    PYTHONPATH=src nice -n 10 python benchmarks/slowlinks_diloco_steps.py diloco 2e-3 1.0 0 200
        # strategy, (inner) AdamW lr, outer lr, outer momentum (Nesterov when > 0), steps
    PYTHONPATH=src nice -n 10 python benchmarks/slowlinks_diloco_steps.py compute 4

The recipe is cluster/loss_worker.py's (W=4 workers on loopback, charlm, 8 windows of 64 bytes per
worker a step from generator seed w, AdamW weight decay 0.01, constant lr, model seed 0): the ring's
curve here equals the emulated cluster's. Every 8 steps rank 0 evaluates two disjoint slices of the
test set: "target", windows 0-127 (what `gradsync cluster --time-to-loss` measures), and "select",
windows 128-639 (what a setting is chosen by, so the choice does not look at the target's windows).
Prints one JSON line: the settings and the curve.
compute W: c, seconds of a step without communication (forward, backward, AdamW), W processes at once.
"""

import json
import sys
import time

import torch
from torch import nn

import gradsync as gs
from gradsync.train.datasets import stdlib_text
from gradsync.train.models import CharLM

WORKERS, BATCH, H = 4, 8, 8


def _loss(model, x, y):
    logits = model(x)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(strategy, lr, outer_lr, outer_momentum, steps):
    torch.set_num_threads(1)
    w = gs.world()
    train_set, test_set = stdlib_text()
    torch.manual_seed(0)
    model = CharLM()
    slices = {"target": test_set[list(range(128))], "select": test_set[list(range(128, 640))]}
    if strategy == "diloco":
        net, optimizer = model, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        diloco = gs.DiLoCo(model, optimizer, outer_lr=outer_lr, outer_momentum=outer_momentum,
                           nesterov=outer_momentum > 0, sync_every=H, algorithm="ring")
    else:
        net, diloco = gs.DistributedDataParallel(model, algorithm="ring"), None
        optimizer = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.01)
    samples = torch.Generator().manual_seed(w.rank)
    curve = []
    for step in range(1, steps + 1):
        x, y = train_set[torch.randint(len(train_set), (BATCH,), generator=samples).tolist()]
        optimizer.zero_grad(set_to_none=True)
        _loss(net, x, y).backward()
        optimizer.step()
        if diloco is not None:
            diloco.step()
        if step % H == 0 and w.rank == 0:
            model.eval()
            with torch.no_grad():
                curve.append({"step": step, **{k: float(_loss(model, *v)) for k, v in slices.items()}})
            model.train()
    return curve


def compute(reps=30):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tokens = CharLM(), torch.randint(256, (BATCH, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    times = []
    for _ in range(reps + 3):
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _loss(model, tokens, tokens).backward()
        optimizer.step()
        times.append(time.perf_counter() - started)
    times = sorted(times[3:])
    return times[len(times) // 2]


if __name__ == "__main__":
    if sys.argv[1] == "compute":
        w = int(sys.argv[2])
        c = gs.spawn(compute, nprocs=w) if w > 1 else [compute()]
        print(f"c at W={w}: {[round(t * 1e3, 1) for t in c]} ms per rank (median of 30 steps)")
    else:
        strategy, lr, outer_lr, momentum, steps = sys.argv[1:6]
        curve = gs.spawn(train, nprocs=WORKERS, args=(strategy, float(lr), float(outer_lr), float(momentum),
                                                       int(steps)))[0]
        print(json.dumps({"strategy": strategy, "lr": float(lr), "outer_lr": float(outer_lr),
                          "outer_momentum": float(momentum), "curve": curve}))
