"""Rank functions for the ZeRO-1 tests (module level so ranks can import them), and the one-process
oracle they are compared with."""

import torch
from torch import nn

import gradsync as gs
from gradsync.comm.allreduce_ring import ring_bytes_sent, ring_chunks
from gradsync.comm.shm import ShmTransport
from gradsync.comm.transport import default_transport

import ddp_fns

OPTIMIZERS = {"momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9)),
              "adam": (torch.optim.Adam, dict(lr=0.01)),
              "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1))}


def resume_data(steps):
    """The global batches (12 rows) of the steps after a resume."""
    g = torch.Generator().manual_seed(5)
    return (torch.randn(steps, 12, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (steps, 12), generator=g))


def one_process_steps(model, opt, xs, ys):
    """The oracle's loop: one process, a plain torch optimizer, the whole global batch each step
    (the mean over N*b rows is the mean of the N ranks' means over b rows)."""
    for x, y in zip(xs, ys):
        opt.zero_grad()
        nn.CrossEntropyLoss()(model(x), y).backward()
        opt.step()


def one_process(opt_kind, xs, ys, model_name="mlp"):
    """A fresh float64 model and a plain ``opt_kind`` optimizer after one_process_steps; returns both."""
    cls, kwargs = OPTIMIZERS[opt_kind]
    model = ddp_fns.make_model(model_name, torch.float64)
    opt = cls(model.parameters(), **kwargs)
    one_process_steps(model, opt, xs, ys)
    return model, opt


def scatter_gather_bytes(numel: int, world_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in one reduce-scatter + all-gather of ``numel`` float64, by the
    formulas in the algorithms' docstrings: the ring's equal one ring all-reduce; over shared memory
    (one host) the reduce-scatter sends the other ranks their chunks (M - s_r) and the all-gather
    its own chunk to each (N-1) s_r."""
    if not isinstance(default_transport(), ShmTransport):
        return ring_bytes_sent(numel, world_size, rank, 8)
    own = ring_chunks(numel, world_size).sizes[rank]
    return (numel - own + (world_size - 1) * own) * 8


def zero_train(opt_kind, steps, local_batch, bucket_cap_mb):
    """ShardedOptimizer on this rank's slice of ddp_fns.global_data. Returns the parameters, the
    gathered state_dict (rank 0; None elsewhere), bytes sent and scatter_gather_bytes' figure, this
    rank's optimizer-state bytes, the number of buckets and every bucket's shard sizes."""
    cls, kwargs = OPTIMIZERS[opt_kind]
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64, seed=w.rank)   # the constructor's broadcast makes them equal
    opt = gs.ShardedOptimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs)
    loss_fn = nn.CrossEntropyLoss()
    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
    gs.traffic_reset()
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model(xs[step].chunk(w.world_size)[w.rank]), ys[step].chunk(w.world_size)[w.rank]).backward()
        opt.step()
    sent = gs.traffic()["bytes_sent"]
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state_dict": opt.state_dict(), "sent": sent, "expected_bytes": steps * sum(
                scatter_gather_bytes(b.numel, w.world_size, w.rank) for b in opt.buckets),
            "state_bytes": opt.state_bytes(), "buckets": len(opt.buckets),
            "shard_sizes": [b.chunks.sizes for b in opt.buckets]}


def zero_copy_train(opt_kind, steps, local_batch, bucket_cap_mb, set_to_none):
    """big_mlp in float64 under ShardedOptimizer on this rank's shard, zero_grad(set_to_none=...)
    each step. Returns the parameters; per bucket whether its gradient buffer lies in a shared
    region; per step whether, right after backward, every .grad already was its view of the bucket
    (backward wrote into the buffer) and whether it was after step(); whether the parameters were
    views of their buckets' shared values after construction, after one was given new data (at
    step 1) and at the end; and per bucket whether its values lie in a shared region."""
    cls, kwargs = OPTIMIZERS[opt_kind]
    w = gs.world()
    model = ddp_fns.make_model("big_mlp", torch.float64, seed=w.rank)
    opt = gs.ShardedOptimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs)
    placed = [default_transport().regions.views_of(b.grads) is not None for b in opt.buckets]

    def grads_are_views() -> bool:
        for bucket in opt.buckets:
            offset = 0
            for p in bucket.params:
                if p.grad is None or p.grad.data_ptr() != bucket.grads[offset:].data_ptr():
                    return False
                offset += p.numel()
        return True

    def params_are_views() -> bool:
        return all(p.data_ptr() == b.values[sum(q.numel() for q in b.params[:i]):].data_ptr()
                   for b in opt.buckets for i, p in enumerate(b.params))

    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
    after_backward, after_step, params_in_place = [], [], [params_are_views()]
    for step in range(steps):
        opt.zero_grad(set_to_none=set_to_none)
        x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
        nn.CrossEntropyLoss()(model(x), y).backward()
        after_backward.append(grads_are_views())
        if step == 1:   # a program replaces a parameter's data: step() must take the new values in
            first = next(model.parameters())
            first.data = first.data.clone()
            params_in_place.append(params_are_views())
        opt.step()
        after_step.append(grads_are_views())
    params_in_place.append(params_are_views())
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "placed": placed,
            "after_backward": after_backward, "after_step": after_step, "params_in_place": params_in_place,
            "values_placed": [default_transport().regions.views_of(b.values) is not None for b in opt.buckets]}


def load_and_continue(full_state, params, steps):
    """Load params + a full state saved by any world size, train ``steps`` more on resume_data; returns params."""
    model = ddp_fns.make_model("mlp", torch.float64)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(params[n])
    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, bucket_cap_mb=0.002, lr=0.01)
    opt.load_state_dict(full_state)
    loss_fn = nn.CrossEntropyLoss()
    w = gs.world()
    xs, ys = resume_data(steps)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model(xs[step].chunk(w.world_size)[w.rank]), ys[step].chunk(w.world_size)[w.rank]).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def round_trip(full_state):
    """load_state_dict then state_dict on this world, with buckets unlike the saver's: rank 0's gathered dict."""
    model = ddp_fns.make_model("mlp", torch.float64)
    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, bucket_cap_mb=0.002, lr=0.01)
    opt.load_state_dict(full_state)
    return opt.state_dict()
