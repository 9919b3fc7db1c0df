"""gradsync bench slowlinks: ring DDP, PowerSGD and DiLoCo trained side by side, same samples, same seed.

The two ways gradsync sends less over slow links, held against the way that sends everything:

    ring      --strategy ddp --algorithm ring: every step one ring all-reduce of the gradient,
              2(N-1)/N * M bytes sent per rank (M: the gradient's bytes)
    powersgd  --compress powersgd --powersgd-rank r (ddp/powersgd.py): after 10 plain steps, each
              gradient matrix as rank-r factors, 2(N-1)/N * rho * M a step (rho: the share sent)
    diloco    --strategy diloco --sync-every H (diloco.py): each rank trains alone; every H steps one
              all-reduce of the parameters, 2(N-1)/N * M every H steps (and at each epoch's end)

Tasks: digits (the CNN, whole epochs) and charlm (the byte-level transformer on the standard library's
source, a fixed number of steps). Every run of a task is `gradsync train` with the same samples in the
same order (the same --seed and global batch: data.EpochCursor), all of them in one world of
``workers`` ranks, one after another (train/loop.py's train_worker, so the runs are the command's).

Measured per run: the test set's accuracy and loss after the last step (train/evaluation.py's exact
evaluation), the bytes each rank sent (the traffic meter, gs.traffic(): every byte of the run,
evaluations included), and per step rank 0's training loss and bytes sent so far (metrics.jsonl),
the curves the figure draws. ``vs ring`` is a run's bytes per rank over ring DDP's for the same task.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path

import gradsync as gs
from gradsync.train.config import TrainConfig

TASKS = {"digits": {"model": "cnn", "dataset": "digits"}, "charlm": {"model": "charlm", "dataset": "stdlib-text"}}
STRATEGIES = ("ring", "powersgd", "diloco")
TARGETS = {("digits", "powersgd"): (0.95, 1 / 4), ("digits", "diloco"): (0.95, 1 / 6)}
"""The issue's targets on digits: (least test accuracy, most bytes as a share of ring DDP's)."""
SMOOTHING = 8
"""Steps in the moving average of the training loss the figure draws (one DiLoCo round at H = 8)."""


@dataclass(frozen=True)
class Plan:
    """What `gradsync bench slowlinks` runs (its flags)."""

    workers: int = 2
    """Ranks of every run."""
    tasks: tuple[str, ...] = ("digits", "charlm")
    """Which of TASKS, in order."""
    digits_epochs: int = 8
    """Epochs of digits (docs/train.md's numbers are of 8)."""
    charlm_steps: int = 300
    """Optimizer steps of charlm."""
    steps: int | None = None
    """If set: every task this many steps instead (small runs, tests)."""
    batch_size: int = 32
    """Samples per rank per step (charlm: windows of 64 bytes)."""
    powersgd_rank: int = TrainConfig.powersgd_rank
    """PowerSGD's r."""
    sync_every: int = TrainConfig.sync_every
    """DiLoCo's H."""
    outer_lr: float = TrainConfig.outer_lr
    """DiLoCo's outer learning rate."""
    outer_momentum: float = TrainConfig.outer_momentum
    """DiLoCo's outer Nesterov momentum."""
    seed: int = 0
    """Every run's --seed: the model's initialisation and the order of the samples."""
    out: str = "runs/slowlinks"
    """Each run's --out is out/<task>-<strategy> (metrics.jsonl, checkpoints); emptied first."""
    timeout: float = 120.0
    """Seconds any wait between ranks may take."""

    def __post_init__(self) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"--tasks {','.join(self.tasks)!r}: choose from {', '.join(TASKS)}, comma-separated")
        if self.workers < 2:
            raise ValueError(f"--workers {self.workers}: the strategies differ only in what ranks send each other; "
                             f"use 2 or more")


def label(strategy: str, plan: Plan) -> str:
    return {"ring": "ring DDP", "powersgd": f"PowerSGD r={plan.powersgd_rank}",
            "diloco": f"DiLoCo H={plan.sync_every}, outer lr {plan.outer_lr:g}"}[strategy]


def config(plan: Plan, task: str, strategy: str) -> TrainConfig:
    """The `gradsync train` run of ``strategy`` on ``task`` (module docstring)."""
    length = ({"steps": plan.steps} if plan.steps else
              {"epochs": plan.digits_epochs} if task == "digits" else {"steps": plan.charlm_steps})
    how = {"ring": {"strategy": "ddp"}, "powersgd": {"strategy": "ddp", "compress": "powersgd"},
           "diloco": {"strategy": "diloco"}}[strategy]
    return TrainConfig(workers=plan.workers, algorithm="ring", **TASKS[task], **length, **how,
                       batch_size=plan.batch_size, powersgd_rank=plan.powersgd_rank, sync_every=plan.sync_every,
                       outer_lr=plan.outer_lr, outer_momentum=plan.outer_momentum, seed=plan.seed,
                       out=str(Path(plan.out) / f"{task}-{strategy}"), timeout=plan.timeout, quiet=True)


