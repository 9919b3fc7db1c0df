"""Clipping by the total gradient norm, as torch.nn.utils.clip_grad_norm_ defines it, for a gradient
that lies in pieces on several ranks (ZeRO-1 shards, parameter-server shards).

Vocabulary
    g          the gradient of every parameter viewed as one vector (in data parallelism: the
               gradient averaged over the ranks, the one the optimizer applies)
    p          norm_type: a real number > 0, or inf
    part       a piece of g that one rank holds; the parts partition g's elements exactly
    power sum  S = sum_i |g_i|^p over a part (finite p); for p = inf the part's max |g_i|

Total norm from the parts (a rank needs only the other parts' S, one scalar each):
    ||g||_p   = (S_1 + S_2 + ... + S_N)^(1/p)          combine with "sum"
    ||g||_inf = max(S_1, ..., S_N)                      combine with "max"
Clipping, torch's formula (torch/nn/utils/clip_grad.py), one coefficient for every part:
    coefficient = min(1, max_norm / (||g||_p + 1e-6));   g <- coefficient * g

torch takes the norm of each tensor, then the norm of those norms; for p > 0 that is the same
number, ((sum_t S_t^(1/p))^p)^(1/p) = (sum_t S_t)^(1/p), up to rounding, so how g is cut into parts
does not matter. Power sums are accumulated in float64 whatever the gradient's dtype; the total
is returned in the gradient's dtype, as torch returns it. Refused: p = 0 (torch counts the tensors
whose norm is non-zero, which depends on how g is cut, so shards would change it), p < 0 and -inf
(not norms), and max_norm that is not a finite number > 0.
"""

from __future__ import annotations

import math

import torch

NORM_EPSILON = 1e-6
"""Added to the norm before dividing, as torch does."""


def check_arguments(max_norm, norm_type, name: str = "max_norm") -> tuple[float, float]:
    """(max_norm, p) as floats (norm_type may be "inf", as torch accepts); ValueError for values that
    cannot be clipped by. ``name``: what the caller calls max_norm, for the message."""
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type {norm_type!r} is not a number; use a p > 0 (1.0, 2.0, ...) or inf") from None
    if math.isnan(p) or p <= 0:
        raise ValueError(f"norm_type {norm_type!r} is not supported: use a p > 0 (1.0, 2.0, ...) or inf "
                         f"(p = 0 would count tensors, not elements, and p < 0 is not a norm)")
    try:
        limit = float(max_norm)
    except (TypeError, ValueError, RuntimeError):
        limit = math.nan
    if isinstance(max_norm, bool) or not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"{name} must be a finite number > 0 (the largest norm the gradient may keep), "
                         f"got {max_norm!r}")
    return limit, p


def combine_op(p: float) -> str:
    """How the parts' power sums add up across ranks: "sum", or "max" for the inf norm."""
    return "max" if math.isinf(p) else "sum"


def power_sum(parts, p: float) -> torch.Tensor:
    """S over ``parts`` (tensors on one rank; empty ones count nothing), a float64 scalar."""
    total = torch.zeros((), dtype=torch.float64)
    for part in parts:
        if part is None or part.numel() == 0:
            continue
        norm = torch.linalg.vector_norm(part.detach(), p, dtype=torch.float64).to(total.device)
        total = torch.maximum(total, norm) if math.isinf(p) else total + norm ** p
    return total


def total_norm(combined: torch.Tensor, p: float, dtype: torch.dtype, error_if_nonfinite: bool) -> torch.Tensor:
    """||g||_p from the combined power sums, in ``dtype``; with ``error_if_nonfinite``, torch's error
    when it is nan or inf."""
    norm = (combined if math.isinf(p) else combined ** (1.0 / p)).to(dtype)
    if error_if_nonfinite and not bool(torch.isfinite(norm)):
        raise RuntimeError(f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
                           f"cannot be clipped. To disable this error and scale the gradients by the non-finite "
                           f"norm anyway, set `error_if_nonfinite=False`")
    return norm


def coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)), in the norm's dtype (torch multiplies by it even when it is 1)."""
    return torch.clamp(max_norm / (norm + NORM_EPSILON), max=1.0)


def clip_local_(parts, max_norm: float, norm_type=2.0, error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip tensors that hold all of g on this rank, in place; returns the total norm (no communication)."""
    max_norm, p = check_arguments(max_norm, norm_type)
    parts = [t for t in parts if t is not None]
    if not parts:
        return torch.zeros(())
    norm = total_norm(power_sum(parts, p), p, parts[0].dtype, error_if_nonfinite)
    scale = coefficient(norm, max_norm)
    for part in parts:
        part.mul_(scale.to(part.device))
    return norm
