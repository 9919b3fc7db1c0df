"""Resuming a checkpoint, on the world size that wrote it or on another.

Vocabulary
    N, M      workers that wrote the checkpoint, workers resuming it
    b, a      samples per worker per micro-batch (--batch-size), micro-batches per step (--grad-accum)
    G         global batch = b x a x workers: samples per optimizer step
    P         position: samples of the interrupted epoch's order already trained on (data.EpochCursor)

What carries over: the weights (whole in every checkpoint), the optimizer state (whole: ZeRO-1
gathers it on save and keeps its own slices on load, ShardedOptimizer.load_state_dict), the step,
the epoch and P, so the epoch continues with exactly the samples not yet seen, whatever M is.

The batch (BatchPlan.for_resume): G stays as it was when M divides it: b x a = G / M per worker,
keeping a when it still divides (else a = 1); the learning rate stays as it was. When M does not
divide G, b and a stay, G becomes b x a x M, and the learning rate follows G as --lr-scaling says
(linear: x G'/G, sqrt: x sqrt(G'/G)). Either way, what changed is printed before the first step.
The run's length and warm-up when --epochs and --warmup-steps are not given (train/batch_math.py)
were decided when it started and are kept.
Example: a checkpoint of N=2 x b=32 x a=1 (G=64): M=1 -> b=64, G=64; M=4 -> b=16, G=64;
M=3 -> 64 does not divide by 3, so b=32 and G=96, lr x sqrt(1.5) (sqrt scaling).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gradsync as gs
from gradsync import checkpoint
from gradsync.train.batch_math import DEFAULT_EPOCHS, WARMUP_MIN_STEPS, default_epochs, default_warmup, lr_multiplier
from gradsync.train.config import TrainConfig
from gradsync.train.strategies import STRATEGIES, strategy
from gradsync.train.tasks import model_defaults

CHECKPOINT_NAME = "checkpoint.pt"
IDENTITY = ("model", "dataset", "strategy", "seed")
"""What must match for a checkpoint to continue a run; the batch is re-planned (BatchPlan)."""


@dataclass
class BatchPlan:
    batch_size: int
    grad_accum: int
    workers: int
    base_lr: float
    peak_lr: float
    changes: list[str] = field(default_factory=list)
    """What resuming on this world changed, in words (empty: nothing)."""
    epochs: int | None = None
    """The run's length in epochs (--epochs, or the default for its global batch); None: not recorded."""
    warmup_steps: int | None = None
    """The run's warm-up in steps (--warmup-steps, or the default); None: sized once the steps are known."""
    schedule: str = "constant"
    """--lr-schedule: what the lr does after the warm-up (train/optimizers.py)."""
    schedule_steps: int | None = None
    """S, the steps the schedule decays over (the run's planned steps); None: sized once the steps are known."""
    min_lr: float = 0.0
    """--min-lr: where cosine and linear end."""

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.grad_accum * self.workers

    def scheduled(self, cfg: TrainConfig, steps_per_epoch: int) -> TrainConfig:
        """``cfg`` with this plan's batch, length and warm-up filled in; a fresh run's default warm-up
        is sized here, from the steps it plans (--steps, or its epochs x ``steps_per_epoch``)."""
        planned = cfg.steps if cfg.steps is not None else self.epochs * steps_per_epoch
        if self.warmup_steps is None:
            self.warmup_steps = default_warmup(planned)
        if self.schedule_steps is None:
            self.schedule_steps = planned
        return dataclasses.replace(cfg, batch_size=self.batch_size, grad_accum=self.grad_accum, epochs=self.epochs,
                                   warmup_steps=self.warmup_steps, lr_schedule=self.schedule, min_lr=self.min_lr)

    @classmethod
    def fresh(cls, cfg: TrainConfig, workers: int, base_lr: float | None = None) -> "BatchPlan":
        """The plan of a new run on ``workers`` workers; ``base_lr``: the optimizer's lr for one worker's batch
        (None: --lr, else the model's default; the loop passes the optimizer's own, Task.optimizer). The lr
        follows the global batch where the strategy says so (DiLoCo's workers each step alone, on their own
        batch: its lr is not scaled, and its run is as long as the rule says, the same samples as ddp's)."""
        if base_lr is None:
            base_lr = cfg.lr if cfg.lr is not None else model_defaults(cfg.model).hyper["lr"]
        global_batch = cfg.batch_size * cfg.grad_accum * workers
        scaled = strategy(cfg.strategy).lr_scaled
        scale = lr_multiplier(cfg.lr_scaling, global_batch, cfg.batch_size) if scaled else 1.0
        epochs = cfg.epochs if cfg.epochs is not None else default_epochs(cfg.lr_scaling, global_batch, cfg.batch_size)
        return cls(cfg.batch_size, cfg.grad_accum, workers, base_lr, base_lr * scale, epochs=epochs,
                   warmup_steps=cfg.warmup_steps, schedule=cfg.lr_schedule or "constant", min_lr=cfg.min_lr)

    @classmethod
    def for_resume(cls, cfg: TrainConfig, workers: int, state: dict) -> "BatchPlan":
        """The plan that continues ``state`` on ``workers`` workers (see module docstring)."""
        saved = saved_plan(cfg, state)
        if workers == saved.workers:
            plan = cls(saved.batch_size, saved.grad_accum, workers, saved.base_lr, saved.peak_lr)
        elif saved.global_batch % workers == 0:
            per_worker = saved.global_batch // workers
            accum = saved.grad_accum if per_worker % saved.grad_accum == 0 else 1
            plan = cls(per_worker // accum, accum, workers, saved.base_lr, saved.peak_lr)
        else:
            new_global = saved.batch_size * saved.grad_accum * workers
            scale = (lr_multiplier(cfg.lr_scaling, new_global, saved.batch_size)
                     / lr_multiplier(cfg.lr_scaling, saved.global_batch, saved.batch_size))
            plan = cls(saved.batch_size, saved.grad_accum, workers, saved.base_lr, saved.peak_lr * scale)
        # the length and warm-up the run started with (older checkpoints: the defaults of their time)
        plan.epochs = cfg.epochs if cfg.epochs is not None else saved.epochs or DEFAULT_EPOCHS
        plan.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else \
            saved.warmup_steps if saved.warmup_steps is not None else WARMUP_MIN_STEPS
        # the schedule it started with: a resume continues the same curve (a flag given again replaces it)
        plan.schedule = cfg.lr_schedule or saved.schedule
        plan.schedule_steps, plan.min_lr = saved.schedule_steps, saved.min_lr
        if (plan.batch_size, plan.grad_accum) != (cfg.batch_size, cfg.grad_accum) or workers != saved.workers:
            plan.changes = _describe(saved, plan, cfg)
        return plan


def _describe(saved: BatchPlan, plan: BatchPlan, cfg: TrainConfig) -> list[str]:
    lines = [f"the checkpoint was written by {saved.workers} worker(s) x {saved.batch_size} per micro-batch x "
             f"{saved.grad_accum} accumulation = {saved.global_batch} global, lr {saved.peak_lr:g}; "
             f"this run has {plan.workers} worker(s)"]
    if plan.global_batch == saved.global_batch:
        lines.append(f"global batch {saved.global_batch} kept: {plan.batch_size} per worker per micro-batch x "
                     f"{plan.grad_accum} accumulation x {plan.workers} workers; lr {plan.peak_lr:g} kept")
    else:
        lines.append(f"global batch {saved.global_batch} does not divide over {plan.workers} workers: kept "
                     f"{plan.batch_size} per worker x {plan.grad_accum} accumulation, so the global batch is "
                     f"{plan.global_batch}; lr {saved.peak_lr:g} -> {plan.peak_lr:g} ({cfg.lr_scaling} scaling)")
    if (plan.batch_size, plan.grad_accum) != (cfg.batch_size, cfg.grad_accum):
        lines.append(f"--batch-size {cfg.batch_size} --grad-accum {cfg.grad_accum} on the command line are "
                     f"replaced by {plan.batch_size} and {plan.grad_accum}, from the checkpoint")
    return lines


def saved_plan(cfg: TrainConfig, state: dict) -> BatchPlan:
    """The batch the checkpoint's run trained with (older checkpoints: from their identity)."""
    if "batch" in state:
        b = state["batch"]
        return BatchPlan(b["batch_size"], b["grad_accum"], b["workers"], b["base_lr"], b["peak_lr"],
                         epochs=b.get("epochs"), warmup_steps=b.get("warmup_steps"),
                         schedule=b.get("schedule", "constant"), schedule_steps=b.get("schedule_steps"),
                         min_lr=b.get("min_lr", 0.0))
    identity = state["identity"]
    old_cfg = dataclasses.replace(cfg, batch_size=identity["batch_size"], grad_accum=identity["grad_accum"])
    old = BatchPlan.fresh(old_cfg, state["world_size"])
    old.epochs = old.warmup_steps = None   # not recorded: the defaults of their time
    return old


def family(value):
    """ddp, zero1 and local checkpoint the same things (whole weights, whole optimizer state), so one
    resumes the others: a job of 2 ddp workers may continue as one local process (the registry's family)."""
    return STRATEGIES[value].family if value in STRATEGIES else value


def _parent_started_at() -> float | None:
    """When this process's parent (a torchrun agent) started, in time.time() seconds (Linux /proc)."""
    try:
        fields = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return None


def wanted(cfg: TrainConfig) -> bool:
    """Resume? With --resume; and when a torchrun agent has restarted the workers
    (TORCHELASTIC_RESTART_COUNT >= 1: --max-restarts, or an elastic --nnodes MIN:MAX membership change)
    and finds a checkpoint in --out written since the agent started: the agent reruns the same command,
    which must continue the job, not start it over (an older checkpoint, from another job, is left alone).
    --resume auto (gradsync train settles it before the ranks start: train/requeue.py): when --out holds one."""
    if cfg.resume == "auto":
        return (Path(cfg.out) / CHECKPOINT_NAME).exists()
    if cfg.resume:
        return True
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) < 1:
        return False
    path = Path(cfg.out) / CHECKPOINT_NAME
    started = _parent_started_at()
    # /proc's start time has clock-tick resolution: one second of slack
    return path.exists() and (started is None or path.stat().st_mtime >= started - 1.0)


