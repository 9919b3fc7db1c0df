"""gradsync bench scaling: the batch-size trap shown. The main job at W workers for each learning-rate
rule, side by side: what more workers do to the global batch, the steps, the accuracy and the time.

Every run is `gradsync train --workers W --lr-scaling R` on digits with the other flags at their
defaults (train/batch_math.py):

    none      lr as given; the default run keeps one worker's number of steps (8 W epochs)
    sqrt      lr x sqrt(W); 8 sqrt(W) epochs, sqrt(W) times fewer steps than one worker (the default)
    linear    lr x W (Goyal et al. 2017); 8 epochs whatever W, W times fewer steps

so each rule's default run has the same lr x steps as 8 epochs of one worker. At W=1 the three are
one run (k = 1), trained once. Per run: the global batch, optimizer steps, the final test accuracy,
the time to 95% (wall time from the first step to the first end-of-epoch evaluation at >= 95%, the
evaluations included; "-": never), training samples per second (the summary's) and whether the
launcher warned of the trap. ``with_flags`` adds the same flags to every run (--epochs 8 shows the
old default: every rule the same length).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gradsync.train.config import TrainConfig

RULES = ("linear", "sqrt", "none")
TARGET = 0.95
"""The accuracy whose time is measured."""


@dataclass(frozen=True)
class Plan:
    """What `gradsync bench scaling` runs (its flags)."""

    workers: tuple[int, ...] = (1, 2, 4, 8)
    """World sizes, in order."""
    rules: tuple[str, ...] = RULES
    """--lr-scaling rules, in order."""
    epochs: int | None = None
    """--epochs for every run; None: each rule's default length."""
    seed: int = 0
    """Every run's --seed."""
    out: str = "runs/scaling"
    """Each run's --out is out/w<W>-<rule>; emptied first."""
    timeout: float = 120.0
    """Seconds any wait between ranks may take."""

    def __post_init__(self) -> None:
        bad = [r for r in self.rules if r not in RULES]
        if bad or not self.rules:
            raise ValueError(f"--rules {','.join(self.rules)!r}: choose from {', '.join(RULES)}, comma-separated")
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"--workers {self.workers!r}: world sizes >= 1, e.g. 1,2,4,8")


def config(plan: Plan, workers: int, rule: str) -> TrainConfig:
    return TrainConfig(workers=workers, lr_scaling=rule, epochs=plan.epochs, seed=plan.seed, timeout=plan.timeout,
                       out=str(Path(plan.out) / f"w{workers}-{rule}"), quiet=True)


def read_run(out: str) -> dict:
    """A run's row from its metrics.jsonl: the start and summary records, the time to TARGET."""
    records = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    summary = [r for r in records if r["event"] == "summary"][-1]
    epochs = [r for r in records if r["event"] == "epoch"]
    reached = next((r["wall_s"] for r in epochs if r["accuracy"] >= TARGET), None)
    return {"global_batch": start["global_batch"], "peak_lr": start["peak_lr"], "epochs": len(epochs),
            "steps": summary["steps"], "accuracy": summary["accuracy"], "time_to_target_s": reached,
            "samples_per_s": summary["samples_per_s"], "wall_s": summary["wall_s"],
            "curve": [{"step": r["step"], "accuracy": r["accuracy"], "wall_s": r["wall_s"]} for r in epochs]}


def command(cfg: TrainConfig) -> list[str]:
    """The `gradsync train` command line of ``cfg`` (the flags this bench sets)."""
    argv = [sys.executable, "-m", "gradsync.cli", "train", "--workers", str(cfg.workers), "--lr-scaling",
            cfg.lr_scaling, "--seed", str(cfg.seed), "--timeout", f"{cfg.timeout:g}", "--out", cfg.out, "--quiet"]
    return argv + (["--epochs", str(cfg.epochs)] if cfg.epochs is not None else [])


def _train(cfg: TrainConfig) -> bool:
    """`gradsync train` with ``cfg``, as a user runs it (its output in train.log in its --out);
    whether the launcher warned of the trap."""
    with open(Path(cfg.out) / "train.log", "w") as log:
        done = subprocess.run(command(cfg), stdout=log, stderr=subprocess.STDOUT, timeout=30 * cfg.timeout)
    said = (Path(cfg.out) / "train.log").read_text()
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command(cfg))} exited with {done.returncode}: {said[-2000:]}")
    return "warning: the batch-size trap" in said


def run(plan: Plan) -> list[dict]:
    """Every (W, rule) run, one after another; a row each (W=1: one run, a row per rule)."""
    rows = []
    for workers in plan.workers:
        first = None
        for rule in plan.rules:
            cfg = config(plan, workers, rule)
            shutil.rmtree(cfg.out, ignore_errors=True)
            Path(cfg.out).mkdir(parents=True)
            if workers == 1 and first is not None:   # k = 1 for every rule: the same run
                rows.append({**first, "rule": rule, "same_as": first["rule"]})
                continue
            warned = _train(cfg)
            row = {"workers": workers, "rule": rule, **read_run(cfg.out), "warned": warned, "same_as": None}
            rows.append(row)
            first = first or row
    return rows


def figure(rows: list[dict], plan: Plan, png: Path) -> Path:
    """Final test accuracy and time to 95% against W, a line per rule; test accuracy against optimizer
    steps for the largest W."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png.parent.mkdir(parents=True, exist_ok=True)
    fig, (by_w, timed, curves) = plt.subplots(1, 3, figsize=(15, 4))
    largest = max(plan.workers)
    for rule in plan.rules:
        mine = [r for r in rows if r["rule"] == rule]
        by_w.plot([r["workers"] for r in mine], [100 * r["accuracy"] for r in mine], marker="o", label=rule)
        reached = [r for r in mine if r["time_to_target_s"] is not None]
        timed.plot([r["workers"] for r in reached], [r["time_to_target_s"] for r in reached], marker="o", label=rule)
        big = next(r for r in mine if r["workers"] == largest)
        curves.plot([p["step"] for p in big["curve"]], [100 * p["accuracy"] for p in big["curve"]], marker=".",
                    label=f"{rule}: G={big['global_batch']}, {big['steps']} steps")
    by_w.axhline(96, color="grey", linestyle=":", linewidth=1)
    by_w.set(title="final test accuracy", xlabel="workers W (global batch 32 W)", ylabel="%")
    timed.set(title=f"time to {TARGET:.0%} (never reached: not drawn)", xlabel="workers W", ylabel="seconds")
    curves.set(title=f"W={largest}: test accuracy after each epoch", xlabel="optimizer step", ylabel="%")
    for ax in (by_w, timed, curves):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, title="--lr-scaling", title_fontsize=8)
    for ax in (by_w, timed):
        ax.set_xticks(list(plan.workers))
    length = f"--epochs {plan.epochs}" if plan.epochs else "each rule's default length"
    fig.suptitle(f"gradsync bench scaling: digits CNN, 32 per worker, {length}, seed {plan.seed}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def save(rows: list[dict], plan: Plan, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"plan": dataclasses.asdict(plan), "rows": rows}, f)
