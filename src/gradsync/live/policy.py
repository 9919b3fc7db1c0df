"""What a world that changes from W to W' ranks (shrinks after a death, grows back when a replacement
joins) does to the batch and the learning rate.

    keep-global    the global batch G stays; each survivor's share grows to about G / W' samples
                   (the epoch's remaining samples are split over W', EpochCursor.share), and the
                   learning rate stays. The training is the same as an uninterrupted run's up to
                   floating-point reassociation, at the cost of W/W' more compute per survivor.
    keep-per-rank  each rank keeps b = G / W samples a step, so the global batch becomes
                   G' = b W' and the learning rate is scaled with it, lr' = lr W' / W (the linear
                   scaling rule, Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 2.1).
                   Growing back (2 -> 3 after 3 -> 2) gives G and lr x 2/3 x 3/2 again: exact for G,
                   lr within floating-point rounding.
"""

from __future__ import annotations

from typing import Literal

BatchPolicy = Literal["keep-global", "keep-per-rank"]
BATCH_POLICIES = ("keep-global", "keep-per-rank")


def resized(policy: str, global_batch: int, lr: float, old_world: int, new_world: int) -> tuple[int, float]:
    """(global batch, learning rate) after the world goes from ``old_world`` to ``new_world`` ranks.

    keep-per-rank: G=12, lr=0.3, 3 -> 2 ranks gives (8, 0.2)."""
    if policy not in BATCH_POLICIES:
        raise ValueError(f"unknown batch policy {policy!r}; choose one of {', '.join(BATCH_POLICIES)}")
    if policy == "keep-global":
        return global_batch, lr
    per_rank = global_batch // old_world
    if per_rank * old_world != global_batch:
        raise ValueError(f"keep-per-rank needs the global batch {global_batch} to be a multiple of the "
                         f"{old_world} ranks")
    return per_rank * new_world, lr * new_world / old_world
