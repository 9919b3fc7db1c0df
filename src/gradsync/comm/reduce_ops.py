"""Reduction operators: what "reduce" means inside every all-reduce algorithm, and where it applies.

Vocabulary
    acc        the partial result a rank holds (its own contribution, then more added in)
    incoming   another rank's contribution (or partial result), the same size and dtype as acc
    combine    acc <- acc (op) incoming, in place, elementwise; every algorithm calls it wherever
               it used to add
    finish     what the rank that owns a finished piece does once before sharing it: divide by N
               for "avg", nothing for the others
    fold       out <- first (op) second, out of place: one pass over memory where copying first
               into out and combining second would take two

The operators, with torch's own elementwise semantics (so results equal torch.distributed's gloo):

    op        combine                        dtypes
    sum       acc += incoming                every dtype (bool: logical or; integers wrap around)
    avg       sum, then finish divides by N  floating dtypes
    product   acc *= incoming                every dtype (bool: logical and; integers wrap around)
    max       acc = maximum(acc, incoming)   every dtype (bool: or)
    min       acc = minimum(acc, incoming)   every dtype (bool: and)
    band      acc &= incoming                integer and bool dtypes
    bor       acc |= incoming                integer and bool dtypes
    bxor      acc ^= incoming                integer and bool dtypes

float16 and bfloat16 sums (sum, avg) travel in their own dtype but are added in float32: where one rank
holds every input of an element (``reduce``: the shared-memory all-reduces and reduce-scatters, the
naive all-reduce), the N inputs are added in float32 in a fixed order and the result is rounded to the
narrow dtype once (avg: divided first, then rounded), so its error is one rounding of the result
(DeepSpeed's and Megatron's fp32 accumulation; gloo and NCCL round after every add, an error that
grows with N: docs/benchmarks.md, "Reduced precision on the wire"). The algorithms that forward partial
sums between ranks (ring, halving-doubling, tree over TCP) send each partial in the narrow dtype, so
they round once per hop. GRADSYNC_HALF_SUM=narrow rounds after every add everywhere, as gloo does (to
measure what float32 accumulation buys; HALF_SUM_ENV).

Every algorithm computes each element of the result on exactly one rank (the owner of its chunk,
or the root) and then copies it to the others, so all ranks hold bit-identical values even where
the operator is not associative in floating point (sum, product): the order only decides the last
bits, and it is the same order on every rank. The one exception, the direct shared-memory
all-reduce for small messages, has every rank compute every element from the same inputs in the
same rank order, which gives the same bits on every rank just as well.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64,
          torch.bool, torch.uint8, torch.int8)
"""Every dtype the collectives take: those torch.distributed's gloo reduces."""


HALF_SUM_ENV = "GRADSYNC_HALF_SUM"
"""GRADSYNC_HALF_SUM=float32 (the default) adds float16 and bfloat16 sums in float32 and rounds once;
=narrow rounds after every add (gloo's and NCCL's running sum, kept to measure against: the native
core reads the same setting, native/reduce.c)."""
HALF_SUM_CHOICES = ("float32", "narrow")
NARROW = (torch.float16, torch.bfloat16)
"""The dtypes whose sums are accumulated in float32."""
_HALF_SUM: list[str] = []


def half_sum() -> str:
    """GRADSYNC_HALF_SUM, read once per process ("float32" or "narrow"); forget_half_sum() reads it again."""
    if not _HALF_SUM:
        setting = os.environ.get(HALF_SUM_ENV, "").strip() or "float32"
        if setting not in HALF_SUM_CHOICES:
            raise ValueError(f"{HALF_SUM_ENV}={setting!r}: give float32 (add float16/bfloat16 sums in float32, the "
                             f"default) or narrow (round after every add, as gloo does)")
        _HALF_SUM.append(setting)
    return _HALF_SUM[0]


def forget_half_sum() -> None:
    """Read GRADSYNC_HALF_SUM again at the next half_sum() (tests switch within one process)."""
    _HALF_SUM.clear()


def _maximum(acc: torch.Tensor, incoming: torch.Tensor) -> None:
    torch.maximum(acc, incoming, out=acc)


def _minimum(acc: torch.Tensor, incoming: torch.Tensor) -> None:
    torch.minimum(acc, incoming, out=acc)


