"""DistributedDataParallel: wrap a module so every rank applies the same averaged gradient.

    model = gs.DistributedDataParallel(module, bucket_cap_mb=25, algorithm="auto",
                                       find_unused_parameters=False, broadcast_buffers=True,
                                       comm_hook=None)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

It speaks torch DDP's training API, so a program changes only the class name:
    constructor     torch DDP's keyword arguments (ddp/torch_arguments.py says what each means)
    register_comm_hook(state, hook)
                    torch's contract, torch's own hooks included (ddp/hooks.py, grad_bucket.py)
    no_sync()       accumulate locally
    join(), Join    uneven inputs: torch's Joinable (ddp/uneven_inputs.py)
In a program that set up torch.distributed itself the wrapper joins that world (runtime.world()).

Construction, as a recipe
    verify_same_model     every replica lists the same parameters (name, shape, dtype) in the same
                          order; otherwise a clear error naming the rank and the first difference
    broadcast_state       the first replica's parameters and buffers overwrite everyone else's
    build_buckets         reverse order, ``bucket_cap_mb`` cap, 1 MiB first bucket (ddp/buckets.py);
                          in shared memory when every rank is on this host (zero-copy all-reduce);
                          rebuilt once in the order gradients became ready in the first backward
    attach_reducer        post-accumulate-grad hooks, reduction on a communication thread
                          (ddp/reducer.py)

Each forward: with ``broadcast_buffers`` the first replica's buffers (BatchNorm running statistics)
are broadcast first, as torch DDP does. ``comm_hook``: None (average), "fp16", "bf16" or "powersgd":
gradsync's built-in hooks (ddp/hooks.py, ddp/powersgd.py at rank 2), which go through the same
mechanism as register_comm_hook. A
callable there is refused: hooks of one's own are registered with register_comm_hook.

torch.compile: both ``torch.compile(DistributedDataParallel(m))`` and
``DistributedDataParallel(torch.compile(m))`` work; the wrapper's own steps before and after the
module (collectives, bookkeeping) are left out of the compiled graph.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

from gradsync.observe import trace
from gradsync.comm.collectives import ALGORITHMS, shared_allocator
from gradsync.ddp import hooks, torch_arguments
from gradsync.ddp.buckets import default_limits
from gradsync.ddp.replica_group import ReplicaGroup
from gradsync.ddp.mixed_precision import MixedPrecisionCasts
from gradsync.ddp.powersgd import PowerSGDState, powersgd_hook
from gradsync.ddp.reducer import Reducer
from gradsync.ddp.uneven_inputs import DDPJoinHook, common_rank, vote
from gradsync.replicas import ReplicaMismatchError, broadcast_coalesced, first_mismatch, verify_same_model

__all__ = ["DistributedDataParallel", "ReplicaMismatchError"]

_OWN_HOOKS = (hooks.allreduce_average, hooks.fp16_compress, hooks.bf16_compress, hooks.reduce_in_dtype,
              powersgd_hook)


class DistributedDataParallel(nn.Module, Joinable):
    """Data-parallel wrapper; see the module docstring."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25, algorithm: str = "auto",
                 find_unused_parameters: bool = False, broadcast_buffers: bool | None = True, comm_hook=None, *,
                 device_ids=None, output_device=None, dim: int = 0, process_group=None,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, init_sync: bool = True,
                 check_reduction: bool = False, mixed_precision=None, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None,
                 **unsupported) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
        unknown = sorted(set(unsupported) - set(torch_arguments.UNSUPPORTED))
        if unknown:
            raise TypeError(f"DistributedDataParallel got unexpected keyword arguments {', '.join(unknown)}")
        if bucket_cap_mb is None:  # torch's default
            bucket_cap_mb = 25
        if not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
        hook = hooks.builtin(comm_hook)
        torch_arguments.check(module, device_ids=device_ids, output_device=output_device, unsupported=unsupported)
        self.module = module
        self.group = ReplicaGroup.of(process_group)
        self.world = self.group.world
        self.process_group = self.group.torch_group
        self.device = torch_arguments.module_device(module)
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = bool(forward_sync_buffers if forward_sync_buffers is not None
                                      else broadcast_buffers if broadcast_buffers is not None else True)
        self.require_backward_grad_sync = True
        self._divide_by_initial_world_size = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel needs a module with at least one parameter that requires grad")
        self._param_names = [n for n, _ in named]
        if init_sync:
            self._verify_same_model()
            self._broadcast_state(src=0, buffers=True)
        self.precision = None
        state = hooks.ReduceState(self.group, algorithm)
        if hook is powersgd_hook:
            state = PowerSGDState(group=self.group, algorithm=algorithm)
            state.check_rank_fits([p for _, p in named])
        if mixed_precision is not None:
            if hook is not hooks.allreduce_average:
                raise RuntimeError(f"DistributedDataParallel: mixed_precision reduces through its own hook, so "
                                   f"comm_hook={comm_hook!r} cannot be added (torch's DDP refuses a second hook too)")
            self.precision = MixedPrecisionCasts(mixed_precision, module)
            hook, state.reduce_dtype = hooks.reduce_in_dtype, self.precision.reduce_dtype
        self._has_buffers = any(b.numel() for b in module.buffers())
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        limits = torch_arguments.bucket_limits(bucket_cap_mb_list) or default_limits(self.bucket_cap_bytes)
        # in shared memory where gradsync's all-reduce can read them in place (auto or shared_memory)
        allocate = (shared_allocator(self.world) if self.group.subgroup is None
                    and algorithm in ("auto", "shared_memory") else None)
        self.reducer = Reducer([p for _, p in named], self._param_names, bucket_limits=limits, allocate=allocate,
                               group=self.group, hook=hook, hook_state=state,
                               find_unused_parameters=find_unused_parameters,
                               rebuild_buckets=static_graph or not find_unused_parameters, precision=self.precision)
        self._hook_registered = comm_hook not in (None, "none") or mixed_precision is not None

    # -- construction ------------------------------------------------------------------------------
    def _verify_same_model(self) -> None:
        if self.group.size > 1:
            verify_same_model(self.module, "DistributedDataParallel", gather=self.group.all_gather)

    @torch.no_grad()
    def _broadcast_state(self, src: int, buffers: bool) -> None:
        tensors = list(self.module.parameters()) + (list(self.module.buffers()) if buffers else [])
        broadcast_coalesced(tensors, broadcast=self.group.broadcast, src=src)

    @torch.no_grad()
    def _sync_buffers(self, src: int = 0) -> None:
        broadcast_coalesced(list(self.module.buffers()), broadcast=self.group.broadcast, src=src)

    def _syncs_buffers(self) -> bool:
        return self.broadcast_buffers and self.group.size > 1 and self.training and self._has_buffers

    def _divisor(self, voters: int) -> int:
        """What built-in hooks divide the gradient sum by, given how many ranks still train (Join)."""
        return self.group.size if self._divide_by_initial_world_size or voters == 0 else voters

    # -- use --------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        args, kwargs = self._pre_forward(*args, **kwargs)
        with trace.span("forward", "compute"):
            output = self.module(*args, **kwargs)
        return self._post_forward(output)

    @torch.compiler.disable
    def _pre_forward(self, *args, **kwargs):
        """The wrapper's collectives before the module runs, in the order ddp/uneven_inputs.py gives."""
        grad_enabled = torch.is_grad_enabled()
        will_sync = self.require_backward_grad_sync and grad_enabled
        Join.notify_join_context(self)
        joining = self._join_config.enable
        divisor = self.group.size
        if joining:
            syncing, _ = vote(self.group, will_sync, grad_enabled)
            divisor = self._divisor(syncing)
        if grad_enabled:
            self.reducer.rebuild_if_due()
        if self._syncs_buffers():
            src = common_rank(self.group, candidate=True) if joining else 0
            with trace.span("broadcast buffers", "comm"):
                self._sync_buffers(src)
        self.reducer.divisor = divisor
        self.reducer.sync_this_backward = will_sync
        if self.precision is not None:
            args, kwargs = self.precision.cast_for_forward(args, kwargs)
        return args, kwargs

    @torch.compiler.disable
    def _post_forward(self, output):
        if self.precision is not None and not torch.is_grad_enabled():
            self.precision.restore_params()   # no backward will come to restore them
        if trace.tracer() is not None:
            first = output if isinstance(output, torch.Tensor) else next(
                (o for o in (output.values() if isinstance(output, dict) else output)
                 if isinstance(o, torch.Tensor)), None)
            if first is not None and first.requires_grad:
                first.register_hook(lambda grad: (trace.instant("backward start", "compute"), grad)[1])
        return output

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this block reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` (torch's contract, ddp/hooks.py); once,
        before the first backward. torch's own hooks (torch.distributed.algorithms.ddp_comm_hooks)
        run unchanged."""
        if not callable(hook):
            raise TypeError(f"register_comm_hook: the hook must be callable, got {type(hook).__name__}")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError as exc:
            raise TypeError(f"register_comm_hook: the hook is called as hook(state, bucket), torch's contract; "
                            f"{getattr(hook, '__qualname__', hook)!r} cannot be: {exc}") from None
        if self.precision is not None:
            raise RuntimeError("register_comm_hook: mixed_precision already reduces through its own hook; torch's "
                               "DDP refuses a second hook too (drop mixed_precision, or cast inside your hook)")
        if self._hook_registered:
            raise RuntimeError("register_comm_hook can be called once, and not after comm_hook='fp16'/'bf16'/"
                               "'powersgd' chose a built-in hook (as torch's DDP allows one hook)")
        if self.reducer.synced_backwards:
            raise RuntimeError("register_comm_hook must be called before the first backward (as in torch's DDP)")
        self.reducer.set_hook(state, hook, ordinary_memory=hook not in _OWN_HOOKS)
        self._hook_registered = True

    # -- uneven inputs (torch's Joinable) -----------------------------------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """``with model.join(): ...``: torch's Join over this wrapper alone (as torch's DDP.join)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs) -> DDPJoinHook:
        return DDPJoinHook(self, divide_by_initial_world_size=kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        return self.device

    @property
    def join_process_group(self):
        return self.group.torch_group

    # -- inspection ------------------------------------------------------------------------------------
    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise ReplicaMismatchError if any parameter differs (bitwise) between replicas."""
        if self.group.size == 1:
            return
        names = [name for name, _ in self.module.named_parameters()]
        difference = first_mismatch(list(self.module.parameters()), gather=self.group.all_gather)
        if difference is not None:
            rank, index = difference
            raise ReplicaMismatchError(
                f"replicas diverged: parameter {names[index]!r} differs between rank 0 and rank {rank}. "
                f"In synchronous data parallelism every rank must apply the same averaged gradient.")

    @property
    def buckets(self):
        """The reducer's current buckets, in launch order."""
        return self.reducer.buckets

    @property
    def last_overlap(self) -> float | None:
        """Share of the last backward's communication time that ran before backward ended."""
        return self.reducer.last_overlap

    @property
    def comm_seconds(self) -> float:
        """Seconds the last backward's bucket reductions took (on the communication thread)."""
        return self.reducer.last_comm_seconds

    @property
    def wait_seconds(self) -> float:
        """Seconds the last backward waited for reductions after its own work ended (exposed communication)."""
        return self.reducer.last_wait_seconds

    def close(self) -> None:
        """Stop the communication thread (the wrapper is unusable afterwards)."""
        self.reducer.close()

    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [b.nbytes for b in self.buckets]
