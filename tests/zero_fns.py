"""Rank functions for the ZeRO-1 tests (module level so ranks can import them)."""

import torch
from torch import nn

import gradsync as gs
from gradsync.comm.allreduce_ring import ring_bytes_sent

import ddp_fns

OPTIMIZERS = {"momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "adam": (torch.optim.Adam, dict(lr=0.01)),
              "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))}


def _train(model, step_fn, steps, local_batch, dtype):
    w = gs.world()
    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, dtype)
    for step in range(steps):
        x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
        step_fn(x, y)


def zero_vs_ddp(opt_kind, steps, local_batch, bucket_cap_mb):
    """The same steps with ShardedOptimizer and with gradsync DDP + the full optimizer."""
    cls, kwargs = OPTIMIZERS[opt_kind]
    model = ddp_fns.make_model("mlp", torch.float64)
    opt = gs.ShardedOptimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs)
    loss_fn = nn.CrossEntropyLoss()
    gs.traffic_reset()

    def zero_step(x, y):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    _train(model, zero_step, steps, local_batch, torch.float64)
    traffic = gs.traffic()
    reference = ddp_fns.make_model("mlp", torch.float64)
    ddp = gs.DistributedDataParallel(reference)
    full_opt = cls(reference.parameters(), **kwargs)

    def ddp_step(x, y):
        full_opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        full_opt.step()
    _train(reference, ddp_step, steps, local_batch, torch.float64)
    w = gs.world()
    expected = steps * sum(ring_bytes_sent(b.numel, w.world_size, w.rank, 8) for b in opt.buckets)
    full_state = sum(t.numel() * t.element_size() for s in full_opt.state.values() for t in s.values()
                     if isinstance(t, torch.Tensor) and t.dim() > 0)
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: p.detach().clone() for n, p in reference.named_parameters()},
            traffic["bytes_sent"], expected, opt.state_bytes(), full_state, len(opt.buckets),
            [b.chunks.sizes for b in opt.buckets])


def save_state(steps, local_batch):
    """Train a few steps with Adam, return the full state dict (rank 0) and the parameters."""
    model = ddp_fns.make_model("mlp", torch.float64)
    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, bucket_cap_mb=0.001, lr=0.01)
    loss_fn = nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    _train(model, step, steps, local_batch, torch.float64)
    return opt.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}


def load_and_continue(full_state, params, steps):
    """Load params + a full state saved by any world size, train more; returns params."""
    model = ddp_fns.make_model("mlp", torch.float64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, bucket_cap_mb=0.002, lr=0.01)
    opt.load_state_dict(full_state)
    loss_fn = nn.CrossEntropyLoss()
    w = gs.world()
    g = torch.Generator().manual_seed(5)
    xs = torch.randn(steps, 12, 8, generator=g, dtype=torch.float64)
    ys = torch.randint(0, 4, (steps, 12), generator=g)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model(xs[step].chunk(w.world_size)[w.rank]), ys[step].chunk(w.world_size)[w.rank]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def round_trip(full_state, params):
    model = ddp_fns.make_model("mlp", torch.float64)
    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, bucket_cap_mb=0.002, lr=0.01)
    opt.load_state_dict(full_state)
    return opt.state_dict()
