"""The batch-size trap in numbers: how the learning rate follows the global batch, how long the
default run is, and when a run is in the trap (said before training; `gradsync doctor` gives the
same advice when a loss spikes after the warm-up).

Vocabulary
    b     samples per worker per micro-batch (--batch-size);  a  micro-batches a step (--grad-accum)
    W     workers that train (a parameter-server job: --workers - --servers)
    G     global batch = b x a x W: samples per optimizer step;  N  training samples
    k     learning-rate multiplier for G: 1 (--lr-scaling none), sqrt(G/b) (sqrt), G/b (linear)
    S     optimizer steps of the run;  ceil(N/G) of them an epoch (the last one shorter)

The rules (docs/train.md, "The batch size and the learning rate", with the measurements):
    lr      = base lr x k. linear: Goyal et al. 2017; sqrt: Krizhevsky 2014, Hoffer et al. 2017,
              and for Adam-like optimizers Malladi et al. 2022; none: the lr as given.
    epochs  = ceil(E0 x (G/b) / k), E0 = DEFAULT_EPOCHS, unless --epochs or --steps is given: the run
              keeps lr x S, its length in units of the learning rate, equal to E0 epochs of one worker
              at the base lr (lr x S = k x base x E0 x N/G x (G/b)/k = base x E0 x N/b, whatever G).
              linear: E0 epochs whatever G (Goyal's recipe); none: the same number of steps as one
              worker (Hoffer et al.'s "train longer"); sqrt: E0 x sqrt(G/b) epochs, sqrt(G/b) times
              fewer steps than one worker. Example, digits (N=1,437, b=32), sqrt: W=2 -> 12 epochs,
              276 steps; W=8 -> 23 epochs, 138 steps (linear: 8 epochs, 48 steps).
    warm-up = max(WARMUP_MIN_STEPS, ceil(WARMUP_SHARE x S)) steps of linear warm-up from 0, unless
              --warmup-steps is given: Goyal et al.'s gradual warm-up (5 of 90 epochs), sized to the run.

Both are decided when a run starts and kept by a resume (the checkpoint's batch record).

The trap (trap_findings), each with what to change:
    short     S < SETTLE_WARMUPS x warm-up: the run ends before it has settled at its peak lr
    brief     lr x S < SHORT_LR_TIME x base x E0 x N/b: the learning rate has too little time to travel
    linear    --lr-scaling linear with G > N / LINEAR_STEPS_PER_EPOCH: a step sees so large a share of the
              data that the gradient barely carries noise any more; the linear rule assumes a batch below
              that point (McCandlish et al. 2018's critical batch) and its k-times lr overshoots
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_EPOCHS = 8
"""E0: epochs of one worker's batch at the base lr that the default run's length matches."""
WARMUP_MIN_STEPS = 20
"""The shortest default warm-up, in optimizer steps."""
WARMUP_SHARE = 0.05
"""The default warm-up's share of the run's steps (Goyal et al.: 5 of 90 epochs)."""
SETTLE_WARMUPS = 5
"""A run shorter than this many warm-ups ends before it settles (warned)."""
SHORT_LR_TIME = 0.6
"""A run whose lr x S is below this share of the default's is too brief (warned)."""
LINEAR_STEPS_PER_EPOCH = 8
"""Linear scaling with fewer steps an epoch than this (G > N/8) is past its range (warned)."""
LR_SCALING = ("none", "linear", "sqrt")
"""--lr-scaling's choices."""


def lr_multiplier(rule: str, global_batch: int, batch_size: int) -> float:
    """k for ``rule``: how many times the base lr (set for ``batch_size`` samples) the step of
    ``global_batch`` samples takes."""
    ratio = global_batch / batch_size
    if rule == "linear":
        return ratio
    if rule == "sqrt":
        return math.sqrt(ratio)
    if rule == "none":
        return 1.0
    raise ValueError(f"--lr-scaling {rule!r} is not one of: {', '.join(LR_SCALING)}")


def default_epochs(rule: str, global_batch: int, batch_size: int) -> int:
    """ceil(E0 x (G/b) / k): the epochs whose lr x S equals E0 epochs of one worker (module docstring).
    W=8 x b=32, sqrt: ceil(8 x 8 / 2.83) = 23."""
    exact = DEFAULT_EPOCHS * (global_batch / batch_size) / lr_multiplier(rule, global_batch, batch_size)
    return max(1, math.ceil(round(exact, 9)))


def default_warmup(total_steps: int) -> int:
    """max(20, ceil(5% of the run's steps)): 20 for every digits run, 264 for charlm's 5,280 at W=2."""
    return max(WARMUP_MIN_STEPS, math.ceil(WARMUP_SHARE * total_steps))


