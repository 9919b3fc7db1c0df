"""Rank functions for tests/test_ddp_torch_api.py: gradsync's wrapper beside torch's DDP (gloo) in
the same world, same seeds and data, float64. Module level so ranks can import them."""

import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import ddp_fns
import gradsync as gs


class Shuffled(nn.Module):
    """Layers registered in another order than forward uses them: backward's ready order (late,
    mid, early) is not the reverse of registration order, which the first buckets assume."""

    def __init__(self):
        super().__init__()
        self.late = nn.Linear(16, 4)
        self.early = nn.Linear(8, 16)
        self.mid = nn.Linear(16, 16)

    def forward(self, x):
        return self.late(torch.tanh(self.mid(torch.tanh(self.early(x)))))


def make_model(name, seed=0):
    torch.manual_seed(seed)
    return (Shuffled() if name == "shuffled" else ddp_fns.MODELS[name]()).double()


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _names(model, tensors):
    by_id = {id(p): n for n, p in model.named_parameters()}
    return [by_id[id(t)] for t in tensors]


# -- communication hooks -----------------------------------------------------------------------------
def _one_bucket_at_a_time(hook):
    """torch's hook, its Future waited inside the hook (so torch's DDP has one bucket in flight):
    with several buckets in flight torch's DDP hangs on gloo under PowerSGD, whose Future callbacks
    wait for nested collectives (seen: gloo's 'Timed out waiting ... for recv')."""
    def waited(state, bucket):
        done = torch.futures.Future()
        done.set_result(hook(state, bucket).wait())
        return done
    return waited


def _orthogonalize_2d_too(original):
    """torch 2.13's batched_powerSGD_hook hands _orthogonalize a 2-D matrix, which it rejects with a
    bare AssertionError (in torch's DDP as in ours); both sides get this 3-D view of it instead."""
    def orthogonalize(matrices, epsilon=0):
        return original(matrices.unsqueeze(0) if matrices.dim() == 2 else matrices, epsilon)
    return orthogonalize


def _hook_for(case, which):
    if case == "allreduce":
        return None, default_hooks.allreduce_hook
    if case == "fp16":
        return None, default_hooks.fp16_compress_hook
    if case == "bf16":
        # torch's DDP refuses a hook *named* bf16_compress_hook without CUDA and NCCL; the same hook
        # under another name runs on gloo
        return None, lambda state, bucket: default_hooks.bf16_compress_hook(state, bucket)
    if case in ("powersgd", "powersgd_buckets", "batched_powersgd"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            min_compression_rate=0.5, random_seed=0)
        hook = powerSGD_hook.batched_powerSGD_hook if case == "batched_powersgd" else powerSGD_hook.powerSGD_hook
        if which == "torch" and case != "powersgd":
            hook = _one_bucket_at_a_time(hook)
        return state, hook
    raise ValueError(case)


def hook_case(case, model_name="shuffled", bucket_cap_mb=0.0006, steps=5, local_batch=4):
    """torch's DDP and ours with torch's hook ``case``: final parameters, and each wrapper's buckets
    (parameter names) in the last step, torch's as its hook saw them. Case "powersgd" has one bucket,
    where torch's DDP runs PowerSGD as it is."""
    w = gs.world()
    if case == "powersgd":
        bucket_cap_mb = 25
    original = powerSGD_hook._orthogonalize
    powerSGD_hook._orthogonalize = _orthogonalize_2d_too(original)
    try:
        results = {}
        for which in ("torch", "ours"):
            model = make_model(model_name)
            wrapped = (TorchDDP(model, bucket_cap_mb=bucket_cap_mb) if which == "torch"
                       else gs.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb))
            state, hook = _hook_for(case, which)
            seen = []

            def recording(state, bucket, hook=hook, seen=seen, model=model):
                seen.append(_names(model, bucket.parameters()))
                return hook(state, bucket)
            wrapped.register_comm_hook(state, recording)
            opt = ddp_fns.make_optimizer("sgd", model.parameters())
            xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
            for step in range(steps):
                seen.clear()
                opt.zero_grad()
                x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
                nn.functional.cross_entropy(wrapped(x), y).backward()
                opt.step()
            results[which] = {"params": params_of(model), "buckets": list(seen)}
        return results
    finally:
        powerSGD_hook._orthogonalize = original


def builtin_fp16_case(steps=5, local_batch=4):
    """comm_hook='fp16' (gradsync's built-in) beside torch's DDP with fp16_compress_hook."""
    w = gs.world()
    results = {}
    for which in ("torch", "ours"):
        model = make_model("mlp")
        if which == "torch":
            wrapped = TorchDDP(model)
            wrapped.register_comm_hook(None, default_hooks.fp16_compress_hook)
        else:
            wrapped = gs.DistributedDataParallel(model, comm_hook="fp16")
        opt = ddp_fns.make_optimizer("sgd", model.parameters())
        xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
        for step in range(steps):
            opt.zero_grad()
            x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
            nn.functional.cross_entropy(wrapped(x), y).backward()
            opt.step()
        results[which] = params_of(model)
    return results


def misuse_errors():
    """(exception type, message) of each misuse of register_comm_hook and comm_hook."""
    from torch.nn.parallel.distributed import _MixedPrecision

    def error_of(action):
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - the test reads what was raised
            return type(exc).__name__, str(exc)
        return None

    def twice():
        ddp = gs.DistributedDataParallel(make_model("mlp"))
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    def with_mixed_precision():
        ddp = gs.DistributedDataParallel(make_model("mlp"), mixed_precision=_MixedPrecision(param_dtype=torch.float32))
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)

    def old_signature():
        gs.DistributedDataParallel(make_model("mlp"), comm_hook=lambda flat, algorithm: None)

    def not_a_future():
        ddp = gs.DistributedDataParallel(make_model("mlp"))
        ddp.register_comm_hook(None, lambda state, bucket: bucket.buffer())
        ddp(torch.randn(2, 8, dtype=torch.float64)).sum().backward()

    return {"twice": error_of(twice), "mixed_precision": error_of(with_mixed_precision),
            "old_signature": error_of(old_signature), "not_a_future": error_of(not_a_future)}


def run_cases(fn, cases):
    """fn(case) for each case; an exception is returned (type, message, traceback), not raised, so
    one failing case neither hides the others nor retires the shared world."""
    out = {}
    for case in cases:
        try:
            out[case] = fn(case)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            out[case] = ("raised", type(exc).__name__, f"{exc}\n{traceback.format_exc()}")
    return out
