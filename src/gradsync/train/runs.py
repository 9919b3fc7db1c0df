"""What `gradsync train` checks in the launcher, before any rank starts: the batch fits the data,
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
gradsync's main with exit status 2), in well under a second: nothing here starts a rank.
"""

from __future__ import annotations

import os
from pathlib import Path

from gradsync import checkpoint
from gradsync.train.batch_math import DEFAULT_EPOCHS, RunShape, trap_warning
from gradsync.train.config import PS_STRATEGIES, TrainConfig
from gradsync.train.resume import CHECKPOINT_NAME, IDENTITY, family

DEFAULT_OUT = "runs/latest"
"""--out when none is given (TrainConfig.out)."""
RUN_FILES = ("checkpoint.pt", "metrics.jsonl", "trace.json", "trace.rank*.json", "replica*.pt", "train.log")
"""What a run writes in --out (patterns): what replacing a run removes, and nothing else."""


def train_samples(dataset: str) -> int | None:
    """How many training samples ``dataset`` has, if that is known without building it (None for
    stdlib-tokens, whose count depends on subsampling the tokenised stdlib)."""
    if dataset == "digits":
        return int(0.8 * 1797)   # datasets.digits: scikit-learn's 1,797 images, 80% train
    if dataset == "synthetic":
        return int(0.8 * 4096)   # datasets.synthetic's default n
    if dataset == "stdlib-text":
        from gradsync.train.datasets import stdlib_text_windows

        return int(0.9 * stdlib_text_windows())
    return None


def check_device(cfg: TrainConfig) -> None:
    """--device cuda needs a GPU torch can see; with it, each spawned rank takes GPU local rank mod GPU
    count before it meets the others (GRADSYNC_BIND_GPU: device_path.bind_gpu), so that ranks with a
    GPU each settle on NCCL."""
    if cfg.device == "auto" and cfg.model == "word2vec":
        return
    if cfg.device == "cuda" or cfg.device == "auto":
        import torch

        if torch.cuda.is_available():
            os.environ["GRADSYNC_BIND_GPU"] = "1"
        elif cfg.device == "cuda":
            raise ValueError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is "
                             "False); use --device cpu or auto")


def check_batch(cfg: TrainConfig) -> None:
    """A step must fit in an epoch: per-worker batch x accumulation x data workers <= training samples
    (ddp, zero1, local, diloco: the global batch; the parameter server: each worker's shard)."""
    samples = train_samples(cfg.dataset)
    if samples is None or cfg.resume:   # a resume re-plans the batch from its checkpoint (resume.py)
        return
    workers = cfg.workers - cfg.servers if cfg.strategy in PS_STRATEGIES else cfg.workers
    step = cfg.batch_size * cfg.grad_accum
    per_worker = -(-samples // workers) if cfg.strategy in PS_STRATEGIES else samples // workers
    if step * workers > samples if cfg.strategy not in PS_STRATEGIES else step > per_worker:
        largest = max(per_worker // cfg.grad_accum, 0)
        raise ValueError(
            f"--batch-size {cfg.batch_size} x --grad-accum {cfg.grad_accum} x {workers} worker(s) = "
            f"{step * workers:,} samples a step, but {cfg.dataset} has {samples:,} training samples ({per_worker:,} "
            f"per worker): a step must fit in an epoch; use --batch-size <= {largest:,}"
            + (" or fewer --workers" if largest < 1 or workers > 1 else ""))


def data_workers(cfg: TrainConfig) -> int:
    """The processes that train (a parameter-server job's servers do not); under torchrun, its world."""
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else cfg.workers
    return world - cfg.servers if cfg.strategy in PS_STRATEGIES else world


def batch_trap_warning(cfg: TrainConfig) -> str | None:
    """A new run in the batch-size trap: one line saying why and what to change (batch_math.py); None
    when it is not, or cannot be told here (stdlib-tokens' size; DiLoCo, whose workers step alone)."""
    samples = train_samples(cfg.dataset)
    if samples is None or cfg.resume or cfg.strategy == "diloco":
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
