"""The experiment trackers of `gradsync train --log`, fed by the reporting rank, and the one tracker run
a training run records to from its start through every resume and every change of a live world.

Vocabulary
    reporting rank  the rank that writes metrics.jsonl and prints (train/report.py): the first that
                    trains; in a live world that lost it, the first of the survivors
    run key         the tracker run's name: drawn by rank 0 when a run starts (or --log-run), broadcast
                    to every rank, kept in every checkpoint (resume.run_record's "tracking") and read
                    back by --resume, so a resumed run records to the same tracker run
    logged step     every --log-every'th step (10, 20, ...), counted from the run's start: the
                    training figures, each rank's timings (train/loop.py gathers them on those steps
                    only) and, at each evaluation, the test figures

A resume records from the checkpoint's step on: a preemption's checkpoint is at the step the run
stopped after, so nothing was recorded past it; after a crash, each tracker keeps what was recorded
past the checkpoint once (trackers/base.py's purge_after). Only the reporting rank imports a
tracker's package: when the run starts, or when it becomes the reporting rank of a live world.
"""

from __future__ import annotations

import secrets
import string

import torch

import gradsync as gs
from gradsync.train.trackers import TRACKERS, tracker_names

KEY_ALPHABET = string.digits + string.ascii_lowercase
KEY_LENGTH = 8
"""A run key is 8 characters of [0-9a-z], as W&B's own run ids: 36^8 = 2.8e12 of them."""


def _draw_key() -> str:
    # the secrets module, not torch: torch's generator is seeded for the model and the data
    return "".join(secrets.choice(KEY_ALPHABET) for _ in range(KEY_LENGTH))


def _as_number(key: str) -> int:
    return int(key, 36)


def _as_key(number: int) -> str:
    digits = []
    for _ in range(KEY_LENGTH):
        number, digit = divmod(number, 36)
        digits.append(KEY_ALPHABET[digit])
    return "".join(reversed(digits))


def run_key(cfg, saved: dict | None, joining: bool) -> str:
    """The run key (module docstring): --log-run, else the checkpoint's, else rank 0's draw, broadcast (one
    int64). A live replacement joins a world past its start: it takes the key from the checkpoint in --out."""
    if cfg.log_run:
        return cfg.log_run
    if saved is not None and saved.get("tracking", {}).get("run_key"):
        return saved["tracking"]["run_key"]
    if joining:
        return _key_of_checkpoint(cfg) or _draw_key()
    number = torch.tensor([_as_number(_draw_key())], dtype=torch.int64)
    if gs.world().world_size > 1:
        gs.broadcast(number, src=0)
    return _as_key(int(number))


def _key_of_checkpoint(cfg) -> str | None:
    from pathlib import Path

    from gradsync import checkpoint
    from gradsync.train.resume import CHECKPOINT_NAME

    try:
        return checkpoint.load(Path(cfg.out) / CHECKPOINT_NAME).get("tracking", {}).get("run_key")
    except checkpoint.CheckpointError:
        return None


class Tracking:
    """The trackers --log names, opened on the reporting rank (module docstring)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.names = tracker_names(cfg.log)
        self.trackers: list | None = None

    def open(self, purge_after: int | None) -> None:
        """Open every tracker (on the reporting rank); ``purge_after``: trackers/base.py."""
        from pathlib import Path

        if self.trackers is None and self.names:
            self.trackers = [TRACKERS[name].load()(Path(self.cfg.out), self.cfg.log_run, purge_after)
                             for name in self.names]

    def log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` at ``step``; a rank that reports for the first time now (a live world's new
        reporting rank) opens the tracker run the one before it recorded to."""
        if not self.names or not values:
            return
        self.open(purge_after=None)
        for tracker in self.trackers:
            tracker.log(step, values)

    def finish(self, done: bool) -> None:
        """Close every open tracker run (done: the training run finished; else a resume goes on with it)."""
        trackers, self.trackers = self.trackers or [], None
        for tracker in trackers:
            tracker.finish(done)
