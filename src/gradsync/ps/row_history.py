"""Copy-on-write snapshots of a table block: the rows as they were at a moment, without copying the table.

Vocabulary
    block      a server's rows of one sparse table, R_s x D, updated in place (sparse_tables.py)
    snapshot   the block as it was when keep(key) was called; key is the server version then
    saved      for one snapshot, the old values of the rows written since it was taken, and
               pos[r] = where row r's old value is in ``saved`` (-1: row r is unchanged since)

Why: SSP with bound 0 answers a pull at clock c from the parameters as they were when the slowest
worker reached c (server.py), while faster workers' pushes keep changing the block. Copying the
whole block at every version costs R_s x D per push whatever the batch touched; a snapshot here
costs an R_s-entry index (8 bytes a row, against D x element size for a copy) plus the old values
of the rows actually written while it is kept: k rows per push.

    before_write(rows)   for every kept snapshot, save the rows not saved yet (rows are unique)
    read(key, rows)      block[rows], then every row saved for that snapshot replaced by its old value
    drop(keys)           forget snapshots no longer asked for
"""

from __future__ import annotations

import torch


class _Saved:
    def __init__(self, rows: int) -> None:
        self.pos = torch.full((rows,), -1, dtype=torch.int64)
        self.parts: list[torch.Tensor] = []
        self.count = 0
        self._joined: torch.Tensor | None = None

    def save(self, rows: torch.Tensor, block: torch.Tensor) -> None:
        new = rows[self.pos[rows] < 0]
        if new.numel():
            self.pos[new] = torch.arange(self.count, self.count + new.numel())
            self.parts.append(block.index_select(0, new))
            self.count += new.numel()
            self._joined = None

    def restore(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        where = self.pos[rows]
        changed = where >= 0
        if self.count and bool(changed.any()):
            if self._joined is None:
                self._joined = torch.cat(self.parts)
            values[changed] = self._joined[where[changed]]


class RowHistory:
    """Snapshots of one block (see the module docstring)."""

    def __init__(self, block: torch.Tensor) -> None:
        self.block = block
        self.snapshots: dict[int, _Saved] = {}

    def keep(self, key: int) -> None:
        """Take a snapshot of the block as it is now, under ``key`` (kept if it exists already)."""
        if key not in self.snapshots:
            self.snapshots[key] = _Saved(self.block.shape[0])

    def drop(self, keep: set[int]) -> None:
        for key in [k for k in self.snapshots if k not in keep]:
            del self.snapshots[key]

    def before_write(self, rows: torch.Tensor) -> None:
        """Call before the unique local ``rows`` of the block are changed."""
        for saved in self.snapshots.values():
            saved.save(rows, self.block)

    def read(self, key: int, rows: torch.Tensor) -> torch.Tensor:
        """The ``rows`` of the block as they were when snapshot ``key`` was taken (a new tensor)."""
        values = self.block.index_select(0, rows)
        self.snapshots[key].restore(rows, values)
        return values
