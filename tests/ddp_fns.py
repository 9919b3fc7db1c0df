"""Models, data and rank functions for the DDP tests (module level so ranks can import them)."""

from contextlib import nullcontext

import torch
from torch import nn

import gradsync as gs
from gradsync.observe import trace


class MLP(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4))

    def forward(self, x):
        return self.net(x)


class CNNWithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # a bias before BatchNorm has zero gradient
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 4)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv(x.view(-1, 1, 4, 2).repeat(1, 1, 1, 2))))
        return self.head(x.flatten(1))


class Tied(nn.Module):
    """One Parameter registered under two modules (as tied input/output embeddings are)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 8, bias=False)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8, bias=False)
        self.out.weight = self.inp.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mid(self.inp(x))))[:, :4]


class TiedSimple(nn.Module):
    """One weight used twice: reduced once, its gradient the sum of both uses."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.shared(torch.tanh(self.shared(x)))))


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.frozen(x)))


class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(8, 4)
        self.unused_branch = nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x)


MODELS = {"mlp": MLP, "cnn_bn": CNNWithBatchNorm, "tied": Tied, "reused": TiedSimple, "frozen": Frozen, "unused": WithUnused,
          "big_mlp": lambda: MLP(width=256)}


def error_of(action):
    """(exception type, message) of what ``action()`` raised, or None if it raised nothing."""
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the test reads what was raised
        return type(exc).__name__, str(exc)
    return None


def make_model(name, dtype, seed=0):
    torch.manual_seed(seed)
    return MODELS[name]().to(dtype)


