"""GradsyncProcessGroup: torch.distributed's ProcessGroup interface on gradsync's collectives.

A thin adapter: each method takes torch's arguments (tensor lists, an options object), checks
them, and queues one gradsync collective on the group's communication thread (work.py), which
torch sees as a Work. What a method does to its arguments first (CUDA tensors to NCCL, complex
tensors as real pairs, ReduceOps to gradsync's op names) is arguments.py's. The mapping:

    torch method                         gradsync
    allreduce, allreduce_coalesced       all_reduce_in (algorithm auto, or GRADSYNC_ALGORITHM)
    broadcast                            broadcast_in (binomial tree)
    allgather, _allgather_base,          all_gather_in (ring), split into torch's outputs
      allgather_into_tensor_coalesced
    reduce_scatter, _reduce_scatter_base reduce_scatter_in (ring); torch's equal pieces are the
                                         ring's chunks
    reduce                               reduce_tree (binomial) on a copy; the root keeps the result
    gather, scatter                      gather_linear, scatter_linear (comm/rooted.py)
    alltoall_base                        alltoall_pairwise (comm/rooted.py)
    barrier                              all_reduce_in of one element
    send, recv, recv_anysource           the transport's tagged messages (torch.distributed's gloo
                                         on a private group): posted at once on the caller's
                                         thread, so send/recv pairs in any order never deadlock

An all-reduce that torch's DDP issues for a bucket during backward may first adopt the bucket into
shared memory (adoption.py): from then on it is all-reduced where it lies, as gradsync's own
wrapper's buckets are, with no copy into the staging halves and out again.

Every collective first compares fingerprints with the other ranks (a mismatch names both ranks),
every wait has the group's timeout, a dead rank on the same host is noticed within a fraction of
a second, the stall inspector (stall.py) watches the default group's collectives, and every byte
is counted by gradsync.traffic(). The group's ranks on one host talk
through shared memory, exactly as in a world of gradsync's own.

ReduceOps: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR on the dtypes reduce_ops.py lists
(PREMUL_SUM is NCCL-only in torch and refused here). CUDA tensors need the
"cpu:gradsync,cuda:nccl" backend string; they then go to an NCCL group on the same store.
"""

from __future__ import annotations

import functools
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from gradsync.group import join
from gradsync.group.world_info import World, release_group
from gradsync.observe import stall
from gradsync.c10d.adoption import BucketAdoption
from gradsync.c10d.arguments import SUM, as_real, check_complex_op, chosen_algorithm, op_name, routed
from gradsync.c10d.comm_thread import CommThread
from gradsync.c10d.work import TransferWork, run_eagerly
from gradsync.comm import world_transport
from gradsync.comm.agree import Fingerprint
from gradsync.comm.host_staging import Handoff
from gradsync.comm.collectives import (Place, agree_in, all_gather_in, all_reduce_in, broadcast_in, next_sequence,
                                       reduce_scatter_in)
from gradsync.comm.allreduce_tree import reduce_tree
from gradsync.comm.reduce_ops import dtype_name, reduction
from gradsync.comm.rooted import alltoall_pairwise, gather_linear, scatter_linear

P2P_TAG_OFFSET = 1
"""torch's tag t travels as tag t+1: tagged messages go over TCP (comm/transport/torch_distributed.py), tag 0 is the
collectives' own, so a program's sends never meet a collective's bytes."""


def _all_reduce_one(place: Place, tensors: list[torch.Tensor], op: str, algorithm: str) -> list[torch.Tensor]:
    all_reduce_in(place, tensors[0], op, algorithm)
    return tensors


def _adopt_and_all_reduce(adoption: BucketAdoption, seen: bool, place: Place, tensors: list[torch.Tensor], op: str,
                          algorithm: str) -> list[torch.Tensor]:
    adoption.run(tensors[0], seen)
    all_reduce_in(place, tensors[0], op, algorithm)
    return tensors


def create(options) -> "GradsyncProcessGroup":
    """Build the group torch asked for: this rank's World inside it, its transport, its thread."""
    rank, size = options.group_rank, options.group_size
    timeout = options.timeout.total_seconds()
    store = dist.PrefixStore("gradsync", options.store)
    name = str(options.group_id or "default")
    # the shared-memory segments' names carry the generation: one per group, the same on every rank
    world = join.world_on_store(store, rank, size, timeout, backend="gradsync",
                                generation=zlib.crc32(name.encode()) + (1 << 32),
                                group_key=f"c10d/{name}/{id(options)}")
    group = GradsyncProcessGroup(world, world_transport.build(world), options.store, name)
    if not dist.is_initialized():  # torch's default group: the stall inspector watches its collectives
        stall.start(world)
    return group


