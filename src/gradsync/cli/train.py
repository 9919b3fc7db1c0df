"""gradsync train: N local workers train a model on its data -- a built-in one, or the user's own
(train/loop.py; the flags are train/config.py's TrainConfig, also settable from --config FILE.toml)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from gradsync.cli.args import keyword_arguments, positive_int

class _DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """Each flag's help ends with its default, unless the help says it (a flag that is off or unset by
    default says what that means in its help)."""

    def _get_help_string(self, action) -> str:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "(default" not in text:
            shown = action.default if not isinstance(action.default, str) or action.default else "''"
            text += f" (default: {shown})"
        return text


def add_parser(commands) -> None:
    from gradsync.train.config import TrainConfig

    defaults = TrainConfig.defaults()
    train = commands.add_parser("train", help="N local workers train a model on its data (a built-in, or yours)",
                                formatter_class=_DefaultsShown, description=RUNBOOK)
    add_flags(train, defaults)


def add_flags(train, defaults: dict) -> None:
    """Every flag of gradsync train on ``train``, each defaulting to ``defaults``' value for its field."""
    from gradsync.train.batch_math import DEFAULT_EPOCHS, LR_SCALING, WARMUP_MIN_STEPS, WARMUP_SHARE
    from gradsync.train.config import COMPRESSION, DEVICES, FAULT_TOLERANCE, LIVE_BATCH, PREEMPT_SIGNALS
    from gradsync.comm.collectives import ALGORITHMS
    from gradsync.train.losses import LOSSES
    from gradsync.train.optimizers import OPTIMIZERS, SCHEDULES
    from gradsync.train.precision import PRECISIONS
    from gradsync.train.runs import DEFAULT_OUT
    from gradsync.train.strategies import STRATEGIES
    from gradsync.train.tasks import DATASETS, MODELS
    from gradsync.train.trackers import TRACKERS

    def flag(*names: str, **options) -> None:
        field = options.get("dest") or names[0].removeprefix("--").replace("-", "_")
        if "default" in options and field not in defaults:
            del options["default"]   # a parser that tells given flags from defaults (config_of) has none
        elif field in defaults and "default" not in options and options.get("action") != "store_true":
            options["default"] = defaults[field]
        train.add_argument(*names, **options)

    def named(choices, flag_name: str):
        """A built-in name from ``choices`` or module:function."""
        from gradsync.train.factory import is_spec

        def parse(text: str) -> str:
            if text in choices or is_spec(text):
                return text
            raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from {', '.join(choices)}, or give "
                                             f"module:function)")
        parse.__name__ = flag_name
        return parse

    flag("--workers", type=positive_int, help="local worker processes (torchrun sets the world instead)")
    flag("--strategy", choices=list(STRATEGIES), metavar="{" + ",".join(STRATEGIES) + "}",
         help="how the gradients become one update: " + "; ".join(f"{s.name}: {s.help}" for s in STRATEGIES.values()))
    flag("--algorithm", choices=ALGORITHMS, metavar="{" + ",".join(ALGORITHMS) + "}",
         help="all-reduce algorithm (ddp, zero1, diloco); auto picks by message size")
    flag("--servers", type=positive_int,
         help="how many of the --workers processes serve parameters (ps-sync, ps-async, ssp); the rest train")
    flag("--staleness", type=int,
         help="ssp: how many steps (worker clocks) the fastest worker may run ahead of the slowest; 0: lockstep")
    flag("--config", metavar="FILE.toml", default=None,
         help="set any flag by its name in a TOML file (flags given here override it); every run keeps its resolved "
              "config as RUN_DIR/config.toml, which --config takes to train it again")
    flag("--model", type=named(MODELS, "model"), metavar="NAME|module:function",
         help=f"what trains: module:function returning a torch.nn.Module (called with --model-args, importable from the "
              f"working directory), or a built-in: {', '.join(MODELS)} (default: the dataset's natural model, cnn)")
    flag("--model-args", type=keyword_arguments("--model-args"), metavar="K=V,...",
         help="keyword arguments of the model's factory, e.g. depth=4,width=256 (values are Python literals, else text)")
    flag("--data", "--dataset", dest="dataset", type=named(DATASETS, "data"), metavar="NAME|module:function",
         help=f"the data: module:function returning the training set, (train, test) or {{'train', 'test', 'collate'}} "
              f"(map-style torch Datasets; called with --data-args, and seed=--seed if it takes one), or a built-in: "
              f"{', '.join(DATASETS)} (default: the model's natural dataset)")
    flag("--data-args", type=keyword_arguments("--data-args"), metavar="K=V,...",
         help="keyword arguments of the data's factory, e.g. root=/data,download=False")
    flag("--loss", metavar="|".join(LOSSES) + "|module:function",
         help="how a batch becomes a loss: cross_entropy or mse on (inputs, targets); model: the model returns the "
              "loss (nanoGPT's (logits, loss), Hugging Face's .loss for dict batches); module:function(outputs, "
              "targets); auto: model for dict batches, else cross_entropy (default: the model's own, else auto)")
    flag("--metric", metavar="module:function",
         help="the accuracy: function(outputs, targets) -> (correct, count) (default: argmax = target where the "
              "outputs are class scores)")
    flag("--epochs", type=positive_int, default=None,
         help=f"passes over the training set, ignored with --steps (default: as many as keep lr x steps equal to "
              f"{DEFAULT_EPOCHS} epochs of one worker's batch: {DEFAULT_EPOCHS} with --lr-scaling linear, "
              f"{DEFAULT_EPOCHS} x sqrt(global / per-worker batch) with sqrt, e.g. 12 for 2 workers; word2vec: "
              f"--steps {MODELS['word2vec'].steps:,}, about a minute, unless --epochs or --steps is given)")
    flag("--steps", type=positive_int, help="optimizer steps in all, counted from the run's start even when "
                                            "resuming (default: as many as --epochs take)")
    flag("--batch-size", type=positive_int, help="samples per worker per micro-batch")
    flag("--grad-accum", type=positive_int, help="micro-batches per optimizer step")
    flag("--optimizer", metavar="|".join(OPTIMIZERS) + "|module:function",
         help="the optimizer, or module:function taking the parameters and returning a torch.optim.Optimizer "
              "(default: the model's: sgd with momentum 0.9 for cnn and mlp, adagrad for word2vec, adamw for charlm "
              "and your own)")
    flag("--lr", type=float, help="base learning rate for one worker's batch (default: the model's: 0.02 cnn and "
                                  "mlp, 0.001 charlm and your own, 0.2 word2vec; a module:function optimizer's own)")
    flag("--weight-decay", type=float, help="the optimizer's weight decay (default: the model's: 0.01 with adamw)")
    flag("--momentum", type=float, help="SGD's momentum (default: the model's: 0.9 for cnn and mlp, else 0)")
    flag("--lr-schedule", choices=SCHEDULES,
         help="after the warm-up the lr stays (constant), or falls to --min-lr by the last step along a cosine or a "
              "line (default: constant, or a resumed run's own)")
    flag("--min-lr", type=float, help="where --lr-schedule cosine and linear end")
    flag("--lr-scaling", choices=LR_SCALING,
         help="how the lr follows the global batch G of b per worker: sqrt: lr x sqrt(G / b) (Krizhevsky 2014, Hoffer "
              "et al. 2017); linear: lr x G / b (Goyal et al. 2017); none: lr as given; the default --epochs follows it")
    flag("--warmup-steps", type=int, help="steps of linear learning-rate warm-up from 0; 0: none (default: "
                                          f"max({WARMUP_MIN_STEPS}, {WARMUP_SHARE * 100:.0f}%% of the run's steps))")
    flag("--bucket-mb", type=float, help="DDP bucket cap in MiB")
    flag("--compress", choices=COMPRESSION,
         help="gradient compression on the wire (ddp): fp16, bf16, or powersgd (rank-r factors)")
    flag("--precision", choices=PRECISIONS,
         help="what forward and loss compute in: fp32; bf16-mixed or fp16-mixed under torch.autocast, weights and "
              "optimizer state in float32 (fp16-mixed with a gradient scaler; every rank skips the same steps)")
    flag("--powersgd-rank", type=positive_int, metavar="R", help="PowerSGD's approximation rank (--compress powersgd)")
    flag("--sync-every", type=positive_int, metavar="H",
         help="--strategy diloco: inner steps each worker takes alone between outer steps")
    flag("--outer-lr", type=float, help="--strategy diloco: the outer Nesterov SGD's lr")
    flag("--outer-momentum", type=float, help="--strategy diloco: its momentum")
    flag("--clip-grad", type=float, metavar="X",
         help="clip the averaged gradient to total 2-norm X before each optimizer step, as torch's clip_grad_norm_ "
              "on one process (ps-sync: on the servers; ps-async, ssp: each push); default: no clipping")
    flag("--device", choices=DEVICES,
         help="where each worker trains: cuda (GPU local rank mod GPU count; ranks sharing a GPU reduce through "
              "host memory, each on its own GPU through NCCL), cpu, or auto (cuda when torch sees a GPU; "
              "parameter servers stay on the CPU)")
    flag("--seed", type=int, help="seed of the model's initialisation, the data split and the shuffling")
    flag("--out", help="directory for metrics.jsonl, checkpoint.pt and trace.json; a run already in a directory you "
                       "name is refused unless --resume or --overwrite, while the default one is replaced, saying so "
                       f"(default: {DEFAULT_OUT})")
    flag("--resume", nargs="?", const=True, type=_auto, metavar="auto",
         help="continue the run whose checkpoint is in --out; --resume auto: continue it when --out holds a "
              "checkpoint, else start a new run (one sbatch script for a job and its requeues)")
    flag("--requeue", action="store_true",
         help="under Slurm: after a preemption's checkpoint, rank 0 runs scontrol requeue $SLURM_JOB_ID and the job "
              "runs again (submit with sbatch --requeue; train with --resume auto)")
    flag("--overwrite", action="store_true", help="replace the run already in --out (default: refuse to start)")
    flag("--trace", action="store_true", help="also write a Chrome trace timeline, trace.json (open it in Perfetto)")
    flag("--timeout", type=float, help="seconds any wait between ranks may take before it is an error")
    flag("--quiet", action="store_true", help="no progress bar")
    flag("--max-restarts", type=int,
         help="after a failure, restart the workers from the last checkpoint up to this many times; with "
              "--fault-tolerance live: start up to this many replacement ranks for dead ones, each joining the "
              "running world")
    flag("--fault-tolerance", choices=FAULT_TOLERANCE,
         help="when a rank dies: restart (stop every rank; see --max-restarts) or live (the survivors rebuild their "
              "world and train on, no restart: --strategy ddp, ps-sync, ps-async or ssp; a dead server ends a "
              "parameter-server job)")
    flag("--live-batch", choices=LIVE_BATCH,
         help="--fault-tolerance live, after ranks die: keep the global batch, or keep each rank's batch and scale the "
              "learning rate with the new global batch as --lr-scaling says")
    flag("--log", metavar="|".join(TRACKERS),
         help="also record to these experiment trackers, comma-separated: tensorboard (RUN_DIR/tensorboard), wandb "
              "(offline, RUN_DIR/wandb), mlflow (a file store, RUN_DIR/mlruns); each an extra: pip install "
              "\"gradsync[tensorboard]\"; a resume records to the same tracker run (default: metrics.jsonl only)")
    flag("--log-every", type=positive_int, metavar="N",
         help="record every N steps: each rank's step, wait and communication time (metrics.jsonl, gradsync doctor) "
              "and, with --log, the loss, lr, throughput and those timings to the trackers")
    flag("--log-run", metavar="ID",
         help="the tracker run to record to: W&B's run id, the MLflow run tagged gradsync.run=ID (default: a new one, "
              "or the checkpoint's with --resume)")
    flag("--min-workers", type=positive_int,
         help="--fault-tolerance live: the fewest workers that train on; a recovery that leaves fewer (deaths, or "
              "the side of a network partition that keeps the job's store) checkpoints and exits 75 (default: half "
              "of the workers the job started with, rounded up)")
    flag("--checkpoint-every", metavar="N|TIME",
         help="also checkpoint every N steps (200) or every span of time (30s, 5m, 1h); default: at each epoch's "
              "end only")
    flag("--preempt-signal", choices=PREEMPT_SIGNALS,
         help="on this signal (to the launcher, any rank or the whole job) stop after the step in flight with a "
              "checkpoint and exit 75 (none: the signal's default action); Ctrl-C does the same and exits 130, a "
              "second Ctrl-C stops at once")


