"""How the gradsync command prints a result: a rich table sized to the terminal, rows as JSON."""

from __future__ import annotations

import json

from rich.table import Table


def show(table: Table, rows, json_path: str | None, width: int = 100) -> None:
    """Print a result table (on a terminal at least ``width`` columns wide; in a pipe or file at its
    natural width or COLUMNS, see gradsync/observe/display.py) and, with --json, write the rows."""
    from gradsync.observe import display

    display.console(width).print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


def human_count(count: float) -> str:
    return next((f"{count / scale:g}{unit}" for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6))
                 if count >= scale), f"{count:g}")


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
