"""One step's work on one rank: which samples it trains, and their forward and backward.

Vocabulary (data.EpochCursor)
    G, P      global batch, and the position: samples of the epoch's order already trained
    share     this rank's samples of the step at P: slot ``slot`` of ``slots`` (the strategy's where())
    a         micro-batches a step (--grad-accum): the share in ``a`` contiguous chunks whose sizes
              differ by at most one (chunks); all but the last backward run under the strategy's no_sync
    w         a micro-batch's weight: its mean loss is multiplied by w = len(ids) x s, with
                  s = W / step samples                  'step' strategies: the W ranks' averaged gradient
                                                        is the mean over the step's samples
                  s = (W / slots) / len(share)          'own' strategies: the rank's own share's mean (W =
                                                        slots but after a live parameter-server worker died:
                                                        then each push still weighs 1 / slots of a step)
              so an epoch's last, shorter step is weighed right however unevenly its samples fall. A
              micro-batch with no sample computes one with weight 0 (its gradient hooks still fire).

Test knob: GRADSYNC_SAMPLE_LOG=DIR makes every rank that trains append the ids of each step it starts:
"epoch id id ..." to DIR/samples.<pid>.r<rank>; in live mode "step epoch id id ..." to
DIR/live.<pid>.m<member> (a step tried again is written again: the last line of a step counts).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from gradsync.train.live_knobs import die


def chunks(ids: list[int], parts: int) -> list[list[int]]:
    """``ids`` in ``parts`` contiguous pieces whose sizes differ by at most one (10 in 3: 4, 3, 3)."""
    size, extra = divmod(len(ids), parts)
    bounds = [m * size + min(m, extra) for m in range(parts + 1)]
    return [ids[bounds[m]:bounds[m + 1]] for m in range(parts)]


def on(device: torch.device, batch):
    """A batch's tensors on ``device`` (asynchronous where the source is pinned), nested as it is."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: on(device, value) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(on(device, value) for value in batch)
    return batch


def weighed(share: list[int], parts: int, scale: float, filler: int) -> list[tuple[list[int], float]]:
    """The share's micro-batches with their weights w = len(ids) x ``scale`` (module docstring); an empty one
    computes the sample ``filler`` with weight 0."""
    return [(ids or [filler], len(ids) * scale) for ids in chunks(share, parts)]


def share_scale(rule: str, trainers: int, slots: int, step_size: int, share_size: int) -> float:
    """s of the module docstring, for the strategy's share ``rule`` ('step' or 'own')."""
    return trainers / step_size if rule == "step" else (trainers / slots) / max(share_size, 1)


@dataclass
class Chosen:
    """The samples of one step on this rank, fetched."""

    epoch: int
    position: int
    step_size: int
    share: list[int]
    batches: list
    weights: list[float]


class StepWork:
    """A rank's step: choose() the samples, compute() their forward and backward (module docstring)."""

    def __init__(self, run) -> None:
        self.run = run
        self._orders: dict[int, list[int]] = {}
        self.loss_sum = 0.0
        self.chosen: Chosen | None = None
        self.sample_log = None
        log_dir = os.environ.get("GRADSYNC_SAMPLE_LOG")
        if log_dir and run.trains:
            name = f"live.{os.getpid()}.m{run.strategy.member}" if run.live else f"samples.{os.getpid()}.r{run.rank}"
            self.sample_log = open(Path(log_dir) / name, "a", buffering=1)  # noqa: SIM115

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            self._orders = {epoch: self.run.cursor.order(epoch)}   # one epoch's order at a time
        return self._orders[epoch]

    def choose(self) -> Chosen:
        run, strategy = self.run, self.run.strategy
        cursor = run.cursor
        epoch, position, slot, slots = strategy.where(cursor)
        order = self._order(epoch)
        step_size = cursor.step_size(position)
        share = cursor.share(order, position, slots, slot)
        scale = share_scale(run.declared.share, strategy.trainers()[1], slots, step_size, len(share))
        micro = weighed(share, run.cfg.grad_accum, scale, filler=order[position])
        self.chosen = Chosen(epoch, position, step_size, share, [run.fetch(ids) for ids, _ in micro],
                             [weight for _, weight in micro])
        return self.chosen

    def compute(self, forward, no_sync, chosen: Chosen) -> dict:
        """Forward and backward of ``chosen``'s micro-batches through ``forward`` (the strategy's model),
        forward and loss under --precision's autocast, backward of the loss times fp16-mixed's scale;
        the progress after the step."""
        run, strategy = self.run, self.run.strategy
        if self.sample_log is not None:   # before the step: a member that dies after its reduction trained these
            prefix = f"{strategy.step + 1} " if run.live else ""
            self.sample_log.write(f"{prefix}{chosen.epoch} {' '.join(map(str, chosen.share))}\n")
        self.loss_sum = 0.0
        last = len(chosen.batches) - 1
        precision = run.precision
        for micro, (batch, weight) in enumerate(zip(chosen.batches, chosen.weights)):
            with no_sync(micro == last):
                with precision.autocast():   # forward and loss (train/precision.py); backward outside it
                    loss, _ = run.task.loss(forward, batch)
                if run.kill == (strategy.step, "forward"):
                    die()
                weighted = loss * weight
                precision.scaled(weighted).backward()
            self.loss_sum += float(weighted.detach())
        position = chosen.position + chosen.step_size
        if position >= run.cursor.n:
            return {"epoch": chosen.epoch + 1, "position": 0}
        return {"epoch": chosen.epoch, "position": position}

    def close(self) -> None:
        if self.sample_log is not None:
            self.sample_log.close()
