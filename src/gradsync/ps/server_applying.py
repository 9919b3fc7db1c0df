"""What a parameter server (server.py) does with a push: check it, then apply it to its shard.

Order: pushes are applied in arrival order, before anything else their worker sends, and the
oldest first when another push would exceed the limit of pushes in flight (server.py). A push
that fails its checks is refused whole: nothing of it is applied.

Per mode (server.py's consistency models):
    sync       the push is added to the version's sum; when every open worker has pushed, the mean
               (sum / W) is clipped where asked (clipping.py: by its norm over every server) and
               applied in one optimizer step, and the version steps
    async, ssp the push is applied at once, as one step on gradient / W; staleness = the version
               at apply - the version it was computed on, recorded per update

A push flagged FLAG_NONFINITE (a worker's gradient scaler found inf or NaN, protocol.py) is not
applied: sync skips the whole version (every server sees every worker's flag, so all skip it; the
version steps with the parameters unchanged and its answers carry FLAG_SKIPPED); async and ssp skip
that push alone.

A version steps the dense shard and every table at once (one optimizer step, sparse_optim.py), so
staleness, clocks and SSP gaps count the same as for dense parameters. Sync mode averages the
touched rows over the W pushes; async applies each push's rows as gradient / W. SSP with bound 0
answers from the tables as they were at the clock boundary: a copy-on-write snapshot per boundary
(row_history.py) keeps the old values of the rows written since, k rows per push instead of a
copy of the whole block; a bound >= 1 or sync needs none.
"""

from __future__ import annotations

import time

import torch

from gradsync.comm.transport import PeerError
from gradsync.ps import protocol as wire
from gradsync.ps import sparse_wire


class Applying:
    """The Server's applying of pushes (module docstring); its state is made by Server.__init__."""

    def _finish_push(self) -> None:
        """Read the oldest push in flight, check all of it, then apply it (a refused push changes nothing)."""
        push = self.in_flight.pop(0)
        header, sections, incoming, body = push.header, push.sections, push.incoming, push.body
        sender = header.sender
        try:
            for receive in push.receives:
                receive.wait()
        except PeerError as exc:
            raise self._lost(sender, "its gradient never arrived") from exc
        wire.check_payload(header, incoming, sender)
        rows = self._checked_sections(sender, sparse_wire.PUSH_SECTION, sections, body)
        if header.flags & wire.FLAG_STOP:
            self.stop_asked = True
        self.counts["pushes"] += 1
        self.counts["bytes_in"] += incoming.numel() * incoming.element_size()
        for table, (local, grad) in zip(self.tables, rows):
            self.counts["rows_in"] += local.numel()
            self.counts["bytes_in"] += local.numel() * sparse_wire.bytes_per_row(sparse_wire.PUSH_SECTION, table.spec)
        self.clock[sender] += 1
        nonfinite = bool(header.flags & wire.FLAG_NONFINITE)
        if self.mode == "sync":
            self.nonfinite_this_version |= nonfinite
            if not self.nonfinite_this_version:   # a skipped version's sum is never read: it is zeroed
                self.grad_sum.add_(incoming)
            for table, (local, grad) in zip(self.tables, rows):
                table.add(sender, local, grad)
            self.pushed_this_version.add(sender)
            self._maybe_step_sync()
        elif nonfinite:
            self._advance_boundary()
        else:
            self.staleness[self.version - header.version] += 1
            workers = len(self.workers)
            self._step(incoming.div_(workers), [(local, grad / workers) for local, grad in rows])
            self._advance_boundary()

    def _maybe_step_sync(self) -> None:
        if self.mode != "sync" or not self.pushed_this_version or not self.open <= self.pushed_this_version:
            return
        self.staleness[0] += len(self.pushed_this_version)
        pushers = len(self.pushed_this_version)
        gradient, table_rows = self.grad_sum.div_(pushers), [table.take_mean(pushers) for table in self.tables]
        if self.nonfinite_this_version:   # every server skips it alike: each saw every worker's flag
            self.version += 1
            self.skipped_versions.add(self.version)
        else:
            if self.clipping is not None:
                self._clip(gradient, table_rows)
            self._step(gradient, table_rows)
        self.grad_sum.zero_()
        self.nonfinite_this_version = False
        self.pushed_this_version.clear()
        if self.stop_asked and self.final_version is None:
            self.final_version = self.version

    def _clip(self, gradient: torch.Tensor, table_rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Clip the version's mean gradient by its norm over every server (clipping.py)."""
        try:
            self.clipping.clip_(([gradient] if gradient.numel() else []) + [grad for _, grad in table_rows],
                                gradient.dtype)
        except PeerError as exc:
            message = (f"parameter server rank {self.rank}: no power sum from server rank {exc.peer} for clipping "
                       f"version {self.version}; it may have died or stalled (timeout {self.timeout:.0f} s): {exc}")
            self._abort(wire.REASON_SERVER_ERROR, exc.peer, message)
            raise RuntimeError(message) from exc

    def _step(self, gradient: torch.Tensor, table_rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One version: the torch optimizer on the dense shard, then each table's sparse rule on its rows.
        ``gradient`` may be overwritten (a push's buffer, or the sync sum)."""
        started = time.perf_counter()
        self._before_step()
        self.shard.grad = gradient
        self.optimizer.step()
        self.shard.grad = None
        for index, (table, (rows, grad)) in enumerate(zip(self.tables, table_rows)):
            if self.histories:
                self.histories[index].before_write(rows)
            table.step(rows, grad)
        self.version += 1
        self.published = self.shard.detach().clone()
        self.published_tables = self._publish_tables()
        self.update_seconds += time.perf_counter() - started

    def _publish_tables(self) -> list[torch.Tensor] | int:
        """What pulls read rows from: the live blocks (rows are copied when answered); for bound-0 SSP
        the version, whose snapshot (row_history.py) a boundary recorded now answers from."""
        return self.version if self.snapshot_tables else [t.block.detach() for t in self.tables]

    def _advance_boundary(self) -> None:
        """Record the parameters at each new minimum clock (what a bound-0 SSP pull returns)."""
        if self.mode != "ssp" or self.staleness_bound != 0 or not self.open:
            return
        lowest = min(self.clock[w] for w in self.open)
        for clock in range(self.min_clock + 1, lowest + 1):
            self.boundary[clock] = (self.version, self.published, self.published_tables)
        self.min_clock = max(self.min_clock, lowest)
        for clock in [c for c in self.boundary if c < self.min_clock]:
            del self.boundary[clock]
        self._keep_snapshots()

    def _keep_snapshots(self) -> None:
        """Bound-0 SSP: a table snapshot for every version a boundary answers from, no other."""
        if not self.histories:
            return
        keys = {tables for _, _, tables in self.boundary.values()}
        for history in self.histories:
            for key in keys:
                history.keep(key)
            history.drop(keys)
