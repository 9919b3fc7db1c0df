"""TrainConfig: every knob of `gradsync train`, with its unit and meaning, validated up front."""

from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Literal

from gradsync.comm.collectives import ALGORITHMS
from gradsync.train import factory
from gradsync.train.batch_math import LR_SCALING
from gradsync.train.optimizers import SCHEDULES
from gradsync.train.precision import PRECISIONS
from gradsync.train.strategies import PS_STRATEGIES, STRATEGIES, strategy
from gradsync.train.tasks import DATASETS, MODELS, resolve

COMPRESSION = ("none", "fp16", "bf16", "powersgd")
DEVICES = ("auto", "cpu", "cuda")
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "none")
FAULT_TOLERANCE = ("restart", "live")
LIVE_BATCH = ("keep-global", "keep-per-rank")


@dataclass
class TrainConfig:
    workers: int = 2
    """Local worker processes (ignored under torchrun, which sets the world)."""
    strategy: Literal["ddp", "ps-sync", "ps-async", "ssp", "zero1", "local", "diloco"] = "ddp"
    """How gradients become one update; 'local' is one process, no communication; 'diloco': each
    worker trains alone and the parameters are averaged every ``sync_every`` steps (diloco.py)."""
    algorithm: Literal["auto", "ring", "halving_doubling", "tree", "naive", "native"] = "auto"
    """All-reduce algorithm for ddp."""
    servers: int = 1
    """How many of the ``workers`` processes serve parameters (ps-* and ssp); the rest train."""
    staleness: int = 2
    """SSP bound, in steps (worker clocks): how many steps the fastest worker may run ahead of the
    slowest (0: lockstep). The summary's staleness counts versions, which advance once per push."""
    model: str | None = None
    """What trains: module:function returning an nn.Module (train/task.py), or a built-in: cnn | mlp | charlm
    | word2vec (train/tasks.py); None: the dataset's natural model (cnn with no dataset either)."""
    dataset: str | None = None
    """The data (--data, or --dataset): module:function returning the training set, (train, test) or a dict
    with train, test and collate, or a built-in: digits | stdlib-text | synthetic | stdlib-tokens; None: the
    built-in model's natural dataset."""
    model_args: dict = field(default_factory=dict)
    """Keyword arguments of the model's factory (--model-args depth=4,width=256)."""
    data_args: dict = field(default_factory=dict)
    """Keyword arguments of the data's factory (--data-args root=/data,download=False)."""
    loss: str | None = None
    """How a batch becomes a loss (train/losses.py): cross_entropy | mse | model (the model returns it) |
    auto (model for dict batches, else cross_entropy) | module:function(outputs, targets); None: the model's
    default (auto, or a built-in's own)."""
    metric: str | None = None
    """module:function(outputs, targets) -> (correct, count), reported as the accuracy; None: argmax = target
    where the outputs are class scores."""
    optimizer: str | None = None
    """sgd | adam | adamw | adagrad | module:function taking the parameters; None: the model's default (sgd
    with momentum 0.9 for cnn and mlp, adamw for charlm and a user's model, adagrad for word2vec)."""
    weight_decay: float | None = None
    """The optimizer's weight decay; None: the model's default (0.01 with adamw, else the optimizer's own)."""
    momentum: float | None = None
    """SGD's momentum; None: the model's default (0.9 for cnn and mlp, else 0)."""
    epochs: int | None = None
    """Passes over the training set (ignored when steps is set); None: as many as keep lr x steps equal to
    8 epochs of one worker's batch at the base lr (8 with linear scaling, 8 x sqrt(global / per-worker
    batch) with sqrt: train/batch_math.py), decided when the run starts and kept by a resume."""
    steps: int | None = None
    """Optimizer steps in total; None: run ``epochs`` epochs."""
    batch_size: int = 32
    """Samples per worker per micro-batch."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (accumulated locally under no_sync)."""
    lr: float | None = None
    """Base learning rate for the per-worker batch; None: the model's default."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "sqrt"
    """How the lr follows the global batch: 'sqrt': lr x sqrt(global batch / per-worker batch) (Krizhevsky
    2014, Hoffer et al. 2017); 'linear': lr x (global batch / per-worker batch) (Goyal et al. 2017);
    'none': the lr as given. The default length follows the rule too (``epochs``)."""
    warmup_steps: int | None = None
    """Steps of linear learning-rate warm-up from 0 (0: none); None: max(20, 5% of the run's steps),
    decided when the run starts and kept by a resume (train/batch_math.py)."""
    lr_schedule: Literal["constant", "cosine", "linear"] | None = None
    """What the lr does after the warm-up: stays (constant), or falls to ``min_lr`` by the run's last step
    along a cosine or a line (train/optimizers.py); None: constant, or a resumed run's own."""
    min_lr: float = 0.0
    """Where --lr-schedule cosine and linear end."""
    bucket_mb: float = 25.0
    """DDP bucket cap in MiB."""
    compress: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """Gradient compression on the wire (ddp): fp16 / bf16 casts, or PowerSGD's rank-r factors
    (ddp/powersgd.py; uncompressed for the first 10 steps)."""
    precision: Literal["fp32", "bf16-mixed", "fp16-mixed"] = "fp32"
    """The dtype forward and loss compute in (train/precision.py): fp32; bf16-mixed or fp16-mixed, under
    torch.autocast with float32 weights and optimizer state, fp16-mixed with a gradient scaler whose skipped
    steps every rank agrees on."""
    powersgd_rank: int = 2
    """PowerSGD's approximation rank r (--compress powersgd)."""
    sync_every: int = 8
    """DiLoCo's H: inner steps each worker takes alone between outer steps (--strategy diloco)."""
    outer_lr: float = 0.4
    """DiLoCo's outer learning rate (Nesterov SGD on the averaged pseudo-gradient). 0.4, where the paper
    has 0.7: on digits the paper's value ends 0.6 (2 workers) and 1.9 points (4) below ring DDP, 0.4
    within 0.3 (the sweep in docs/train.md, "Slow links"); --outer-lr 0.7 gives the paper's."""
    outer_momentum: float = 0.9
    """DiLoCo's outer momentum (the paper's 0.9)."""
    clip_grad: float | None = None
    """Largest total 2-norm of the averaged gradient a step applies (torch.nn.utils.clip_grad_norm_ on one
    process with the global batch; where each strategy takes the norm: clip_site()); None: no clipping."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each worker trains: cuda (the GPU local rank mod GPU count; ranks that share one go through
    host memory: comm/host_staging.py), cpu, or auto (cuda when torch sees a GPU). Parameter servers
    stay on the CPU."""
    seed: int = 0
    """Seed for model initialisation, data split and shuffling."""
    out: str = "runs/latest"
    """Directory for metrics.jsonl, trace.json and checkpoints."""
    resume: bool | Literal["auto"] = False
    """Continue from the checkpoint in ``out``; "auto": continue when ``out`` holds one, else start a new
    run (the same Slurm batch script for a job and its requeues: train/requeue.py)."""
    overwrite: bool = False
    """Replace the run already in ``out`` (its checkpoint, metrics, traces: train/runs.py) instead of
    refusing to start; the default ``out`` is replaced without it."""
    trace: bool = False
    """Record a timeline and write trace.json."""
    timeout: float = 60.0
    """Seconds any wait between ranks may take before it is an error."""
    quiet: bool = False
    """No progress bar (for tests and logs)."""
    max_restarts: int = 0
    """Local launcher: after a failure, start the workers again from the last checkpoint this many
    times (under torchrun use its own --max-restarts with --resume). With --fault-tolerance live: start
    a replacement for a dead rank, at most this many in the whole run (gs.spawn's replacements), each
    joining the running world at a step boundary with the state of a live peer (live/growth.py)."""
    checkpoint_every: str = ""
    """Also checkpoint between epochs: every N steps ("200") or every span of wall time ("30s", "5m",
    "1h"; rank 0's clock, agreed with the preemption flag in one 2-element all-reduce per step). Empty:
    at each epoch's end only."""

    fault_tolerance: Literal["restart", "live"] = "restart"
    """When a rank dies: restart (stop every rank; with --max-restarts start again from the last
    checkpoint) or live (the survivors rebuild their world and train on: the strategies with a live object in
    train/strategies/registry.py, ddp and the parameter server's; it says why not the others)."""
    live_batch: Literal["keep-global", "keep-per-rank"] = "keep-global"
    """--fault-tolerance live, after ranks die: keep the global batch (the survivors' shares grow) or keep
    each rank's batch and scale the learning rate by the new world size over the old (live/policy.py)."""
    min_workers: int | None = None
    """--fault-tolerance live: the fewest workers that train on (parameter-server jobs: workers besides the
    servers). A recovery that leaves fewer (deaths, or a partition: the side that keeps the job's store)
    checkpoints the step its survivors agreed on and exits 75 (preempted), so that a scheduler starts the
    job again. None: half of the workers the job started with, rounded up (live/failures.py default_floor:
    torchft's majority rule, applied to the job as it started)."""

    requeue: bool = False
    """Under Slurm: after a preemption's checkpoint is on disk, rank 0 runs `scontrol requeue $SLURM_JOB_ID`,
    so the job runs again (train/requeue.py; submit with sbatch --requeue, train with --resume auto)."""

    preempt_signal: Literal["SIGTERM", "SIGUSR1", "none"] = "SIGTERM"
    """The signal that stops the job at the next step boundary with a checkpoint, exit status 75
    (train/preempt.py, train/strategies/ps.py); sent to the launcher or to any rank. 'none': the signal's
    default action."""

    log: str = ""
    """Experiment trackers the reporting rank records to, comma-separated: tensorboard | wandb (offline) |
    mlflow (a local file store), each an optional extra (train/trackers/); empty: metrics.jsonl only."""
    log_every: int = 10
    """Steps between records of each rank's step, wait and communication time (one small all-gather on
    those steps only) to metrics.jsonl and, with --log, of the training figures to the trackers."""
    log_run: str | None = None
    """The trackers' run to record to (W&B's run id, the MLflow run tagged with it); None: a new one, or on
    --resume the checkpoint's, so that a resumed run goes on in the same tracker run (train/tracking.py)."""

    def checkpoint_interval(self) -> tuple[int | None, float | None]:
        """(steps, seconds) from ``checkpoint_every``; at most one is set."""
        text = self.checkpoint_every.strip().lower()
        if not text:
            return None, None
        units = {"s": 1.0, "m": 60.0, "h": 3600.0}
        try:
            if text[-1] in units:
                seconds = float(text[:-1]) * units[text[-1]]
                if seconds > 0:
                    return None, seconds
            elif int(text) >= 1:
                return int(text), None
        except ValueError:
            pass
        raise ValueError(f"--checkpoint-every {self.checkpoint_every!r}: give a number of steps (200) or a time "
                         f"with its unit (30s, 5m, 1h)")

    def _check_live(self) -> None:
        """--fault-tolerance live runs the strategies that declare a live object, without the features it
        would have to rebuild."""
        declared = strategy(self.strategy)
        if declared.live_object is None:
            raise RuntimeError(f"--fault-tolerance live is not supported with --strategy {self.strategy}: "
                               f"{declared.live_refused}; use --strategy ddp, or --fault-tolerance restart")
        if declared.serves and self.live_batch != "keep-global":
            raise RuntimeError(f"--strategy {self.strategy} --fault-tolerance live keeps the global batch (--live-batch "
                               f"keep-global): the servers' learning rate is not rescaled when a worker dies")
        if self.min_workers is not None:
            world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ and "RANK" in os.environ else \
                self.workers   # torchrun sets the world, as train/runs.py data_workers reads it
            trainers = world - (self.servers if declared.serves else 0)
            if not isinstance(self.min_workers, int) or isinstance(self.min_workers, bool) or self.min_workers < 1:
                raise ValueError(f"--min-workers must be an integer >= 1, got {self.min_workers!r}")
            if self.min_workers > trainers:
                raise ValueError(f"--min-workers {self.min_workers} is more than the {trainers} worker(s) that train "
                                 f"in this job: it could never start; give at most {trainers}")
        if self.checkpoint_interval()[1] is not None:
            raise RuntimeError(f"--fault-tolerance live checkpoints every N steps: give --checkpoint-every a number "
                               f"of steps (200), not a time ({self.checkpoint_every!r})")
        refused = [(self.clip_grad is not None, "--clip-grad"), (self.trace, "--trace"),
                   (self.compress == "powersgd", "--compress powersgd (its per-rank error feedback would be lost)")]
        for given, flag in refused:
            if given:
                raise RuntimeError(f"--fault-tolerance live does not support {flag}; drop it or use "
                                   f"--fault-tolerance restart")

    def __post_init__(self) -> None:
        def choose(field: str, value, choices) -> None:
            if value not in choices:
                raise ValueError(f"--{field.replace('_', '-')} {value!r} is not one of: {', '.join(map(str, choices))}")

        choose("strategy", self.strategy, STRATEGIES)
        choose("algorithm", self.algorithm, ALGORITHMS)
        choose("compress", self.compress, COMPRESSION)
        choose("precision", self.precision, PRECISIONS)
        choose("lr_scaling", self.lr_scaling, LR_SCALING)
        choose("preempt_signal", self.preempt_signal, PREEMPT_SIGNALS)
        choose("fault_tolerance", self.fault_tolerance, FAULT_TOLERANCE)
        choose("live_batch", self.live_batch, LIVE_BATCH)
        if self.lr_schedule is not None:
            choose("lr_schedule", self.lr_schedule, SCHEDULES)
        declared = strategy(self.strategy)
        if self.fault_tolerance == "live":
            self._check_live()
        elif self.min_workers is not None:
            raise RuntimeError(f"--min-workers {self.min_workers} is the floor of --fault-tolerance live (the fewest "
                               f"workers that train on after a recovery); --fault-tolerance {self.fault_tolerance} "
                               f"stops every rank at any death: drop --min-workers or add --fault-tolerance live")
        self._check_task()
        for name in ("workers", "batch_size", "grad_accum", "epochs", "servers"):
            value = getattr(self, name)
            if name == "epochs" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.staleness < 0:
            raise ValueError(f"--staleness must be an integer >= 0 (how many steps the fastest SSP worker may run "
                             f"ahead of the slowest), got {self.staleness}")
        if self.warmup_steps is not None and (not isinstance(self.warmup_steps, int) or self.warmup_steps < 0):
            raise ValueError(f"--warmup-steps must be an integer >= 0 (0: no warm-up), got {self.warmup_steps}")
        if self.resume not in (True, False, "auto"):
            raise ValueError(f"--resume takes no value or 'auto', got {self.resume!r}")
        if self.resume and self.overwrite:
            raise ValueError("--resume continues the run in --out and --overwrite replaces it: give one of them")
        for name in ("lr", "weight_decay", "momentum", "min_lr"):
            value = getattr(self, name)
            low_ok = name != "lr"
            if value is not None and not (math.isfinite(value) and (value >= 0 if low_ok else value > 0)):
                raise ValueError(f"--{name.replace('_', '-')} must be {'>= 0' if low_ok else '> 0'}, got {value}")
        if self.clip_grad is not None and not (math.isfinite(self.clip_grad) and self.clip_grad > 0):
            raise ValueError(f"--clip-grad must be a finite number > 0 (the largest total 2-norm of the averaged "
                             f"gradient), got {self.clip_grad}")
        for name in ("bucket_mb", "timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
        if declared.serves and self.servers >= self.workers:
            raise ValueError(f"--servers {self.servers} >= --workers {self.workers}: a parameter server job needs "
                             f"at least one worker besides the servers (servers < workers)")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be an integer >= 0, got {self.max_restarts!r}")
        if self.max_restarts and declared.restarts:
            raise RuntimeError(f"--max-restarts is not supported with --strategy {self.strategy}: {declared.restarts}")
        self.checkpoint_interval()
        self._check_log()
        if self.checkpoint_every and declared.periodic_checkpoints:
            raise RuntimeError(f"--checkpoint-every is not supported with --strategy {self.strategy}: "
                               f"{declared.periodic_checkpoints}; use ddp, zero1 or local")
        for name in ("powersgd_rank", "sync_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"--outer-lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.compress not in declared.compress:
            if self.compress == "powersgd":
                raise RuntimeError(f"--compress powersgd compresses the gradients DDP all-reduces; --strategy "
                                   f"{self.strategy} sends none that way (use --strategy ddp)")
            raise RuntimeError(f"--compress {self.compress} casts the gradients DDP all-reduces; --strategy "
                               f"{self.strategy} does not send them that way (use --strategy ddp, or --compress none)")
        if self.device not in DEVICES:
            raise ValueError(f"--device {self.device!r}: choose one of {', '.join(DEVICES)}")
        if declared.one_process and self.workers != 1:
            raise ValueError(f"--strategy {self.strategy} trains in one process; use --workers 1 (got {self.workers})")
        self._check_out_dir()

    def _check_log(self) -> None:
        """--log names known trackers (whether each is installed is the launcher's check: train/runs.py),
        --log-every is a number of steps, --log-run a name every tracker takes as a run's."""
        from gradsync.train.trackers import tracker_names

        tracker_names(self.log)
        if not isinstance(self.log_every, int) or isinstance(self.log_every, bool) or self.log_every < 1:
            raise ValueError(f"--log-every must be an integer >= 1 (steps between records), got {self.log_every!r}")
        if self.log_run is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", str(self.log_run)):
            raise ValueError(f"--log-run {self.log_run!r}: give 1 to 64 letters, digits, '-' or '_' (a W&B run id)")

    def _check_task(self) -> None:
        """--model and --data: a built-in name or module:function (what they return is checked in the launcher,
        train/task.py); the defaults filled in (train/tasks.py)."""
        for flag, value, names in (("--model", self.model, MODELS), ("--data", self.dataset, DATASETS)):
            if value is not None and value not in names and not factory.is_spec(value):
                raise ValueError(f"{flag} {value!r} is not a built-in ({', '.join(names)}) nor module:function")
        self.model, self.dataset = resolve(self.model, self.dataset)
        for name in ("model_args", "data_args"):
            if not isinstance(getattr(self, name), dict):
                raise ValueError(f"--{name.replace('_', '-')} must be name=value pairs, got {getattr(self, name)!r}")

    def _check_out_dir(self) -> None:
        """Create ``out`` and write a probe file: permission bits alone mislead (root, /proc, read-only mounts)."""
        out = Path(self.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            probe = out / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"--out {self.out} is not a writable directory: {exc.strerror or exc}") from None

    def clip_site(self) -> str:
        """Where --clip-grad takes the norm and clips, for this strategy (the batch-math line prints it)."""
        return strategy(self.strategy).clip_site

    @classmethod
    def defaults(cls) -> dict:
        """Every field's default value (a fresh one for the dict fields)."""
        return {f.name: f.default_factory() if f.default is MISSING else f.default for f in fields(cls)}

    def to_dict(self) -> dict:
        return asdict(self)
