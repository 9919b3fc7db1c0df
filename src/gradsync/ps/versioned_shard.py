"""One parameter server's shard at its current version: the dense elements, the rows of every sparse
table, the one torch optimizer over both, and what pulls read (server.py).

Vocabulary
    version    optimizer steps applied to this shard so far (skipped versions included)
    published  the dense payload pulls return: a copy made at each step, replaced, never mutated
    previous   (sync, live) the version, dense shard and optimizer state just before the last
               step, so a server that closed a step its peers did not can undo it (roll_back)

A step changes the dense shard and every table at once (one optimizer step, sparse_optim.py), so
staleness, clocks and SSP gaps count the same for dense and sparse parameters. SSP with bound 0
answers from the tables as they were at a clock boundary: a copy-on-write snapshot per boundary
(row_history.py) keeps the old values of the rows written since, k rows per push instead of a
copy of the whole block.

Why roll_back: in a live job the servers' versions differ by at most one when a worker dies (a
server closes V + 1 only once every worker pulled V from every server); the one that closed the
step the others did not rolls it back, so every server holds V_min and the survivors train step
V_min again (live/ps.py). async and ssp keep no previous state.
"""

from __future__ import annotations

import copy
import time
from typing import Callable

import torch
from torch import nn

from gradsync.ps import resharding
from gradsync.ps.row_history import RowHistory
from gradsync.ps.sharding import Piece, gather_shard
from gradsync.ps.sparse_optim import sparse_rule
from gradsync.ps.sparse_tables import TableBlock, TableSpec


