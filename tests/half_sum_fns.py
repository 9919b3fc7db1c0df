"""What the ranks of test_half_sum.py run: float16/bfloat16 all-reduces and the DDP hooks that send them,
each from a random input every rank (and the test) can draw from its seed."""

import torch
from torch import nn

import gradsync as gs


def wire_values(rank: int, numel: int, dtype: torch.dtype, case: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input: standard normal values rounded to ``dtype`` (what crosses the wire)."""
    generator = torch.Generator().manual_seed(7919 * case + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def all_reduced(cases: list[tuple]) -> list[tuple]:
    """Each (case, dtype, op, numel, algorithm, in_region): this rank's wire_values all-reduced (in a
    shared region where ``in_region``: the in-place band DDP's buckets take), with the meter's bytes
    sent and received by that one call: [(result, bytes_sent, bytes_received)]."""
    from gradsync.comm.collectives import shared_allocator

    w = gs.world()
    out = []
    for case, dtype, op, numel, algorithm, in_region in cases:
        allocate = shared_allocator(w) if in_region else None
        t = allocate(numel, dtype) if allocate is not None else torch.empty(numel, dtype=dtype)
        assert not in_region or allocate is not None, "no shared region on this world"
        t.copy_(wire_values(w.rank, numel, dtype, case))
        gs.traffic_reset()
        gs.all_reduce(t, op=op, algorithm=algorithm)
        traffic = gs.traffic()
        out.append((t.clone(), traffic["bytes_sent"], traffic["bytes_received"]))
    return out


def hook_reduced(cases: list[tuple]) -> list[torch.Tensor]:
    """Each (case, hook, numel, algorithm): one bucket of this rank's float32 values (wire_values of
    float64, times 10) through a built-in hook, called as the reducer calls it. hook: "fp16", "bf16",
    or "mixed-bf16" (mixed precision's reduce_in_dtype with reduce_dtype bfloat16)."""
    from gradsync.ddp.buckets import build_buckets
    from gradsync.ddp.grad_bucket import GradBucket
    from gradsync.ddp.replica_group import ReplicaGroup
    from gradsync.ddp.hooks import BUILTIN, ReduceState, reduce_in_dtype

    w = gs.world()
    out = []
    for case, hook, numel, algorithm in cases:
        param = nn.Parameter(torch.zeros(numel))
        bucket = build_buckets([param], ["p"], [1 << 30])[0]
        bucket.flat.copy_(wire_values(w.rank, numel, torch.float64, case) * 10)
        state = ReduceState(ReplicaGroup.of(None), algorithm, divisor=w.world_size)
        if hook == "mixed-bf16":
            state.reduce_dtype = torch.bfloat16
            reduced = reduce_in_dtype(state, GradBucket(bucket, 1)).wait()
        else:
            reduced = BUILTIN[hook](state, GradBucket(bucket, 1)).wait()
        out.append(reduced.clone())
    return out
