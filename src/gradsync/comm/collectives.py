"""The public collectives: argument checks, agreement, then one algorithm file does the work.

    all_reduce(t, op="sum", algorithm="auto")   in place; returns t
    reduce_scatter(t, op="sum") -> shard         this rank's chunk of the ring partition (ring_chunks:
                                                 the first n mod N ranks get one extra element)
    all_gather(shard) -> full                    concatenation of every rank's shard in rank order
                                                 (any shard sizes; the inverse of reduce_scatter)
    broadcast(t, src=0)                          in place; returns t

Accepted: dtypes float32, float64, float16, bfloat16, int32, int64; any shape, including 0
elements; non-contiguous tensors (reduced through a contiguous copy written back). op="avg" needs a
floating dtype. Reductions run in the tensor's own dtype, as torch.distributed does.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync import runtime, stall
from gradsync.comm import select
from gradsync.comm.agree import (DTYPES, Fingerprint, check_everyone, check_neighbours, gather_control,
                                  mismatch_error)
from gradsync.comm.allreduce_halving_doubling import allreduce_halving_doubling
from gradsync.comm.allreduce_hierarchical import allreduce_hierarchical, layout_error
from gradsync.comm.allreduce_naive import allreduce_naive
from gradsync.comm.allreduce_shared import allreduce_shared
from gradsync.comm.allreduce_shared import layout_error as shared_layout_error
from gradsync.comm.allreduce_ring import Chunks, all_gather_ring, allreduce_ring, reduce_scatter_ring
from gradsync.comm.allreduce_tree import allreduce_tree
from gradsync.comm.broadcast import broadcast_binomial
from gradsync.comm.transport import Transport, default_transport

ALGORITHMS = ("auto", "ring", "halving_doubling", "tree", "naive", "native", "hierarchical", "shared_memory")
OPS = ("sum", "avg")

_IMPLEMENTATIONS = {
    "ring": allreduce_ring,
    "halving_doubling": allreduce_halving_doubling,
    "tree": allreduce_tree,
    "naive": allreduce_naive,
    "hierarchical": allreduce_hierarchical,
    "shared_memory": allreduce_shared,
}


def _check_tensor(tensor, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in DTYPES)
        raise TypeError(f"{what}: dtype {str(tensor.dtype).replace('torch.', '')} is not supported; use one of {names}")
    if tensor.is_cuda and "nccl" not in runtime.world().backend:
        raise RuntimeError(f"{what}: CUDA tensors need the NCCL backend; this world uses {runtime.world().backend!r}")


def _check_op(op: str, tensor: torch.Tensor, what: str) -> None:
    if op not in OPS:
        raise ValueError(f"{what}: unknown op {op!r}; choose one of {', '.join(OPS)}")
    if op == "avg" and not tensor.is_floating_point():
        raise TypeError(f"{what}: op='avg' needs a floating dtype, got {str(tensor.dtype).replace('torch.', '')}; "
                        f"use op='sum' and divide")


def _agree(transport: Transport, fingerprint: Fingerprint) -> None:
    stall.entered(fingerprint)
    if runtime.world().debug:
        check_everyone(transport, fingerprint)
    else:
        check_neighbours(transport, fingerprint)


def _next_sequence(transport: Transport) -> int:
    transport.sequence = getattr(transport, "sequence", 0) + 1
    return transport.sequence


@stall.tracked
def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto") -> torch.Tensor:
    """Reduce ``tensor`` across all ranks in place (op "sum" or "avg") and return it."""
    _check_tensor(tensor, "all_reduce")
    _check_op(op, tensor, "all_reduce")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    w = runtime.world()
    if w.world_size == 1:
        return tensor
    transport = default_transport()
    target = tensor.detach()
    flat = target.reshape(-1) if target.is_contiguous() else target.contiguous().reshape(-1)
    shared_problem = "the shared-memory all-reduce takes CPU tensors" if flat.is_cuda else shared_layout_error(transport)
    if algorithm == "auto":
        algorithm = select.choose(flat.numel() * flat.element_size(), w.world_size, hosts=w.hosts,
                                  shared_memory=shared_problem is None)
    problem = (layout_error(w.hosts) if algorithm == "hierarchical"
               else shared_problem if algorithm == "shared_memory" else None)
    if problem:
        raise RuntimeError(f"all_reduce: {problem}; use another algorithm")
    _agree(transport, Fingerprint("all_reduce", _next_sequence(transport), flat.numel(), flat.dtype, op, algorithm))
    if flat.numel() > 0:
        if algorithm == "native":
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            if op == "avg":
                flat.div_(w.world_size)
        else:
            _IMPLEMENTATIONS[algorithm](flat, transport, average=(op == "avg"))
    if flat.data_ptr() != target.data_ptr() or not target.is_contiguous():
        target.copy_(flat.view_as(target))
    return tensor


@stall.tracked
def reduce_scatter(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Ring reduce-scatter: returns this rank's 1-D chunk of the reduced, flattened ``tensor``.

    Chunk sizes follow ``ring_chunks``: n elements over N ranks, the first n mod N ranks get
    ceil(n/N) elements, the rest floor(n/N). ``tensor`` itself is left unchanged.
    """
    _check_tensor(tensor, "reduce_scatter")
    _check_op(op, tensor, "reduce_scatter")
    w = runtime.world()
    work = tensor.detach().reshape(-1).clone()
    if w.world_size == 1:
        return work
    transport = default_transport()
    _agree(transport, Fingerprint("reduce_scatter", _next_sequence(transport), work.numel(), work.dtype, op, "ring"))
    chunks = reduce_scatter_ring(work, transport, "reduce_scatter/ring")
    shard = chunks.view(work, w.rank)
    if op == "avg":
        shard.div_(w.world_size)
    return shard.clone()


