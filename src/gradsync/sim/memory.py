"""Memory model: bytes of model state per rank for plain data parallelism and ZeRO stages 1, 2, 3.

Symbols (Rajbhandari et al., "ZeRO", SC 2020, section 3 and figure 1)
    Psi   parameters;  N  data-parallel ranks
    P     bytes per parameter as trained (2 for bf16/fp16 in mixed precision, 4 in fp32)
    G     bytes per gradient (as P)
    K     bytes of optimizer state per parameter:
              adam, mixed:  4 (fp32 master copy) + 4 (m) + 4 (v) = 12
              adam, fp32:   4 (m) + 4 (v) = 8            (the parameters are the master copy)
              sgd (momentum), mixed: 4 (master) + 4 (momentum) = 8;  fp32: 4

Bytes per rank
    plain DP   Psi * (P + G + K)              every rank holds everything
    ZeRO-1     Psi * (P + G + K/N)            optimizer state sharded (gradsync's ShardedOptimizer)
    ZeRO-2     Psi * (P + (G + K)/N)          + gradients sharded
    ZeRO-3     Psi * (P + G + K) / N          + parameters sharded

Example: mixed-precision Adam (P=G=2, K=12), Psi = 70e9: plain DP 16 * 70e9 = 1.12 TB per rank;
with N=64, ZeRO-1 = 70e9 * (4 + 12/64) = 293 GB, ZeRO-3 = 17.5 GB. Activations and buffers are
not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZERS = ("adam", "sgd")
PRECISIONS = ("mixed", "fp32")
STAGES = ("plain DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")

_K = {("adam", "mixed"): 12, ("adam", "fp32"): 8, ("sgd", "mixed"): 8, ("sgd", "fp32"): 4}


@dataclass(frozen=True)
class StateBytes:
    param: float
    """Bytes of parameters per rank."""
    grad: float
    """Bytes of gradients per rank."""
    optimizer: float
    """Bytes of optimizer state per rank."""

    @property
    def total(self) -> float:
        return self.param + self.grad + self.optimizer


def bytes_per_parameter(optimizer: str, precision: str) -> tuple[int, int, int]:
    """(P, G, K) for an optimizer and precision (see the module docstring)."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    width = 2 if precision == "mixed" else 4
    return width, width, _K[(optimizer, precision)]


def model_state_bytes(params: float, ranks: int, stage: str, optimizer: str = "adam",
                      precision: str = "mixed") -> StateBytes:
    """Bytes per rank of parameters, gradients and optimizer state for one stage."""
    if params <= 0 or ranks < 1:
        raise ValueError(f"need params > 0 and ranks >= 1, got params={params}, ranks={ranks}")
    p, g, k = bytes_per_parameter(optimizer, precision)
    n = ranks
    if stage == "plain DP":
        return StateBytes(params * p, params * g, params * k)
    if stage == "ZeRO-1":
        return StateBytes(params * p, params * g, params * k / n)
    if stage == "ZeRO-2":
        return StateBytes(params * p, params * g / n, params * k / n)
    if stage == "ZeRO-3":
        return StateBytes(params * p / n, params * g / n, params * k / n)
    raise ValueError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")


def human(nbytes: float) -> str:
    """Decimal units, as capacities are quoted: 1.12 TB, 293 GB."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{nbytes:.0f} B"
