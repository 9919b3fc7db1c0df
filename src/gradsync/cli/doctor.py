"""gradsync doctor: the DDP performance checklist, read from a run directory (gradsync/train/doctor.py)."""

from __future__ import annotations

from rich.table import Table

from gradsync.cli.output import show


def add_parser(commands) -> None:
    doctor = commands.add_parser("doctor", help="the DDP performance checklist, read from a run directory")
    doctor.add_argument("run_dir", help="a --out directory of gradsync train")


def run(args) -> int:
    from gradsync.train.doctor import examine

    findings = examine(args.run_dir)
    table = Table(title=f"gradsync doctor: {args.run_dir}")
    for column in ("check", "verdict", "finding"):
        table.add_column(column)
    colours = {"OK": "green", "WARN": "yellow", "INFO": "cyan"}
    for f in findings:
        table.add_row(f.check, f"[{colours[f.verdict]}]{f.verdict}[/]", f.detail)
    show(table, None, None, 120)
    return 0
