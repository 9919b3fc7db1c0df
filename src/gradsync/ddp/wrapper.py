"""DistributedDataParallel: wrap a module so every rank applies the same averaged gradient.

    model = gs.DistributedDataParallel(module, bucket_cap_mb=25, algorithm="auto",
                                       find_unused_parameters=False, broadcast_buffers=True,
                                       comm_hook=None)
    loss = loss_fn(model(x), y); loss.backward(); optimizer.step()

Construction, as a recipe
    verify_same_model     every rank lists the same parameters (name, shape, dtype) in the same
                          order; otherwise a clear error naming the rank and the first difference
    broadcast_state       rank 0's parameters and buffers overwrite everyone else's
    build_buckets         reverse order, ``bucket_cap_mb`` cap, 1 MiB first bucket (ddp/buckets.py)
    attach_reducer        post-accumulate-grad hooks, async reduction (ddp/reducer.py)

Each forward: with ``broadcast_buffers`` rank 0's buffers (BatchNorm running statistics) are
broadcast first, as torch DDP does. ``comm_hook``: None (average), "fp16", "bf16", or a callable
with the signature documented in ddp/hooks.py.
"""

from __future__ import annotations

import zlib
from contextlib import contextmanager

import torch
from torch import nn

from gradsync import runtime, trace
from gradsync.comm.agree import DTYPES
from gradsync.comm.collectives import ALGORITHMS, all_gather, broadcast
from gradsync.ddp.buckets import build_buckets
from gradsync.ddp.hooks import BUILTIN
from gradsync.ddp.reducer import Reducer


class ReplicaMismatchError(RuntimeError):
    """Ranks hold different models or different parameter values."""


def _crc(data: bytes) -> int:
    return zlib.crc32(data) & 0x7FFFFFFF


def _gather_strings(lines: list[str]) -> list[list[str]]:
    """Every rank's list of strings (used only to explain a mismatch, so simplicity beats speed)."""
    texts = _gather_hashes([ord(c) for c in "\n".join(lines)])  # any int64 list travels the same way
    return ["".join(map(chr, codes)).split("\n") if codes else [] for codes in texts]


def _first_difference(per_rank_hashes: list[list[int]]) -> tuple[int, int] | None:
    """(rank, index) of the first entry where some rank differs from rank 0."""
    reference = per_rank_hashes[0]
    for rank, hashes in enumerate(per_rank_hashes[1:], start=1):
        for index in range(max(len(reference), len(hashes))):
            mine = hashes[index] if index < len(hashes) else None
            if mine != (reference[index] if index < len(reference) else None):
                return rank, index
    return None


def _gather_hashes(hashes: list[int]) -> list[list[int]]:
    """Every rank's list of integers, in rank order (lists may differ in length)."""
    mine = torch.tensor(hashes, dtype=torch.int64)
    counts = all_gather(torch.tensor([mine.numel()], dtype=torch.int64)).tolist()
    flat = all_gather(mine).tolist()
    out, start = [], 0
    for count in counts:
        out.append(flat[start:start + count])
        start += count
    return out


@torch.no_grad()
def _broadcast_coalesced(tensors: list[torch.Tensor]) -> None:
    """Rank 0's values of ``tensors`` onto every rank: one broadcast per dtype, not one per tensor."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel() and t.dtype in DTYPES:
            by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        broadcast(flat, src=0)
        offset = 0
        for t in group:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper; see the module docstring."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, algorithm: str = "auto",
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True, comm_hook=None) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}")
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
        self.broadcast_buffers = broadcast_buffers
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel needs a module with at least one parameter that requires grad")
        self._param_names = [n for n, _ in named]
        self._verify_same_model()
        self._broadcast_state()
        self._has_buffers = any(b.numel() for b in module.buffers())
        self.bucket_cap_bytes = int(bucket_cap_mb * (1 << 20))
        self.buckets = build_buckets([p for _, p in named], self._param_names, self.bucket_cap_bytes)
        self.reducer = Reducer(self.buckets, algorithm, comm_hook, find_unused_parameters)

    # -- construction ------------------------------------------------------------------------------
    def _signature(self) -> list[str]:
        params = [f"param {n} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')} requires_grad={p.requires_grad}"
                  for n, p in self.module.named_parameters()]
        buffers = [f"buffer {n} {tuple(b.shape)} {str(b.dtype).replace('torch.', '')}"
                   for n, b in self.module.named_buffers()]
        return params + buffers

    def _verify_same_model(self) -> None:
        if self.world.world_size == 1:
            return
        lines = self._signature()
        per_rank = _gather_hashes([_crc(line.encode()) for line in lines])
        difference = _first_difference(per_rank)
        if difference is None:
            return
        rank, index = difference
        texts = _gather_strings(lines)
        ours = texts[0][index] if index < len(texts[0]) else "(nothing)"
        theirs = texts[rank][index] if index < len(texts[rank]) else "(nothing)"
        raise ReplicaMismatchError(
            f"rank {rank} wraps a different model than rank 0: entry #{index} is '{theirs}' on rank {rank} "
            f"but '{ours}' on rank 0. Every rank must build the same model (same parameters, shapes, "
            f"dtypes, order) before wrapping it.")

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        _broadcast_coalesced(list(self.module.parameters()) + list(self.module.buffers()))

    @torch.no_grad()
    def _sync_buffers(self) -> None:
        _broadcast_coalesced(list(self.module.buffers()))

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
        names, hashes = [], []
        for name, p in self.module.named_parameters():
            names.append(name)
            hashes.append(_crc(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()))
        difference = _first_difference(_gather_hashes(hashes))
        if difference is not None:
            rank, index = difference
            raise ReplicaMismatchError(
                f"replicas diverged: parameter {names[index]!r} differs between rank 0 and rank {rank}. "
                f"In synchronous data parallelism every rank must apply the same averaged gradient.")

    @property
    def last_overlap(self) -> float | None:
        """Share of the last backward's communication time that ran before backward ended."""
        return self.reducer.last_overlap

    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order."""
        return [b.nbytes for b in self.buckets]
