"""Test knobs of live mode: a member that kills itself at a planted point, so that tests and `gradsync bench
faults --live` can kill a rank exactly where they mean to.

GRADSYNC_LIVE_KILL=M:S:PHASE makes member M SIGKILL itself in step S (0-based) at PHASE:
    forward     after its forward, before its backward: the others wait for its gradients in the all-reduce
                (a parameter-server worker: before its push)
    optimizer   after the all-reduce, before its optimizer step (ddp)
    checkpoint  member M, rank 0 then, writes half of step S's checkpoint (S a multiple of
                --checkpoint-every's N) and dies
    evaluate    step S the last of an epoch: as the evaluation after it starts; the others wait for M in
                the evaluation's collectives, outside any step
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import torch

from gradsync import checkpoint

KILL_PHASES = ("forward", "optimizer", "checkpoint", "evaluate")


def planted_kill(member: int) -> tuple[int, str] | None:
    """(step, phase) at which this member kills itself (GRADSYNC_LIVE_KILL), or None."""
    text = os.environ.get("GRADSYNC_LIVE_KILL", "")
    if not text:
        return None
    try:
        who, step, phase = text.split(":")
        who, step = int(who), int(step)
    except ValueError:
        raise ValueError(f"GRADSYNC_LIVE_KILL={text!r}: give MEMBER:STEP:PHASE, e.g. 1:5:forward") from None
    if phase not in KILL_PHASES:
        raise ValueError(f"GRADSYNC_LIVE_KILL phase {phase!r} is not one of {', '.join(KILL_PHASES)}")
    return (step, phase) if who == member else None


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def die_writing(path: Path, state: dict) -> None:
    """The checkpoint kill: half of the checkpoint's temporary file written, then SIGKILL."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open(checkpoint.temporary(path, os.getpid()), "wb") as f:
        f.write(buffer.getvalue()[:buffer.tell() // 2])
        f.flush()
        os.fsync(f.fileno())
    die()
