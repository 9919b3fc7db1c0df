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
            initial = [b.names for b in wrapped.buckets] if which == "ours" else None
            opt = ddp_fns.make_optimizer("sgd", model.parameters())
            xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
            ddp_fns.train_on_shards(wrapped, opt, xs, ys, before_step=lambda step, seen=seen: seen.clear())
            results[which] = {"params": params_of(model), "buckets": list(seen), "initial": initial}
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
        ddp_fns.train_on_shards(wrapped, opt, *ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64))
        results[which] = params_of(model)
    return results


def misuse_errors():
    """(exception type, message) of each misuse of register_comm_hook and comm_hook."""
    from torch.nn.parallel.distributed import _MixedPrecision

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

    def never_completes():
        ddp = gs.DistributedDataParallel(make_model("mlp"))
        ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
        ddp.reducer.wait_limit = 1.0   # a knob for tests: seconds a bucket's Future may take
        ddp(torch.randn(2, 8, dtype=torch.float64)).sum().backward()

    return {"twice": ddp_fns.error_of(twice), "mixed_precision": ddp_fns.error_of(with_mixed_precision),
            "old_signature": ddp_fns.error_of(old_signature), "not_a_future": ddp_fns.error_of(not_a_future),
            "never_completes": ddp_fns.error_of(never_completes)}


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


# -- uneven inputs (Join) --------------------------------------------------------------------------
JOIN_CLIP = 0.3
"""max_norm of the clipping case: below most steps' averaged-gradient norm, so clipping acts."""


def uneven_batches(rank, local_batch=4):
    """Rank r's own 6 + 3r batches (seeded by r)."""
    g = torch.Generator().manual_seed(1000 + rank)
    count = 6 + 3 * rank
    return (torch.randn(count, local_batch, 8, generator=g, dtype=torch.float64),
            torch.randint(0, 4, (count, local_batch), generator=g))