@stall.tracked
def all_gather(shard: torch.Tensor) -> torch.Tensor:
    """Ring all-gather: the 1-D concatenation of every rank's ``shard`` in rank order.

    Shards may differ in size (reduce_scatter's uneven chunks do); they must agree in dtype.
    """
    _check_tensor(shard, "all_gather")
    w = runtime.world()
    flat_shard = shard.detach().reshape(-1)
    if w.world_size == 1:
        return flat_shard.clone()
    transport = default_transport()
    mine = Fingerprint("all_gather", _next_sequence(transport), flat_shard.numel(), flat_shard.dtype, "none", "ring")
    # Sizes legitimately differ, so every rank learns every fingerprint (they carry the sizes).
    table = gather_control(transport, mine.encode(), "all_gather/agree")
    sizes = []
    for other_rank in range(w.world_size):
        theirs = Fingerprint.decode(table[other_rank])
        if (theirs.kind, theirs.sequence, theirs.dtype) != (mine.kind, mine.sequence, mine.dtype):
            raise mismatch_error(w.rank, mine, other_rank, theirs)
        sizes.append(theirs.numel)
    offsets = tuple(sum(sizes[:r]) for r in range(w.world_size))
    chunks = Chunks(offsets, tuple(sizes))
    full = torch.empty(sum(sizes), dtype=flat_shard.dtype, device=flat_shard.device)
    chunks.view(full, w.rank).copy_(flat_shard)
    all_gather_ring(full, chunks, transport, "all_gather/ring")
    return full


@stall.tracked
def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with its value on rank ``src``, in place; returns it."""
    _check_tensor(tensor, "broadcast")
    w = runtime.world()
    if not isinstance(src, int) or not 0 <= src < w.world_size:
        raise ValueError(f"broadcast: src must be a rank in 0..{w.world_size - 1}, got {src!r}")
    if w.world_size == 1:
        return tensor
    transport = default_transport()
    target = tensor.detach()
    flat = target.reshape(-1) if target.is_contiguous() else target.contiguous().reshape(-1)
    _agree(transport, Fingerprint("broadcast", _next_sequence(transport), flat.numel(), flat.dtype,
                                  "none", "binomial", root=src))
    if flat.numel() > 0:
        broadcast_binomial(flat, src, transport)
    if not target.is_contiguous():
        target.copy_(flat.view_as(target))
    return tensor
