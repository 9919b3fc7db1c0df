"""Functions the host-staging tests run on every rank (module level, so child processes import them)."""

import torch

import gradsync as gs
from cases import contribution, expected_sum


def device() -> torch.device:
    """Where this rank's tensors go: its current GPU where there is one (cuda:0, shared by every rank,
    unless the world was started with GRADSYNC_BIND_GPU=1: a GPU each), else the CPU
    (GRADSYNC_HOST_STAGING=cpu)."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def world_path():
    from gradsync.comm.world_transport import default_transport
    return gs.world().cuda_path, gs.world().backend, default_transport().context.stage_cpu


def every_collective(numels: list[int], dtypes: list[torch.dtype]):
    """all_reduce (sum, and max on floats), reduce_scatter + all_gather and broadcast of the closed-form
    contributions on this rank's device, each twice, against the closed form on the CPU; returns
    the labels that differ and the meter's staged bytes."""
    w, where = gs.world(), device()
    wrong = []
    gs.traffic_reset()
    for dtype in dtypes:
        for numel in numels:
            want = expected_sum(w.world_size, numel, dtype)
            for call in range(2):
                t = contribution(w.rank, numel, dtype).to(where)
                gs.all_reduce(t)
                if t.device != where or not torch.equal(t.cpu(), want):
                    wrong.append(f"all_reduce {dtype} {numel} #{call}")
                shard = gs.reduce_scatter(contribution(w.rank, numel, dtype).to(where))
                full = gs.all_gather(shard)
                if full.device.type != where.type or not torch.equal(full.cpu(), want):
                    wrong.append(f"reduce_scatter+all_gather {dtype} {numel} #{call}")
                b = torch.full((numel,), w.rank, dtype=dtype, device=where)
                gs.broadcast(b, src=w.world_size - 1)
                if not torch.equal(b.cpu(), torch.full((numel,), w.world_size - 1, dtype=dtype)):
                    wrong.append(f"broadcast {dtype} {numel} #{call}")
                if dtype.is_floating_point:
                    m = contribution(w.rank, numel, dtype).to(where)
                    gs.all_reduce(m, op="max")
                    if not torch.equal(m.cpu(), contribution(w.world_size - 1, numel, dtype)):
                        wrong.append(f"all_reduce max {dtype} {numel} #{call}")
    traffic = gs.traffic()
    return wrong, traffic["device_to_host_bytes"], traffic["host_to_device_bytes"]


def _mlp(seed: int, where=None) -> torch.nn.Module:
    """The float64 MLP every training case here starts from, seeded, on ``where`` (None: the CPU)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)).double()
    return model if where is None else model.to(where)


def _train(model, opt, steps: int, batch: int, seed: int, world_size: int, rank: int | None = None, where=None):
    """``steps`` of MSE on one seeded global batch of world_size x ``batch`` a step; with ``rank``, only
    rank r's slice of it, moved to ``where``."""
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(world_size * batch, 12, generator=g, dtype=torch.float64)
        y = torch.randn(world_size * batch, 3, generator=g, dtype=torch.float64)
        if rank is not None:
            mine = slice(rank * batch, (rank + 1) * batch)
            x, y = x[mine].to(where), y[mine].to(where)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def ddp_steps(steps: int, batch: int, seed: int = 0):
    """DDP over a float64 MLP on this rank's device, ``batch`` samples a rank a step, rank r's slice of
    one global batch of N x ``batch``: the final parameters (on the CPU)."""
    w, where = gs.world(), device()
    model = _mlp(seed, where)
    ddp = gs.DistributedDataParallel(model, bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    _train(ddp, opt, steps, batch, seed, w.world_size, w.rank, where)
    ddp.check_replicas()
    return [p.detach().cpu() for p in model.parameters()]


def one_process_steps(world_size: int, steps: int, batch: int, seed: int = 0):
    """The same training in one process with the global batch of world_size x ``batch`` (the oracle)."""
    model = _mlp(seed)
    _train(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), steps, batch, seed, world_size)
    return [p.detach() for p in model.parameters()]


def zero1_steps(steps: int, batch: int, seed: int = 0):
    """ShardedOptimizer (Adam) over the same model on this rank's device: the final parameters."""
    w, where = gs.world(), device()
    model = _mlp(seed, where)
    ddp = gs.DistributedDataParallel(model)
    opt = gs.ShardedOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.01)
    _train(ddp, opt, steps, batch, seed, w.world_size, w.rank, where)
    return [p.detach().cpu() for p in model.parameters()]


def one_process_adam(world_size: int, steps: int, batch: int, seed: int = 0):
    model = _mlp(seed)
    _train(model, torch.optim.Adam(model.parameters(), lr=0.01), steps, batch, seed, world_size)
    return [p.detach() for p in model.parameters()]


def torch_ddp_on_the_backend(backend: str, steps: int, batch: int, seed: int = 0):
    """torch's own DDP on a process group of ``backend`` ("gradsync" or "gloo"), the module on this
    rank's device: the final parameters (on the CPU)."""
    import torch.distributed as dist

    w, where = gs.world(), device()
    group = dist.new_group(backend=backend)
    model = _mlp(seed, where)
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), steps, batch, seed, w.world_size, w.rank, where)
    return [p.detach().cpu() for p in model.parameters()]


