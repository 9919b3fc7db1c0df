"""What `gradsync train` checks in the launcher, before any rank starts: the task's factories import and
give a model and map-style data whose batch the loss takes (train/task.py), the batch fits the data,
and --out is never overwritten or appended to without being asked; a new run in the batch-size trap
is warned about (one line, batch_math.py), and trains.

Vocabulary
    run        what one `gradsync train` command, with its resumes, leaves in --out: RUN_FILES
    default    --out DEFAULT_OUT: the README's first command may be run again; the run there is
               replaced, saying so in one line
    named      any other --out: a run there is refused (one line: what is there, the ways forward:
               --resume, another --out, --overwrite), never appended to or overwritten silently
    finished   a checkpoint with no step left for this command (--steps, or --epochs) to train

Each check fails with one line naming the flag and what is accepted (ValueError, printed by
gradsync's main with exit status 2), in well under a second for the built-in tasks (the task check
calls the factories once: a user's data factory costs what it costs): nothing here starts a rank.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from gradsync import checkpoint
from gradsync.train import precision
from gradsync.train.batch_math import DEFAULT_EPOCHS, RunShape, trap_warning
from gradsync.train.config import TrainConfig
from gradsync.train.resume import CHECKPOINT_NAME, IDENTITY, family
from gradsync.train.sparse_rows import sparse_modules
from gradsync.train.strategies import strategy
from gradsync.train.task import Task, TaskData
from gradsync.train.trackers import check_installed, tracker_names

DEFAULT_OUT = "runs/latest"
"""--out when none is given (TrainConfig.out)."""
RUN_FILES = ("checkpoint.pt", "metrics.jsonl", "trace.json", "trace.rank*.json", "replica*.pt", "train.log")
"""What a run writes in --out (patterns): what replacing a run removes, and nothing else."""
RUN_FOLDERS = ("tensorboard", "wandb", "mlruns")
"""The folders --log's trackers write in --out (train/trackers/): replacing a run removes them too."""


def check_task(cfg: TrainConfig) -> tuple[Task, torch.nn.Module, TaskData]:
    """The task's factories imported, called and checked (Task.check), its optimizer, and what the strategy
    asks of the model: one line naming the flag for each failure. Then check_batch, and Task.probe."""
    task = Task.of(cfg)
    task.optimizer(cfg)
    torch.manual_seed(cfg.seed)
    model = task.build_model()
    declared = strategy(cfg.strategy)
    if declared.serves:
        tables = sorted(sparse_modules(model))
        if tables and cfg.fault_tolerance == "live":
            raise RuntimeError(f"--strategy {cfg.strategy} --fault-tolerance live does not support sparse tables "
                               f"({', '.join(tables)} of --model {cfg.model}): their rows in flight are not "
                               f"recovered; use --fault-tolerance restart")
        if tables and cfg.device == "cuda":
            raise RuntimeError(f"--device cuda: the sparse tables {', '.join(tables)} of --model {cfg.model} train on "
                               f"the CPU under a parameter server (their rows travel as sparse gradients); use "
                               f"--device cpu or auto")
    return task, model, task.build_data()


def check_device(cfg: TrainConfig) -> None:
    """--device cuda needs a GPU torch can see; with it, each spawned rank takes GPU local rank mod GPU
    count before it meets the others (GRADSYNC_BIND_GPU: device_path.bind_gpu), so that ranks with a
    GPU each settle on NCCL. --precision's autocast must run on the device the ranks train on."""
    if cfg.device == "cuda" or cfg.device == "auto":
        if torch.cuda.is_available():
            os.environ["GRADSYNC_BIND_GPU"] = "1"
        elif cfg.device == "cuda":
            raise ValueError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is "
                             "False); use --device cpu or auto")
    on_gpu = cfg.device != "cpu" and torch.cuda.is_available()
    precision.check(cfg.precision, "cuda" if on_gpu else "cpu")   # an autocast this torch cannot run here


def check_trackers(cfg: TrainConfig) -> None:
    """--log's trackers are installed: one line naming the install command for the first that is not."""
    check_installed(tracker_names(cfg.log))


def check_batch(cfg: TrainConfig, samples: int) -> None:
    """A step must fit in an epoch: per-worker batch x accumulation x the workers that train <= the
    training samples (``samples``)."""
    if cfg.resume:   # a resume re-plans the batch from its checkpoint (resume.py)
        return
    workers = data_workers(cfg)
    step = cfg.batch_size * cfg.grad_accum
    per_worker = samples // workers
    if step * workers > samples:
        largest = max(per_worker // cfg.grad_accum, 0)
        raise ValueError(
            f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum} x {workers} worker(s) = "
            f"{step * workers:,} samples a step, but {cfg.dataset} has {samples:,} training samples ({per_worker:,} "
            f"per worker): a step must fit in an epoch; use --batch-size <= {largest:,}"
            + (" or fewer --workers" if largest < 1 or workers > 1 else ""))


