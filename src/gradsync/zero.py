"""ShardedOptimizer: ZeRO stage 1. Each rank keeps optimizer state for only 1/N of the parameters.

    opt = gs.ShardedOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    loss.backward()          # plain local backward: no DDP wrapper, ShardedOptimizer reduces
    opt.clip_grad_norm_(1.0) # optional: reduce-scatter grads, clip by the averaged gradient's norm
    opt.step()               # reduce-scatter grads (unless clip did) -> update own shard -> all-gather params
    opt.zero_grad()

Vocabulary
    N       ranks;  bucket  a flat buffer of consecutive parameters (in parameter order, up to
            ``bucket_cap_mb``);  n  elements of one bucket
    shard   rank r's slice of a bucket: ring_chunks(n, N) (allreduce_ring.py): the first n mod N
            ranks own ceil(n/N) elements, the others floor(n/N). An exact element partition, so
            shards of one bucket differ by at most one element.

One step, per bucket (Rajbhandari et al., "ZeRO", SC 2020):
    1. reduce-scatter  the bucket's gradients, averaged: rank r receives the mean gradient of its shard
    2. update          the wrapped optimizer steps over this rank's shards only
    3. all-gather      the updated shards, so every rank again holds every parameter
Traffic: reduce-scatter (N-1)/N*M + all-gather (N-1)/N*M = 2(N-1)/N*M bytes per rank, exactly what
one ring all-reduce sends (across hosts, the ring; on one host the shared-memory reduce-scatter and
all-gather move as much, M - s_r + (N-1) s_r for chunk s_r, with no forwarding). Memory: optimizer state (Adam: m and v, 8 bytes per fp32 parameter)
is 1/N of the unsharded state on every rank; ``state_bytes()`` measures it.

Gradients: a bucket's gradients live in one flat buffer, in shared memory when every rank is on this
host over shared memory (collectives.shared_allocator), so the reduce-scatter reads the other ranks'
chunks where they lie (comm/reduce_scatter_in_place.py). step() copies each new gradient in once and makes
.grad a view of the buffer: after zero_grad(set_to_none=False) backward accumulates into the buffer
and nothing is copied. On one host the parameters, too, are views of a flat shared buffer per bucket
(their .data is replaced at construction) and this rank's shard is its chunk of that buffer: the
wrapped optimizer updates the parameters where they lie, and the all-gather copies the other ranks'
shards straight into them (comm/all_gather_in_place.py).

Clipping: ``clip_grad_norm_(max_norm, norm_type=2.0)`` is torch.nn.utils.clip_grad_norm_ on the
averaged gradient, what torch DDP + ZeroRedundancyOptimizer + torch's clip_grad_norm_ compute. Call it
after the step's last backward and before step(), on every rank. It does the step's reduce-scatter
(step() then uses those shards: the gradients are reduced once per step), takes this rank's power sum
over its shards, sum_i |g_i|^p (max |g_i| for inf), and combines the ranks' sums in one all-reduce of
one float64 scalar (8 bytes of payload per rank, on top of the 2(N-1)/N*M); the total norm
(clip.py) gives one coefficient, min(1, max_norm / (norm + 1e-6)), applied to every shard on every
rank. Afterwards .grad still holds this rank's local, unclipped gradient: the averaged, clipped one
lives in the shards. Until step() or clip_grad_norm_, .grad is local, so torch.nn.utils.clip_grad_norm_
(or clip_grad_value_) called there would clip each rank's own gradient by its own norm: a silently
different update. A gradient changed in place after backward therefore draws a warning at the
reduction (grad_watch.py; a linear change such as dividing by a constant is harmless), and a
gradient changed after clip_grad_norm_ reduced it (another backward, an in-place change, a
zero_grad of the model) makes step() raise, since the change would be ignored.

Checkpoints: ``state_dict()`` gathers the whole state onto rank 0 in the layout of the wrapped
optimizer's own state_dict (per parameter, parameter order), so a plain torch optimizer can load it;
other ranks get None. ``load_state_dict(full)`` takes that full dict on every rank and keeps this
rank's slices, whatever the number of ranks that saved it.

Element-wise optimizers (SGD with momentum, Adam, AdamW) give exactly the unsharded result; an
optimizer that looks across a whole tensor (a per-tensor norm, as LAMB does) would not.

Uneven inputs: the optimizer is torch's Joinable, as torch's ZeroRedundancyOptimizer is, so
``with torch.distributed.algorithms.join.Join([opt])`` (or ``Join([model, opt])`` with gradsync's
DistributedDataParallel as ``model``) lets ranks run out of batches at different steps. A rank
that has joined takes part in each step of the others (``_JoinHook.main_hook``): it contributes the
gradients written since its last step, which a DistributedDataParallel joined before it leaves
there (the others' average), and zeros otherwise (no batch, no gradient), then updates its shards
and all-gathers like them. When the others clip first (clip_grad_norm_), each of their calls and
step() is announced by an all-reduce of four numbers (``_announce``), so the joined rank clips with
the same arguments, the same global norm and coefficient, before it steps. The reduce-scatter divides by N, every rank counted. The result is
torch's DDP + Join with the unsharded optimizer (tests/test_ddp_torch_api.py). torch's own
ZeroRedundancyOptimizer under Join differs from that: its joined rank steps its shard with the
gradient left over from its own last step (19% relative on the test's case, 3 ranks).
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradsync import clip
from gradsync.group import runtime
from gradsync.comm.allreduce_ring import Chunks, ring_chunks
from gradsync.comm.collectives import all_gather, all_gather_in_place, all_reduce, reduce_scatter, shared_allocator
from gradsync.observe.grad_watch import GradientWatch
from gradsync.replicas import broadcast_coalesced

DEFAULT_BUCKET_CAP_MB = 25.0

_CLIP, _STEP = 1.0, 2.0
"""Under Join, what the ranks still training call next (ShardedOptimizer._announce)."""


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    chunks: Chunks                 # the N-way partition of the bucket's n elements
    shard: nn.Parameter            # this rank's slice, what the wrapped optimizer updates (a view of values)
    grads: torch.Tensor            # the bucket's gradients, flat; each parameter's .grad is a view of it
    values: torch.Tensor | None    # on one host: the parameters, flat in a shared region (each .data a view)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class _Reduced:
    """What the step's reduction left (clip_grad_norm_ reduces before step()), so step() can tell
    whether the gradients changed since."""
    versions: list[int]            # per bucket: its flat gradient buffer's version counter
    had_grad: list[bool]           # per parameter: whether it had a .grad (now a view of its bucket's buffer)


class LocalGradientWarning(UserWarning):
    """A gradient was changed in place while it held only this rank's local gradient (see zero.py)."""


