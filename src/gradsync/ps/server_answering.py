"""What a parameter server (server.py) does with a pull: answer it when its mode allows, through the
outbox.

When a pull may be answered (server.py's consistency models): sync once the version equals the
worker's clock; ssp while the worker's clock is at most staleness_bound ahead of the slowest open
worker's; async at once. SSP with bound 0 answers with the parameters of the clock boundary.

Answers in flight: sync sends a version's W answers together (every worker waits for that version
anyway). async and ssp answer a pull as soon as they may, with at most ANSWERS_IN_FLIGHT answers
moving at once: a further answer is held until the oldest one is received. Answers that share the
upload all finish late; taken two at a time, each worker gets its parameters sooner and pushes
again sooner, which keeps the server's download busy (1 Gbit/s, one server: W=4 859 -> 725 ms a
step, W=6 1296 -> 1200 ms; one at a time was better at W=2-3 and worse at W=6). The server's
outbox (outbox.py) posts the answers and waits for them on a thread of its own, so the server
reads the next message and posts the next push's receives while an answer is held (W=6: 1148 ->
1002 ms a step; docs/studies/ps-server.md).

Stopping early: once the job is asked to end (server.py), sync reads the ask when a version is
stepped, and every PARAMS answer of that version and later carries FLAG_STOP, so every worker stops
on the same version (each worker ORs its S servers' flags; all of them answer version v alike).
async and ssp: from the ask on, every answer carries FLAG_STOP and each worker stops at its own
clock.
"""

from __future__ import annotations

import torch

from gradsync.comm.transport import PeerError
from gradsync.ps import protocol as wire
from gradsync.ps import sparse_wire
from gradsync.ps.outbox import Part
from gradsync.ps.protocol import Header


class Answering:
    """The Server's answering of pulls (module docstring); its state is made by Server.__init__."""

    def _may_answer(self, worker: int) -> bool:
        if self.mode == "sync":
            return self.version == self.clock[worker]
        if self.mode == "ssp":
            return self.clock[worker] - min(self.clock[w] for w in self.open) <= self.staleness_bound
        return True

    def _answer_pulls(self) -> None:
        for worker in sorted(self.pending_pulls):
            if not self._may_answer(worker):
                continue
            self.pending_pulls.discard(worker)
            self.gaps[self.clock[worker] - min(self.clock[w] for w in self.open)] += 1
            version, payload, blocks = self.version, self.published, self.published_tables
            if self.mode == "ssp" and self.staleness_bound == 0:
                version, payload, blocks = self.boundary[self.clock[worker]]
            answers, sections = [], []
            for index, (table, local) in enumerate(zip(self.tables, self.pending_rows.pop(worker, []))):
                history = self.histories[index] if self.histories else None
                values = history.read(blocks, local) if history else blocks[index].index_select(0, local)
                sections.append(sparse_wire.section_header(sparse_wire.ANSWER_SECTION, self.rank, self.rank,
                                                           table.spec, None, values))
                answers.append(values)
                self.counts["rows_out"] += local.numel()
                self.counts["bytes_out"] += sections[-1].nbytes
            header = Header(wire.PARAMS, self.rank, version, self.rank, payload.numel(),
                            payload.numel() * payload.element_size(), self._checksum(payload),
                            self._stop_flag(version) | (wire.FLAG_SKIPPED if version in self.skipped_versions else 0))
            body = sparse_wire.pack([], answers)
            self.outbox.send(worker, [self._header_part(header, sections)] +
                             [Part(tensor, "ps/pull", self.channel.payload_tag) for tensor in (payload, body)
                              if tensor.numel()])
            self.counts["pulls"] += 1
            self.counts["bytes_out"] += header.nbytes

    def _stop_flag(self, version: int) -> int:
        """FLAG_STOP on an answer of ``version`` (see the module docstring), else 0."""
        if self.mode == "sync":
            return wire.FLAG_STOP if self.final_version is not None and version >= self.final_version else 0
        return wire.FLAG_STOP if self.stop_asked else 0

    def _checksum(self, payload: torch.Tensor) -> int:
        """An answer's checksum, computed once per published payload (never mutated): a version's W
        answers share it."""
        if self.answer_checksum[0] is not payload:
            self.answer_checksum = (payload, wire.checksum(payload))
        return self.answer_checksum[1]

    def _header_part(self, header: Header, sections: list[Header] = ()) -> Part:
        return Part(wire.message(header, list(sections), len(self.tables)), "ps/header", self.channel.header_tag,
                    control=True)

    def _settle_sends(self, worker: int) -> None:
        """Wait for every letter posted to ``worker`` (outbox.py). Called when a message from it arrives: a
        worker sends its next message only after reading every answer (pull() returns when all of them
        arrived), so this returns at once. torch's gloo marks a send finished only once it is waited for,
        so sends that are never waited for pile up, each keeping its tensor alive."""
        try:
            self.outbox.settle(worker)
        except PeerError as exc:
            raise self._lost(worker if exc.peer is None else exc.peer, "it stopped receiving") from exc