class VersionedShard:
    """Shard ``rank`` of ``num_servers``: its parameters, optimizer and version (module docstring).
    ``snapshot_tables``: keep table snapshots for bound-0 SSP (published_tables is then the version)."""

    def __init__(self, pieces: list[Piece], params: list[torch.Tensor], optimizer_fn: Callable,
                 tables: list[tuple[TableSpec, torch.Tensor]], rank: int, num_servers: int,
                 snapshot_tables: bool) -> None:
        self.rank = rank
        self.num_servers = num_servers
        dtype = (list(params) or [full for _, full in tables])[0].dtype
        numel = sum(p.length for p in pieces)
        self.dense = nn.Parameter(gather_shard(params, pieces, torch.empty(numel, dtype=dtype)))
        self.tables = [TableBlock(spec, full, rank, num_servers, "SGD", {}) for spec, full in tables]
        # one torch optimizer holds the dense shard and the table blocks (which never get a .grad): a
        # schedule that sets its param groups' lr reaches the sparse rules too (sparse_optim.py)
        self.optimizer = optimizer_fn(([self.dense] if numel or not self.tables else []) +
                                      [t.block for t in self.tables])
        for table in self.tables:   # torch's Adagrad fills its state for every parameter it is given at
            self.optimizer.state.pop(table.block, None)   # construction; the sparse rules keep their own
        if self.tables:
            rule = sparse_rule(self.optimizer)
            for table in self.tables:
                table.optimizer.rule = rule
                table.optimizer.group = self._group_of(table)
        self.version = 0
        self.skipped_versions: set[int] = set()   # sync: versions reached without an update (answers say so)
        self.snapshot_tables = snapshot_tables
        self.histories = [RowHistory(t.block.detach()) for t in self.tables] if snapshot_tables else []
        self.published = self.dense.detach().clone()
        self.published_tables = self._publish_tables()
        self.update_seconds = 0.0   # in step: the optimizer, the tables, the published copy
        self.keep_previous = False
        """Sync, live: keep the state before each step (roll_back); set by live/ps.py."""
        self.previous: tuple | None = None

    # -- changing it ---------------------------------------------------------------------------------
    def step(self, gradient: torch.Tensor, table_rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One version: the torch optimizer on the dense shard, then each table's sparse rule on its rows.
        ``gradient`` may be overwritten (a push's buffer, or the sync sum)."""
        started = time.perf_counter()
        if self.keep_previous:
            self.previous = (self.version, self.dense.detach().clone(), copy.deepcopy(self.optimizer.state_dict()))
        self.dense.grad = gradient
        self.optimizer.step()
        self.dense.grad = None
        for index, (table, (rows, grad)) in enumerate(zip(self.tables, table_rows)):
            if self.histories:
                self.histories[index].before_write(rows)
            table.step(rows, grad)
        self.version += 1
        self._publish()
        self.update_seconds += time.perf_counter() - started

    def skip(self) -> None:
        """One version with the parameters unchanged (sync: a worker's gradient was not finite)."""
        self.version += 1
        self.skipped_versions.add(self.version)

    def roll_back(self) -> None:
        """Undo the last step (sync, keep_previous): the shard and the optimizer state as before it."""
        assert self.previous is not None and self.previous[0] == self.version - 1, (
            f"server rank {self.rank}: no state kept from before version {self.version}")
        version, dense, state = self.previous
        with torch.no_grad():
            self.dense.copy_(dense)
        self.optimizer.load_state_dict(state)
        self.version = version
        self._publish()
        self.previous = None

    # -- what pulls read -----------------------------------------------------------------------------
    def rows(self, index: int, blocks: list[torch.Tensor] | int, local: torch.Tensor) -> torch.Tensor:
        """Rows ``local`` of table ``index`` out of ``blocks`` (a published_tables, perhaps an older one)."""
        if self.histories:
            return self.histories[index].read(blocks, local)
        return blocks[index].index_select(0, local)

    def keep_snapshots(self, keys: set[int]) -> None:
        """Bound-0 SSP: a table snapshot for every version in ``keys``, no other."""
        for history in self.histories:
            for key in keys:
                history.keep(key)
            history.drop(keys)

    def _publish(self) -> None:
        self.published = self.dense.detach().clone()
        self.published_tables = self._publish_tables()

    def _publish_tables(self) -> list[torch.Tensor] | int:
        """What pulls read rows from: the live blocks (rows are copied when answered); for bound-0 SSP
        the version, whose snapshot (row_history.py) a boundary recorded now answers from."""
        return self.version if self.snapshot_tables else [t.block.detach() for t in self.tables]

    # -- checkpoints (resharding.py) -----------------------------------------------------------------
    def _dense_index(self) -> int | None:
        """The shard's index among the torch optimizer's parameters (None: it is not one of them)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return next((i for i, p in enumerate(params) if p is self.dense), None)

    def _group_of(self, table: TableBlock) -> dict:
        return next(g for g in self.optimizer.param_groups if any(p is table.block for p in g["params"]))

    def part(self) -> dict:
        """This shard's state: the dense elements, their optimizer state, the tables, the version."""
        saved = self.optimizer.state_dict()
        index = self._dense_index()
        dense_state = saved["state"].get(index, {}) if index is not None else {}
        return {"shard": self.dense.detach().clone(), "version": self.version,
                "dense_state": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dense_state.items()},
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]],
                "tables": {t.spec.name: {"block": t.block.detach().clone(), "t": t.optimizer.t,
                                         "state": {k: v.clone() for k, v in t.optimizer.state.items()}}
                           for t in self.tables}}

    def load_part(self, whole: dict, pieces: list) -> None:
        """Take this shard's part of a whole state (resharding.py); ``pieces`` are this server's."""
        dense, dense_state = resharding.dense_part(whole, pieces, self.dense.numel())
        with torch.no_grad():
            self.dense.copy_(dense)
        saved = self.optimizer.state_dict()
        index = self._dense_index()
        if len(saved["param_groups"]) != len(whole["param_groups"]):
            raise ValueError(f"the checkpoint's server optimizer has {len(whole['param_groups'])} parameter groups, "
                             f"this one {len(saved['param_groups'])}")
        groups = [{**old, "params": mine["params"]} for old, mine in zip(whole["param_groups"], saved["param_groups"])]
        state = {index: dense_state} if index is not None and dense_state else {}
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        for table in self.tables:
            part = resharding.table_part(whole["tables"][table.spec.name], self.rank, self.num_servers)
            with torch.no_grad():
                table.block.copy_(part["block"])
            table.optimizer.t = part["t"]
            table.optimizer.state = part["state"]
            table.optimizer.group = self._group_of(table)
        self.version = whole["version"]
        self._publish()
        for history in self.histories:
            history.drop(set())

    def state_bytes(self) -> int:
        """Bytes of per-element optimizer state held (torch's and the sparse rules'; scalars apart)."""
        tensors = [v for state in self.optimizer.state.values() for v in state.values()]
        tensors += [v for t in self.tables for v in t.optimizer.state.values()]
        return sum(v.numel() * v.element_size() for v in tensors if isinstance(v, torch.Tensor) and v.dim() > 0)