class GradsyncProcessGroup(dist.ProcessGroup):
    """See the module docstring; every method returns a torch Work at once."""

    def __init__(self, world: World, transport, torch_store, name: str = "") -> None:
        super().__init__(world.rank, world.world_size)
        self._group_name, self._group_desc = name, ""
        self.place = Place(world, transport)
        self._thread = CommThread(f"gradsync-c10d-r{world.rank}", world.timeout, world.rank)
        self._adoption = BucketAdoption(transport, world.world_size)
        self._torch_store = torch_store
        self._nccl = None
        self._side_streams: dict = {}   # device -> the stream its CUDA operations run on (Handoff)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "gradsync"

    # torch keeps a group's name and description on its C++ backends, which a Python group has
    # none of; DeviceMesh and the group registry read them back through these.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    @property
    def _world(self) -> World:
        return self.place.world

    # -- helpers ------------------------------------------------------------------------------
    def cuda_to_nccl(self) -> bool:
        """Whether this group's CUDA tensors go to NCCL (the backend string "cpu:gradsync,cuda:nccl");
        otherwise gradsync takes them itself, staged through host memory (comm/host_staging.py), as
        gloo does."""
        return "cuda:nccl" in str(dist.distributed_c10d._world.pg_backend_config.get(self, ""))

    def _nccl_group(self, what: str):
        if self._nccl is None:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timedelta(seconds=self.place.world.timeout)
            self._nccl = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self._torch_store), self.place.world.rank,
                                               self.place.world.world_size, options)
        return self._nccl

    def _run(self, what: str, tensors: list[torch.Tensor], operation, opts=None):
        """Queue ``operation`` (a closure over ``tensors``); the Work's value is ``tensors``. A
        synchronous call (torch's opts.asyncOp False) runs at once on the caller's thread when
        nothing is queued, and otherwise does not wake the communication thread: the caller waits
        at once and so runs the operation itself when its turn comes (work.py). CUDA tensors (staged
        through host memory, as gloo does) are ordered against the caller's stream as gloo orders
        them: an event on the caller's current stream now, the operation's kernels on a side stream
        that waits for it, and the caller's current stream waiting for them in wait() and in the
        Work's future (comm/host_staging.py, Handoff)."""
        for t in tensors:
            if t.is_sparse:
                raise RuntimeError(f"gradsync backend: {what} got a sparse tensor ({dtype_name(t.dtype)}); "
                                   f"sparse collectives are not supported, densify it first")

        def run():
            operation()
            return tensors
        if not getattr(opts, "asyncOp", True):
            done = self._thread.run_now(operation, tensors)
            if done is not None:
                return done
        return self._thread.submit(run, what, wake=getattr(opts, "asyncOp", True),
                                   handoff=Handoff.of(tensors, self._side_streams))

    def _fingerprint(self, kind: str, numel: int, dtype: torch.dtype, algorithm: str, root: int = 0,
                     op: str = "none") -> None:
        agree_in(self.place, Fingerprint(kind, next_sequence(self.place), numel, dtype, op, algorithm, root))

    # -- all-reduce ---------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        """See torch.distributed.all_reduce. One dense CPU tensor (what dist.all_reduce and DDP's
        buckets pass) takes a short way to the same operation: on a 4 KiB call the general one
        cost 14 us, a third of the call. SUM is recognised by one comparison: looking the op up
        in a dictionary hashes and compares torch's enum objects (1.3 us)."""
        tensor = tensors[0] if len(tensors) == 1 else None
        if tensor is None or tensor.is_cuda or tensor.is_sparse or tensor.is_complex():
            return self._allreduce_any(tensors, opts)
        if opts is None:
            op, asynchronous = "sum", True
        else:
            reduce_op, asynchronous = opts.reduceOp, opts.asyncOp
            op = "sum" if reduce_op == SUM else op_name(reduce_op)
        if not asynchronous:
            done = self._thread.run_now(all_reduce_in, tensors, self.place, tensor, op, chosen_algorithm())
            if done is not None:
                return done
            seen = None   # a synchronous call is never adopted, whether it ran at once or not
        else:
            seen = self._adoption.consider(tensor)
        if seen is not None:   # an adoption round first (adoption.py: torch DDP's buckets into shared memory)
            return self._thread.submit(functools.partial(_adopt_and_all_reduce, self._adoption, seen, self.place,
                                                         tensors, op, chosen_algorithm()), "allreduce", wake=True)
        return self._thread.submit(functools.partial(_all_reduce_one, self.place, tensors, op, chosen_algorithm()),
                                   "allreduce", wake=asynchronous)

    def _allreduce_any(self, tensors, opts=None):
        if any(t.is_cuda for t in tensors) and self.cuda_to_nccl():
            return self._nccl_group("allreduce").allreduce(tensors, opts)
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        if any(t.is_complex() for t in tensors):
            check_complex_op("allreduce", op)
            tensors = as_real(tensors)
        algorithm = chosen_algorithm()
        return self._run("allreduce", tensors,
                         lambda: [all_reduce_in(self.place, t, op, algorithm) for t in tensors], opts)

    @routed
    def allreduce_coalesced(self, tensors, opts=None):
        """See torch.distributed.all_reduce_coalesced: one all-reduce per dtype over the tensors
        flattened together."""
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        algorithm = chosen_algorithm()

        def run():
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for t in tensors:
                by_dtype.setdefault(t.dtype, []).append(t)
            for group in by_dtype.values():
                flat = torch.cat([t.reshape(-1) for t in group])
                all_reduce_in(self.place, flat, op, algorithm)
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        return self._run("allreduce_coalesced", tensors, run, opts)

    @routed
    def reduce(self, tensors, opts):
        """See torch.distributed.reduce: a binomial tree onto the root (comm/allreduce_tree.py) on a
        copy; only the root's tensor changes."""
        op, root = op_name(opts.reduceOp), opts.rootRank

        def run():
            for t in tensors:
                work = t.detach().reshape(-1).clone()
                self._fingerprint("reduce", work.numel(), work.dtype, "tree", root, op)
                reduce_tree(work, root, self.place.transport, reduction=reduction(op, work.dtype, "reduce"))
                if self.place.world.rank == root:
                    t.copy_(work.view_as(t))
        return self._run("reduce", tensors, run, opts)

    # -- broadcast, gathers, scatters -----------------------------------------------------------
    @routed
    def broadcast(self, tensors, opts):
        """See torch.distributed.broadcast."""
        return self._run("broadcast", tensors,
                         lambda: [broadcast_in(self.place, t, opts.rootRank) for t in tensors], opts)

    @routed
    def allgather(self, output_tensors, input_tensors, opts=None):
        """See torch.distributed.all_gather: output_tensors[0][r] <- rank r's input_tensors[0]."""
        def run():
            for outputs, tensor in zip(output_tensors, input_tensors):
                full = all_gather_in(self.place, tensor)
                offset = 0
                for out in outputs:
                    out.copy_(full[offset:offset + out.numel()].view_as(out))
                    offset += out.numel()
        flat = [t for outputs in output_tensors for t in outputs]
        return self._run("allgather", flat + list(input_tensors), run, opts)

    @routed
    def _allgather_base(self, output, input, opts=None):
        """See torch.distributed.all_gather_into_tensor."""
        return self._run("_allgather_base", [output, input],
                         lambda: output.copy_(all_gather_in(self.place, input).view_as(output)), opts)

    @routed
    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """See torch.distributed.all_gather_into_tensor, for several pairs in one call."""
        return self._run("allgather_into_tensor_coalesced", list(outputs) + list(inputs),
                         lambda: [out.copy_(all_gather_in(self.place, inp).view_as(out))
                                  for out, inp in zip(outputs, inputs)], opts)

    @routed
    def _reduce_scatter_base(self, output, input, opts=None):
        """See torch.distributed.reduce_scatter_tensor: input holds N equal pieces, output one."""
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self._check_pieces("reduce_scatter_tensor", input.numel(), output.numel())
        return self._run("_reduce_scatter_base", [output, input],
                         lambda: output.copy_(reduce_scatter_in(self.place, input, op).view_as(output)), opts)

    @routed
    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """See torch.distributed.reduce_scatter: output_tensors[0] <- reduction of every rank's
        input_tensors[0][rank]."""
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)

        def run():
            for output, pieces in zip(output_tensors, input_tensors):
                for piece in pieces:
                    self._check_pieces("reduce_scatter", piece.numel() * len(pieces), output.numel())
                flat = torch.cat([piece.reshape(-1) for piece in pieces])
                output.copy_(reduce_scatter_in(self.place, flat, op).view_as(output))
        flat = [t for pieces in input_tensors for t in pieces]
        return self._run("reduce_scatter", list(output_tensors) + flat, run, opts)

    @routed
    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """See torch.distributed.reduce_scatter_tensor, for several pairs in one call."""
        op = op_name(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for out, inp in zip(outputs, inputs):
            self._check_pieces("reduce_scatter_tensor", inp.numel(), out.numel())
        return self._run("reduce_scatter_tensor_coalesced", list(outputs) + list(inputs),
                         lambda: [out.copy_(reduce_scatter_in(self.place, inp, op).view_as(out))
                                  for out, inp in zip(outputs, inputs)], opts)

    @routed
    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """See torch.distributed.all_gather_coalesced: output_lists[r][j] <- rank r's
        input_tensors[j]. One all-gather per dtype over the inputs flattened together: rank r's
        piece of the gathered buffer is its inputs back to back."""
        def run():
            by_dtype: dict[torch.dtype, list[int]] = {}
            for j, t in enumerate(input_tensors):
                by_dtype.setdefault(t.dtype, []).append(j)
            for indices in by_dtype.values():
                flat = torch.cat([input_tensors[j].reshape(-1) for j in indices])
                full = all_gather_in(self.place, flat)
                for r, outputs in enumerate(output_lists):
                    offset = r * flat.numel()
                    for j in indices:
                        out = outputs[j]
                        out.copy_(full[offset:offset + out.numel()].view_as(out))
                        offset += out.numel()
        self._check_coalesced_outputs(output_lists, input_tensors)
        flat_outputs = [t for outputs in output_lists for t in outputs]
        return self._run("allgather_coalesced", flat_outputs + list(input_tensors), run, opts)

    def _check_coalesced_outputs(self, output_lists, input_tensors) -> None:
        n_ranks = self.place.world.world_size
        if len(output_lists) != n_ranks or any(len(outputs) != len(input_tensors) for outputs in output_lists):
            raise ValueError(f"gradsync backend: all_gather_coalesced needs world_size={n_ranks} output lists of "
                             f"{len(input_tensors)} tensors (one per input), got "
                             f"{[len(outputs) for outputs in output_lists]}")
        for outputs in output_lists:
            for out, t in zip(outputs, input_tensors):
                if out.numel() != t.numel() or out.dtype != t.dtype:
                    raise ValueError(f"gradsync backend: all_gather_coalesced output of {out.numel()} "
                                     f"{dtype_name(out.dtype)} elements for an input of {t.numel()} "
                                     f"{dtype_name(t.dtype)} elements; they must match")

    @routed
    def alltoall(self, output_tensors, input_tensors, opts=None):
        """See torch.distributed.all_to_all: output_tensors[r] <- rank r's input_tensors[this rank]."""
        def run():
            self._fingerprint("all_to_all", 0, input_tensors[0].dtype, "pairwise")
            received = [t if t.is_contiguous() else t.contiguous() for t in output_tensors]
            alltoall_pairwise(received, [t.contiguous() for t in input_tensors], self.place.transport)
            for out, got in zip(output_tensors, received):
                if out is not got:
                    out.copy_(got)
        return self._run("alltoall", list(output_tensors) + list(input_tensors), run, opts)

    # torch 2.13's Python API calls these names; its C++ callers (DDP, FSDP) the older ones above
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced
    reduce_scatter_single = _reduce_scatter_base
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _check_pieces(self, what: str, total: int, piece: int) -> None:
        if total != piece * self.place.world.world_size:
            raise ValueError(f"gradsync backend: {what} needs the input to hold world_size="
                             f"{self.place.world.world_size} pieces of the output's {piece} elements, got {total}")

    @routed
    def gather(self, output_tensors, input_tensors, opts):
        """See torch.distributed.gather: the root's output_tensors[0][r] <- rank r's input."""
        root, w = opts.rootRank, self.place.world

        def run():
            piece = input_tensors[0].contiguous()
            self._fingerprint("gather", piece.numel(), piece.dtype, "linear", root)
            outputs = output_tensors[0] if w.rank == root else None
            staging = [o if o.is_contiguous() else o.contiguous() for o in outputs] if outputs else None
            gather_linear(piece, staging, root, self.place.transport)
            if outputs:
                for o, s in zip(outputs, staging):
                    if o is not s:
                        o.copy_(s)
        return self._run("gather", [t for ts in output_tensors for t in ts] + list(input_tensors), run, opts)

    @routed
    def scatter(self, output_tensors, input_tensors, opts):
        """See torch.distributed.scatter: output_tensors[0] <- the root's input_tensors[0][rank]."""
        root, w = opts.rootRank, self.place.world

        def run():
            out = output_tensors[0]
            target = out if out.is_contiguous() else out.contiguous()
            self._fingerprint("scatter", target.numel(), target.dtype, "linear", root)
            pieces = [p.contiguous() for p in input_tensors[0]] if w.rank == root else None
            scatter_linear(target, pieces, root, self.place.transport)
            if target is not out:
                out.copy_(target)
        return self._run("scatter", list(output_tensors) + [t for ts in input_tensors for t in ts], run, opts)

    @routed
    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """See torch.distributed.all_to_all_single (splits along dim 0; empty lists: equal splits)."""
        n_ranks = self.place.world.world_size

        def splits(tensor, sizes):
            rows = list(sizes) if len(sizes) else [tensor.shape[0] // n_ranks] * n_ranks
            if len(rows) != n_ranks or sum(rows) != tensor.shape[0]:
                raise ValueError(f"gradsync backend: all_to_all_single split sizes {rows} do not cover the "
                                 f"{tensor.shape[0]} rows of a tensor in {n_ranks} parts")
            return [piece.contiguous() for piece in torch.split(tensor, rows)]

        def run():
            self._fingerprint("all_to_all", 0, input.dtype, "pairwise")
            received = splits(output, output_split_sizes)
            alltoall_pairwise(received, splits(input, input_split_sizes), self.place.transport)
            output.copy_(torch.cat(received).view_as(output))
        return self._run("alltoall_base", [output, input], run, opts)

    all_to_all_single = alltoall_base

    def barrier(self, opts=None):
        """See torch.distributed.barrier: a one-element all-reduce."""
        return self._run("barrier", [], lambda: all_reduce_in(self.place, torch.zeros(1), "sum", "auto"), opts)

    # -- point-to-point -------------------------------------------------------------------------
    @routed
    def send(self, tensors, dst, tag):
        """See torch.distributed.send (posted at once; the Work completes when the bytes are gone)."""
        handles = [self.place.transport.isend(t.contiguous(), dst, "p2p/send", tag=tag + P2P_TAG_OFFSET)
                   for t in tensors]
        return TransferWork(handles, tensors)

    @routed
    def recv(self, tensors, src, tag):
        """See torch.distributed.recv."""
        return self._receive(tensors, src, tag)

    @routed
    def recv_anysource(self, tensors, tag):
        """See torch.distributed.recv with src=None; work._source_rank() names the sender."""
        return self._receive(tensors, None, tag)

    def _receive(self, tensors, src, tag):
        for t in tensors:
            if not t.is_contiguous():
                raise ValueError("gradsync backend: recv needs a contiguous tensor")
        handles = [self.place.transport.irecv(t, src, "p2p/recv", tag=tag + P2P_TAG_OFFSET) for t in tensors]
        return TransferWork(handles, tensors)

    def shutdown(self) -> None:
        """Stop the thread and close the transport (torch calls it when the group is destroyed)."""
        self._thread.close()
        self.place.transport.close()
        release_group(self.place.world.group_key)


run_eagerly(GradsyncProcessGroup, (
    "allreduce", "allreduce_coalesced", "reduce", "broadcast", "allgather", "_allgather_base",
    "allgather_into_tensor_coalesced", "_reduce_scatter_base", "reduce_scatter", "reduce_scatter_tensor_coalesced",
    "allgather_coalesced", "alltoall", "all_gather_single", "all_gather_single_coalesced", "reduce_scatter_single",
    "reduce_scatter_single_coalesced", "gather", "scatter", "alltoall_base", "all_to_all_single", "barrier", "send",
    "recv", "recv_anysource"))