@dataclass(frozen=True)
class Reduction:
    """One reduction operator (see the module docstring for the table)."""

    name: str
    """The user's name for it: "sum", "avg", "product", "max", "min", "band", "bor" or "bxor"."""
    combine: Callable[[torch.Tensor, torch.Tensor], None]
    """acc <- acc (op) incoming, in place."""
    average: bool = False
    """Divide the finished result by the number of ranks (only "avg")."""
    bitwise: bool = False
    """Only defined on integer and bool dtypes."""
    out_of_place: Callable | None = None
    """torch's out-of-place form of ``combine`` (called with ``out=``), for ``fold``."""

    def fold(self, out: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> None:
        """out <- first (op) second; ``out`` may be one of the inputs itself (the same tensor, as an
        in-place operation), but must not overlap either in part."""
        self.out_of_place(first, second, out=out)

    def widens(self, dtype: torch.dtype) -> bool:
        """Whether ``reduce`` adds ``dtype`` in float32 (sum and avg of float16 and bfloat16; module docstring)."""
        return dtype in NARROW and self.out_of_place is torch.add and half_sum() == "float32"

    def accumulator(self, first: torch.Tensor) -> torch.Tensor:
        """What the inputs are combined into, starting from ``first``: a float32 copy of it where this
        reduction widens ``first``'s dtype, else ``first`` itself (which it then changes)."""
        return first.float() if self.widens(first.dtype) else first

    def settle(self, out: torch.Tensor, acc: torch.Tensor, n_ranks: int) -> None:
        """finish ``acc`` (avg: divided by N) and write it into ``out`` (one rounding where ``acc`` is wider);
        ``acc`` may be ``out`` itself."""
        self.finish(acc, n_ranks)
        if acc is not out:
            out.copy_(acc)

    def reduce(self, out: torch.Tensor, inputs: Sequence[torch.Tensor], n_ranks: int) -> None:
        """out <- inputs[0] (op) inputs[1] (op) ... in that order, finished: what the owner of an element
        computes from every rank's input (float16/bfloat16 sums in float32, rounded once). ``out`` may be
        ``inputs[0]`` or ``inputs[1]`` itself (the one-pass fold of the first two), and must not overlap
        any input in part."""
        if self.widens(out.dtype):
            acc = inputs[0].float()
            for incoming in inputs[1:]:
                acc.add_(incoming)
            self.settle(out, acc, n_ranks)
            return
        if len(inputs) == 1:
            if out is not inputs[0]:
                out.copy_(inputs[0])
        else:
            self.fold(out, inputs[0], inputs[1])
            for incoming in inputs[2:]:
                self.combine(out, incoming)
        self.finish(out, n_ranks)

    def finish(self, owned: torch.Tensor, n_ranks: int) -> None:
        """Called once on each finished piece by the rank that computed it, before it is shared. For
        a power-of-two N, avg multiplies by 1/N: the same bits as dividing by N (both scale by an
        exact power of two and round once), and a quarter cheaper (512 KiB in cache, float32: 21
        against 28.5 us)."""
        if self.average:
            if n_ranks & (n_ranks - 1) == 0:
                owned.mul_(1.0 / n_ranks)
            else:
                owned.div_(n_ranks)


SUM = Reduction("sum", torch.Tensor.add_, out_of_place=torch.add)
REDUCTIONS = {r.name: r for r in (
    SUM,
    Reduction("avg", torch.Tensor.add_, average=True, out_of_place=torch.add),
    Reduction("product", torch.Tensor.mul_, out_of_place=torch.mul),
    Reduction("max", _maximum, out_of_place=torch.maximum),
    Reduction("min", _minimum, out_of_place=torch.minimum),
    Reduction("band", torch.Tensor.bitwise_and_, bitwise=True, out_of_place=torch.bitwise_and),
    Reduction("bor", torch.Tensor.bitwise_or_, bitwise=True, out_of_place=torch.bitwise_or),
    Reduction("bxor", torch.Tensor.bitwise_xor_, bitwise=True, out_of_place=torch.bitwise_xor),
)}
OPS = tuple(REDUCTIONS)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def reduction(op: str, dtype: torch.dtype, what: str) -> Reduction:
    """The Reduction called ``op``, checked against ``dtype``; ``what`` names the caller in errors."""
    if op not in REDUCTIONS:
        raise ValueError(f"{what}: unknown op {op!r}; choose one of {', '.join(OPS)}")
    chosen = REDUCTIONS[op]
    if chosen.average and not dtype.is_floating_point:
        raise TypeError(f"{what}: op='avg' needs a floating dtype, got {dtype_name(dtype)}; "
                        f"use op='sum' and divide")
    if chosen.bitwise and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{what}: op={op!r} is a bitwise operation and needs an integer or bool dtype, got "
                        f"{dtype_name(dtype)}; for floating tensors use one of sum, avg, product, max, min")
    return chosen