def steps_per_epoch(samples: int, global_batch: int) -> int:
    """ceil(N/G): the epoch's last step takes what is left (data.EpochCursor)."""
    return -(-samples // global_batch)


@dataclass(frozen=True)
class RunShape:
    """What the batch math says about one run, before it starts."""

    rule: str
    """--lr-scaling."""
    batch_size: int
    """b, samples per worker per micro-batch."""
    global_batch: int
    """G."""
    samples: int
    """N, training samples."""
    epochs: int | None
    """--epochs (None: the default length)."""
    steps: int | None
    """--steps (None: from the epochs)."""
    warmup_steps: int | None
    """--warmup-steps (None: the default warm-up)."""

    @property
    def multiplier(self) -> float:
        return lr_multiplier(self.rule, self.global_batch, self.batch_size)

    @property
    def steps_per_epoch(self) -> int:
        return steps_per_epoch(self.samples, self.global_batch)

    @property
    def planned_epochs(self) -> int:
        return self.epochs if self.epochs is not None else default_epochs(self.rule, self.global_batch, self.batch_size)

    @property
    def total_steps(self) -> int:
        return self.steps if self.steps is not None else self.planned_epochs * self.steps_per_epoch

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else default_warmup(self.total_steps)

    @property
    def lr_time_share(self) -> float:
        """lr x S over the default's lr x S (base x E0 x N/b, in units of the base lr)."""
        reference = DEFAULT_EPOCHS * steps_per_epoch(self.samples, self.batch_size)
        return self.multiplier * self.total_steps / reference


def trap_findings(shape: RunShape) -> list[str]:
    """What puts ``shape`` in the trap (module docstring), in words; empty: nothing."""
    found = []
    s, w = shape.total_steps, shape.warmup
    if s < SETTLE_WARMUPS * w:
        found.append(f"{s:,} optimizer steps, {w:,} of them warm-up: the run ends before it settles "
                     f"(fewer than {SETTLE_WARMUPS} warm-ups long)")
    if shape.lr_time_share < SHORT_LR_TIME:
        found.append(f"lr x steps is {shape.lr_time_share:.0%} of what {DEFAULT_EPOCHS} epochs of one worker's batch "
                     f"take: too brief a run for this global batch")
    if shape.rule == "linear" and shape.global_batch * LINEAR_STEPS_PER_EPOCH > shape.samples:
        found.append(f"--lr-scaling linear multiplies the lr by {shape.multiplier:.3g} while each step takes "
                     f"{shape.global_batch / shape.samples:.0%} of the data set ({shape.steps_per_epoch} steps an "
                     f"epoch): past the batch where the linear rule holds")
    return found


def advice(shape: RunShape) -> str:
    """What to change so that ``shape`` leaves the trap: linear scaling gives way to sqrt, the length
    to the rule's default one (what no --epochs gives), a given warm-up to a fifth of the run at most."""
    past_linear = shape.global_batch * LINEAR_STEPS_PER_EPOCH > shape.samples
    short = shape.total_steps < SETTLE_WARMUPS * shape.warmup
    rule = "sqrt" if shape.rule == "linear" and (past_linear or short) else shape.rule
    epochs = default_epochs(rule, shape.global_batch, shape.batch_size)
    steps = epochs * shape.steps_per_epoch
    changes = [f"--lr-scaling {rule}"] if rule != shape.rule else []
    if shape.total_steps < steps:
        changes.append(f"--epochs {epochs} ({steps:,} steps: {rule} scaling's default length for this global batch, "
                       f"what no --epochs gives)")
    if shape.warmup_steps is not None and SETTLE_WARMUPS * shape.warmup > max(steps, shape.total_steps):
        changes.append(f"--warmup-steps {max(steps, shape.total_steps) // SETTLE_WARMUPS} or fewer")
    if not changes:
        return "use a smaller global batch (fewer --workers, a smaller --grad-accum or --batch-size)"
    return "use " + " and ".join(changes)


def trap_warning(shape: RunShape) -> str | None:
    """One line: why ``shape`` is in the trap and what to change; None when it is not."""
    found = trap_findings(shape)
    if not found:
        return None
    return (f"warning: the batch-size trap: global batch {shape.global_batch:,} ({shape.global_batch / shape.samples:.0%} "
            f"of {shape.samples:,} samples), lr x {shape.multiplier:.3g} ({shape.rule} scaling): " + "; ".join(found)
            + f"; {advice(shape)}")