def data_workers(cfg: TrainConfig) -> int:
    """The processes that train (a parameter-server job's servers do not); under torchrun, its world."""
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else cfg.workers
    return world - cfg.servers if strategy(cfg.strategy).serves else world


def batch_trap_warning(cfg: TrainConfig, samples: int) -> str | None:
    """A new run in the batch-size trap: one line saying why and what to change (batch_math.py); None
    when it is not, or when the rule does not apply (DiLoCo, whose workers step alone)."""
    if cfg.resume or not strategy(cfg.strategy).lr_scaled:
        return None
    shape = RunShape(cfg.lr_scaling, cfg.batch_size, cfg.batch_size * cfg.grad_accum * data_workers(cfg), samples,
                     cfg.epochs, cfg.steps, cfg.warmup_steps)
    return trap_warning(shape)


def _describe(out: Path) -> str:
    """What the run in ``out`` is, in a few words."""
    path = out / CHECKPOINT_NAME
    if not path.exists():
        return "metrics.jsonl of a run with no checkpoint"
    try:
        state = checkpoint.load(path)
    except checkpoint.CheckpointError as exc:
        return f"a checkpoint that cannot be read: {exc}"
    identity = state.get("identity", {})
    return (f"{identity.get('model')} on {identity.get('dataset')}, --strategy {identity.get('strategy')}, "
            f"checkpoint at step {state.get('step')}")


def holds_a_run(out: Path) -> bool:
    return (out / CHECKPOINT_NAME).exists() or (out / "metrics.jsonl").exists()


def _remove_run(out: Path) -> None:
    for pattern in RUN_FILES:
        for path in out.glob(pattern):
            path.unlink(missing_ok=True)
    for folder in RUN_FOLDERS:
        if (out / folder).is_dir() and not (out / folder).is_symlink():
            shutil.rmtree(out / folder)


def claim_out(cfg: TrainConfig, overwrite: bool, say=print) -> None:
    """A new run (no --resume) in ``cfg.out``: a run there is replaced when --out is the default or
    ``overwrite`` is given (said in one line), else refused (ValueError)."""
    out = Path(cfg.out)
    if not holds_a_run(out):
        return
    what = _describe(out)
    if not overwrite and os.path.normpath(cfg.out) != os.path.normpath(DEFAULT_OUT):
        raise ValueError(f"--out {cfg.out} holds another run ({what}): continue it with --resume, choose another "
                         f"--out, or replace it with --overwrite")
    _remove_run(out)
    say(f"gradsync train: replaced the run in {cfg.out} ({what})"
        + ("" if overwrite else "; name --out DIR to keep a run"), flush=True)


def steps_left(cfg: TrainConfig, state: dict) -> bool | None:
    """Whether this command would train any step from ``state`` (None: cannot tell before the ranks
    build the data: a parameter-server checkpoint without its steps per epoch)."""
    if "ps" in state:
        done = min(state["ps"]["clocks"])
        if cfg.steps is not None:
            return done < cfg.steps
        per_epoch = state.get("steps_per_epoch")
        return None if per_epoch is None else done < epochs_of(cfg, state) * per_epoch
    if cfg.steps is not None:
        return state["step"] < cfg.steps
    return state["epoch"] < epochs_of(cfg, state)


def epochs_of(cfg: TrainConfig, state: dict) -> int:
    """The epochs a resume of ``state`` trains to: --epochs, else the run's own (older checkpoints: 8)."""
    if cfg.epochs is not None:
        return cfg.epochs
    return state.get("batch", {}).get("epochs") or DEFAULT_EPOCHS


def check_resume(cfg: TrainConfig) -> str | None:
    """--resume: the checkpoint exists, belongs to this run (IDENTITY) and has steps left. Returns a
    line saying the run is finished (nothing to train: exit 0), or None to go on; raises otherwise."""
    path = Path(cfg.out) / CHECKPOINT_NAME
    if not path.exists():
        raise ValueError(f"--resume: {cfg.out} holds no checkpoint ({CHECKPOINT_NAME}); train without --resume to "
                         f"start a run there, or give --out the directory of the run to continue")
    state = checkpoint.load(path)
    mine = {k: family(getattr(cfg, k)) for k in IDENTITY}
    theirs = {k: family(state["identity"].get(k)) for k in IDENTITY}
    differing = [f"--{k} {state['identity'].get(k)} (this command: {getattr(cfg, k)})" for k in IDENTITY
                 if mine[k] != theirs[k]]
    if differing:
        raise ValueError(f"--resume: the checkpoint in {cfg.out} is of another run: {', '.join(differing)}; give "
                         f"those flags to continue it, or choose another --out for a new run")
    if steps_left(cfg, state) is False:
        length = f"--steps {cfg.steps}" if cfg.steps is not None else f"--epochs {epochs_of(cfg, state)}"
        return (f"gradsync train: the run in {cfg.out} is finished (step {state['step']}, {length}): nothing left to "
                f"train; give a larger --epochs or --steps with --resume to train on")
    return None