def _build_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters of one dtype, up to ``cap_bytes`` per bucket (a larger one alone)."""
    buckets: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        if buckets and buckets[-1][0].dtype == p.dtype and size + nbytes <= cap_bytes:
            buckets[-1].append(p)
            size += nbytes
        else:
            buckets.append([p])
            size = nbytes
    return buckets


def _views(flat: torch.Tensor, params: list[nn.Parameter]):
    """(p, p's part of ``flat`` shaped like p) for each parameter, the parts back to back."""
    offset = 0
    for p in params:
        yield p, flat.narrow(0, offset, p.numel()).view_as(p)
        offset += p.numel()


class _JoinHook(JoinHook):
    """A joined rank's part in the others' steps (see the module docstring)."""

    def __init__(self, optimizer: "ShardedOptimizer") -> None:
        self.optimizer = optimizer
        super().__init__()

    def main_hook(self) -> None:
        opt = self.optimizer
        for p in opt.params:
            if p.grad is not None and opt._gradient_marks.get(id(p)) == (p.grad.data_ptr(), p.grad._version):
                p.grad = None   # the gradient of its own last step: nothing new, so zeros
        while True:   # the others' clip_grad_norm_ calls of this step, if any, then their step()
            kind, max_norm, norm_type, error_if_nonfinite = opt._announce(None)
            if kind == _STEP:
                opt._step()
                return
            opt._clip(max_norm, norm_type, error_if_nonfinite)


class ShardedOptimizer(Joinable):
    """See the module docstring. ``defaults`` go to ``optimizer_class``; ``bucket_cap_mb`` sets the bucket size."""

    def __init__(self, params, optimizer_class: type, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, **defaults):
        super().__init__()
        params = list(params)
        if any(isinstance(p, dict) for p in params):
            raise TypeError("ShardedOptimizer takes an iterable of parameters, not parameter groups; "
                            "set per-group options on .param_groups after construction")
        if not params or not all(isinstance(p, torch.Tensor) for p in params):
            raise ValueError("ShardedOptimizer needs a non-empty iterable of tensors (e.g. model.parameters())")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.Adam, "
                            f"got {optimizer_class!r}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        if any(not p.is_floating_point() for p in params):
            raise TypeError("ShardedOptimizer needs floating-point parameters")
        self.world = runtime.world()
        self.params = [p for p in params if p.requires_grad]
        broadcast_coalesced(self.params)   # replicas must start equal; rank 0's values win
        rank, n_ranks = self.world.rank, self.world.world_size
        allocate = None if any(p.is_cuda for p in self.params) else shared_allocator(self.world)
        self.buckets: list[_Bucket] = []
        for group in _build_buckets(self.params, int(bucket_cap_mb * (1 << 20))):
            numel = sum(p.numel() for p in group)
            chunks = ring_chunks(numel, n_ranks)
            flat = torch.cat([p.detach().reshape(-1) for p in group])
            grads = allocate(numel, flat.dtype) if allocate is not None else None
            if grads is None:   # not every rank on this host over shared memory, or /dev/shm is full
                grads = torch.zeros(numel, dtype=flat.dtype, device=flat.device)
            values = allocate(numel, flat.dtype) if allocate is not None else None
            if values is not None:   # the shard is this rank's chunk of them: updated where it lies
                values.copy_(flat)
                shard = nn.Parameter(chunks.view(values, rank))
            else:
                shard = nn.Parameter(chunks.view(flat, rank).clone())
            self.buckets.append(_Bucket(group, chunks, shard, grads, values))
            self._point_into_values(self.buckets[-1])
        self.optimizer = optimizer_class([b.shard for b in self.buckets], **defaults)
        self.last_comm_seconds = 0.0
        self._watch = GradientWatch(self.params)
        self._reduced: _Reduced | None = None   # this step's gradients are in the shards (clip_grad_norm_ ran)
        self._reduce_seconds = 0.0
        self._gradient_marks: dict[int, tuple[int, int]] = {}   # .grad (pointer, version) after the last step
        self._notified = False   # this step's Join round has begun (clip_grad_norm_ came first)

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's groups (set ``lr`` here for schedules)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._reduced = None   # a reduction not yet stepped is dropped with the gradients
        self._watch.forget()
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @staticmethod
    def _point_into_values(bucket: _Bucket) -> None:
        """Make every parameter's .data its view of the bucket's shared values, first copying in the
        values of one whose .data was replaced since (e.g. ``p.data = ...``; an in-place change, as
        model.load_state_dict() makes, is already there)."""
        if bucket.values is None:
            return
        for p, view in _views(bucket.values, bucket.params):
            if p.data_ptr() != view.data_ptr():
                if p.dtype != view.dtype or p.device != view.device:
                    raise RuntimeError(f"ShardedOptimizer: a parameter became {p.dtype} on {p.device} after "
                                       f"construction, where it was {view.dtype} on {view.device}; build the "
                                       f"optimizer after moving or casting the model")
                view.copy_(p.detach())
                p.data = view

    def _refresh_shard(self, bucket: _Bucket) -> None:
        """Copy this rank's slice of the parameters into the shard: the parameters are the truth, as for a
        torch optimizer, so a model.load_state_dict() between steps is honoured. (With shared values
        the shard is that slice: only a parameter given new .data is copied in.)"""
        if bucket.values is not None:
            self._point_into_values(bucket)
            return
        start = bucket.chunks.offsets[self.world.rank]
        end = start + bucket.shard.numel()
        offset = 0
        for p in bucket.params:
            lo, hi = max(start, offset), min(end, offset + p.numel())
            if lo < hi:
                bucket.shard.data[lo - start:hi - start].copy_(p.detach().reshape(-1)[lo - offset:hi - offset])
            offset += p.numel()

    @staticmethod
    def _collect_grads(bucket: _Bucket) -> None:
        """Bring every parameter's gradient into the bucket's flat buffer and make its .grad a view of
        it; a missing gradient counts as zeros (and .grad stays None). A gradient that is already the
        view (the last step made it one, and zero_grad(set_to_none=False) kept it) is not copied."""
        for p, view in _views(bucket.grads, bucket.params):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
                p.grad = view

    def _reduce(self) -> None:
        """The step's reduce-scatter: every bucket's averaged gradient, this rank's shard of it, into
        bucket.shard.grad. Warns first when a gradient was changed after backward (module docstring)."""
        changed = self._watch.changed()
        if changed:
            param = self.params[changed[0]]
            warnings.warn(
                f"ShardedOptimizer: the gradient of {len(changed)} parameter(s) (the first: #{changed[0]}, shape "
                f"{tuple(param.shape)}) was changed in place after backward, while .grad held this rank's local "
                f"gradient (the average across ranks is taken in step() or opt.clip_grad_norm_). "
                f"torch.nn.utils.clip_grad_norm_ or clip_grad_value_ there clip each rank's own gradient, not the "
                f"average: call opt.clip_grad_norm_(max_norm) after backward instead. A linear change (dividing by "
                f"a constant) gives the same average and is safe to silence.", LocalGradientWarning,
                stacklevel=5)   # the caller of step() or clip_grad_norm_ (each wrapped by torch.no_grad)
        started = time.perf_counter()
        for bucket in self.buckets:
            self._collect_grads(bucket)
            bucket.shard.grad = reduce_scatter(bucket.grads, op="avg")
        self._reduce_seconds = time.perf_counter() - started
        self._watch.forget()
        self._reduced = _Reduced([bucket.grads._version for bucket in self.buckets],
                                 [p.grad is not None for p in self.params])

    def _reduce_once(self) -> None:
        """Reduce this step's gradients, or check that those already reduced are still what was reduced."""
        if self._reduced is None:
            self._reduce()
        else:
            self._check_unchanged_since_reduce(self._reduced)

    def _check_unchanged_since_reduce(self, reduced: _Reduced) -> None:
        """RuntimeError when a gradient changed after clip_grad_norm_ reduced it: step() would ignore it."""
        index = 0
        for bucket, version in zip(self.buckets, reduced.versions):
            for p, view in _views(bucket.grads, bucket.params):
                moved = (p.grad is not None) != reduced.had_grad[index] or (
                    p.grad is not None and p.grad.data_ptr() != view.data_ptr())
                if moved or bucket.grads._version != version:
                    raise RuntimeError(
                        f"ShardedOptimizer: the gradients changed after clip_grad_norm_ reduced them (parameter "
                        f"#{index}, shape {tuple(p.shape)}: another backward, an in-place change to .grad, or "
                        f".grad replaced or set to None). step() applies the gradients as clip_grad_norm_ "
                        f"reduced and clipped them, so the change would be ignored. Call clip_grad_norm_ after "
                        f"the step's last backward, just before step(); opt.zero_grad() starts the step over")
                index += 1

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip the averaged gradient by its total norm, as torch.nn.utils.clip_grad_norm_ would on one
        process (or on torch DDP's averaged .grad); returns that norm, taken before clipping, in the
        gradients' dtype.

        Where: after the step's last backward (after all gradient accumulation), before step(), on
        every rank (it is collective). Not torch.nn.utils.clip_grad_norm_(model.parameters(), ...):
        before step() .grad holds only this rank's gradient.

        It performs the step's reduce-scatter, which step() then reuses, plus one all-reduce of one
        float64 scalar (this rank's power sum; "max" for inf); see the module docstring and clip.py.
        ``norm_type``: any p > 0 or inf; ``error_if_nonfinite``: raise, as torch does, when the norm is
        nan or inf (every rank raises: the norm is the same everywhere)."""
        max_norm, p = clip.check_arguments(max_norm, norm_type)
        self._notify_join_once()
        self._announce((_CLIP, max_norm, p, error_if_nonfinite))
        return self._clip(max_norm, p, error_if_nonfinite)

    def _clip(self, max_norm: float, p: float, error_if_nonfinite: bool) -> torch.Tensor:
        self._reduce_once()
        started = time.perf_counter()
        shard_grads = [bucket.shard.grad for bucket in self.buckets]
        combined = clip.power_sum(shard_grads, p).reshape(1)
        all_reduce(combined, op=clip.combine_op(p))
        self._reduce_seconds += time.perf_counter() - started
        dtype = functools.reduce(torch.promote_types, [g.dtype for g in shard_grads])
        norm = clip.total_norm(combined[0], p, dtype, error_if_nonfinite)
        scale = clip.coefficient(norm, max_norm)
        for grad in shard_grads:
            grad.mul_(scale.to(grad.device))
        return norm

    def step(self) -> None:
        """Reduce-scatter gradients (unless clip_grad_norm_ did), update this rank's shards, all-gather
        the parameters."""
        self._notify_join_once()
        self._announce((_STEP, 0.0, 0.0, False))
        self._notified = False
        self._step()

    def _notify_join_once(self) -> None:
        """One Join round per step, clip_grad_norm_'s calls and step() together: a joined rank's
        main_hook takes part in all of them (_announce)."""
        if not self._notified:
            Join.notify_join_context(self)
            self._notified = True

    def _announce(self, call: tuple | None) -> tuple[float, float, float, bool]:
        """Under Join, every rank learns what the ranks still training call next, so that a joined
        rank (``call`` None) takes part in the same collectives: clip_grad_norm_ with its arguments,
        or step(). One all-reduce (max) of four numbers; nothing outside a Join context."""
        if call is None:
            vote = torch.zeros(4, dtype=torch.float64)
        elif self._join_config.enable:
            vote = torch.tensor([call[0], call[1], call[2], float(call[3])], dtype=torch.float64)
        else:
            return call
        all_reduce(vote, op="max")
        kind, max_norm, norm_type, error_if_nonfinite = vote.tolist()
        return kind, max_norm, norm_type, bool(error_if_nonfinite)

    @torch.no_grad()
    def _step(self) -> None:
        self._reduce_once()
        self._reduced = None
        for bucket in self.buckets:
            self._refresh_shard(bucket)
        self.optimizer.step()
        started = time.perf_counter()
        for bucket in self.buckets:
            bucket.shard.grad = None
            if bucket.values is not None:   # the update is already in place; the others' shards follow
                all_gather_in_place(bucket.values)
                continue
            for p, gathered in _views(all_gather(bucket.shard.detach()), bucket.params):
                p.copy_(gathered)
        self.last_comm_seconds = self._reduce_seconds + time.perf_counter() - started
        self._gradient_marks = {id(p): (p.grad.data_ptr(), p.grad._version) for p in self.params if p.grad is not None}

    # -- uneven inputs (torch's Joinable) --------------------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        return _JoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.params[0].device

    @property
    def join_process_group(self):
        return dist.distributed_c10d._get_default_group()

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held by this rank (the quantity ZeRO-1 divides by N)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)

    # -- checkpoints -------------------------------------------------------------------------------
    def _sharded_keys(self, bucket: _Bucket) -> list[str]:
        state = self.optimizer.state.get(bucket.shard, {})
        return sorted(k for k, v in state.items() if isinstance(v, torch.Tensor) and v.dim() > 0)

    def state_dict(self) -> dict | None:
        """The full, unsharded state on rank 0 (torch optimizer layout, one entry per parameter); None elsewhere."""
        full_state: dict[int, dict] = {}
        index = 0
        for bucket in self.buckets:
            own = self.optimizer.state.get(bucket.shard, {})
            gathered = {key: all_gather(own[key].detach()) for key in self._sharded_keys(bucket)}
            scalars = {k: v for k, v in own.items() if k not in gathered}
            offset = 0
            for p in bucket.params:
                if own:
                    full_state[index] = {**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                            for k, v in scalars.items()},
                                         **{k: g[offset:offset + p.numel()].view_as(p).clone()
                                            for k, g in gathered.items()}}
                offset += p.numel()
                index += 1
        if self.world.rank != 0:
            return None
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": list(range(len(self.params)))}
                  for g in self.optimizer.param_groups]
        return {"state": full_state, "param_groups": groups}

    def load_state_dict(self, full: dict) -> None:
        """Keep this rank's slices of a full state (as state_dict() returns; any world size saved it)."""
        if not isinstance(full, dict) or "state" not in full or "param_groups" not in full:
            raise ValueError("load_state_dict needs the full dict that state_dict() returned on rank 0 "
                             "(keys 'state' and 'param_groups'), on every rank")
        if len(full["param_groups"]) != 1:
            raise ValueError(f"expected one parameter group, the checkpoint has {len(full['param_groups'])}")
        saved_params = len(full["param_groups"][0]["params"])
        if saved_params != len(self.params):
            raise ValueError(f"the checkpoint holds optimizer state for {saved_params} parameters, this model "
                             f"has {len(self.params)}")
        rank = self.world.rank
        state: dict[int, dict] = {}
        index = 0
        for position, bucket in enumerate(self.buckets):
            entries = [full["state"].get(index + i, full["state"].get(str(index + i))) for i in range(len(bucket.params))]
            index += len(bucket.params)
            if all(e is None for e in entries):
                continue
            if any(e is None for e in entries):
                raise ValueError("the checkpoint has optimizer state for only some parameters of a bucket")
            keys = [k for k, v in entries[0].items() if isinstance(v, torch.Tensor) and v.dim() > 0]
            # clone: Adam increments its "step" tensor in place, and shards must not share one
            shard_state = {k: v.clone() if isinstance(v, torch.Tensor) else v
                           for k, v in entries[0].items() if k not in keys}
            for key in keys:
                flat = torch.cat([e[key].reshape(-1) for e in entries])
                shard_state[key] = bucket.chunks.view(flat, rank).clone()
            state[position] = shard_state
        groups = [{**{k: v for k, v in full["param_groups"][0].items() if k != "params"},
                   "params": list(range(len(self.buckets)))}]
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
