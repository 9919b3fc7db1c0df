"""What a world that changes from W to W' ranks (shrinks after a death, grows back when a replacement
joins) does to the batch and the learning rate.

    keep-global    the global batch G stays; each survivor's share grows to about G / W' samples
                   (the epoch's remaining samples are split over W', EpochCursor.share), and the
                   learning rate stays. The training is the same as an uninterrupted run's up to
                   floating-point reassociation, at the cost of W/W' more compute per survivor.
    keep-per-rank  each rank keeps b = G / W samples a step, so the global batch becomes
                   G' = b W' and the learning rate follows it as --lr-scaling says: lr' = lr W' / W
                   with linear (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1),
                   lr sqrt(W' / W) with sqrt, lr with none (train/batch_math.py).
                   Growing back (2 -> 3 after 3 -> 2) gives G and lr x 2/3 x 3/2 again: exact for G,
                   lr within floating-point rounding.
"""

from __future__ import annotations

BATCH_POLICIES = ("keep-global", "keep-per-rank")


def resized(policy: str, global_batch: int, lr: float, old_world: int, new_world: int,
            scaling: str = "linear") -> tuple[int, float]:
    """(global batch, learning rate) after the world goes from ``old_world`` to ``new_world`` ranks;
    ``scaling``: --lr-scaling (linear, sqrt or none).

    keep-per-rank, linear: G=12, lr=0.3, 3 -> 2 ranks gives (8, 0.2); sqrt: (8, 0.245)."""
    if policy not in BATCH_POLICIES:
        raise ValueError(f"unknown batch policy {policy!r}; choose one of {', '.join(BATCH_POLICIES)}")
    if policy == "keep-global":
        return global_batch, lr
    per_rank = global_batch // old_world
    if per_rank * old_world != global_batch:
        raise ValueError(f"keep-per-rank needs the global batch {global_batch} to be a multiple of the "
                         f"{old_world} ranks")
    factor = {"linear": new_world / old_world, "sqrt": (new_world / old_world) ** 0.5, "none": 1.0}[scaling]
    return per_rank * new_world, lr * factor
