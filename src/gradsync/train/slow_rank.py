"""Test knob: a rank made slow on purpose from a given step on, so that tests (and a reader trying
`gradsync doctor`) see a straggler appear partway through a run.

GRADSYNC_SLOW_RANK=R:K:MS makes rank R sleep MS milliseconds at the start of every step after its K-th
(the steps numbered K+1, K+2, ... as the loop counts them from 1), before it computes: the sleep is
part of its step time and of its compute, and the other ranks of a synchronous strategy wait for it in
their reductions (their exposed wait grows). Rank R is the rank the run started with.
"""

from __future__ import annotations

import os


def planted_delay(rank: int) -> tuple[int, float] | None:
    """(K, seconds) for this rank (GRADSYNC_SLOW_RANK), or None."""
    text = os.environ.get("GRADSYNC_SLOW_RANK", "")
    if not text:
        return None
    try:
        who, after, millis = text.split(":")
        who, after, millis = int(who), int(after), float(millis)
    except ValueError:
        raise ValueError(f"GRADSYNC_SLOW_RANK={text!r}: give RANK:STEP:MILLISECONDS, e.g. 1:30:50") from None
    if after < 0 or not millis >= 0:
        raise ValueError(f"GRADSYNC_SLOW_RANK={text!r}: the step and the milliseconds must be >= 0")
    return (after, millis / 1000.0) if who == rank else None
