"""Communication hooks: what happens to a bucket between "all its gradients ready" and "averaged".

One mechanism, torch's (``DistributedDataParallel.register_comm_hook``):

    def hook(state, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]
        state    whatever was registered with the hook (torch's hooks take a process group or a
                 PowerSGDState; gradsync's built-ins take a ReduceState)
        bucket   ddp/grad_bucket.py: buffer() holds this rank's local gradients on entry
        returns  a Future whose value is the reduced buffer (a tensor of the buffer's size, or a
                 list holding one); the wrapper copies it into the bucket if it is another tensor

The reducer calls the hook on its communication thread, one bucket at a time in bucket order on
every rank, and waits (bounded) for the Future before it calls the hook for the next bucket
(ddp/reducer.py says why). torch's hooks run their own torch.distributed collectives on the
process group in their state (None: torch's default group). Those collectives are issued from the
communication thread, not from backward's: a model whose backward runs collectives of its own on
that same group (SyncBatchNorm) would interleave with them in an order that can differ between
ranks, so give such a hook a group of its own (state=torch.distributed.new_group(), made on every
rank).

gradsync's built-ins are hooks of the same form, run on gradsync's own collectives (or on the
wrapper's subgroup, ddp/replica_group.py) with the wrapper's ``algorithm``; their Future is already
complete when they return, because the collective ran on the communication thread itself:

    allreduce_average   the default (comm_hook=None): the average, in the gradients' own dtype
    fp16_compress       comm_hook="fp16": each rank divides by the divisor and casts to float16 (what
                        crosses the wire); the N values are added in float32 and the sum rounded
                        to float16 once (comm/reduce_ops.py), then cast back
    bf16_compress       comm_hook="bf16": the same in bfloat16
    powersgd_hook       comm_hook="powersgd": rank-2 factors with error feedback (ddp/powersgd.py; other
                        ranks: register_comm_hook(PowerSGDState(rank=R), powersgd_hook))
    reduce_in_dtype     mixed precision's reduction (ddp/mixed_precision.py): cast to reduce_dtype,
                        average (float16/bfloat16: added and divided in float32, rounded once); the
                        Future holds the reduce_dtype result

Division: by ``state.divisor``, the number of replicas, except under Join with
divide_by_initial_world_size=False, where it is the number of ranks that have not joined (as
torch's reducer divides). With divisor == replicas the average is the collective's own "avg".

Stated error of the compression hooks: each value is rounded once to the compressed type before
the reduction (u |x / N|, u the unit roundoff: 2^-11 for fp16, 2^-8 for bf16) and the sum of those N
values is rounded once (u |result|), whatever N, so the result is within u (max |x| + |average|)
of the exact average. The all-reduce adds them in float32 where one rank holds every input of an
element: the shared-memory algorithms and "naive" on one host, "ring" (its direct reduce-scatter)
anywhere (reduce_ops.py). "halving_doubling", "tree" and "hierarchical" forward partial sums, which
are rounded at every hop (hierarchical: once per level); "auto" picks them only across hosts (comm/select.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from gradsync.ddp.replica_group import ReplicaGroup
from gradsync.ddp.powersgd import powersgd_hook


@dataclass
class ReduceState:
    """The state of gradsync's built-in hooks."""

    group: ReplicaGroup
    """Where the reduction runs."""
    algorithm: str = "auto"
    """gradsync's all-reduce algorithm (comm/collectives.py ALGORITHMS)."""
    divisor: int | None = None
    """What the sum is divided by in this backward (the reducer sets it; see the module docstring);
    None: the number of replicas."""
    reduce_dtype: torch.dtype | None = None
    """reduce_in_dtype's dtype (mixed precision)."""


def _done(value) -> torch.futures.Future:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(value)
    return future


def _divisor(state: ReduceState) -> int:
    return state.group.size if state.divisor is None else state.divisor


def _average_in_place(state: ReduceState, flat: torch.Tensor) -> None:
    if _divisor(state) == state.group.size:
        state.group.all_reduce(flat, op="avg", algorithm=state.algorithm)
    else:
        state.group.all_reduce(flat, op="sum", algorithm=state.algorithm).div_(_divisor(state))


def allreduce_average(state: ReduceState, bucket) -> torch.futures.Future:
    """The default hook: the bucket averaged in place (see the module docstring)."""
    flat = bucket.buffer()
    _average_in_place(state, flat)
    return _done(flat)


def _compressed(dtype: torch.dtype):
    def hook(state: ReduceState, bucket) -> torch.futures.Future:
        flat = bucket.buffer()
        compressed = flat.div(_divisor(state)).to(dtype)
        state.group.all_reduce(compressed, op="sum", algorithm=state.algorithm)
        flat.copy_(compressed)
        return _done(flat)
    hook.__name__ = hook.__qualname__ = f"{str(dtype).replace('torch.', '')}_compress"
    return hook


fp16_compress = _compressed(torch.float16)
bf16_compress = _compressed(torch.bfloat16)


def reduce_in_dtype(state: ReduceState, bucket) -> torch.futures.Future:
    """Mixed precision: the sum in ``state.reduce_dtype``, divided in it; the Future holds that
    reduce_dtype tensor, from which the reducer writes full-precision gradients."""
    flat = bucket.buffer()
    reduced = flat.to(state.reduce_dtype) if state.reduce_dtype not in (None, flat.dtype) else flat
    _average_in_place(state, reduced)   # avg: float16/bfloat16 added and divided in float32, rounded once
    return _done(reduced)


BUILTIN = {"none": allreduce_average, "fp16": fp16_compress, "bf16": bf16_compress, "powersgd": powersgd_hook}
"""comm_hook names the constructor accepts (None means "none"; "powersgd": ddp/powersgd.py at rank 2,
its defaults; register PowerSGDState(rank=R, ...) with powersgd_hook for other settings)."""


def builtin(comm_hook) -> Callable:
    """The built-in hook the constructor's ``comm_hook`` names."""
    if comm_hook is None:
        return allreduce_average
    if isinstance(comm_hook, str):
        if comm_hook not in BUILTIN:
            raise ValueError(f"unknown comm_hook {comm_hook!r}; choose one of {', '.join(BUILTIN)} or None, "
                             f"or register any hook with model.register_comm_hook(state, hook)")
        return BUILTIN[comm_hook]
    raise TypeError(f"comm_hook={comm_hook!r}: the constructor takes None, 'fp16', 'bf16', 'powersgd' or 'none'. "
                    f"Register a hook of your own with model.register_comm_hook(state, hook), torch's contract: "
                    f"hook(state, bucket) -> torch.futures.Future of the reduced bucket.buffer(). (The old "
                    f"hook(flat, algorithm) signature is no longer called: reduce bucket.buffer() in place and "
                    f"return a completed Future holding it.)")
