"""gradsync train: N local workers train a real model on real data (train/loop.py; the flags are
train/config.py's TrainConfig)."""

from __future__ import annotations

import sys

from gradsync.cli.args import positive_int


def add_parser(commands) -> None:
    from gradsync.train.config import (COMPRESSION, FAULT_TOLERANCE, LIVE_BATCH, LR_SCALING, PREEMPT_SIGNALS,
                                        STRATEGIES, TrainConfig)
    from gradsync.comm.collectives import ALGORITHMS
    from gradsync.train.datasets import DATASETS
    from gradsync.train.models import MODELS

    defaults = TrainConfig.__dataclass_fields__
    train = commands.add_parser("train", help="N local workers train a real model on real data")
    train.add_argument("--workers", type=positive_int, default=defaults["workers"].default, help="local worker processes")
    train.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    train.add_argument("--algorithm", choices=ALGORITHMS, default="auto")
    train.add_argument("--servers", type=positive_int, default=1, help="how many of the --workers processes serve parameters (ps-sync, ps-async, ssp)")
    train.add_argument("--staleness", type=int, default=2, help="SSP bound in versions")
    train.add_argument("--model", choices=MODELS, default=None, help="default: the dataset's natural model")
    train.add_argument("--dataset", choices=DATASETS, default=None, help="default: digits (or stdlib-text for charlm)")
    train.add_argument("--epochs", type=positive_int, default=defaults["epochs"].default)
    train.add_argument("--steps", type=positive_int, default=None, help="total optimizer steps (overrides --epochs)")
    train.add_argument("--batch-size", type=positive_int, default=32, help="samples per worker per micro-batch")
    train.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--lr", type=float, default=None, help="base learning rate for one worker's batch")
    train.add_argument("--lr-scaling", choices=LR_SCALING, default="linear")
    train.add_argument("--warmup-steps", type=int, default=defaults["warmup_steps"].default)
    train.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB")
    train.add_argument("--compress", choices=COMPRESSION, default="none",
                       help="gradient compression on the wire (ddp): fp16, bf16, or powersgd (rank-r factors)")
    train.add_argument("--powersgd-rank", type=positive_int, default=2, metavar="R",
                       help="PowerSGD's approximation rank (--compress powersgd)")
    train.add_argument("--sync-every", type=positive_int, default=8, metavar="H",
                       help="--strategy diloco: inner steps each worker takes alone between outer steps")
    train.add_argument("--outer-lr", type=float, default=0.7, help="--strategy diloco: the outer Nesterov SGD's lr")
    train.add_argument("--outer-momentum", type=float, default=0.9, help="--strategy diloco: its momentum")
    train.add_argument("--clip-grad", type=float, default=None, metavar="X",
                       help="clip the averaged gradient to total 2-norm X before each optimizer step, as torch's "
                            "clip_grad_norm_ on one process (ps-sync: on the servers; ps-async, ssp: each push)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", default="runs/latest", help="directory for metrics.jsonl, trace.json, checkpoints")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    train.add_argument("--trace", action="store_true", help="write a Chrome trace timeline (trace.json)")
    train.add_argument("--timeout", type=float, default=60.0, help="seconds any wait between ranks may take")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="after a failure, restart the workers from the last checkpoint up to this many times; "
                            "with --fault-tolerance live: start up to this many replacement ranks for dead ones, "
                            "each joining the running world")
    train.add_argument("--fault-tolerance", choices=FAULT_TOLERANCE, default="restart",
                       help="when a rank dies: restart (stop every rank; see --max-restarts) or live (the survivors "
                            "rebuild their world and train on, no restart; --strategy ddp)")
    train.add_argument("--live-batch", choices=LIVE_BATCH, default="keep-global",
                       help="--fault-tolerance live, after ranks die: keep the global batch, or keep each rank's "
                            "batch and scale the learning rate by new/old world size (default keep-global)")
    train.add_argument("--checkpoint-every", default="", metavar="N|TIME",
                       help="also checkpoint every N steps (200) or every span of time (30s, 5m, 1h)")
    train.add_argument("--preempt-signal", choices=PREEMPT_SIGNALS, default="SIGTERM",
                       help="on this signal (to the launcher or any rank) stop at the next step with a checkpoint "
                            "and exit 75 (default SIGTERM; none: the signal's default action)")


def run(args) -> int:
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import run

    import signal

    from gradsync.train.preempt import EXIT_INTERRUPTED, EXIT_PREEMPTED, signal_number

    fields = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        results = run(cfg)
    except KeyboardInterrupt:   # a second Ctrl-C: the ranks were stopped at once
        print(f"gradsync train: interrupted again: stopped at once; {cfg.out} keeps the last checkpoint written",
              file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    for signum in (signal_number(cfg.preempt_signal), signal.SIGINT):
        if signum is not None:   # training is over: a signal now must not turn its end into a kill or a traceback
            signal.signal(signum, signal.SIG_IGN)
    results = [r for r in results if r is not None]   # --fault-tolerance live: members that died return nothing
    stopped = [r["preempted"] for r in results if r.get("preempted")]
    if cfg.model == "word2vec" and not stopped:
        from gradsync.train.word2vec import print_neighbours

        print_neighbours(results)
    if any(s.get("reason") == "interrupted" for s in stopped):
        return EXIT_INTERRUPTED
    return EXIT_PREEMPTED if stopped else 0
