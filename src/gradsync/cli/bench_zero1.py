"""gradsync bench zero1: ZeRO-1 step time and optimizer-state bytes beside DDP (bench/zero1.py)."""

from __future__ import annotations

from rich.table import Table

from gradsync.cli.args import int_list, positive_int
from gradsync.cli.output import show


def add_parser(benches) -> None:
    zero1 = benches.add_parser("zero1", help="ZeRO-1 step time and optimizer-state bytes beside DDP")
    zero1.add_argument("--workers", type=int_list, default=[2, 4], help="comma-separated rank counts")
    zero1.add_argument("--model", choices=("charlm", "mlp"), default="charlm",
                       help="charlm (0.47M parameters) or the DDP bench's mlp (10.5M)")
    zero1.add_argument("--batch-size", type=positive_int, default=16, help="samples per rank")
    zero1.add_argument("--steps", type=positive_int, default=10, help="timed steps per implementation (median)")
    zero1.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run(args) -> int:
    from gradsync.bench import zero1

    rows = zero1.run(args.workers, args.batch_size, args.steps, model=args.model)
    table = Table(title=f"ZeRO-1 vs DDP, {args.model} ({rows[0]['params'] / 1e6:.2f}M params), AdamW, "
                        f"batch {args.batch_size}/rank, median of {args.steps} steps")
    for column in ("N", "implementation", "step (ms)", "time ratio", "optimizer state/rank", "state ratio",
                   "bytes sent/step"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["workers"]), r["impl"], f"{r['step_s'] * 1e3:.1f}", f"{r['time_ratio']:.2f}x",
                      f"{r['state_bytes']:,}", f"{r['state_ratio']:.3f}x", f"{r['bytes_sent_per_step']:,}")
    show(table, rows, args.json)
    return 0