def _auto(text: str) -> str:
    """--resume's one value."""
    if text != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto' (continue a checkpoint in --out if "
                                         f"there is one, else start), got {text!r}")
    return text


def _before_spawning(cfg) -> str | None:
    """The checks that need no rank (train/runs.py): the task's factories and a batch through its loss, the
    batch fits the data, --out holds what this command expects, and a warning when a new run is in the
    batch-size trap (train/batch_math.py). Returns the line saying a resumed run is finished, if it is."""
    from gradsync.train import runs

    runs.check_trackers(cfg)
    task, model, data = runs.check_task(cfg)
    runs.check_batch(cfg, len(data.train))
    task.probe(model, data)
    runs.check_device(cfg)
    if cfg.resume:
        return runs.check_resume(cfg)
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) < 1:   # a torchrun restart continues its run
        say = print if _first_rank() else lambda *_, **__: None   # under torchrun every rank checks, one says
        runs.claim_out(cfg, cfg.overwrite, say=say)
        warning = runs.batch_trap_warning(cfg, len(data.train))
        if warning:
            say(f"gradsync train: {warning}", flush=True)
    return None


def _first_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def config_of(args):
    """The TrainConfig the command asks for: TrainConfig's defaults, then --config's file, then the flags given
    on the command line."""
    from gradsync.train import config_file
    from gradsync.train.config import TrainConfig

    fields = TrainConfig.__dataclass_fields__
    given = {k: v for k, v in vars(args).items() if k in fields and not (k == "epochs" and v is None)}
    if getattr(args, "config", None):
        explicit = _explicit(args)
        given = {**config_file.read(args.config, fields), **{k: v for k, v in given.items() if k in explicit}}
    return TrainConfig(**given)


