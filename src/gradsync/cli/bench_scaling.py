"""gradsync bench scaling: the main job at W workers under linear, sqrt and no learning-rate scaling, side
by side: global batch, steps, final accuracy, time to 95%, samples/s (bench/scaling.py)."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from gradsync.cli.args import int_list, positive_int
from gradsync.cli.output import show


def add_parser(benches) -> None:
    scaling = benches.add_parser("scaling", help="the batch-size trap: the main job at W workers under linear, sqrt "
                                                 "and no lr scaling: accuracy, steps, time to 95%%")
    scaling.add_argument("--workers", type=int_list, default=[1, 2, 4, 8], help="world sizes, comma-separated")
    scaling.add_argument("--rules", default="linear,sqrt,none", help="--lr-scaling rules, comma-separated")
    scaling.add_argument("--epochs", type=positive_int, default=None,
                         help="every run this many epochs (default: each rule's default length; 8 is the old default)")
    scaling.add_argument("--seed", type=int, default=0)
    scaling.add_argument("--out", default="runs/scaling", help="each run's --out is OUT/w<W>-<rule>")
    scaling.add_argument("--json", metavar="PATH", help="also write the rows and the accuracy curves as JSON")
    scaling.add_argument("--figure", metavar="PNG", help="also draw accuracy and time to 95%% against W")


def run(args) -> int:
    from gradsync.bench import scaling

    plan = scaling.Plan(workers=tuple(args.workers), rules=tuple(r.strip() for r in args.rules.split(",") if r.strip()),
                        epochs=args.epochs, seed=args.seed, out=args.out)
    rows = scaling.run(plan)
    length = f"--epochs {plan.epochs}" if plan.epochs else "each rule's default length (lr x steps of 8 epochs of one worker)"
    table = Table(title=f"batch scaling: digits CNN, 32 per worker, {length}, seed {plan.seed}; time to "
                        f"{scaling.TARGET:.0%}: first epoch-end evaluation at or above it (evaluations included)")
    for column in ("W", "lr scaling", "global batch", "lr", "epochs", "steps", "test accuracy",
                   f"time to {scaling.TARGET:.0%} (s)", "samples/s", "wall s", "trap warned"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["workers"]), r["rule"] + (f" (= {r['same_as']})" if r["same_as"] else ""),
                      str(r["global_batch"]), f"{r['peak_lr']:.3g}", str(r["epochs"]), str(r["steps"]),
                      f"{r['accuracy']:.2%}",
                      "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.1f}",
                      f"{r['samples_per_s']:,.0f}", f"{r['wall_s']:.1f}", "yes" if r["warned"] else "no")
    show(table, rows, None, 120)
    if args.json:
        scaling.save(rows, plan, args.json)
    if args.figure:
        print(f"wrote {scaling.figure(rows, plan, Path(args.figure))}")
    return 0