def agreed(cfg: TrainConfig) -> bool:
    """``wanted`` on any rank: the ranks resume together or not at all. A node that joins an elastic
    job later runs under a fresh agent (TORCHELASTIC_RESTART_COUNT 0) while the others' agents have
    restarted: deciding alone, it would start over while they continue. Every rank must then find
    the checkpoint in --out (a filesystem every node shares); one that does not raises, naming it."""
    w = gs.world()
    mine = wanted(cfg)
    if w.world_size == 1:
        return mine
    flag = torch.tensor([int(mine), int((Path(cfg.out) / CHECKPOINT_NAME).exists())])
    flags = gs.all_gather(flag).view(w.world_size, 2)
    if not bool(flags[:, 0].any()):
        return False
    missing = [rank for rank in range(w.world_size) if not flags[rank, 1]]
    if len(missing) == w.world_size:
        raise checkpoint.CheckpointError(f"--resume: {cfg.out} holds no checkpoint ({CHECKPOINT_NAME}) on any rank; "
                                         f"train without --resume to start a run there")
    if missing:
        asking = int(flags[:, 0].nonzero()[0])
        raise checkpoint.CheckpointError(
            f"rank {asking} resumes from {Path(cfg.out) / CHECKPOINT_NAME}, but rank(s) {missing} have no such file: "
            f"--out must be a directory every node shares (or pass --resume with a copy on every node)")
    return True


