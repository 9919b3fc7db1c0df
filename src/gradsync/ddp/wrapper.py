"""DistributedDataParallel: wrap a module so every rank applies the same averaged gradient.

    model = gs.DistributedDataParallel(module, bucket_cap_mb=25, algorithm="auto",
                                       find_unused_parameters=False, broadcast_buffers=True,
                                       comm_hook=None)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

torch DDP's keyword arguments (device_ids, output_device, dim, process_group,
gradient_as_bucket_view, static_graph, init_sync, ...) are accepted too, so a program changes
only the class name; ddp/torch_arguments.py says what each means here. In a program that set up
torch.distributed itself the wrapper joins that world (runtime.world()).

Construction, as a recipe
    verify_same_model     every rank lists the same parameters (name, shape, dtype) in the same
                          order; otherwise a clear error naming the rank and the first difference
    broadcast_state       rank 0's parameters and buffers overwrite everyone else's
    build_buckets         reverse order, ``bucket_cap_mb`` cap, 1 MiB first bucket (ddp/buckets.py);
                          in shared memory when every rank is on this host (zero-copy all-reduce)
    attach_reducer        post-accumulate-grad hooks, async reduction (ddp/reducer.py)

Each forward: with ``broadcast_buffers`` rank 0's buffers (BatchNorm running statistics) are
broadcast first, as torch DDP does. ``comm_hook``: None (average), "fp16", "bf16", or a callable
with the signature documented in ddp/hooks.py.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from gradsync import runtime, trace
from gradsync.comm.collectives import ALGORITHMS, shared_allocator
from gradsync.ddp import torch_arguments
from gradsync.ddp.buckets import build_buckets
from gradsync.ddp.hooks import BUILTIN
from gradsync.ddp.reducer import Reducer
from gradsync.replicas import ReplicaMismatchError, broadcast_coalesced, first_mismatch, verify_same_model

__all__ = ["DistributedDataParallel", "ReplicaMismatchError"]


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper; see the module docstring."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = 25, algorithm: str = "auto",
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True, comm_hook=None, *,
                 device_ids=None, output_device=None, dim: int = 0, process_group=None,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, init_sync: bool = True,
                 check_reduction: bool = False, **unsupported) -> None:
        super().__init__()
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
        if isinstance(comm_hook, str):
            if comm_hook not in BUILTIN:
                raise ValueError(f"unknown comm_hook {comm_hook!r}; choose one of {', '.join(BUILTIN)} or pass a callable")
            comm_hook = BUILTIN[comm_hook]
        elif comm_hook is not None and not callable(comm_hook):
            raise TypeError("comm_hook must be None, 'fp16', 'bf16', 'none' or a callable hook(flat, algorithm)")
        self.module = module
        self.world = runtime.world()
        torch_arguments.check(module, device_ids=device_ids, output_device=output_device,
                              process_group=process_group, world_size=self.world.world_size, unsupported=unsupported)
        self.static_graph = static_graph
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel needs a module with at least one parameter that requires grad")
        self._param_names = [n for n, _ in named]
        if init_sync:
            self._verify_same_model()
            self._broadcast_state()
        self._has_buffers = any(b.numel() for b in module.buffers())
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        # in shared memory where the all-reduce can read them in place (auto or shared_memory)
        allocate = shared_allocator(self.world) if algorithm in ("auto", "shared_memory") else None
        self.buckets = build_buckets([p for _, p in named], self._param_names, self.bucket_cap_bytes,
                                     allocate=allocate)
        self.reducer = Reducer(self.buckets, algorithm, comm_hook, find_unused_parameters)

    # -- construction ------------------------------------------------------------------------------
    def _verify_same_model(self) -> None:
        if self.world.world_size > 1:
            verify_same_model(self.module, "DistributedDataParallel")

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        broadcast_coalesced(list(self.module.parameters()) + list(self.module.buffers()))

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        broadcast_coalesced(list(self.module.buffers()))

    # -- use --------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.broadcast_buffers and self.world.world_size > 1 and self.training and self._has_buffers:
            with trace.span("broadcast buffers", "comm"):
                self._sync_buffers()
        self.reducer.sync_this_backward = self.require_backward_grad_sync and torch.is_grad_enabled()
        with trace.span("forward", "compute"):
            output = self.module(*args, **kwargs)
        self._mark_backward_start(output)
        return output

    def _mark_backward_start(self, output) -> None:
        if trace.tracer() is None:
            return
        first = output if isinstance(output, torch.Tensor) else next(
            (o for o in (output.values() if isinstance(output, dict) else output) if isinstance(o, torch.Tensor)), None)
        if first is not None and first.requires_grad:
            first.register_hook(lambda grad: (trace.instant("backward start", "compute"), grad)[1])

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the next backward outside this block reduces the sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    @torch.no_grad()
    def check_replicas(self) -> None:
        """Raise ReplicaMismatchError if any parameter differs (bitwise) between ranks."""
        if self.world.world_size == 1:
            return
        names = [name for name, _ in self.module.named_parameters()]
        difference = first_mismatch(list(self.module.parameters()))
        if difference is not None:
            rank, index = difference
            raise ReplicaMismatchError(
                f"replicas diverged: parameter {names[index]!r} differs between rank 0 and rank {rank}. "
                f"In synchronous data parallelism every rank must apply the same averaged gradient.")

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
