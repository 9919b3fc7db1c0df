"""Communication hooks: what happens to a bucket between "all gradients ready" and "averaged".

Signature of a hook (user hooks too):

    def hook(flat: torch.Tensor, algorithm: str) -> None
        flat       the bucket's gradients, 1-D, this rank's local values on entry
        algorithm  the all-reduce algorithm the wrapper was built with
        on return  flat must hold the average over ranks, identical on every rank

It runs on the wrapper's communication thread, once per bucket, in bucket order on every rank.

Built-ins: fp16 and bf16 compression (cast, all-reduce, cast back). Each rank divides by N before
the cast so the sum cannot overflow fp16's range (65504). Stated error: each value is rounded once
to the compressed type before the reduction and the sum is accumulated in it; for N ranks the
relative error is at most about (N+1) * 2^-11 for fp16 and (N+1) * 2^-8 for bf16 (unit roundoff
2^-11 and 2^-8), tested against the exact average.
"""

from __future__ import annotations

import torch

from gradsync.comm.collectives import all_reduce
from gradsync import runtime


def allreduce_avg(flat: torch.Tensor, algorithm: str) -> None:
    """The default: average in the gradients' own dtype."""
    all_reduce(flat, op="avg", algorithm=algorithm)


def _compressed(dtype: torch.dtype):
    def hook(flat: torch.Tensor, algorithm: str) -> None:
        compressed = flat.div(runtime.world().world_size).to(dtype)
        all_reduce(compressed, op="sum", algorithm=algorithm)
        flat.copy_(compressed)
    hook.__name__ = f"{str(dtype).replace('torch.', '')}_compress"
    return hook


fp16_compress = _compressed(torch.float16)
bf16_compress = _compressed(torch.bfloat16)

BUILTIN = {"fp16": fp16_compress, "bf16": bf16_compress, "none": allreduce_avg}
