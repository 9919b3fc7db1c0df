"""Alpha-beta cost model of gradsync's collectives.

Symbols
    N      ranks;  p = 2^floor(log2 N);  L = ceil(log2 N)
    M      message size in bytes
    alpha  seconds of fixed cost per message (latency + software overhead)
    beta   seconds per byte on one link (1 / bandwidth)
    gamma  seconds per byte reduced (one add of an incoming byte into a local one)

Times (one all-reduce of M bytes; Thakur, Rabenseifner & Gropp, IJHPCA 2005; Patarasuk & Yuan,
JPDC 2009):
    ring              2(N-1)*alpha + 2(N-1)/N*M*beta + (N-1)/N*M*gamma
    halving_doubling  2*log2(p)*alpha + 2(p-1)/p*M*beta + (p-1)/p*M*gamma
                      + (N != p) * (2*alpha + 2*M*beta + M*gamma)       (fold / unfold)
    tree              2*L*(alpha + M*beta) + L*M*gamma
    naive             2(N-1)*(alpha + M*beta) + (N-1)*M*gamma             (rank 0's link serialises)
Per-rank bytes sent (the busiest rank):
    ring 2(N-1)/N*M;  halving_doubling 2(p-1)/p*M (+M when folded);  tree L*M;  naive (N-1)*M
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = ("ring", "halving_doubling", "tree", "naive")


@dataclass(frozen=True)
class Link:
    """Cost of one link. Defaults: measured on the 2-core CI machine, gloo over loopback (docs/benchmarks.md)."""

    alpha: float = 60e-6
    """Seconds per message (latency plus per-message software cost)."""
    beta: float = 1 / 2.5e9
    """Seconds per byte (1 / bandwidth)."""
    gamma: float = 1 / 4e9
    """Seconds per byte of reduction (an add over the incoming bytes)."""

    def __post_init__(self) -> None:
        if min(self.alpha, self.beta, self.gamma) < 0:
            raise ValueError(f"link costs must be >= 0, got alpha={self.alpha}, beta={self.beta}, gamma={self.gamma}")


def allreduce_time(algorithm: str, nbytes: float, n_ranks: int, link: Link) -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over ``n_ranks`` (formulas above)."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if n_ranks == 1:
        return 0.0
    a, b, g, n, m = link.alpha, link.beta, link.gamma, n_ranks, nbytes
    if algorithm == "ring":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * m * b + (n - 1) / n * m * g
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        t = 2 * math.log2(p) * a + 2 * (p - 1) / p * m * b + (p - 1) / p * m * g
        return t + (2 * a + 2 * m * b + m * g if n != p else 0.0)
    if algorithm == "tree":
        levels = math.ceil(math.log2(n))
        return 2 * levels * (a + m * b) + levels * m * g
    if algorithm == "naive":
        return 2 * (n - 1) * (a + m * b) + (n - 1) * m * g
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def allreduce_bytes_per_rank(algorithm: str, nbytes: float, n_ranks: int) -> float:
    """Bytes sent by the busiest rank in one all-reduce (see module docstring)."""
    n, m = n_ranks, nbytes
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) / n * m
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        return 2 * (p - 1) / p * m + (m if n != p else 0.0)
    if algorithm == "tree":
        return math.ceil(math.log2(n)) * m
    if algorithm == "naive":
        return (n - 1) * m
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")
