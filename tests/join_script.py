"""A training script that owns its torch.distributed set-up, run by test_join.py under torchrun.

It does what such scripts do: ``init_process_group("gloo")`` first, then wraps its model, and
``destroy_process_group()`` at the end. gradsync is used without ``gradsync.init()``: every
gradsync object joins the script's world on first use. Each check compares gradsync with an
independent oracle computed in this same run (torch's own DDP on the same data, torch's Adam, the
script's own dist.all_reduce, a single-process SGD step over the workers' union batch), float64.
Each rank prints one line ``RESULT {json}`` (one write: ranks share the pipe).
"""

import json
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs

torch.set_num_threads(1)
torch.set_default_dtype(torch.float64)
dist.init_process_group("gloo")
RANK, N = dist.get_rank(), dist.get_world_size()
LR, STEPS, ACCUM = 0.1, 3, 2


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def batch(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    return torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)


def train_ddp(wrap, optimizer_class, accumulation: str, **optimizer_args):
    """STEPS optimizer steps of ACCUM micro-batches; gradients are synchronised only on the last one,
    through no_sync() or require_backward_grad_sync (as Lightning and Accelerate do)."""
    model = wrap(make_model())
    optimizer = optimizer_class(model.parameters(), **optimizer_args)
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUM):
            last = micro == ACCUM - 1
            if accumulation == "flag":
                model.require_backward_grad_sync = last
            context = model.no_sync() if accumulation == "no_sync" and not last else nullcontext()
            with context:
                x, y = batch(RANK, step, micro)
                loss = nn.functional.mse_loss(model(x), y) / ACCUM
                loss.backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, [p.detach().clone() for p in model.parameters()]


def max_relative(ours, reference) -> float:
    worst = 0.0
    for a, b in zip(ours, reference):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        worst = max(worst, float(((a - b).abs() / b.abs().clamp_min(1e-300)).max()))
    return worst


def compare_ddp(accumulation: str) -> dict:
    torch_ddp = train_ddp(nn.parallel.DistributedDataParallel, torch.optim.SGD, accumulation, lr=LR, momentum=0.9)
    # torch's own keyword arguments, unchanged: gradsync accepts them (device_ids=None on CPU)
    ours = train_ddp(lambda m: gs.DistributedDataParallel(m, device_ids=None, output_device=None, dim=0,
                                                          process_group=dist.group.WORLD, static_graph=False,
                                                          gradient_as_bucket_view=True, bucket_cap_mb=None),
                     torch.optim.SGD, accumulation, lr=LR, momentum=0.9)
    return {"losses": max_relative(ours[0], torch_ddp[0]), "params": max_relative(ours[1], torch_ddp[1])}


def compare_zero1() -> dict:
    """ShardedOptimizer on a bare model against torch DDP + torch's Adam (accumulation: none)."""
    reference = train_ddp(nn.parallel.DistributedDataParallel, torch.optim.Adam, "none", lr=0.01)
    ours = train_ddp(lambda model: model, lambda params, **args: gs.ShardedOptimizer(params, torch.optim.Adam, **args),
                     "none", lr=0.01)
    return {"losses": max_relative(ours[0], reference[0]), "params": max_relative(ours[1], reference[1])}


def compare_collectives() -> dict:
    """gs.all_reduce with several ops and gs.broadcast against the script's own dist calls."""
    g = torch.Generator().manual_seed(RANK)
    worst = {}
    for op, native in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("product", dist.ReduceOp.PRODUCT)):
        ours = torch.randn(1000, generator=g)
        reference = ours.clone()
        gs.all_reduce(ours, op=op)
        dist.all_reduce(reference, op=native)
        worst[op] = max_relative([ours], [reference])
    ints = torch.randint(0, 1 << 40, (257,), generator=g)
    reference = ints.clone()
    gs.all_reduce(ints, op="bxor")
    dist.all_reduce(reference, op=dist.ReduceOp.BXOR)
    worst["bxor_exact"] = bool(torch.equal(ints, reference))
    shape = torch.full((4, 3), float(RANK))
    gs.broadcast(shape, src=N - 1)
    worst["broadcast_exact"] = bool(torch.equal(shape, torch.full((4, 3), float(N - 1))))
    return worst


def compare_parameter_server() -> dict:
    """Sync PS (rank 0 serves, the others train one SGD step each): the workers' pulled parameters
    equal one SGD step of a single process on the mean of the workers' gradients."""
    model = make_model()
    ps = gs.ParameterServer(model, lambda params: torch.optim.SGD(params, lr=LR), num_servers=1, mode="sync")
    if ps.is_server:
        ps.serve()
        return {"role": "server"}
    ps.pull()
    x, y = batch(RANK, 0, 0)
    nn.functional.mse_loss(model(x), y).backward()
    ps.push()
    ps.pull()
    ps.close()
    oracle = make_model()
    for worker in range(1, N):
        x, y = batch(worker, 0, 0)
        (nn.functional.mse_loss(oracle(x), y) / (N - 1)).backward()
    with torch.no_grad():
        expected = [p - LR * p.grad for p in oracle.parameters()]
    return {"role": "worker", "params": max_relative([p.detach() for p in model.parameters()], expected)}


def bad_inputs() -> dict:
    errors = {}
    for name, call in (
            ("init_other_world_size", lambda: gs.init(world_size=N + 1)),
            ("subgroup", lambda: gs.DistributedDataParallel(make_model(), process_group=subgroup)),
            ("bxor_on_float", lambda: gs.all_reduce(torch.ones(3), op="bxor"))):
        try:
            call()
            errors[name] = None
        except Exception as exc:  # the message is what the test checks
            errors[name] = f"{type(exc).__name__}: {exc}"
    return errors


subgroup = dist.new_group([0])  # collective: every rank makes it, only rank 0 is in it
result = {"rank": RANK, "world_size": N,
          "joined": gs.world().rank == RANK and gs.world().world_size == N,
          "transport": type(__import__("gradsync.comm.world_transport", fromlist=["x"]).default_transport()).__name__,
          "ddp_no_sync": compare_ddp("no_sync"), "ddp_flag": compare_ddp("flag"), "zero1": compare_zero1(),
          "collectives": compare_collectives(), "ps": compare_parameter_server(), "errors": bad_inputs()}
gs.shutdown()
# The script's own world is still there after gradsync left it, and its own teardown works.
after = torch.ones(2)
dist.all_reduce(after)
result["script_group_after_shutdown"] = after.tolist()
dist.destroy_process_group()
result["destroyed"] = not dist.is_initialized()
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result) + "\n").encode())