def global_data(steps, world_size, local_batch, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    xs = torch.randn(steps, world_size * local_batch, 8, generator=g, dtype=torch.float64).to(dtype)
    ys = torch.randint(0, 4, (steps, world_size * local_batch), generator=g)
    return xs, ys


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def train_on_shards(wrapped, opt, xs, ys, before_step=None, world_size=None, rank=None):
    """Each step: this rank's shard of the global batch (xs[step], ys[step]) through ``wrapped``,
    cross-entropy, backward, ``opt.step()``; ``before_step(step)`` first, if given. Returns the losses.
    ``world_size``/``rank`` default to gradsync's world (a subgroup passes its own)."""
    w = gs.world()
    world_size = w.world_size if world_size is None else world_size
    rank = w.rank if rank is None else rank
    losses = []
    for step in range(len(xs)):
        if before_step is not None:
            before_step(step)
        opt.zero_grad()
        x, y = xs[step].chunk(world_size)[rank], ys[step].chunk(world_size)[rank]
        loss = nn.functional.cross_entropy(wrapped(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def single_process(model_name, opt_kind, steps, world_size, local_batch, dtype, per_shard_loss):
    """The oracle: one process, global batch N*b. ``per_shard_loss``: the loss is the mean of the N
    shard losses (needed when BatchNorm statistics are per shard, as they are per rank in DDP)."""
    model = make_model(model_name, dtype)
    opt = make_optimizer(opt_kind, [p for p in model.parameters() if p.requires_grad])
    xs, ys = global_data(steps, world_size, local_batch, dtype)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        opt.zero_grad()
        if per_shard_loss:
            loss = sum(loss_fn(model(x), y) for x, y in zip(xs[step].chunk(world_size), ys[step].chunk(world_size))) / world_size
        else:
            loss = loss_fn(model(xs[step]), ys[step])
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def ddp_train(model_name, opt_kind, steps, local_batch, dtype, bucket_cap_mb=25, algorithm="auto",
              find_unused=False, comm_hook=None, perturb_seed=True):
    """gradsync DDP on this rank's shard of the same global data; returns final parameters."""
    w = gs.world()
    # Different seeds per rank: the construction-time broadcast must make them equal.
    model = make_model(model_name, dtype, seed=w.rank if perturb_seed else 0)
    ddp = gs.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, algorithm=algorithm,
                                     find_unused_parameters=find_unused, comm_hook=comm_hook)
    opt = make_optimizer(opt_kind, [p for p in model.parameters() if p.requires_grad])
    xs, ys = global_data(steps, w.world_size, local_batch, dtype)
    loss_fn = nn.CrossEntropyLoss()
    grads_none = []
    for step in range(steps):
        opt.zero_grad()
        x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
        loss_fn(ddp(x), y).backward()
        grads_none = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        opt.step()
    ddp.check_replicas()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, grads_none, len(ddp.buckets)


def torch_ddp_vs_ours(steps, local_batch, bucket_cap_mb):
    """Same seed, data and optimizer under torch DDP (gloo) and gradsync DDP, float32; each one's
    buckets in the last step (torch's as torch's own allreduce_hook, which changes nothing, saw them)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    w = gs.world()
    results = {}
    for which in ("torch", "ours"):
        model = make_model("mlp", torch.float32)
        wrapped = (TorchDDP(model, bucket_cap_mb=bucket_cap_mb) if which == "torch"
                   else gs.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb))
        names = {id(p): n for n, p in model.named_parameters()}
        seen = []
        if which == "torch":
            def recording(state, bucket):
                seen.append([names[id(p)] for p in bucket.parameters()])
                return allreduce_hook(state, bucket)
            wrapped.register_comm_hook(None, recording)
        opt = make_optimizer("sgd", model.parameters())
        xs, ys = global_data(steps, w.world_size, local_batch, torch.float32)
        train_on_shards(wrapped, opt, xs, ys, before_step=lambda step: seen.clear())
        results[which] = {n: p.detach().clone() for n, p in model.named_parameters()}
        results[f"{which} buckets"] = seen if which == "torch" else [bucket.names for bucket in wrapped.buckets]
    return results


def no_sync_train(micro_steps, local_batch):
    w = gs.world()
    model = make_model("mlp", torch.float64)
    ddp = gs.DistributedDataParallel(model)
    opt = make_optimizer("sgd", model.parameters())
    xs, ys = global_data(micro_steps, w.world_size, local_batch, torch.float64)
    opt.zero_grad()
    for k in range(micro_steps):
        x, y = xs[k].chunk(w.world_size)[w.rank], ys[k].chunk(w.world_size)[w.rank]
        if k < micro_steps - 1:
            with ddp.no_sync():
                nn.functional.cross_entropy(ddp(x), y).backward()
        else:
            nn.functional.cross_entropy(ddp(x), y).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def no_sync_against_torch(windows, micro_steps, local_batch, local_steps):
    """gradsync's DDP and torch's DDP (gloo, this world) on the same model and shards, each through
    ``windows`` accumulation windows of ``micro_steps`` micro-batches: every micro-batch but the last
    under no_sync(), then opt.step(). With ``local_steps`` the program also steps the optimizer after
    each micro-batch under no_sync (local SGD: the replicas drift apart until the synchronised one).
    Returns, for each, every parameter's .grad after each backward and the parameters after each
    step: under no_sync .grad is this rank's own gradient, not the average."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    w = gs.world()
    xs, ys = global_data(windows * micro_steps, w.world_size, local_batch, torch.float64)

    def train(model, wrapped):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        grads, params = [], []
        for window in range(windows):
            opt.zero_grad()
            for micro in range(micro_steps):
                k = window * micro_steps + micro
                x, y = xs[k].chunk(w.world_size)[w.rank], ys[k].chunk(w.world_size)[w.rank]
                synced = micro == micro_steps - 1
                with nullcontext() if synced else wrapped.no_sync():
                    nn.functional.cross_entropy(wrapped(x), y).backward()
                grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
                if local_steps or synced:
                    opt.step()
                    params.append({n: p.detach().clone() for n, p in model.named_parameters()})
                if local_steps and not synced:
                    opt.zero_grad()
        return grads, params

    model = make_model("mlp", torch.float64)
    ours = train(model, gs.DistributedDataParallel(model))
    reference = make_model("mlp", torch.float64)
    theirs = train(reference, TorchDDP(reference))
    return {"ours": ours, "torch": theirs}


def unused_without_flag():
    model = make_model("unused", torch.float32)
    ddp = gs.DistributedDataParallel(model)
    nn.functional.cross_entropy(ddp(torch.randn(4, 8)), torch.tensor([0, 1, 2, 3])).backward()


def mismatched_models():
    width = 16 if gs.world().rank != 1 else 17
    gs.DistributedDataParallel(MLP(width=width))


def diverged_replicas():
    model = make_model("mlp", torch.float32)
    ddp = gs.DistributedDataParallel(model)
    if gs.world().rank == 1:   # one ulp: the next float32 after the value, towards +inf
        with torch.no_grad():
            model.net[2].bias[0] = torch.nextafter(model.net[2].bias[0], torch.tensor(float("inf")))
    ddp.check_replicas()


def compressed_grads(hook, numel):
    """One bucket's average through a built-in compression hook (called as the reducer calls it),
    next to the exact float64 average of every rank's local values (each rank draws them all from
    the same seeds; no collective involved)."""
    from gradsync.ddp.buckets import build_buckets
    from gradsync.ddp.grad_bucket import GradBucket
    from gradsync.ddp.replica_group import ReplicaGroup
    from gradsync.ddp.hooks import BUILTIN, ReduceState
    w = gs.world()

    def local_of(rank):
        return torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64) * 10
    exact = torch.stack([local_of(r) for r in range(w.world_size)]).mean(dim=0)
    param = nn.Parameter(torch.zeros(numel))
    bucket = build_buckets([param], ["p"], [1 << 30])[0]
    bucket.flat.copy_(local_of(w.rank))
    state = ReduceState(ReplicaGroup.of(None), "ring", divisor=w.world_size)
    reduced = BUILTIN[hook](state, GradBucket(bucket, 1)).wait()
    return reduced.double(), exact


class _HoldBackward(torch.autograd.Function):
    """Identity whose backward waits (up to 30 s) until ``started`` is set."""

    @staticmethod
    def forward(ctx, x, started):
        ctx.started = started
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.started.wait(30.0):
            raise RuntimeError("no bucket's all-reduce started while backward was running")
        return grad, None


class HeldStack(nn.Module):
    """Eight 512x512 layers; backward stops between the first two until ``started`` is set."""

    def __init__(self, started):
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)])
        self.started = started

    def forward(self, x):
        x = _HoldBackward.apply(self.layers[0](x), self.started)
        for layer in self.layers[1:]:
            x = layer(x)
        return x