def _train_joined(which, case, xs, ys):
    """One uneven run: ``which`` is "torch" (torch's DDP + Join, plain optimizer) or "ours"."""
    model_name = "cnn_bn" if case == "buffers_divide_by_alive" else "mlp"
    model = make_model(model_name)
    sharded = case in ("sharded_with_ddp", "sharded_alone", "sharded_alone_clip")
    if which == "torch":
        wrapped = TorchDDP(model, bucket_cap_mb=0.0006)
    elif case in ("sharded_alone", "sharded_alone_clip"):
        wrapped = model
    else:
        wrapped = gs.DistributedDataParallel(model, bucket_cap_mb=0.0006)
    if case == "torch_hook":
        wrapped.register_comm_hook(None, default_hooks.allreduce_hook)
    if which == "ours" and sharded:
        opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.01) if sharded else ddp_fns.make_optimizer("sgd", model.parameters())
    joinables = [opt] if which == "ours" and case in ("sharded_alone", "sharded_alone_clip") else [wrapped, opt] if which == "ours" and sharded \
        else [wrapped]
    options = {"divide_by_initial_world_size": case != "buffers_divide_by_alive",
               "throw_on_early_termination": case == "throw"}
    steps = clipped_steps = 0
    try:
        with Join(joinables, throw_on_early_termination=options["throw_on_early_termination"],
                  divide_by_initial_world_size=options["divide_by_initial_world_size"]):
            for x, y in zip(xs, ys):
                opt.zero_grad()
                nn.functional.cross_entropy(wrapped(x), y).backward()
                if case == "sharded_alone_clip":   # torch: DDP's averaged .grad; ours: the sharded optimizer's
                    clipped = opt.clip_grad_norm_(JOIN_CLIP) if which == "ours" else \
                        nn.utils.clip_grad_norm_(model.parameters(), JOIN_CLIP)
                    clipped_steps += int(clipped > JOIN_CLIP)
                opt.step()
                steps += 1
    except RuntimeError as exc:
        if case != "throw":
            raise
        return {"raised": str(exc), "steps": steps}
    out = {"params": params_of(model), "steps": steps, "clipped_steps": clipped_steps}
    if model_name == "cnn_bn":
        out["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
    return out


def join_case(case):
    """torch's DDP + Join beside ours, rank r with 6 + 3r batches. Cases: "ddp" (Join([model])),
    "buffers_divide_by_alive" (BatchNorm buffers, divide_by_initial_world_size=False), "torch_hook"
    (torch's allreduce_hook), "throw" (throw_on_early_termination), "sharded_with_ddp"
    (Join([model, ShardedOptimizer])), "sharded_alone" (Join([ShardedOptimizer]) over a bare model),
    "sharded_alone_clip" (that, clipping by the global norm before each step: ShardedOptimizer.clip_grad_norm_
    beside torch's clip_grad_norm_ of DDP's averaged gradients);
    the sharded cases' oracle is torch's DDP + Join with the unsharded optimizer."""
    xs, ys = uneven_batches(gs.world().rank)
    return {which: _train_joined(which, case, xs, ys) for which in ("torch", "ours")}


# -- mixed precision ---------------------------------------------------------------------------------
MIXED_PRECISION_CASES = {
    # model, param_dtype, reduce_dtype, buffer_dtype
    "cnn_bn": ("cnn_bn", torch.float32, None, torch.float32),
    "mlp_reduce_fp16": ("mlp", torch.float32, torch.float16, None),
    "mlp_bf16_reduce_fp32": ("mlp", torch.bfloat16, torch.float32, None),   # reduced wider than computed
}


def _low_precision_oracle_step(low, master, ddp, reduced, x, y, param_dtype):
    """torch's DDP over the low-precision copy; master (full precision) gets the reduced gradients."""
    with torch.no_grad():
        for p_low, p in zip(low.parameters(), master.parameters()):
            p_low.copy_(p)
    low.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(ddp(x.to(param_dtype)), y).backward()
    for p_low, p in zip(low.parameters(), master.parameters()):
        p.grad = reduced[id(p_low)].to(p.dtype)


def mixed_precision_case(case, steps=4, local_batch=4):
    """Ours with mixed_precision beside torch's DDP running the arithmetic torch's mixed precision
    defines (its _reducer_allreduce_and_upcast_hook; torch's own needs an accelerator: on CPU its
    first forward raises "cpu backend doesn't support events"): a copy of the model in param_dtype
    (buffers in buffer_dtype) under torch's DDP, each bucket cast to reduce_dtype, summed on gloo,
    divided by N there, and written as the full-precision master's gradient."""
    import copy

    from torch.nn.parallel.distributed import _MixedPrecision

    model_name, param_dtype, reduce_dtype, buffer_dtype = MIXED_PRECISION_CASES[case]
    w = gs.world()
    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
    config = _MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype)
    model = make_model(model_name)
    ours = gs.DistributedDataParallel(model, mixed_precision=config)
    opt = ddp_fns.make_optimizer("sgd", model.parameters())
    master = make_model(model_name)
    low = copy.deepcopy(master).to(param_dtype)
    if buffer_dtype is not None:
        for buffer in low.buffers():
            if buffer.is_floating_point():
                buffer.data = buffer.data.to(buffer_dtype)
    reduced = {}

    def upcast_hook(state, bucket):
        buffer = bucket.buffer().to(reduce_dtype or param_dtype)

        def divided(future):
            result = future.value()[0].div_(w.world_size)
            offset = 0
            for p in bucket.parameters():
                reduced[id(p)] = result[offset:offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            return bucket.buffer()
        return dist.all_reduce(buffer, async_op=True).get_future().then(divided)
    oracle = TorchDDP(low)
    oracle.register_comm_hook(None, upcast_hook)
    oracle_opt = ddp_fns.make_optimizer("sgd", master.parameters())
    dtypes_in_forward = []
    for step in range(steps):
        x, y = xs[step].chunk(w.world_size)[w.rank], ys[step].chunk(w.world_size)[w.rank]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ours(x), y)
        dtypes_in_forward.append(str(next(model.parameters()).dtype))
        loss.backward()
        opt.step()
        oracle_opt.zero_grad()
        _low_precision_oracle_step(low, master, oracle, reduced, x, y, param_dtype)
        oracle_opt.step()
    return {"ours": params_of(model), "torch": params_of(master),
            "ours buffers": {n: b.clone() for n, b in model.named_buffers()},
            "torch buffers": {n: b.clone() for n, b in low.named_buffers()},
            "dtypes": {"in forward": dtypes_in_forward, "after": [str(p.dtype) for p in model.parameters()],
                       "grads": [str(p.grad.dtype) for p in model.parameters()]}}


