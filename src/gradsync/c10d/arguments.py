"""From torch's call to gradsync's: what the backend's methods (process_group.py) do to their
arguments before one of gradsync's collectives runs.

    routed           a method's tensors: CUDA ones to an NCCL group, complex ones viewed as real pairs
    op_name          torch's ReduceOp -> gradsync's op name (reduce_ops.py), or an error naming the
                     supported ones
    chosen_algorithm GRADSYNC_ALGORITHM, read on every call
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist

from gradsync.comm.collectives import ALGORITHMS

OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
       dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
       dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor"}
SUM = dist.ReduceOp.SUM


def tensors_in(values) -> list[torch.Tensor]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += tensors_in(value)
    return found


def as_real(value):
    """``value`` with every complex tensor in it (lists included) viewed as real pairs."""
    if isinstance(value, torch.Tensor):
        return torch.view_as_real(value) if value.is_complex() else value
    if isinstance(value, (list, tuple)):
        return type(value)(as_real(v) for v in value)
    return value


def check_complex_op(what: str, op: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"gradsync backend: {what} of complex tensors supports SUM and AVG, not {op.upper()} "
                         f"(torch refuses it in all_reduce too)")


def routed(method):
    """Where a call's tensors go before the method sees them:
    - CUDA tensors go to the same method of an NCCL group on the same store (made on first use)
      when the backend string was "cpu:gradsync,cuda:nccl" (torch stops at the first device's
      backend when that backend is a Python ProcessGroup, so the group itself sends CUDA work on);
      otherwise the method takes them, and the collectives stage them through host memory;
    - complex tensors are viewed as pairs of reals, as torch's own Python layer does for most
      collectives before the backend sees them: the bytes are the same, and a sum or an average of
      complex numbers is the sum or average of their parts. Other reductions of complex numbers are
      refused, as torch refuses them in all_reduce."""
    @functools.wraps(method)
    def route(self, *args):
        tensors = tensors_in(args)
        if any(t.is_cuda for t in tensors) and self.cuda_to_nccl():
            return getattr(self._nccl_group(method.__name__), method.__name__)(*args)
        if any(t.is_complex() for t in tensors):
            for value in args:
                if getattr(value, "reduceOp", None) is not None:
                    check_complex_op(method.__name__, op_name(value.reduceOp))
            return method(self, *as_real(args))
        return method(self, *args)
    return route


def op_name(op) -> str:
    kind = getattr(op, "op", op)  # a ReduceOp object or its RedOpType
    for known, name in OPS.items():
        if kind == known or kind == getattr(known, "op", known):
            return name
    raise ValueError(f"gradsync backend: ReduceOp {op} is not supported on CPU; choose one of "
                     f"SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR (PREMUL_SUM is NCCL-only)")


_ENCODED_ENVIRON = getattr(os.environ, "_data", None)
_ALGORITHM_KEY = os.environ.encodekey("GRADSYNC_ALGORITHM") if _ENCODED_ENVIRON is not None else None


def chosen_algorithm() -> str:
    """GRADSYNC_ALGORITHM, read on every call (a program may change it between calls). When it is
    unset, os.environ.get raises and catches KeyError twice, 4-5 us of a 4 KiB call; os.environ's
    own encoded mapping answers without (a private attribute, so it is used only where present)."""
    if _ENCODED_ENVIRON is not None and _ALGORITHM_KEY not in _ENCODED_ENVIRON:
        return "auto"
    algorithm = os.environ.get("GRADSYNC_ALGORITHM", "auto")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"GRADSYNC_ALGORITHM={algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
    return algorithm
