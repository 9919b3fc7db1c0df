"""TrainConfig: every knob of `gradsync train`, with its unit and meaning, validated up front."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from gradsync.comm.collectives import ALGORITHMS
from gradsync.train.batch_math import LR_SCALING
from gradsync.train.datasets import DATASETS
from gradsync.train.models import MODELS

STRATEGIES = ("ddp", "ps-sync", "ps-async", "ssp", "zero1", "local", "diloco")
COMPRESSION = ("none", "fp16", "bf16", "powersgd")
DEVICES = ("auto", "cpu", "cuda")
PREEMPT_SIGNALS = ("SIGTERM", "SIGUSR1", "none")
FAULT_TOLERANCE = ("restart", "live")
LIVE_BATCH = ("keep-global", "keep-per-rank")
LIVE_REFUSED = {
    "zero1": "ZeRO-1 keeps each rank's optimizer state shard on that rank alone, and live mode keeps no "
             "buddy copy of it, so a dead rank's shard would be lost",
    "diloco": "DiLoCo's replicas differ between outer steps, and live mode keeps no copy of a dead worker's",
    "local": "one process has no survivors",
}
"""Why --fault-tolerance live refuses each strategy it does not run."""
PS_STRATEGIES = ("ps-sync", "ps-async", "ssp")
DEFAULT_MODEL_FOR = {"digits": "cnn", "stdlib-text": "charlm", "synthetic": "mlp", "stdlib-tokens": "word2vec"}
DEFAULT_DATASET_FOR = {"cnn": "digits", "mlp": "digits", "charlm": "stdlib-text", "word2vec": "stdlib-tokens"}
SEQUENCE_PAIRS = {"charlm": "stdlib-text", "word2vec": "stdlib-tokens"}
"""Models that read one dataset only (the others read images: digits, synthetic)."""


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
    """cnn | mlp | charlm | word2vec; None: the dataset's natural model."""
    dataset: str | None = None
    """digits | stdlib-text | synthetic | stdlib-tokens; None: the model's natural dataset."""
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
    bucket_mb: float = 25.0
    """DDP bucket cap in MiB."""
    compress: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    """Gradient compression on the wire (ddp): fp16 / bf16 casts, or PowerSGD's rank-r factors
    (ddp/powersgd.py; uncompressed for the first 10 steps)."""
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
    checkpoint) or live (the survivors rebuild their world and train on: train/loop_live.py for ddp,
    train/loop_ps_live.py for ps-sync, ps-async and ssp; LIVE_REFUSED says why not the others)."""
    live_batch: Literal["keep-global", "keep-per-rank"] = "keep-global"
    """--fault-tolerance live, after ranks die: keep the global batch (the survivors' shares grow) or keep
    each rank's batch and scale the learning rate by the new world size over the old (live/policy.py)."""

    requeue: bool = False
    """Under Slurm: after a preemption's checkpoint is on disk, rank 0 runs `scontrol requeue $SLURM_JOB_ID`,
    so the job runs again (train/requeue.py; submit with sbatch --requeue, train with --resume auto)."""

    preempt_signal: Literal["SIGTERM", "SIGUSR1", "none"] = "SIGTERM"
    """The signal that stops the job at the next step boundary with a checkpoint, exit status 75
    (train/preempt.py, train/loop_ps.py); sent to the launcher or to any rank. 'none': the signal's
    default action."""

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
        """--fault-tolerance live runs ddp alone and without the features it would have to rebuild."""
        if self.strategy in LIVE_REFUSED:
            raise RuntimeError(f"--fault-tolerance live is not supported with --strategy {self.strategy}: "
                               f"{LIVE_REFUSED[self.strategy]}; use --strategy ddp, or --fault-tolerance restart")
        if self.strategy in PS_STRATEGIES and self.live_batch != "keep-global":
            raise RuntimeError(f"--strategy {self.strategy} --fault-tolerance live keeps the global batch (--live-batch "
                               f"keep-global): the servers' learning rate is not rescaled when a worker dies")
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
        choose("lr_scaling", self.lr_scaling, LR_SCALING)
        choose("preempt_signal", self.preempt_signal, PREEMPT_SIGNALS)
        choose("fault_tolerance", self.fault_tolerance, FAULT_TOLERANCE)
        choose("live_batch", self.live_batch, LIVE_BATCH)
        if self.fault_tolerance == "live":
            self._check_live()
        if self.model is None and self.dataset is None:
            self.model, self.dataset = "cnn", "digits"
        if self.model is None:
            self.model = DEFAULT_MODEL_FOR.get(self.dataset, "cnn")
        if self.dataset is None:
            self.dataset = DEFAULT_DATASET_FOR.get(self.model, "digits")
        choose("model", self.model, MODELS)
        choose("dataset", self.dataset, DATASETS)
        if SEQUENCE_PAIRS.get(self.model) != self.dataset and (self.model in SEQUENCE_PAIRS or
                                                              self.dataset in SEQUENCE_PAIRS.values()):
            raise ValueError(f"--model {self.model} cannot train on --dataset {self.dataset}: charlm reads text "
                             f"(stdlib-text), word2vec reads tokens (stdlib-tokens); cnn and mlp read images "
                             f"(digits, synthetic)")
        if self.fault_tolerance == "live" and self.strategy in PS_STRATEGIES and self.model == "word2vec":
            raise RuntimeError(f"--strategy {self.strategy} --fault-tolerance live does not support sparse tables "
                               f"(--model word2vec): their rows in flight are not recovered; use --fault-tolerance "
                               f"restart")
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
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.clip_grad is not None and not (math.isfinite(self.clip_grad) and self.clip_grad > 0):
            raise ValueError(f"--clip-grad must be a finite number > 0 (the largest total 2-norm of the averaged "
                             f"gradient), got {self.clip_grad}")
        for name in ("bucket_mb", "timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a number > 0, got {value}")
        if self.strategy.startswith("ps") or self.strategy == "ssp":
            if self.servers >= self.workers:
                raise ValueError(f"--servers {self.servers} >= --workers {self.workers}: a parameter server job needs "
                                 f"at least one worker besides the servers (servers < workers)")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be an integer >= 0, got {self.max_restarts!r}")
        if self.max_restarts and self.strategy in ("ps-sync", "ps-async", "ssp"):
            raise RuntimeError(f"--max-restarts is not supported with --strategy {self.strategy}: a parameter-server "
                               f"job checkpoints on preemption and at its end, not periodically, so a restart after "
                               f"a failure would start over; use ddp, zero1 or local, or --resume after a preemption")
        self.checkpoint_interval()
        if self.checkpoint_every and self.strategy in ("ps-sync", "ps-async", "ssp"):
            raise RuntimeError(f"--checkpoint-every is not supported with --strategy {self.strategy}: a parameter-server "
                               f"job checkpoints on preemption and at its end only (its servers and workers reach a "
                               f"common point only when they stop); use ddp, zero1 or local")
        for name in ("powersgd_rank", "sync_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not self.outer_lr > 0:
            raise ValueError(f"--outer-lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise ValueError(f"--outer-momentum must be in [0, 1), got {self.outer_momentum}")
        if self.compress == "powersgd" and self.strategy != "ddp":
            raise RuntimeError(f"--compress powersgd compresses the gradients DDP all-reduces; --strategy "
                               f"{self.strategy} sends none that way (use --strategy ddp)")
        if self.strategy == "diloco" and self.compress != "none":
            raise RuntimeError(f"--strategy diloco averages parameters every --sync-every steps, not gradients: "
                               f"--compress {self.compress} does not apply (use --compress none)")
        if self.device not in DEVICES:
            raise ValueError(f"--device {self.device!r}: choose one of {', '.join(DEVICES)}")
        if self.device == "cuda" and self.model == "word2vec":
            raise RuntimeError("--device cuda: word2vec's sparse tables train on the CPU (their rows travel as "
                               "sparse gradients); use --device cpu")
        if self.strategy == "local" and self.workers != 1:
            raise ValueError(f"--strategy local trains in one process; use --workers 1 (got {self.workers})")
        self._check_out_dir()

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
        return {"ddp": "torch's clip_grad_norm_ on the all-reduced .grad",
                "local": "torch's clip_grad_norm_",
                "zero1": "ShardedOptimizer.clip_grad_norm_: shard norms, 1 scalar all-reduce",
                "ps-sync": "on the servers, the version's averaged gradient, norm over all shards",
                "ps-async": "on each worker, its own push",
                "ssp": "on each worker, its own push",
                "diloco": "torch's clip_grad_norm_ on each worker's own gradient, every inner step"}[self.strategy]

    def default_lr(self) -> float:
        return {"cnn": 0.02, "mlp": 0.02, "charlm": 1e-3, "word2vec": 0.2}[self.model]

    def to_dict(self) -> dict:
        return asdict(self)
