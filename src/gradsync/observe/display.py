"""Where tables and report lines are printed: a rich Console sized so that a row stays on one line.

On a terminal, rich takes the terminal's width (or COLUMNS) and the commands widen that to the
table's minimum. When stdout is a pipe or a file (CI logs, ``| tee``), rich falls back to 80
columns and wraps every wider table, splitting cells over two lines; there nothing needs to fit a
screen, so tables print at their natural width instead, unless COLUMNS asks for a width.
"""

from __future__ import annotations

import os

from rich.console import Console

UNBOUNDED_COLUMNS = 100_000
"""A width no table reaches: rich then prints each table at its natural width (tables do not expand)."""


def console(minimum_width: int = 80) -> Console:
    """A Console for tables and report lines: on a terminal its width, at least ``minimum_width``;
    elsewhere COLUMNS when set, else unbounded (see the module docstring)."""
    terminal = Console()
    if terminal.is_terminal:
        return Console(width=max(minimum_width, terminal.width))
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isdigit() and int(columns) > 0:
        return Console(width=int(columns))
    return Console(width=UNBOUNDED_COLUMNS)