def nccl_communicators_made() -> bool:
    """Whether torch's default group sends this process's CUDA tensors to NCCL (the host path must
    not: no NCCL communicator can then be made). Its backend for CUDA is asked, not whether it has one:
    gloo is registered for CUDA tensors too, so a gloo group answers with gloo."""
    import torch.distributed as dist

    group = dist.distributed_c10d._get_default_group()
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    try:
        backend = group._get_backend(torch.device("cuda"))
    except RuntimeError:   # no backend at all for CUDA tensors
        return False
    return nccl is not None and isinstance(backend, nccl)


def train_digest(config: dict, out: str) -> tuple[int, float, int]:
    """The main job's own rank function (train/loop.py train_rank) on this world: (parameter digest,
    test accuracy, bytes copied to the host for collectives) of this rank."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import train_rank

    result = train_rank(TrainConfig(workers=gs.world().world_size, out=f"{out}/r{gs.world().rank}", quiet=True,
                                    **config))
    return (result["digest"], result["summary"]["accuracy"] if result.get("summary") else None,
            gs.traffic()["device_to_host_bytes"])


def _digest(t: torch.Tensor) -> int:
    import zlib

    return zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())


def staged_digests(steps: int = 4) -> list[int]:
    """What host staging computes on this rank's GPU, as digests of the bytes, for comparing the two
    staging modes (GRADSYNC_STAGING_MODE) bit for bit. Every input is written by a kernel just before
    its call, so a copy that did not wait for it would read stale bytes: each collective on 1,000 and
    4 Mi float32; the DDP wrapper with each hook (the default, fp16, bf16, PowerSGD compressing from
    the third step, mixed precision in bfloat16) on an MLP of 0.5 M parameters, ``steps`` steps; torch's
    DDP on the "gradsync" backend, the same."""
    import torch.distributed as dist
    from types import SimpleNamespace

    from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook

    w, where = gs.world(), device()
    digests = []
    g = torch.Generator(device=where).manual_seed(w.rank)
    for numel in (1000, 1 << 22):
        t = torch.randn(numel, device=where, generator=g).mul_(3)
        digests.append(_digest(gs.all_reduce(t)))
        shard = gs.reduce_scatter(torch.randn(numel, device=where, generator=g).add_(1))
        digests += [_digest(shard), _digest(gs.all_gather(shard.mul(2)))]
        b = torch.randn(numel, device=where, generator=g).sub_(1)
        digests.append(_digest(gs.broadcast(b, src=w.world_size - 1)))

    def train(model, parameters):
        optimizer = torch.optim.SGD(parameters, lr=0.01)
        for _ in range(steps):
            optimizer.zero_grad()
            model(torch.randn(64, 256, device=where, generator=g)).pow(2).mean().backward()
            optimizer.step()

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 256)).to(where)
    for hook in ("none", "fp16", "bf16", "powersgd", "mixed"):
        module = mlp()
        options = {"bucket_cap_mb": 1}
        if hook in ("fp16", "bf16"):
            options["comm_hook"] = hook
        if hook == "mixed":
            options["mixed_precision"] = SimpleNamespace(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                         buffer_dtype=None)
        model = gs.DistributedDataParallel(module, **options)
        if hook == "powersgd":
            model.register_comm_hook(PowerSGDState(rank=2, start_iter=2), powersgd_hook)
        train(model, model.parameters())
        digests += [_digest(p) for p in module.parameters()]
        model.close()
    group = dist.new_group(backend="gradsync")
    module = mlp()
    train(torch.nn.parallel.DistributedDataParallel(module, process_group=group), module.parameters())
    digests += [_digest(p) for p in module.parameters()]
    dist.destroy_process_group(group)
    return digests


def past_nccls_buffers(numel: int) -> list[str]:
    """On NCCL (a GPU a rank): the algorithms over its point-to-point with messages far past its
    buffers (where a send and a receive not posted as one group wait for ever), and the bitwise
    reductions NCCL lacks (staged): the labels whose result differs from the closed form."""
    w, where = gs.world(), device()
    wrong = []
    want = expected_sum(w.world_size, numel, torch.float32)
    for algorithm in ("ring", "halving_doubling"):
        t = contribution(w.rank, numel, torch.float32).to(where)
        if not torch.equal(gs.all_reduce(t, algorithm=algorithm).cpu(), want):
            wrong.append(f"all_reduce {algorithm}")
    if not torch.equal(gs.all_gather(gs.reduce_scatter(contribution(w.rank, numel, torch.float32).to(where))).cpu(),
                       want):
        wrong.append("reduce_scatter + all_gather")
    bits = torch.full((1000,), 1 << w.rank, dtype=torch.int64, device=where)
    if not torch.equal(gs.all_reduce(bits, op="bor").cpu(), torch.full((1000,), (1 << w.world_size) - 1)):
        wrong.append("all_reduce bor")
    return wrong
