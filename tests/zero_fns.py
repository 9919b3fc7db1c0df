"""Rank functions for the ZeRO-1 tests (module level so ranks can import them), and the one-process
oracle they are compared with."""

import torch
from torch import nn

import gradsync as gs
from gradsync.comm.allreduce_ring import ring_bytes_sent, ring_chunks
from gradsync.comm.transport.shm.transport import ShmTransport
from gradsync.comm.world_transport import default_transport

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


# -- clip_grad_norm_ ---------------------------------------------------------------------------------
def clip_against_torch(cases, steps, local_batch):
    """Per case (optimizer, norm_type, max_norm, bucket_cap_mb): ShardedOptimizer.clip_grad_norm_
    before each step, and torch's DDP + ZeroRedundancyOptimizer + torch.nn.utils.clip_grad_norm_ on
    the same data in this world (gloo). Returns per case both parameter sets, both norms per step, our
    bytes sent, and what the reduce-scatter + all-gather formula plus one scalar all-reduce per step
    would send."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    w = gs.world()
    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
    loss_fn = nn.CrossEntropyLoss()
    out = []
    for opt_kind, norm_type, max_norm, bucket_cap_mb in cases:
        cls, kwargs = OPTIMIZERS[opt_kind]
        scalar = torch.zeros(1, dtype=torch.float64)
        gs.traffic_reset()
        gs.all_reduce(scalar, op="max" if norm_type == float("inf") else "sum")
        scalar_bytes = gs.traffic()["bytes_sent"]

        model = ddp_fns.make_model("mlp", torch.float64, seed=w.rank)
        opt = gs.ShardedOptimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs)
        ours = []
        gs.traffic_reset()
        for step in range(steps):
            opt.zero_grad()
            loss_fn(model(xs[step].chunk(w.world_size)[w.rank]), ys[step].chunk(w.world_size)[w.rank]).backward()
            ours.append(float(opt.clip_grad_norm_(max_norm, norm_type)))
            opt.step()
        sent = gs.traffic()["bytes_sent"]

        reference = ddp_fns.make_model("mlp", torch.float64, seed=w.rank)
        ddp = TorchDDP(reference)   # broadcasts rank 0's parameters, as ShardedOptimizer does
        zero = ZeroRedundancyOptimizer(reference.parameters(), optimizer_class=cls, **kwargs)
        theirs = []
        for step in range(steps):
            zero.zero_grad()
            loss_fn(ddp(xs[step].chunk(w.world_size)[w.rank]), ys[step].chunk(w.world_size)[w.rank]).backward()
            theirs.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)))
            zero.step()
        out.append({"ours": {n: p.detach().clone() for n, p in model.named_parameters()},
                    "torch": {n: p.detach().clone() for n, p in reference.named_parameters()},
                    "our_norms": ours, "torch_norms": theirs, "sent": sent,
                    "expected_bytes": steps * (scalar_bytes + sum(
                        scatter_gather_bytes(b.numel, w.world_size, w.rank) for b in opt.buckets))})
    return out


def clip_misuse():
    """What a program sees when it clips in the wrong place, or passes bad arguments; see test_zero."""
    import warnings

    from gradsync.zero import LocalGradientWarning

    w = gs.world()
    xs, ys = ddp_fns.global_data(3, w.world_size, 4, torch.float64)
    loss_fn = nn.CrossEntropyLoss()

    def fresh(set_to_none=True):
        model = ddp_fns.make_model("mlp", torch.float64)
        return model, gs.ShardedOptimizer(model.parameters(), torch.optim.SGD, bucket_cap_mb=0.001, lr=0.1)

    def backward(model, step=0):
        loss_fn(model(xs[step].chunk(w.world_size)[w.rank]), ys[step].chunk(w.world_size)[w.rank]).backward()

    def local_warnings(fn) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        return [str(c.message) for c in caught if issubclass(c.category, LocalGradientWarning)]

    def raised(fn, kind=Exception) -> str:
        try:
            fn()
        except kind as exc:
            return f"{type(exc).__name__}: {exc}"
        return "nothing raised"

    result = {}
    # ours in the right place, or torch's on the local gradient before step(), over three steps, with
    # .grad kept (views of the buckets) or set to None: torch's is warned at every step, ours never
    for clipper, set_to_none in [(c, s) for c in ("ours", "torch") for s in (True, False)]:
        model, opt = fresh()

        def three_steps():
            for step in range(3):
                opt.zero_grad(set_to_none=set_to_none)
                backward(model, step)
                if clipper == "ours":
                    opt.clip_grad_norm_(1e-3)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
        result[f"{clipper}_warnings_{set_to_none}"] = local_warnings(three_steps)
    # a backward after clip_grad_norm_ reduced the gradients: step() refuses to ignore it
    model, opt = fresh()
    backward(model)
    opt.clip_grad_norm_(1e-3)
    backward(model, 1)
    result["backward_after_clip"] = raised(opt.step, RuntimeError)
    # the model's own zero_grad after clip_grad_norm_, then a new backward
    model, opt = fresh()
    backward(model)
    opt.clip_grad_norm_(1e-3)
    model.zero_grad()
    backward(model, 1)
    result["model_zero_grad_after_clip"] = raised(opt.step, RuntimeError)
    # opt.zero_grad() after clip_grad_norm_ starts the step over: no error
    opt.zero_grad()
    backward(model, 2)
    result["zero_grad_starts_over"] = raised(opt.step)
    # bad arguments: refused before anything is reduced
    model, opt = fresh()
    backward(model)
    result["bad_max_norm"] = {repr(value): raised(lambda: opt.clip_grad_norm_(value), ValueError)
                              for value in (0.0, -1.0, float("nan"), float("inf"), "big", True)}
    result["bad_norm_type"] = {repr(value): raised(lambda: opt.clip_grad_norm_(1.0, value), ValueError)
                               for value in (0, -2.0, float("-inf"), float("nan"), "fro")}
    # a non-finite gradient on one rank: every rank raises with error_if_nonfinite, as torch does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LocalGradientWarning)   # the nan written into .grad is a change too
        if w.rank == 0:
            next(model.parameters()).grad[0, 0] = float("nan")
        result["nonfinite"] = raised(lambda: opt.clip_grad_norm_(1.0, error_if_nonfinite=True), RuntimeError)
    return result


def changed_between_steps(opt_kind, steps, local_batch, bucket_cap_mb):
    """ShardedOptimizer and torch's DDP + ZeroRedundancyOptimizer (gloo, this world) train the same
    model on the same shards while the program changes the parameters between steps, the same way
    on every rank: before step 1 model.load_state_dict() of other weights (in place), before step 2
    every parameter given new .data (each step must start from the parameters as they are, as a torch
    optimizer does). Returns both parameter sets after each step, and per bucket whether its values
    lie in a shared region (shared memory: the shard is that region; else a copy refreshed each step)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    cls, kwargs = OPTIMIZERS[opt_kind]
    w = gs.world()
    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
    other_weights = ddp_fns.make_model("mlp", torch.float64, seed=100).state_dict()

    def change(model, step):
        if step == 1:
            model.load_state_dict(other_weights)
        elif step == 2:
            for p in model.parameters():
                p.data = p.detach() * 0.5 + 0.01

    def train(model, forward, opt):
        after = []
        for step in range(steps):
            change(model, step)
            opt.zero_grad()
            x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
            nn.CrossEntropyLoss()(forward(x), y).backward()
            opt.step()
            after.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return after

    model = ddp_fns.make_model("mlp", torch.float64, seed=w.rank)
    opt = gs.ShardedOptimizer(model.parameters(), cls, bucket_cap_mb=bucket_cap_mb, **kwargs)
    ours = train(model, model, opt)
    reference = ddp_fns.make_model("mlp", torch.float64, seed=w.rank)
    ddp = TorchDDP(reference)   # broadcasts rank 0's parameters, as ShardedOptimizer does
    theirs = train(reference, ddp, ZeroRedundancyOptimizer(reference.parameters(), optimizer_class=cls, **kwargs))
    return {"ours": ours, "torch": theirs, "buckets": len(opt.buckets),
            "values_placed": [b.values is not None for b in opt.buckets]}


