"""GradBucket: what a communication hook receives, with torch.distributed.GradBucket's methods.

A hook registered with ``model.register_comm_hook(state, hook)`` is called once per bucket and
backward as ``hook(state, bucket)`` (torch's contract, ddp/hooks.py). ``bucket`` answers exactly
what torch's C++ GradBucket answers, so torch's own hooks (torch.distributed.algorithms.
ddp_comm_hooks: allreduce, fp16/bf16 compression, PowerSGD, ...) run unchanged:

    index()          the bucket's position in launch order, 0 .. bucket_count-1
    is_last()        index() == bucket_count - 1: the last bucket of this backward
    buffer()         the flat 1-D gradients, this rank's local (unreduced) values on entry; the
                     hook may reduce them in place
    set_buffer(t)    replace the buffer (compression wrappers hand the inner hook a cast copy)
    gradients()      one view per parameter into the *current* buffer, shaped like it (so writing
                     a view writes the buffer, as PowerSGD's decompression relies on)
    parameters()     the parameters whose gradients the bucket holds, in buffer order

The buffer is the bucket's own flat buffer (ddp/buckets.py), not a copy: a hook that reduces in
place and returns it costs no extra copy.
"""

from __future__ import annotations

import torch

from gradsync.ddp.buckets import Bucket


class GradBucket:
    """One bucket as a communication hook sees it (see the module docstring)."""

    def __init__(self, bucket: Bucket, bucket_count: int, buffer: torch.Tensor | None = None) -> None:
        self._bucket = bucket
        self._bucket_count = bucket_count
        self._buffer = bucket.flat if buffer is None else buffer

    def index(self) -> int:
        return self._bucket.index

    def is_last(self) -> bool:
        return self._bucket.index == self._bucket_count - 1

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def gradients(self) -> list[torch.Tensor]:
        return [self._bucket.grad_view(slot, self._buffer) for slot in range(len(self._bucket.params))]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._bucket.params)

    def __repr__(self) -> str:
        return (f"GradBucket(index={self.index()}, of {self._bucket_count}, {self._buffer.numel()} x "
                f"{str(self._buffer.dtype).replace('torch.', '')}, parameters {', '.join(self._bucket.names)})")
