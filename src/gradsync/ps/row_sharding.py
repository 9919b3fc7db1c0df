"""Row sharding of a sparse table (an embedding's weight) over S servers: row r lives on server r mod S.

Vocabulary
    R       rows of the table;  D  columns (embedding dimension);  S  servers
    owner   owner(r) = r mod S, the server that holds row r
    local   local(r) = r // S, the row's index in its owner's compact block of rows
    block   the rows one server holds, rows s, s+S, s+2S, ...: R_s = ceil((R - s) / S) of them

Example: R=10, S=3: server 0 holds rows 0,3,6,9 (locals 0..3), server 1 rows 1,4,7, server 2 rows 2,5,8.

Why striping by r mod S and not contiguous ranges: vocabularies are numbered by frequency (row 0 is
the most frequent token), and token frequencies follow Zipf's law, so the touched rows of a batch
crowd at the low ids. Contiguous ranges would send most of every push and pull to server 0;
striping deals the hot head round-robin, so each server gets about 1/S of the touched rows of any
batch whatever the skew (within one row per server of the hottest S rows). A hash would balance as
well but needs a lookup table to invert; r mod S is its own inverse (r = local * S + s) and costs
nothing. An adversarial id pattern (all ids congruent mod S) defeats it; word ids are not that.
"""

from __future__ import annotations

import torch


def rows_on(server: int, rows: int, servers: int) -> int:
    """R_s: how many of ``rows`` rows server ``server`` holds."""
    return max(0, (rows - server + servers - 1) // servers)


def global_rows(server: int, rows: int, servers: int) -> torch.Tensor:
    """The global ids of server ``server``'s block, in local order (int64)."""
    return torch.arange(server, rows, servers, dtype=torch.int64)


def split_by_owner(ids: torch.Tensor, servers: int) -> list[torch.Tensor]:
    """Positions in ``ids`` of the rows each server owns: ``positions[s]`` (order kept)."""
    owner = ids % servers
    return [torch.nonzero(owner == s).view(-1) for s in range(servers)]


def to_local(ids: torch.Tensor, servers: int) -> torch.Tensor:
    """Global row ids (all owned by one server) -> that server's local indices."""
    return torch.div(ids, servers, rounding_mode="floor")