def nonfinite_in_each_shard():
    """A NaN or an inf written into one rank's gradient at the last element of another rank's shard
    of the first bucket, for each rank as that shard's owner (the first, a middle one, the last):
    ShardedOptimizer.clip_grad_norm_ with error_if_nonfinite, for the 2-norm (the ranks' power sums
    added) and the inf-norm (combined with max). Returns {(norm_type, value, owner): what this rank
    got: the error's first words, or the norm it returned}."""
    import math
    import warnings

    from gradsync.zero import LocalGradientWarning

    w = gs.world()
    xs, ys = ddp_fns.global_data(1, w.world_size, 4, torch.float64)
    model = ddp_fns.make_model("mlp", torch.float64)
    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.SGD, bucket_cap_mb=0.001, lr=0.1)
    bucket = opt.buckets[0]
    got = {}
    for norm_type in (2.0, math.inf):
        for value in (math.nan, math.inf):
            for owner in range(w.world_size):
                opt.zero_grad()
                nn.CrossEntropyLoss()(model(xs[0].chunk(w.world_size)[w.rank]),
                                      ys[0].chunk(w.world_size)[w.rank]).backward()
                if w.rank == (owner + 1) % w.world_size:   # a rank other than the shard's owner
                    index = bucket.chunks.offsets[owner] + bucket.chunks.sizes[owner] - 1
                    offset = 0
                    for p in bucket.params:
                        if offset <= index < offset + p.numel():
                            p.grad.view(-1)[index - offset] = value
                        offset += p.numel()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", LocalGradientWarning)   # the value written is a change
                    try:
                        got[(norm_type, value, owner)] = float(opt.clip_grad_norm_(1.0, norm_type,
                                                                                   error_if_nonfinite=True))
                    except RuntimeError as exc:
                        got[(norm_type, value, owner)] = str(exc)[:60]
    return got
