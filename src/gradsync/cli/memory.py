"""gradsync memory: bytes per rank of model state, plain data parallelism and ZeRO stages 1-3 (sim/memory.py)."""

from __future__ import annotations

from rich.table import Table

from gradsync.cli.args import count, positive_int
from gradsync.cli.output import human_count, show


def add_parser(commands) -> None:
    memory = commands.add_parser("memory", help="bytes per rank of model state: plain DP and ZeRO stages 1-3")
    memory.add_argument("--params", type=count, required=True, help="parameters, e.g. 70e9 or 70B")
    memory.add_argument("--workers", type=positive_int, required=True, help="data-parallel ranks N")
    memory.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    memory.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")


def run(args) -> int:
    from gradsync.sim import memory

    p, g, k = memory.bytes_per_parameter(args.optimizer, args.precision)
    table = Table(title=f"model state per rank: {human_count(args.params)} parameters, {args.workers} ranks, "
                        f"{args.optimizer} {args.precision} (P={p}, G={g}, K={k} bytes per parameter)")
    for column in ("stage", "formula", "params", "grads", "optimizer", "total per rank", "vs plain DP"):
        table.add_column(column, justify="right")
    formulas = {"plain DP": "Psi*(P+G+K)", "ZeRO-1": "Psi*(P+G+K/N)", "ZeRO-2": "Psi*(P+(G+K)/N)",
                "ZeRO-3": "Psi*(P+G+K)/N"}
    plain = memory.model_state_bytes(args.params, args.workers, "plain DP", args.optimizer, args.precision).total
    for stage in memory.STAGES:
        b = memory.model_state_bytes(args.params, args.workers, stage, args.optimizer, args.precision)
        table.add_row(stage, formulas[stage], memory.human(b.param), memory.human(b.grad), memory.human(b.optimizer),
                      memory.human(b.total), f"{b.total / plain:.3f}x")
    show(table, None, None)
    return 0
