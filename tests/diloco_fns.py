"""Rank functions for tests/test_diloco.py: gs.DiLoCo against DiLoCo written out in one process,
float64. Module level so ranks can import them."""

import torch
from torch import nn

import ddp_fns
import gradsync as gs

H, ROUNDS, LOCAL_BATCH = 3, 3, 4
INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.01, 0.7, 0.9


def _data(world_size, steps):
    return ddp_fns.global_data(steps, world_size, LOCAL_BATCH, torch.float64)


def _inner(model):
    return torch.optim.AdamW(model.parameters(), lr=INNER_LR)


def _step(model, inner, x, y):
    inner.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    inner.step()


def train(rounds=ROUNDS, algorithm="auto", stop_after=None, resume_from=None):
    """gs.DiLoCo for ``rounds`` x H inner steps on this rank's shards, every rank's model starting
    from its own seed. Returns the parameters after each outer step and the bytes sent in each inner
    step; with ``stop_after`` inner steps, the checkpoint taken there instead. ``resume_from``: every
    rank's checkpoint, in rank order (this rank continues from its own)."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64, seed=w.rank)
    inner = _inner(model)
    diloco = gs.DiLoCo(model, inner, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, sync_every=H,
                       algorithm=algorithm)
    start = 0
    if resume_from is not None:
        mine = resume_from[w.rank]
        model.load_state_dict(mine["model"])
        inner.load_state_dict(mine["inner"])
        diloco.load_state_dict(mine["diloco"])
        start = diloco.inner_steps
    xs, ys = _data(w.world_size, rounds * H)
    after_outer, sent = [], []
    for step in range(start, rounds * H):
        if stop_after is not None and step == stop_after:
            return {"checkpoint": {"model": {k: v.clone() for k, v in model.state_dict().items()},
                                   "inner": inner.state_dict(), "diloco": diloco.state_dict()}}
        gs.traffic_reset()
        x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
        _step(model, inner, x, y)
        if diloco.step():
            after_outer.append({n: p.detach().clone() for n, p in model.named_parameters()})
        sent.append(gs.traffic()["bytes_sent"])
    return {"after_outer": after_outer, "sent": sent, "bytes_per_sync": diloco.bytes_per_sync()}


def reference(world_size, rounds=ROUNDS):
    """DiLoCo in one process: every replica starts from rank 0's model, runs H AdamW steps on its
    shards with its own AdamW state, the anchor takes one Nesterov SGD step with the averaged
    (anchor - replica), and every replica restarts from the anchor. Parameters after each round."""
    anchor_model = ddp_fns.make_model("mlp", torch.float64, seed=0)
    anchor = [p.detach().clone().requires_grad_() for p in anchor_model.parameters()]
    names = [n for n, _ in anchor_model.named_parameters()]
    outer = torch.optim.SGD(anchor, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    replicas = [ddp_fns.make_model("mlp", torch.float64, seed=0) for _ in range(world_size)]
    inners = [_inner(m) for m in replicas]
    xs, ys = _data(world_size, rounds * H)
    rounds_out = []
    for round_index in range(rounds):
        for step in range(round_index * H, (round_index + 1) * H):
            for r, (model, inner) in enumerate(zip(replicas, inners)):
                _step(model, inner, xs[step].chunk(world_size)[r], ys[step].chunk(world_size)[r])
        with torch.no_grad():
            for i, a in enumerate(anchor):
                a.grad = sum(a - list(m.parameters())[i] for m in replicas) / world_size
        outer.step()
        with torch.no_grad():
            for model in replicas:
                for p, a in zip(model.parameters(), anchor):
                    p.copy_(a)
        rounds_out.append({n: a.detach().clone() for n, a in zip(names, anchor)})
    return rounds_out


def refusals():
    model = ddp_fns.make_model("mlp", torch.float64)
    inner = _inner(model)
    return {"h0": ddp_fns.error_of(lambda: gs.DiLoCo(model, inner, sync_every=0)),
            "lr": ddp_fns.error_of(lambda: gs.DiLoCo(model, inner, outer_lr=0.0)),
            "momentum": ddp_fns.error_of(lambda: gs.DiLoCo(model, inner, outer_momentum=1.0))}