def traced_overlap(steps):
    """DDP with the trace on. The comm hook (the default average) first signals that a bucket's
    reduction has started, and backward cannot finish before that signal: on a busy machine the
    communication thread may be scheduled late, but the reduction must still start during backward,
    or backward fails after 30 s."""
    import threading

    from gradsync.ddp.hooks import allreduce_average
    w = gs.world()
    torch.manual_seed(0)
    started = threading.Event()
    model = HeldStack(started)

    def signal_then_average(state, bucket):
        started.set()
        return allreduce_average(state, bucket)
    ddp = gs.DistributedDataParallel(model, bucket_cap_mb=1)
    ddp.register_comm_hook(ddp.reducer.hook_state, signal_then_average)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tracer = trace.enable(w.rank)
    x = torch.randn(256, 512)
    for _ in range(steps):
        opt.zero_grad()
        started.clear()
        ddp(x).pow(2).mean().backward()
        with trace.span("optimizer", "compute"):
            opt.step()
    events = trace.disable()
    return events, ddp.last_overlap, len(ddp.buckets), tracer.rank


def zero_copy_train(steps, local_batch, bucket_cap_mb):
    """big_mlp in float64 on this rank's shard; per bucket: whether it lives in a shared region, its
    bytes; per step: the payload bytes this rank received; and the final parameters."""
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    model = make_model("big_mlp", torch.float64, seed=w.rank)
    ddp = gs.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    regions = default_transport().regions
    placed = [regions.views_of(b.flat) is not None for b in ddp.buckets]
    opt = make_optimizer("sgd", model.parameters())
    xs, ys = global_data(steps, w.world_size, local_batch, torch.float64)
    received = []
    for step in range(steps):
        opt.zero_grad(set_to_none=False)  # the gradients stay views of the shared buckets
        x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
        gs.traffic_reset()
        nn.functional.cross_entropy(ddp(x), y).backward()
        received.append(gs.traffic()["per_op"].get("all_reduce/shared_memory", {}).get("received", 0))
        opt.step()
    ddp.check_replicas()
    return ({n: p.detach().clone() for n, p in model.named_parameters()}, placed,
            [b.nbytes for b in ddp.buckets], received)


def region_against_plain(numel):
    """Every rank allocates a shared region; rank 1 then all-reduces a plain copy instead of it."""
    from gradsync.comm.world_transport import default_transport

    region = default_transport().regions.allocate(numel, torch.float32)
    region.fill_(1.0)
    gs.all_reduce(region.clone() if gs.world().rank == 1 else region)