def _train_each(configs: list[TrainConfig]) -> list[dict | None]:
    """On every rank of one world: each run in turn; rank 0's summaries. What a run prints (its
    summary table) goes to train.log in its --out, so the bench's own table stands alone."""
    from gradsync.train.loop import train_rank

    summaries = []
    for cfg in configs:
        with open(Path(cfg.out) / "train.log", "a") as log, contextlib.redirect_stdout(log):
            summaries.append(train_rank(cfg)["summary"])
    return summaries


def read_curve(out: str) -> dict:
    """A run's curves from its metrics.jsonl: per step rank 0's loss and bytes sent so far; per
    evaluation the step, test loss and accuracy."""
    steps, losses, sent, evaluations = [], [], [], []
    for line in (Path(out) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["event"] == "step":
            steps.append(record["step"])
            losses.append(record["loss"])
            sent.append(record["bytes_sent"])
        elif record["event"] == "epoch":
            evaluations.append({"step": record["step"], "test_loss": record["test_loss"],
                                "accuracy": record["accuracy"]})
    return {"step": steps, "loss": losses, "bytes_sent": sent, "evaluations": evaluations}


def run(plan: Plan) -> tuple[list[dict], dict]:
    """Every task's three runs; (rows, curves[task][strategy])."""
    runs = [(task, strategy, config(plan, task, strategy)) for task in plan.tasks for strategy in STRATEGIES]
    for _, _, cfg in runs:   # a run's metrics.jsonl is appended to: start each from nothing
        shutil.rmtree(cfg.out, ignore_errors=True)
        Path(cfg.out).mkdir(parents=True)
    summaries = gs.spawn(_train_each, nprocs=plan.workers, args=([cfg for _, _, cfg in runs],),
                         timeout=plan.timeout)[0]
    rows, curves = [], {}
    for (task, strategy, cfg), summary in zip(runs, summaries):
        curve = curves.setdefault(task, {})[strategy] = read_curve(cfg.out)
        tail = curve["loss"][-max(1, len(curve["loss"]) // 10):]
        rows.append({"task": task, "strategy": strategy, "label": label(strategy, plan), "model": cfg.model,
                     "steps": summary["steps"], "accuracy": summary["accuracy"], "test_loss": summary["test_loss"],
                     "final_train_loss": statistics.fmean(tail),
                     "bytes_per_rank": max(summary["bytes_sent_per_rank"]), "wall_s": summary["wall_s"]})
    for row in rows:
        ring = next(r for r in rows if r["task"] == row["task"] and r["strategy"] == "ring")
        row["vs_ring"] = row["bytes_per_rank"] / ring["bytes_per_rank"]
        row["target"] = target_verdict(row)
    return rows, curves


def target_verdict(row: dict) -> str | None:
    """"met" / "not met (...)" against the issue's target for this task and strategy; None if it has none."""
    if (row["task"], row["strategy"]) not in TARGETS:
        return None
    accuracy, share = TARGETS[row["task"], row["strategy"]]
    misses = ([f"accuracy {row['accuracy']:.1%} < {accuracy:.0%}"] if row["accuracy"] < accuracy else []) + \
             ([f"bytes 1/{1 / row['vs_ring']:.1f} of ring's > 1/{1 / share:.0f}"] if row["vs_ring"] > share else [])
    return "met" if not misses else "not met: " + "; ".join(misses)


def smoothed(values: list[float], window: int = SMOOTHING) -> list[float]:
    """Trailing moving average over up to ``window`` values."""
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def figure(curves: dict, plan: Plan, png: Path) -> Path:
    """Per task: training loss (rank 0's, smoothed over SMOOTHING steps) vs step and vs MB sent by rank 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(len(curves), 2, figsize=(11, 3.8 * len(curves)), squeeze=False)
    for (task, runs), (by_step, by_bytes) in zip(curves.items(), axes):
        for strategy, curve in runs.items():
            loss = smoothed(curve["loss"])
            by_step.plot(curve["step"], loss, label=label(strategy, plan))
            by_bytes.plot([b / 1e6 for b in curve["bytes_sent"]], loss, label=label(strategy, plan))
        by_step.set(title=f"{task}: training loss vs step", xlabel="step", ylabel=f"loss ({SMOOTHING}-step mean)")
        by_bytes.set(title=f"{task}: training loss vs bytes sent", xlabel="MB sent by rank 0",
                     ylabel=f"loss ({SMOOTHING}-step mean)")
        by_bytes.set_xscale("symlog", linthresh=1.0)
        for ax in (by_step, by_bytes):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"gradsync bench slowlinks: {plan.workers} ranks, same samples and seed", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def save(rows: list[dict], curves: dict, plan: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"plan": dataclasses.asdict(plan), "rows": rows, "curves": curves}, f)
