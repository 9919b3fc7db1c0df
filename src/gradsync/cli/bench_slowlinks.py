"""gradsync bench slowlinks: ring DDP, PowerSGD and DiLoCo on digits and charlm, same samples and seed;
accuracy, loss and bytes per rank beside ring DDP's (bench/slowlinks.py)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from gradsync.cli.args import positive_int
from gradsync.cli.output import show
from gradsync.train.config import TrainConfig


def add_parser(benches) -> None:
    slow = benches.add_parser("slowlinks", help="ring DDP, PowerSGD and DiLoCo side by side: accuracy, loss, "
                                                "bytes per rank")
    slow.add_argument("--workers", type=positive_int, default=2)
    slow.add_argument("--tasks", default="digits,charlm", help="comma-separated: digits, charlm")
    slow.add_argument("--epochs", type=positive_int, default=8, help="digits: epochs")
    slow.add_argument("--charlm-steps", type=positive_int, default=300, help="charlm: optimizer steps")
    slow.add_argument("--steps", type=positive_int, default=None, help="every task this many steps instead")
    slow.add_argument("--batch-size", type=positive_int, default=32, help="samples per rank per step")
    slow.add_argument("--powersgd-rank", type=positive_int, default=TrainConfig.powersgd_rank, metavar="R")
    slow.add_argument("--sync-every", type=positive_int, default=TrainConfig.sync_every, metavar="H", help="DiLoCo's H")
    slow.add_argument("--outer-lr", type=float, default=TrainConfig.outer_lr,
                      help="DiLoCo's outer lr (default %(default)s, gradsync train's; the paper's: 0.7)")
    slow.add_argument("--outer-momentum", type=float, default=TrainConfig.outer_momentum)
    slow.add_argument("--seed", type=int, default=0)
    slow.add_argument("--out", default="runs/slowlinks", help="each run's --out is OUT/<task>-<strategy>")
    slow.add_argument("--json", metavar="PATH", help="also write the rows and the loss curves as JSON")
    slow.add_argument("--figure", metavar="PNG", help="also draw loss vs step and vs bytes, a line per strategy")


def _megabytes(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def run(args) -> int:
    from gradsync.bench import slowlinks

    plan = slowlinks.Plan(workers=args.workers, tasks=tuple(t.strip() for t in args.tasks.split(",") if t.strip()),
                          digits_epochs=args.epochs, charlm_steps=args.charlm_steps, steps=args.steps,
                          batch_size=args.batch_size, powersgd_rank=args.powersgd_rank, sync_every=args.sync_every,
                          outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, seed=args.seed, out=args.out)
    rows, curves = slowlinks.run(plan)
    table = Table(title=f"slow links: {plan.workers} ranks, batch {plan.batch_size}/rank, seed {plan.seed}, the same "
                        f"samples for every strategy; bytes: the traffic meter, the busiest rank, whole run")
    for column in ("task", "strategy", "steps", "test accuracy", "test loss", "train loss (last 10%)",
                   "MB sent/rank", "vs ring", "target", "wall s"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["task"], r["label"], str(r["steps"]), f"{r['accuracy']:.1%}", f"{r['test_loss']:.4f}",
                      f"{r['final_train_loss']:.4f}", _megabytes(r["bytes_per_rank"]),
                      "1 (baseline)" if r["strategy"] == "ring" else f"1/{1 / r['vs_ring']:.1f}",
                      r["target"] or "-", f"{r['wall_s']:.1f}")
    show(table, rows, None, 120)
    if args.json:
        slowlinks.save(rows, curves, plan, args.json)
    if args.figure:
        print(f"wrote {slowlinks.figure(curves, plan, Path(args.figure))}")
    return 0