def _explicit(args) -> set[str]:
    """The fields whose flags were given on the command line (not left at their defaults)."""
    parser = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    add_flags(parser, defaults={})
    known, _ = parser.parse_known_args(list(getattr(args, "argv", []))[1:])
    return set(vars(known))


RUNBOOK = """N local workers train a model on its data, and one summary says what the ranks did.

  gradsync train                                  2 workers, a CNN on scikit-learn's digits (a few seconds)
  gradsync train --model my_pkg.models:build --data my_pkg.data:build --loss mse
                                                  your own model and data (docs/your-model.md)
  gradsync train --config run.toml                every flag from a TOML file (RUN_DIR/config.toml reruns a run)
  gradsync train --workers 4 --strategy zero1     4 workers, optimizer state sharded
  gradsync train --out runs/a --steps 80 --resume continue the run in runs/a to step 80
  torchrun --nproc-per-node 2 -m gradsync.train   the same flags under torchrun
  srun gradsync train                             one rank per Slurm task (docs/slurm.md)

A signal stops the job cleanly: SIGTERM (to the launcher, a rank or the whole job: timeout, Slurm) after the
step in flight, with a checkpoint, exit 75; Ctrl-C the same, exit 130. --fault-tolerance live: a world shrunk
below --min-workers also checkpoints and exits 75; a member cut off from its job for --timeout exits 69."""