# -- a subgroup as process_group ---------------------------------------------------------------------
def subgroup_case(members=(0, 2), steps=4, local_batch=4):
    """torch's DDP and ours over ``dist.new_group(members)``, each member training on its shard of
    the members' data; a rank outside the group reports what each constructor raised."""
    w = gs.world()
    group = dist.new_group(list(members))
    if w.rank not in members:
        raised = {}
        for which, build in (("torch", lambda: TorchDDP(make_model("mlp"), process_group=group)),
                             ("ours", lambda: gs.DistributedDataParallel(make_model("mlp"), process_group=group))):
            try:
                build()
                raised[which] = None
            except Exception as exc:  # noqa: BLE001 - the test reads what was raised
                raised[which] = (type(exc).__name__, str(exc))
        return {"outside": raised}
    position = list(members).index(w.rank)
    xs, ys = ddp_fns.global_data(steps, len(members), local_batch, torch.float64)
    results = {}
    for which in ("torch", "ours"):
        model = make_model("cnn_bn", seed=w.rank)   # different seeds: the group's broadcast must equalise them
        wrapped = (TorchDDP(model, process_group=group, bucket_cap_mb=0.0006) if which == "torch"
                   else gs.DistributedDataParallel(model, process_group=group, bucket_cap_mb=0.0006))
        opt = ddp_fns.make_optimizer("sgd", model.parameters())
        ddp_fns.train_on_shards(wrapped, opt, xs, ys, world_size=len(members), rank=position)
        results[which] = {**params_of(model), **{n: b.clone() for n, b in model.named_buffers()}}
        if which == "ours":
            wrapped.check_replicas()
    return results


# -- torch.compile -------------------------------------------------------------------------------------
def compile_case(order, backend="aot_eager", steps=4, local_batch=4):
    """Losses per step: torch's DDP (eager) beside ours compiled, ``order`` "compile(DDP(m))" or
    "DDP(compile(m))"; aot_eager traces the graphs (dynamo, AOTAutograd) without generating code."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    w = gs.world()
    xs, ys = ddp_fns.global_data(steps, w.world_size, local_batch, torch.float64)
    torch._dynamo.reset()
    counters.clear()
    losses = {}
    for which in ("torch", "ours"):
        model = make_model("mlp")
        if which == "torch":
            wrapped = TorchDDP(model, bucket_cap_mb=0.0006)
        elif order == "compile(DDP(m))":
            wrapped = torch.compile(gs.DistributedDataParallel(model, bucket_cap_mb=0.0006), backend=backend)
        else:
            wrapped = gs.DistributedDataParallel(torch.compile(model, backend=backend), bucket_cap_mb=0.0006)
        opt = ddp_fns.make_optimizer("sgd", model.parameters())
        losses[which] = ddp_fns.train_on_shards(wrapped, opt, xs, ys)
        losses[f"{which} params"] = params_of(model)
    losses["graphs"] = counters["stats"]["unique_graphs"]   # what dynamo compiled: it did compile
    return losses
