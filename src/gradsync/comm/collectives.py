"""The public collectives: argument checks, agreement, then one algorithm file does the work.

    all_reduce(t, op="sum", algorithm="auto")   in place; returns t
    reduce_scatter(t, op="sum") -> shard         this rank's chunk of the ring partition (ring_chunks:
                                                 the first n mod N ranks get one extra element)
    all_gather(shard) -> full                    concatenation of every rank's shard in rank order
                                                 (any shard sizes; the inverse of reduce_scatter)
    all_gather_in_place(full)                    the same within a shared-region tensor whose chunk
                                                 r this rank wrote (one host; ShardedOptimizer)
    (both by ring, or on one host over shared memory by reduce_scatter_staged.py / all_gather_staged.py,
    or their single-copy twins where the kernel lets ranks read each other's memory; an input in a
    shared region is reduce-scattered where it lies, reduce_scatter_in_place.py)
    broadcast(t, src=0)                          in place; returns t

Accepted: dtypes float32, float64, float16, bfloat16, int32, int64, bool, uint8, int8; any shape,
including 0 elements; non-contiguous tensors (reduced through a contiguous copy written back).
op: "sum" | "avg" | "product" | "max" | "min" | "band" | "bor" | "bxor" (reduce_ops.py: "avg" needs
a floating dtype, the bitwise ones an integer or bool dtype). Reductions run in the tensor's own
dtype with torch's elementwise semantics, as torch.distributed's gloo does, except float16 and bfloat16
sums: added in float32 and rounded once wherever one rank holds every input of an element (the
shared-memory algorithms, naive, the ring's direct reduce-scatter; reduce_ops.py); every rank ends with
bit-identical values.

Each public function runs on gradsync's world (runtime.world(), joined on first use where the
program made torch.distributed's world). Its ``*_in(place, ...)`` twin runs on any Place (a World
and the transport between its ranks): the torch.distributed backend (c10d/) runs one per process
group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsync.group import runtime
from gradsync.group.world_info import transfer_group
from gradsync.observe import stall
from gradsync.comm import host_staging, select
from gradsync.comm.agree import (DTYPES, Fingerprint, check_everyone, check_neighbours, check_staged,
                                  gather_control, mismatch_error, next_sequence_of, uses_staged_check)
from gradsync.comm.allreduce_halving_doubling import allreduce_halving_doubling
from gradsync.comm.allreduce_hierarchical import allreduce_hierarchical, layout_error
from gradsync.comm.allreduce_naive import allreduce_naive
from gradsync.comm.allreduce_ring import Chunks, all_gather_ring, allreduce_ring, reduce_scatter_ring, ring_chunks
from gradsync.comm.reduce_scatter_direct import reduce_scatter_direct
from gradsync.comm.allreduce_tree import allreduce_tree
from gradsync.comm.broadcast import broadcast_binomial
from gradsync.comm.reduce_ops import OPS, Reduction, dtype_name, reduction
from gradsync.comm.transport import Transport
from gradsync.comm.place import Place, here, holds, on_own_core, spins, spins_anywhere  # noqa: F401 - Place, here: callers'
from gradsync.comm.world_transport import default_transport
from gradsync.comm.transport.shm import single_copy
from gradsync.comm.all_gather_in_place import all_gather_in_place as all_gather_region
from gradsync.comm.all_gather_staged import all_gather_staged
from gradsync.comm.all_gather_single_copy import all_gather_single_copy
from gradsync.comm.allreduce_two_shot import TwoShotAllReduce, allreduce_two_shot, direct_below
from gradsync.comm.allreduce_two_shot import layout_error as shared_layout_error
from gradsync.comm.allreduce_one_shot import OneShotAllReduce
from gradsync.comm.allreduce_in_place import IN_PLACE_FROM_BYTES, allreduce_in_place
from gradsync.comm.reduce_scatter_in_place import reduce_scatter_in_place
from gradsync.comm.reduce_scatter_staged import reduce_scatter_staged
from gradsync.comm.reduce_scatter_single_copy import reduce_scatter_single_copy

ALGORITHMS = ("auto", "ring", "halving_doubling", "tree", "naive", "native", "hierarchical", "shared_memory")

_IMPLEMENTATIONS = {
    "ring": allreduce_ring,
    "halving_doubling": allreduce_halving_doubling,
    "tree": allreduce_tree,
    "naive": allreduce_naive,
    "hierarchical": allreduce_hierarchical,
    "shared_memory": allreduce_two_shot,
}


def shared_allocator(w: runtime.World):
    """``allocate(numel, dtype)`` for buffers the collectives read where they lie (DDP's buckets,
    ShardedOptimizer's gradients and parameters): the transport's shared regions when every rank of
    ``w`` is on this host over shared memory (transport/shm/regions.py; allocate returns None when /dev/shm
    cannot hold one); None otherwise, and for a world of one."""
    return shared_allocator_of(Place(w, default_transport()))


def shared_allocator_of(place: Place):
    """shared_allocator for ``place``'s world and transport."""
    if place.world.world_size == 1:
        return None
    transport = place.transport
    return transport.regions.allocate if transport.shares_memory else None


def _flat(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(target, flat): ``tensor`` detached, and a 1-D contiguous alias of it (a copy when it is not
    contiguous: the caller copies the result back into target). A 1-D contiguous tensor that needs
    no grad is both as it is: no new tensor objects, a few us of a small collective."""
    if tensor.dim() == 1 and not tensor.requires_grad and tensor.is_contiguous():
        return tensor, tensor
    target = tensor.detach()
    return target, (target.reshape(-1) if target.is_contiguous() else target.contiguous().reshape(-1))


def _check_tensor(tensor, what: str, w: runtime.World) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in DTYPES:
        names = ", ".join(dtype_name(d) for d in DTYPES)
        raise TypeError(f"{what}: dtype {dtype_name(tensor.dtype)} is not supported; use one of {names}")
    if tensor.is_cuda and w.cuda_path != "nccl":   # staged through the host before it came here
        raise RuntimeError(f"{what}: a CUDA tensor in a world without CUDA (backend {w.backend!r}); this rank "
                           f"has no GPU that torch.distributed was set up with")


NCCL_REFUSES = ("band", "bor", "bxor")
"""Reductions NCCL has no operation for: a CUDA tensor in a world on NCCL is staged through the
host for them and reduced by the CPU algorithms (over gloo), which have them."""


def _staging(place: Place, tensor, op: str | None = None) -> host_staging.HostStaging | None:
    """Host staging (host_staging.py) for ``tensor`` on ``place``: a CUDA tensor in a world whose CUDA
    path is "host" (device_path.py), or reduced by ``op`` where NCCL has none (NCCL_REFUSES), or any
    CPU tensor under GRADSYNC_HOST_STAGING=cpu; else None."""
    if not isinstance(tensor, torch.Tensor):
        return None
    if tensor.is_cuda:
        if place.world.cuda_path == "nccl" and op not in NCCL_REFUSES:
            return None
    elif not place.transport.context.stage_cpu:
        return None
    return host_staging.staging_of(place.transport, shared_allocator_of(place))


_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "product": dist.ReduceOp.PRODUCT,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN, "band": dist.ReduceOp.BAND,
               "bor": dist.ReduceOp.BOR, "bxor": dist.ReduceOp.BXOR}
assert set(_NATIVE_OPS) == set(OPS)


def agree_in(place: Place, fingerprint: Fingerprint) -> None:
    """Compare ``fingerprint`` with the other ranks of ``place`` before a collective (agree.py)."""
    _agree(place.world, place.transport, fingerprint)


def next_sequence(place: Place) -> int:
    """The sequence number of the next collective on ``place``."""
    return next_sequence_of(place.transport)


def _entered(transport: Transport, kind: str, flat: torch.Tensor, op: str, algorithm: str, *,
             region: int = -1) -> Fingerprint:
    """The fingerprint of the collective this rank enters now (the transport's next sequence number),
    told to the stall inspector; the shared-memory algorithms publish it with their data."""
    fingerprint = Fingerprint(kind, next_sequence_of(transport), flat.numel(), flat.dtype, op, algorithm, region=region)
    stall.entered(fingerprint)
    return fingerprint


def _agree(w: runtime.World, transport: Transport, fingerprint: Fingerprint) -> None:
    stall.entered(fingerprint)
    if uses_staged_check(transport):
        check_staged(transport, fingerprint, spins(transport, fingerprint))
    elif w.debug:
        check_everyone(transport, fingerprint)
    else:
        check_neighbours(transport, fingerprint)


def _shared(transport: Transport, tensor: torch.Tensor) -> bool:
    """Every rank on this host over shared memory, and a CPU tensor: the shared-memory algorithms."""
    return not tensor.is_cuda and transport.shares_memory


def _native_all_reduce(flat: torch.Tensor, chosen: Reduction, w: runtime.World) -> None:
    """torch.distributed's own all-reduce on gradsync's process group (the benchmarks' baseline)."""
    group = dist.distributed_c10d._get_default_group() if flat.is_cuda and w.joined else transfer_group(w)
    group.allreduce([flat], _allreduce_options(_NATIVE_OPS[chosen.name])).wait()
    chosen.finish(flat, w.world_size)


def _allreduce_options(op: dist.ReduceOp) -> dist.AllreduceOptions:
    options = dist.AllreduceOptions()
    options.reduceOp = op
    return options


def resolve_algorithm(place: Place, flat: torch.Tensor, algorithm: str = "auto") -> str:
    """The algorithm all_reduce runs for ``flat`` on ``place``: ``algorithm``, or auto's choice
    (select.py); raises when the layout does not admit it. Remembered per transport for each
    (algorithm, bytes, device): nothing else changes the answer while the transport lives (the
    link auto prices is fixed per world, select.shared_link)."""
    w, transport = place.world, place.transport
    key = (algorithm, flat.numel() * flat.element_size(), flat.is_cuda)
    choices = transport.context.algorithm_choices
    chosen = choices.get(key)
    if chosen is None:
        chosen = _resolve(w, transport, flat, algorithm)
        if len(choices) >= 256:
            choices.clear()
        choices[key] = chosen
    return chosen


def _resolve(w: runtime.World, transport: Transport, flat: torch.Tensor, algorithm: str) -> str:
    if flat.is_cuda and algorithm == "auto":   # each rank on a GPU of its own: NCCL's own all-reduce
        return "native"   # (band, bor, bxor never get here: NCCL has none, so they are staged: _staging)
    shared_problem = "the shared-memory all-reduce takes CPU tensors" if flat.is_cuda else shared_layout_error(transport)
    if algorithm == "auto":
        algorithm = select.choose(flat.numel() * flat.element_size(), w.world_size, hosts=w.hosts,
                                  shared_memory=shared_problem is None,
                                  link=None if shared_problem is None else select.shared_link(w))
    problem = (layout_error(w.hosts) if algorithm == "hierarchical"
               else shared_problem if algorithm == "shared_memory" else None)
    if problem:
        raise RuntimeError(f"all_reduce: {problem}; use another algorithm")
    return algorithm


def all_reduce(tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto") -> torch.Tensor:
    """Reduce ``tensor`` across all ranks in place (op: see the module docstring) and return it."""
    return all_reduce_in(here(), tensor, op, algorithm)


@stall.tracked
def all_reduce_in(place: Place, tensor: torch.Tensor, op: str = "sum", algorithm: str = "auto") -> torch.Tensor:
    """all_reduce on ``place``."""
    transport = place.transport
    plans = transport.context.plans
    if plans and type(tensor) is torch.Tensor:   # a shape reduced directly before: straight to its plan
        plan = plans.get(("all_reduce", op, algorithm, tensor.dtype, tensor.numel()))
        if (plan is not None and tensor.dim() == 1 and tensor.is_contiguous() and not tensor.requires_grad
                and not tensor.is_cuda
                and (plan.nbytes < IN_PLACE_FROM_BYTES or transport.regions.views_of(tensor) is None)):
            plan.run(tensor, transport)   # held on the rank's core as on_own_core holds
            return tensor
    staging = _staging(place, tensor, op)
    if staging is not None:   # a CUDA tensor through host memory (host_staging.py)
        return host_staging.in_place(staging, tensor, lambda host: _all_reduce_in(place, host, op, algorithm))
    return _all_reduce_in(place, tensor, op, algorithm)


@on_own_core
def _all_reduce_in(place: Place, tensor: torch.Tensor, op: str, algorithm: str) -> torch.Tensor:
    """all_reduce_in without a plan (its first call for a shape, or one no plan is kept for)."""
    w, transport = place.world, place.transport
    _check_tensor(tensor, "all_reduce", w)
    chosen = reduction(op, tensor.dtype, "all_reduce")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    if w.world_size == 1:
        return tensor
    target, flat = _flat(tensor)
    requested, algorithm = algorithm, resolve_algorithm(place, flat, algorithm)
    in_place = (transport.regions.views_of(flat) if algorithm == "shared_memory"
                and flat.numel() * flat.element_size() >= IN_PLACE_FROM_BYTES else None)
    if in_place is not None:  # the tensor lives in a shared region: no staging copy (small ones: direct)
        region, views = in_place
        fingerprint = _entered(transport, "all_reduce", flat, op, "shared_memory_in_place", region=region)
        allreduce_in_place(flat, transport, views, reduction=chosen, fingerprint=fingerprint,
                                  spin=spins(transport, fingerprint))
    elif algorithm == "shared_memory":  # the fingerprint travels with the data (agree.py: staged)
        fingerprint = _entered(transport, "all_reduce", flat, op, algorithm)
        spin = spins(transport, fingerprint)
        allreduce_two_shot(flat, transport, reduction=chosen, fingerprint=fingerprint, spin=spin)
        if flat is target:
            _remember_plan(transport, flat, op, requested, chosen, spin)
    else:
        fingerprint = Fingerprint("all_reduce", next_sequence_of(transport), flat.numel(), flat.dtype, op, algorithm)
        _agree(w, transport, fingerprint)
        if flat.numel() > 0 and algorithm == "native":
            _native_all_reduce(flat, chosen, w)
        elif flat.numel() > 0:
            _IMPLEMENTATIONS[algorithm](flat, transport, reduction=chosen)
    if flat is not target and (flat.data_ptr() != target.data_ptr() or not target.is_contiguous()):
        target.copy_(flat.view_as(target))
    return tensor


def _remember_plan(transport: Transport, flat: torch.Tensor, op: str, requested: str, chosen: Reduction,
                   spin: bool) -> None:
    """Keep a plan for ``flat``'s shape: a OneShotAllReduce below allreduce_two_shot.direct_below, else a
    TwoShotAllReduce (told to hold the call and to poll as on_own_core and spins would off the main
    thread); all_reduce_in runs it straight from its key, for a tensor of IN_PLACE_FROM_BYTES or more
    only when it does not lie in a shared region (those are reduced in place)."""
    nbytes = flat.numel() * flat.element_size()
    context = transport.context
    if context.stage_cpu:   # every CPU call staged: no short way
        return
    plans = context.plans
    if len(plans) >= 256:
        plans.clear()
    if nbytes < direct_below(transport):
        plan = OneShotAllReduce(transport, flat.numel(), flat.dtype, chosen, spin)
    else:
        plan = TwoShotAllReduce(transport, flat.numel(), flat.dtype, chosen, spins_anywhere(transport, nbytes),
                              transport.hold if holds(transport, nbytes) else None)
    plans[("all_reduce", op, requested, flat.dtype, flat.numel())] = plan


def reduce_scatter(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Ring reduce-scatter: returns this rank's 1-D chunk of the reduced, flattened ``tensor``.

    Chunk sizes follow ``ring_chunks``: n elements over N ranks, the first n mod N ranks get
    ceil(n/N) elements, the rest floor(n/N). ``tensor`` itself is left unchanged.
    """
    return reduce_scatter_in(here(), tensor, op)


@stall.tracked
def reduce_scatter_in(place: Place, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """reduce_scatter on ``place``."""
    staging = _staging(place, tensor, op)
    if staging is not None:   # a CUDA tensor through host memory (host_staging.py)
        return host_staging.producing(staging, tensor, lambda host: _reduce_scatter_in(place, host, op))
    return _reduce_scatter_in(place, tensor, op)


@on_own_core
def _reduce_scatter_in(place: Place, tensor: torch.Tensor, op: str) -> torch.Tensor:
    w, transport = place.world, place.transport
    _check_tensor(tensor, "reduce_scatter", w)
    chosen = reduction(op, tensor.dtype, "reduce_scatter")
    if w.world_size == 1:
        return tensor.detach().reshape(-1).clone()
    if _shared(transport, tensor):  # the fingerprint with the data
        flat = _flat(tensor)[1]
        in_place = (transport.regions.views_of(flat) if flat.numel() * flat.element_size() >= IN_PLACE_FROM_BYTES
                    else None)
        if in_place is not None:  # the input lives in a shared region (ShardedOptimizer's gradients)
            region, views = in_place
            fingerprint = _entered(transport, "reduce_scatter", flat, op, "shared_memory_in_place", region=region)
            return reduce_scatter_in_place(flat, transport, views, reduction=chosen, fingerprint=fingerprint,
                                           spin=spins(transport, fingerprint))
        if transport.single_copy and flat.numel() * flat.element_size() >= single_copy.FROM_BYTES:
            # each rank reads its chunk where it lies
            fingerprint = _entered(transport, "reduce_scatter", flat, op, "shared_memory_single_copy")
            shard = reduce_scatter_single_copy(flat, transport, reduction=chosen, fingerprint=fingerprint,
                                               spin=spins(transport, fingerprint))
            if shard is not None:
                return shard   # (None: some rank's input cannot be read where it lies; staged, as on every rank)
        fingerprint = _entered(transport, "reduce_scatter", flat, op, "shared_memory")  # one barrier per staging half
        return reduce_scatter_staged(flat, transport, reduction=chosen, fingerprint=fingerprint,
                                     spin=spins(transport, fingerprint))
    work = tensor.detach().reshape(-1).clone()
    _agree(w, transport, Fingerprint("reduce_scatter", next_sequence_of(transport), work.numel(), work.dtype, op, "ring"))
    if chosen.widens(work.dtype) and not transport.pairs_exchanges(work):   # no partial sum on the wire
        chunks = ring_chunks(work.numel(), w.world_size)
        reduce_scatter_direct(work, chunks, transport, "reduce_scatter/ring", chosen)
        return chunks.view(work, w.rank).clone()
    chunks = reduce_scatter_ring(work, transport, "reduce_scatter/ring", combine=chosen.combine)
    shard = chunks.view(work, w.rank)
    chosen.finish(shard, w.world_size)
    return shard.clone()


def all_gather(shard: torch.Tensor) -> torch.Tensor:
    """Ring all-gather: the 1-D concatenation of every rank's ``shard`` in rank order.

    Shards may differ in size (reduce_scatter's uneven chunks do); they must agree in dtype.
    """
    return all_gather_in(here(), shard)


@stall.tracked
def all_gather_in(place: Place, shard: torch.Tensor) -> torch.Tensor:
    """all_gather on ``place``."""
    staging = _staging(place, shard)
    if staging is not None:   # a CUDA tensor through host memory (host_staging.py)
        return host_staging.producing(staging, shard, lambda host: _all_gather_in(place, host))
    return _all_gather_in(place, shard)


@on_own_core
def _all_gather_in(place: Place, shard: torch.Tensor) -> torch.Tensor:
    w, transport = place.world, place.transport
    _check_tensor(shard, "all_gather", w)
    flat_shard = _flat(shard)[1]
    if w.world_size == 1:
        return flat_shard.clone()
    if _shared(transport, shard):
        mine = _entered(transport, "all_gather", flat_shard, "none", "shared_memory")
        if transport.single_copy:
            full = all_gather_single_copy(flat_shard, transport, mine, spin=spins(transport, mine))
            if full is not None:
                return full
            # a shard that cannot be read where it lies: staged, as on every rank
            mine = _entered(transport, "all_gather", flat_shard, "none", "shared_memory")
        return all_gather_staged(flat_shard, transport, mine, spin=spins(transport, mine))
    mine = Fingerprint("all_gather", next_sequence_of(transport), flat_shard.numel(), flat_shard.dtype, "none", "ring")
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


def all_gather_in_place(full: torch.Tensor) -> torch.Tensor:
    """All-gather within ``full``, a 1-D tensor in a shared region (``shared_allocator``) whose chunk
    ``ring_chunks(n, N)`` r this rank has written: afterwards every chunk holds its owner's values,
    copied out of the owners' regions (all_gather_in_place.py). Returns ``full``."""
    return all_gather_in_place_in(here(), full)


@stall.tracked
@on_own_core
def all_gather_in_place_in(place: Place, full: torch.Tensor) -> torch.Tensor:
    """all_gather_in_place on ``place``."""
    w, transport = place.world, place.transport
    _check_tensor(full, "all_gather_in_place", w)
    if w.world_size == 1:
        return full
    located = transport.regions.views_of(full) if full.dim() == 1 and _shared(transport, full) else None
    if located is None:
        raise ValueError("all_gather_in_place needs a 1-D tensor in a shared region (collectives.shared_allocator), "
                         "with every rank on this host over shared memory; use all_gather otherwise")
    region, views = located
    fingerprint = _entered(transport, "all_gather", full, "none", "shared_memory_in_place", region=region)
    all_gather_region(full, transport, views, fingerprint=fingerprint, spin=spins(transport, fingerprint))
    return full


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with its value on rank ``src``, in place; returns it."""
    return broadcast_in(here(), tensor, src)


@stall.tracked
def broadcast_in(place: Place, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """broadcast on ``place``."""
    staging = _staging(place, tensor)
    if staging is not None:   # a CUDA tensor through host memory (host_staging.py)
        return host_staging.in_place(staging, tensor, lambda host: _broadcast_in(place, host, src))
    return _broadcast_in(place, tensor, src)


@on_own_core
def _broadcast_in(place: Place, tensor: torch.Tensor, src: int) -> torch.Tensor:
    w, transport = place.world, place.transport
    _check_tensor(tensor, "broadcast", w)
    if not isinstance(src, int) or not 0 <= src < w.world_size:
        raise ValueError(f"broadcast: src must be a rank in 0..{w.world_size - 1}, got {src!r}")
    if w.world_size == 1:
        return tensor
    target, flat = _flat(tensor)
    _agree(w, transport, Fingerprint("broadcast", next_sequence_of(transport), flat.numel(), flat.dtype,
                                  "none", "binomial", root=src))
    if flat.numel() > 0:
        broadcast_binomial(flat, src, transport)
    if flat is not target and not target.is_contiguous():
        target.copy_(flat.view_as(target))
    return tensor