def run(args) -> int:
    from gradsync.train import config_file, tasks
    from gradsync.train.launcher import run
    from gradsync.live.failures import EXIT_LOST_CONTACT, LostContact
    from gradsync.train.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED, signal_number
    from gradsync.group import slurm
    from gradsync.train import requeue

    os.environ.update(slurm.step_torchrun_env())   # under srun each task is one rank, as under torchrun
    cfg = config_of(args)
    requeue.check(cfg)
    cfg = requeue.settle_resume(cfg, say=print if _first_rank() else lambda *_, **__: None)
    default_steps = tasks.model_defaults(cfg.model).steps
    if default_steps and cfg.epochs is None and cfg.steps is None and not cfg.resume:
        cfg = dataclasses.replace(cfg, steps=default_steps)
        print(f"gradsync train: {cfg.model} trains {default_steps:,} steps by default; --epochs N trains N passes over "
              f"the data", flush=True)
    finished = _before_spawning(cfg)
    if finished:
        print(finished, flush=True)
        return 0
    if _first_rank():
        config_file.write(cfg, cfg.out)
    try:
        results = run(cfg)
    except KeyboardInterrupt:   # a second Ctrl-C: the ranks were stopped at once
        print(f"gradsync train: interrupted again: stopped at once; {cfg.out} keeps the last checkpoint written",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except LostContact as lost:   # a live member cut off from its job: its one line, and out
        print(f"gradsync: {lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # not a return: threads of this process wait inside store calls on a server that went silent, and
        # the interpreter's exit would tear down what they use under them (C++ terminate: SIGABRT)
        os._exit(EXIT_LOST_CONTACT)
    for signum in (signal_number(cfg.preempt_signal), signal.SIGINT):
        if signum is not None:   # training is over: a signal now must not turn its end into a kill or a traceback
            signal.signal(signum, signal.SIG_IGN)
    results = [r for r in results if r is not None]   # --fault-tolerance live: members that died return nothing
    stopped = [r["preempted"] for r in results if r.get("preempted")]
    after = tasks.model_defaults(cfg.model).after
    if after and not stopped:
        from gradsync.train.factory import load

        load(after, "--model")(results)
    if any(s.get("reason") == "interrupted" for s in stopped):
        return EXIT_INTERRUPTED
    return EXIT_PREEMPTED if stopped else 0
