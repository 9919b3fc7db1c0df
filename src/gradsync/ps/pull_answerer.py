"""What a parameter server (server.py) sends its workers: the answer to a pull, once its mode allows
one, and the BYE to a close, through the server's outbox (outbox.py).

When a pull may be answered (server.py's consistency models): sync once the version equals the
worker's clock; ssp while the worker's clock is at most staleness_bound ahead of the slowest open
worker's; async at once. SSP with bound 0 answers with the parameters of the clock boundary: those
of the version at which the slowest open worker reached that clock (a reference kept per boundary,
and a table snapshot, versioned_shard.py).

Answers in flight: sync sends a version's W answers together (every worker waits for that version
anyway); async and ssp hand the outbox at most ANSWERS_IN_FLIGHT moving at once, since answers that
share the upload all finish late (docs/studies/ps-server.md has the measurements). The outbox waits
for them on a thread of its own, so the server reads the next message meanwhile.

Stopping early: sync answers of the final version and later carry FLAG_STOP, so every worker stops on
the same version (each worker ORs its S servers' flags; all of them answer version v alike); async
and ssp carry it on every answer from the ask on, and each worker stops at its own clock.
"""

from __future__ import annotations

from collections import Counter

import torch

from gradsync.ps import protocol as wire
from gradsync.ps import sparse_wire
from gradsync.ps.outbox import Outbox, Part
from gradsync.ps.protocol import Header
from gradsync.ps.versioned_shard import VersionedShard


class PullAnswerer:
    """Answers the pulls of ``shard``'s workers in ``mode`` (module docstring) on ``channel``'s tags."""

    def __init__(self, shard: VersionedShard, mode: str, staleness_bound: int, channel: wire.Channel) -> None:
        self.shard = shard
        self.mode = mode
        self.staleness_bound = staleness_bound
        self.channel = channel
        self.bound_zero = mode == "ssp" and staleness_bound == 0
        self.pending: dict[int, list[torch.Tensor]] = {}   # worker -> local rows wanted, per table
        self.counts = Counter()   # pulls, rows_out, bytes_out
        self.gaps = Counter()   # a pulling worker's clock minus the slowest open worker's, per answer
        self.answer_checksum: tuple[torch.Tensor | None, int] = (None, 0)   # (payload, its checksum)
        self.min_clock = 0
        self.boundary: dict[int, tuple] = {}   # ssp, bound 0: clock -> (version, payload, tables)
        self.restart(0, channel)

    def want(self, worker: int, rows: list[torch.Tensor]) -> None:
        """``worker`` pulled, asking for ``rows`` of each table."""
        self.pending[worker] = rows

    def forget(self, worker: int) -> None:
        """``worker`` closed: no answer is owed to it."""
        self.pending.pop(worker, None)

    def may_answer(self, worker: int, clock: dict[int, int], open_workers: set[int]) -> bool:
        if self.mode == "sync":
            return self.shard.version == clock[worker]
        if self.mode == "ssp":
            return clock[worker] - min(clock[w] for w in open_workers) <= self.staleness_bound
        return True

    def answer(self, outbox: Outbox, clock: dict[int, int], open_workers: set[int], stop_from: int | None) -> None:
        """Send every pending pull its mode allows; answers of version ``stop_from`` and later carry FLAG_STOP."""
        for worker in sorted(self.pending):
            if not self.may_answer(worker, clock, open_workers):
                continue
            local_rows = self.pending.pop(worker)
            self.gaps[clock[worker] - min(clock[w] for w in open_workers)] += 1
            version, payload, blocks = self.shard.version, self.shard.published, self.shard.published_tables
            if self.bound_zero:
                version, payload, blocks = self.boundary[clock[worker]]
            answers, sections = [], []
            for index, (table, local) in enumerate(zip(self.shard.tables, local_rows)):
                values = self.shard.rows(index, blocks, local)
                sections.append(sparse_wire.section_header(sparse_wire.ANSWER_SECTION, self.shard.rank,
                                                           self.shard.rank, table.spec, None, values))
                answers.append(values)
                self.counts["rows_out"] += local.numel()
                self.counts["bytes_out"] += sections[-1].nbytes
            stop = wire.FLAG_STOP if stop_from is not None and version >= stop_from else 0
            header = Header(wire.PARAMS, self.shard.rank, version, self.shard.rank, payload.numel(),
                            payload.numel() * payload.element_size(), self._checksum(payload),
                            stop | (wire.FLAG_SKIPPED if version in self.shard.skipped_versions else 0))
            body = sparse_wire.pack([], answers)
            outbox.send(worker, [self._header_part(header, sections)] +
                        [Part(tensor, "ps/pull", self.channel.payload_tag) for tensor in (payload, body)
                         if tensor.numel()])
            self.counts["pulls"] += 1
            self.counts["bytes_out"] += header.nbytes

    def bye(self, outbox: Outbox, worker: int) -> None:
        """Acknowledge ``worker``'s CLOSE."""
        rank = self.shard.rank
        outbox.send(worker, [self._header_part(Header(wire.BYE, rank, self.shard.version, rank))], answer=False)

    def advance_boundary(self, clock: dict[int, int], open_workers: set[int]) -> None:
        """SSP bound 0: record the parameters at each new minimum clock (what a pull at that clock returns)."""
        if not self.bound_zero or not open_workers:
            return
        lowest = min(clock[w] for w in open_workers)
        for reached in range(self.min_clock + 1, lowest + 1):
            self.boundary[reached] = (self.shard.version, self.shard.published, self.shard.published_tables)
        self.min_clock = max(self.min_clock, lowest)
        for old in [c for c in self.boundary if c < self.min_clock]:
            del self.boundary[old]
        self._keep_snapshots()

    def restart(self, min_clock: int, channel: wire.Channel) -> None:
        """Start again from the shard as it is, the slowest worker at ``min_clock`` (a checkpoint was
        loaded, or the world was rebuilt on ``channel``): no pull is pending."""
        self.channel = channel
        self.pending = {}
        self.min_clock = min_clock
        self.boundary = {min_clock: (self.shard.version, self.shard.published, self.shard.published_tables)}
        self._keep_snapshots()

    def _keep_snapshots(self) -> None:
        """Bound-0 SSP: a table snapshot for every version a boundary answers from, no other (the
        tables a boundary holds are then a version number)."""
        if self.bound_zero:
            self.shard.keep_snapshots({tables for _, _, tables in self.boundary.values()})

    def _checksum(self, payload: torch.Tensor) -> int:
        """An answer's checksum, computed once per published payload (never mutated): a version's W
        answers share it."""
        if self.answer_checksum[0] is not payload:
            self.answer_checksum = (payload, wire.checksum(payload))
        return self.answer_checksum[1]

    def _header_part(self, header: Header, sections: list[Header] = ()) -> Part:
        return Part(wire.message(header, list(sections), len(self.shard.tables)), "ps/header",
                    self.channel.header_tag, control=True)
