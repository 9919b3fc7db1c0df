"""Rank functions for tests/test_powersgd.py: gradsync's PowerSGD hook (ddp/powersgd.py) beside
torch's powerSGD_hook on torch's DDP (gloo), and a single-process reference, float64. Module level
so ranks can import them."""

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_fns
import gradsync as gs
from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook

RANK_R, START, STEPS, LOCAL_BATCH = 2, 2, 6, 4


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _one_bucket_at_a_time(hook):
    """torch's hook waited inside the hook, so torch's DDP (on gloo) has one bucket in flight."""
    def waited(state, bucket):
        done = torch.futures.Future()
        done.set_result(hook(state, bucket).wait())
        return done
    return waited


def beside_torch(bucket_cap_mb=25.0):
    """Final parameters of torch's DDP with torch's powerSGD_hook and of ours with powersgd_hook,
    same settings, seeds and shards."""
    w = gs.world()
    xs, ys = ddp_fns.global_data(STEPS, w.world_size, LOCAL_BATCH, torch.float64)
    results = {}
    for which in ("torch", "ours"):
        model = ddp_fns.make_model("mlp", torch.float64)
        if which == "torch":
            wrapped = TorchDDP(model, bucket_cap_mb=bucket_cap_mb)
            state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=RANK_R,
                                                start_powerSGD_iter=START)
            wrapped.register_comm_hook(state, _one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
        else:
            wrapped = gs.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
            wrapped.register_comm_hook(PowerSGDState(rank=RANK_R, start_iter=START), powersgd_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ddp_fns.train_on_shards(wrapped, opt, xs, ys)
        results[which] = _params(model)
    return results


def traffic_per_step(algorithm="ring"):
    """Bytes this rank sent in each step with comm_hook PowerSGD on ``algorithm``, and the
    (compressed, whole) element counts of the model's gradient."""
    from gradsync.ddp.powersgd import bytes_per_step

    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    wrapped = gs.DistributedDataParallel(model, algorithm=algorithm)
    wrapped.register_comm_hook(PowerSGDState(rank=RANK_R, start_iter=START), powersgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = ddp_fns.global_data(STEPS, w.world_size, LOCAL_BATCH, torch.float64)
    sent = []
    ddp_fns.train_on_shards(wrapped, opt, xs, ys, before_step=lambda step: (
        sent.append(gs.traffic()["bytes_sent"]) if step else None, gs.traffic_reset()))
    sent.append(gs.traffic()["bytes_sent"])
    return {"sent": sent, "elements": bytes_per_step(list(model.parameters()), RANK_R)}


def ours_and_replicas():
    """This rank's final parameters with comm_hook='powersgd' settings of the reference below."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    wrapped = gs.DistributedDataParallel(model)
    wrapped.register_comm_hook(PowerSGDState(rank=RANK_R, start_iter=START), powersgd_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_fns.train_on_shards(wrapped, opt, *ddp_fns.global_data(STEPS, w.world_size, LOCAL_BATCH, torch.float64))
    order = [name for bucket in wrapped.buckets for name in bucket.names]
    return {"params": _params(model), "order": order}


def reference(world_size, order, rank_r=RANK_R, start=START, steps=STEPS):
    """PowerSGD written out in one process for ``world_size`` replicas (the algorithm of Vogels et al.
    with torch's conventions: the first ``start`` steps plain averages, error feedback, warm start,
    one seeded draw of Q per bucket, P summed, Q averaged), orthonormalizing with QR. ``order``:
    the parameters' names in the order the (single) bucket holds them, which fixes the order of
    the random Q draws."""
    model = ddp_fns.make_model("mlp", torch.float64)
    named = dict(model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    xs, ys = ddp_fns.global_data(steps, world_size, LOCAL_BATCH, torch.float64)
    seeds = np.random.RandomState(0)
    errors = [{name: torch.zeros_like(named[name]) for name in order} for _ in range(world_size)]
    qs = {}

    def orthonormal(matrix):
        return torch.linalg.qr(matrix).Q

    for step in range(steps):
        grads = []
        for r in range(world_size):
            model.zero_grad()
            x, y = xs[step].chunk(world_size)[r], ys[step].chunk(world_size)[r]
            nn.functional.cross_entropy(model(x), y).backward()
            grads.append({name: named[name].grad.detach().clone() for name in order})
        averaged = {}
        if step < start:
            for name in order:
                averaged[name] = sum(g[name] / world_size for g in grads)
        else:
            corrected = [{name: g[name] + e[name] for name in order} for g, e in zip(grads, errors)]
            compressed = [name for name in order if named[name].dim() > 1 and
                          (named[name].shape[0] + named[name][0].numel()) * min(rank_r, *named[name].view(
                              named[name].shape[0], -1).shape) * 2 < named[name].numel()]
            if not qs:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(seeds.randint(1_000_000_000))
                    for name in compressed:
                        n, m = named[name].view(named[name].shape[0], -1).shape
                        qs[name] = orthonormal(torch.randn(m, min(n, m, rank_r), dtype=torch.float64))
            for name in order:
                matrices = [c[name].view(c[name].shape[0], -1) if c[name].dim() else c[name] for c in corrected]
                if name in compressed:
                    q = orthonormal(qs[name])
                    p = orthonormal(sum(m @ q for m in matrices))
                    qs[name] = sum(m.t() @ p for m in matrices) / world_size
                    averaged[name] = (p @ qs[name].t()).view_as(named[name])
                else:
                    averaged[name] = sum(c[name] for c in corrected) / world_size
            errors = [{name: c[name] - averaged[name] for name in order} for c in corrected]
        for name in order:
            named[name].grad = averaged[name].clone()
        opt.step()
    return _params(model)


def refusals():
    """(exception type, message) of each bad PowerSGD setting."""
    model = ddp_fns.make_model("mlp", torch.float64)
    return {
        "rank0": ddp_fns.error_of(lambda: PowerSGDState(rank=0)),
        "start1": ddp_fns.error_of(lambda: PowerSGDState(rank=2, start_iter=1)),
        "too_big": ddp_fns.error_of(lambda: PowerSGDState(rank=17).check_rank_fits(list(model.parameters()))),
        "fits": ddp_fns.error_of(lambda: PowerSGDState(rank=16).check_rank_fits(list(model.parameters()))),
        "comm_hook": ddp_fns.error_of(lambda: gs.DistributedDataParallel(ddp_fns.make_model("mlp", torch.float64),
                                                                         comm_hook="powersgd")),
    }