def read(cfg: TrainConfig) -> dict:
    """The checkpoint in ``cfg.out``, refused if it belongs to another run (IDENTITY)."""
    state = checkpoint.load(Path(cfg.out) / CHECKPOINT_NAME)
    mine = {k: family(getattr(cfg, k)) for k in IDENTITY}
    theirs = {k: family(state["identity"].get(k)) for k in IDENTITY}
    if mine != theirs:
        differing = {k: (theirs[k], mine[k]) for k in IDENTITY if mine[k] != theirs[k]}
        raise checkpoint.CheckpointError(f"the checkpoint belongs to a different run: (checkpoint, now) = {differing}")
    return state


def position_of(state: dict) -> int:
    """Samples of the interrupted epoch already trained on (older checkpoints stored whole batches)."""
    if "position" in state:
        return state["position"]
    identity = state["identity"]
    return state["batch_in_epoch"] * identity["batch_size"] * identity["grad_accum"] * state["world_size"]


def state_of(cfg: TrainConfig, plan: BatchPlan, model, optimizer, step: int, epoch: int, position: int,
             world_size: int) -> dict:
    """What a checkpoint holds (optimizer.state_dict() is collective for zero1: call on every rank)."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "epoch": epoch,
            "position": position, "batch_in_epoch": -(-position // plan.global_batch), "world_size": world_size,
            **run_record(cfg, plan), "rng_torch": torch.get_rng_state(),
            **({"rng_cuda": torch.cuda.get_rng_state_all()} if torch.cuda.is_available() else {})}


def run_record(cfg: TrainConfig, plan: BatchPlan) -> dict:
    """What every checkpoint says about its run: the batch it trained with, its identity, and the run key
    of the tracker run it records to (train/tracking.py), which a resume goes on with."""
    return {"batch": {"batch_size": plan.batch_size, "grad_accum": plan.grad_accum, "workers": plan.workers,
                      "base_lr": plan.base_lr, "peak_lr": plan.peak_lr, "epochs": plan.epochs,
                      "warmup_steps": plan.warmup_steps, "schedule": plan.schedule,
                      "schedule_steps": plan.schedule_steps, "min_lr": plan.min_lr},
            "identity": {**{k: getattr(cfg, k) for k in IDENTITY}, "batch_size": plan.batch_size,
                         "grad_accum": plan.grad_accum},
            "tracking": {"run_key": cfg.log_run}}


def apply(state: dict, model, optimizer) -> tuple[int, int, int]:
    """Load weights, optimizer state and RNG; return (step, epoch, position)."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng_torch"])
    if "rng_cuda" in state and torch.cuda.is_available() and len(state["rng_cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["rng_cuda"])   # a CPU run, or another GPU count, keeps its own
    return state["step"], state["epoch"], position_of(state)
