"""Parameter-server side: one shard of the parameters, its optimizer, and the consistency model.

Vocabulary
    W        workers;  M_s  bytes of this server's shard
    version  optimizer steps applied to this shard so far (the parameters a PULL returns)
    clock    pushes received from one worker so far (its iteration count)
    gap      clock of the pulling worker minus the clock of the slowest open worker

Consistency models (what a PUSH does, and when a PULL is answered):
    sync   PUSHes for version v are summed; when every open worker has pushed, the mean gradient
           is applied in one optimizer step (version v+1). A PULL from a worker at clock c is
           answered once version == c, so every worker computes step c on the same parameters.
    async  every PUSH is applied, in arrival order, as one optimizer step on gradient / W (the 1/W keeps
           W pushes worth one synchronous step); a PULL is answered at once with the newest version.
           staleness = version at apply - version the gradient was computed on, recorded per update.
    ssp    applied as async, but a PULL from a worker at clock c waits while c - min(open clocks)
           > staleness_bound (Ho et al., NIPS 2013), then returns the newest version. A huge bound
           gives async. Bound 0 returns the parameters as they were when the slowest worker reached
           clock c, so every worker computes step c on the same parameters, as in sync.

The Server is the serving loop: it reads each worker's messages, checks them (a malformed or
unexpected one is refused, never applied), notices lost workers, and owns three parts: the shard
at its version (versioned_shard.py), what a push does to it (push_applier.py) and what goes back to
the workers (pull_answerer.py). Pushes are applied in arrival order, before anything else their
worker sends; a push is read while the next header comes in (PUSHES_IN_FLIGHT: two in sync, one in
async and ssp) and answers leave through an outbox thread, so the server's download and upload both
work. docs/studies/ps-server.md measured each of these choices on emulated links.

Traffic: per step (W pushes) the server receives W*M_s payload bytes and sends W*M_s; with one
server M_s = M, so the server link carries 2*W*M per step against 2(N-1)/N*M per rank for ring
all-reduce. Sparse tables (sparse_wire.py): a PUSH carries each worker's k_w unique touched rows,
(8 + D*esize) * k_w bytes; a PULL is answered with exactly the rows it names, D*esize bytes each.

Stopping early (preemption): ``serve(stop)`` polls ``stop()`` between messages, and a PUSH may carry
FLAG_STOP (protocol.py); either ends the job, and the answers say so (pull_answerer.py). serve()
still returns only when every worker has closed; ``stopped`` says whether it ended early. part() and
load_part() carry the server's state into a checkpoint and back (resharding.py).

Failures: a worker that is not waiting on the server and sends nothing for ``timeout`` seconds is
declared dead; so is one whose transfer fails. Either way, and on a refused message, every other
open worker gets an ABORT header, then serve() raises naming the rank. In a live job (live/ps.py) a
lost worker sends no ABORT: the survivors rebuild the world, a server that closed one step more than
its peers rolls it back (VersionedShard.roll_back) and rejoin() serves the new world.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from gradsync.comm.transport import Handle, PeerError, Transport
from gradsync.ps import protocol as wire
from gradsync.ps import sparse_wire
from gradsync.ps.protocol import Header, ProtocolError
from gradsync.ps.clipping import ServerClipping
from gradsync.ps.outbox import Outbox
from gradsync.ps.pull_answerer import PullAnswerer
from gradsync.ps.push_applier import PushApplier
from gradsync.ps.sharding import Piece
from gradsync.ps.sparse_tables import TableSpec
from gradsync.ps.versioned_shard import VersionedShard

MODES = ("sync", "async", "ssp")
PUSHES_IN_FLIGHT = {"sync": 2, "async": 1, "ssp": 1}
"""Pushes read at once, per mode; each holds a receive buffer of the shard's size. async and ssp read
one, so an answer goes out while a push comes in and the workers fall out of step (a second would
keep them pushing together, then pulling together); sync workers push together anyway, and with S
servers each splits its upload between them, so one push at a time would idle half a server's
download (docs/studies/ps-server.md)."""
ANSWERS_IN_FLIGHT = 2
"""async and ssp: answers moving at once; more share the upload and all finish late
(docs/studies/ps-server.md, "Two answers at a time")."""


@dataclass
class _Push:
    """A push being read: its header, its row-section headers, the buffers its payload and rows come
    into, and their receives."""
    header: Header
    sections: list[Header]
    incoming: torch.Tensor
    body: torch.Tensor
    receives: list[Handle]


class WorkerLostError(RuntimeError):
    """A worker died or stopped answering; ``worker`` is its rank."""

    def __init__(self, message: str, worker: int | None) -> None:
        super().__init__(message)
        self.worker = worker


class Server:
    """Serves shard ``rank`` of the parameters to ``workers`` until all of them have closed."""

    def __init__(self, transport: Transport, workers: list[int], pieces: list[Piece], params: list[torch.Tensor],
                 optimizer_fn: Callable, mode: str, staleness_bound: int, timeout: float,
                 channel: wire.Channel, tables: list[tuple[TableSpec, torch.Tensor]] = (),
                 num_servers: int = 1, clipping: ServerClipping | None = None) -> None:
        self.transport = transport
        self.channel = channel
        self.rank = transport.rank
        self.workers = list(workers)
        self.mode = mode
        self.staleness_bound = staleness_bound
        self.timeout = timeout
        self.num_servers = num_servers
        self.shard = VersionedShard(pieces, params, optimizer_fn, tables, self.rank, num_servers,
                                    snapshot_tables=mode == "ssp" and staleness_bound == 0)
        self.applier = PushApplier(self.shard, mode, clipping, self._abort, timeout)
        self.answerer = PullAnswerer(self.shard, mode, staleness_bound, channel)
        self.incoming = [torch.empty_like(self.shard.published) for _ in range(PUSHES_IN_FLIGHT[mode])]
        self.clock = {w: 0 for w in self.workers}
        self.open = set(self.workers)
        self.last_seen = {w: time.monotonic() for w in self.workers}
        self.outbox: Outbox | None = None   # made by serve(): the answers and BYEs to workers
        self.most_pushes_in_flight = 0
        self.in_flight: list[_Push] = []   # pushes being read, oldest first
        self.counts = Counter()   # pushes, bytes_in, rows_in (the answerer counts what goes out)
        self.idle_seconds = 0.0
        self.stop_asked = False
        self.final_version: int | None = None   # sync: the version from which answers carry FLAG_STOP
        self.abort_on_loss = True   # tell the other workers when one is lost (live/ps.py: no, the job goes on)

    @property
    def version(self) -> int:
        """Optimizer steps applied to this server's shard (skipped versions included)."""
        return self.shard.version

    @property
    def stopped(self) -> bool:
        """The job was asked to end early (its workers closed on a FLAG_STOP answer, or will)."""
        return self.stop_asked

    # -- the loop ---------------------------------------------------------------------------------
    def serve(self, stop=None) -> None:
        self.outbox = Outbox(self.transport, None if self.mode == "sync" else ANSWERS_IN_FLIGHT, self.timeout,
                             name=f"gradsync-ps-outbox-{self.rank}")
        try:
            while self.open:
                if stop is not None and not self.stop_asked and stop():
                    self.stop_asked = True   # sync: final_version is set when the next version is stepped
                header, message = self._next_message()
                self.last_seen[header.sender] = time.monotonic()
                self._settle_sends(header.sender)
                while any(push.header.sender == header.sender for push in self.in_flight) or (
                        header.kind == wire.PUSH and len(self.in_flight) == len(self.incoming)):
                    self._finish_push()   # a worker's own next message sees its push applied
                self._handle(header, message)
                self.answerer.answer(self.outbox, self.clock, self.open, self._stop_from())
                self._check_liveness()
            while self.in_flight:
                self._finish_push()
            try:
                self.outbox.close()
            except PeerError as exc:
                raise self._lost(exc.peer, "it stopped receiving") from exc
        except ProtocolError as exc:
            self._abort(wire.REASON_PROTOCOL, exc.sender, str(exc))
            raise
        except WorkerLostError as exc:
            if self.abort_on_loss:
                self._abort(wire.REASON_DEAD_WORKER, exc.worker, str(exc))
            raise
        finally:
            self.outbox.abandon()   # after close(): nothing left; after an error: the thread ends

    def _stop_from(self) -> int | None:
        """The first version whose answers carry FLAG_STOP: sync, the version stepped after the ask (so
        every worker stops on the same one); async and ssp, every answer from the ask on."""
        if self.mode == "sync":
            return self.final_version
        return 0 if self.stop_asked else None

    def _next_message(self) -> tuple[Header, torch.Tensor]:
        """The next header message from any worker: its header, and the message (section headers follow)."""
        buffer = wire.empty_header(len(self.shard.tables))
        handle = self.transport.irecv(buffer, None, "ps/header", control=True, tag=self.channel.header_tag)
        started = time.monotonic()
        try:
            sender = handle.wait()
        except PeerError as exc:
            try:
                self.outbox.check()   # an answer that failed names its worker better than silence does
            except PeerError as sent:
                raise self._lost(sent.peer, "it stopped receiving") from sent
            # gloo's receive from any worker is not woken by one worker's death, nor does it go on to
            # the others' messages: a worker the transport knows dead is the cause, before the quietest
            dead = [w for w in self.transport.dead_peers() if w in self.open]
            if dead:
                raise self._lost(dead[0], "its process exited") from exc
            raise self._lost(self._quietest(), "no message from any worker arrived") from exc
        finally:
            self.idle_seconds += time.monotonic() - started
        if sender not in self.clock:
            raise ProtocolError(f"server rank {self.rank}: rank {sender} is not a worker of this parameter "
                                f"server (workers: {self.workers}); its message was refused", sender)
        return wire.decode(buffer, sender), buffer

    def _handle(self, header: Header, message: torch.Tensor) -> None:
        sender = header.sender
        if header.kind == wire.ABORT and header.numel == wire.REASON_MEMBER_DIED and not self.abort_on_loss:
            raise WorkerLostError(f"parameter server rank {self.rank}: worker rank {sender} says a member of the live "
                                  f"job died", None)   # live/ps.py's relay: a receive from any worker names no one
        if sender not in self.open:
            raise ProtocolError(f"server rank {self.rank}: unexpected {header.describe()}: that worker already "
                                f"closed; the message was refused", sender)
        if header.kind != wire.CLOSE and header.shard != self.rank:
            raise ProtocolError(f"server rank {self.rank}: {header.describe()} is about shard {header.shard}, "
                                f"but this server owns shard {self.rank}; refused", sender)
        if header.kind == wire.PUSH:
            self._on_push(header, message)
        elif header.kind == wire.PULL:
            if header.version != self.clock[sender]:
                raise ProtocolError(f"server rank {self.rank}: {header.describe()} says the worker has pushed "
                                    f"{header.version} times, the server counted {self.clock[sender]}; refused", sender)
            self.answerer.want(sender, self._pull_request(sender, message))
        elif header.kind == wire.CLOSE:
            self.open.discard(sender)
            self.answerer.forget(sender)
            self.answerer.bye(self.outbox, sender)
            self._version_closed(self.applier.close_version(self.open))
            self.answerer.advance_boundary(self.clock, self.open)
        else:
            raise ProtocolError(f"server rank {self.rank}: a worker may not send {header.describe()}; refused",
                                sender)

    # -- pushes --------------------------------------------------------------------------------------
    def _on_push(self, header: Header, message: torch.Tensor) -> None:
        """Check a PUSH header and post the receives of its payload and rows; the push stays in flight
        (_finish_push) while the server reads the next message (module docstring)."""
        sender = header.sender
        wire.check_payload_header(header, self.shard.dense.numel(), self.shard.dense.element_size(), sender)
        self.applier.check(header)
        sections = self._section_headers(sender, sparse_wire.PUSH_SECTION, message)
        body = torch.empty(sum(h.nbytes for h in sections), dtype=torch.uint8)
        in_use = [push.incoming for push in self.in_flight]
        incoming = next(buffer for buffer in self.incoming if all(buffer is not used for used in in_use))
        receives = [self.transport.irecv(buffer, sender, "ps/push", tag=self.channel.payload_tag)
                    for buffer in (incoming, body) if buffer.numel()]
        self.in_flight.append(_Push(header, sections, incoming, body, receives))
        self.most_pushes_in_flight = max(self.most_pushes_in_flight, len(self.in_flight))

    def _finish_push(self) -> None:
        """Read the oldest push in flight, check all of it, then apply it (a refused push changes nothing)."""
        push = self.in_flight.pop(0)
        header, sender = push.header, push.header.sender
        try:
            for receive in push.receives:
                receive.wait()
        except PeerError as exc:
            raise self._lost(sender, "its gradient never arrived") from exc
        wire.check_payload(header, push.incoming, sender)
        rows = self._checked_sections(sender, sparse_wire.PUSH_SECTION, push.sections, push.body)
        if header.flags & wire.FLAG_STOP:
            self.stop_asked = True
        self.counts["pushes"] += 1
        self.counts["bytes_in"] += push.incoming.numel() * push.incoming.element_size()
        for table, (local, _) in zip(self.shard.tables, rows):
            self.counts["rows_in"] += local.numel()
            self.counts["bytes_in"] += local.numel() * sparse_wire.bytes_per_row(sparse_wire.PUSH_SECTION, table.spec)
        self.clock[sender] += 1
        self._version_closed(self.applier.apply(header, push.incoming, rows, len(self.workers), self.open))
        self.answerer.advance_boundary(self.clock, self.open)

    def _version_closed(self, closed: bool) -> None:
        """Sync: a version just closed; the first one after an ask to stop is the final one."""
        if closed and self.stop_asked and self.final_version is None:
            self.final_version = self.shard.version

    def _section_headers(self, sender: int, section: str, message: torch.Tensor) -> list[Header]:
        """The T ROWS section headers in a header message from ``sender``, each checked (sparse_wire.py)."""
        headers = sparse_wire.decode_sections(message, len(self.shard.tables), sender)
        for table, header in zip(self.shard.tables, headers):
            sparse_wire.check_section_header(header, section, table.spec, self.rank, table.rows_held, sender,
                                             f"server rank {self.rank}")
        return headers

    def _checked_sections(self, sender: int, section: str, headers: list[Header],
                          body: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per table, (local row ids, gradient rows or None for a pull request) out of a received body,
        once its checksums and ids are checked."""
        where = f"server rank {self.rank}"
        tables = self.shard.tables
        parts = sparse_wire.unpack(body, section, [t.spec for t in tables],
                                   [sparse_wire.listed_rows(h) for h in headers], self.shard.dense.dtype)
        checked = []
        for table, header, (ids, values) in zip(tables, headers, parts):
            sparse_wire.check_section_payload(header, ids, values, sender, where)
            if sparse_wire.whole_table(header):   # every row held, in local order
                checked.append((torch.arange(table.rows_held, dtype=torch.int64), values))
                continue
            sparse_wire.check_ids(ids, table.spec, self.rank, self.num_servers, sender, where,
                                  unique=values is not None)
            checked.append((table.local(ids), values))
        return checked

    # -- pulls ---------------------------------------------------------------------------------------
    def _pull_request(self, sender: int, message: torch.Tensor) -> list[torch.Tensor]:
        """The local rows a PULL asks for, per table (its ids body read at once)."""
        headers = self._section_headers(sender, sparse_wire.REQUEST_SECTION, message)
        body = torch.empty(sum(h.nbytes for h in headers), dtype=torch.uint8)
        if body.numel():
            try:
                self.transport.irecv(body, sender, "ps/pull/ids", tag=self.channel.payload_tag).wait()
            except PeerError as exc:
                raise self._lost(sender, "the rows it asked for never arrived") from exc
        return [local for local, _ in self._checked_sections(sender, sparse_wire.REQUEST_SECTION, headers, body)]

    def _settle_sends(self, worker: int) -> None:
        """Wait for every letter posted to ``worker`` (outbox.py). Called when a message from it arrives: a
        worker sends its next message only after reading every answer (pull() returns when all of them
        arrived), so this returns at once. torch's gloo marks a send finished only once it is waited for,
        so sends that are never waited for pile up, each keeping its tensor alive."""
        try:
            self.outbox.settle(worker)
        except PeerError as exc:
            raise self._lost(worker if exc.peer is None else exc.peer, "it stopped receiving") from exc

    # -- failures ----------------------------------------------------------------------------------
    def _quietest(self) -> int | None:
        """The open worker that is not waiting on us and has been silent longest (the likely dead one)."""
        candidates = [w for w in self.open if w not in self.answerer.pending] or list(self.open)
        return min(candidates, key=lambda w: self.last_seen[w]) if candidates else None

    def _check_liveness(self) -> None:
        worker = self._quietest()
        if worker is not None and worker not in self.answerer.pending:
            silent = time.monotonic() - self.last_seen[worker]
            if silent > self.timeout:
                raise self._lost(worker, f"it sent nothing for {silent:.1f} s")

    def _lost(self, worker: int | None, why: str) -> WorkerLostError:
        who = f"worker rank {worker}" if worker is not None else "a worker"
        return WorkerLostError(
            f"parameter server rank {self.rank}: {who} is lost: {why} (timeout {self.timeout:.0f} s); it may have "
            f"died or stalled. Open workers: {sorted(self.open)}; server version {self.shard.version}.", worker)

    def _abort(self, reason: int, culprit: int | None, message: str) -> None:
        """Tell every other open worker that this server stopped: the notice, then an ABORT header each."""
        if self.outbox is not None:
            self.outbox.abandon()
        self.channel.post_abort(culprit, message)
        header = Header(wire.ABORT, self.rank, -1 if culprit is None else culprit, self.rank, reason)
        dead = {culprit} if reason == wire.REASON_DEAD_WORKER else set()
        for worker in sorted(self.open - dead):
            try:
                self.transport.isend(wire.message(header, [], len(self.shard.tables)), worker, "ps/header",
                                     control=True, tag=self.channel.header_tag).wait(timeout=2.0)
            except (PeerError, RuntimeError):  # gloo refuses to send on a connection it closed
                pass

    # -- a live job's rebuilt world ----------------------------------------------------------------
    def rejoin(self, transport: Transport, channel: wire.Channel, clocks: dict[int, int], open_workers: set[int]) -> None:
        """Serve the rebuilt world (live/ps.py): a new transport, the workers renumbered densely in member
        order (servers keep ranks 0..S-1); ``clocks`` maps each surviving worker's new rank to its clock as
        the survivors agreed it, ``open_workers`` are those that have not closed. Whatever was in flight is
        forgotten; the shard keeps its version (a sync server one step ahead has rolled it back)."""
        self.transport, self.channel = transport, channel
        self.workers = sorted(clocks)
        self.clock = dict(clocks)
        self.open = set(open_workers)
        self.in_flight = []
        self.last_seen = {w: time.monotonic() for w in self.workers}
        self.applier.rejoin(transport)
        self.answerer.restart(min(self.clock.values(), default=0), channel)

    # -- checkpoints (resharding.py) ---------------------------------------------------------------
    def part(self) -> dict:
        """This server's state (after serve() has returned: nothing is in flight)."""
        return {**self.shard.part(), "clocks": [self.clock[w] for w in self.workers]}

    def load_part(self, whole: dict, pieces: list) -> None:
        """Take this server's part of a whole state (before serve()); ``pieces`` are this server's."""
        self.shard.load_part(whole, pieces)
        self.clock = dict(zip(self.workers, whole["clocks"]))
        self.answerer.restart(min(self.clock.values()), self.channel)

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        steps = self.counts["pushes"] / len(self.workers)
        dense = self.shard.dense
        shard_bytes = dense.numel() * dense.element_size()
        sent, gaps, clipping = self.answerer.counts, self.answerer.gaps, self.applier.clipping
        return {
            "role": "server", "rank": self.rank, "mode": self.mode, "staleness_bound": self.staleness_bound,
            "workers": list(self.workers), "shard_elements": dense.numel(), "shard_bytes": shard_bytes,
            "version": self.shard.version, "pushes": self.counts["pushes"], "pulls": sent["pulls"],
            "tables": {t.spec.name: t.rows_held for t in self.shard.tables},
            "rows_in": self.counts["rows_in"], "rows_out": sent["rows_out"],
            "steps": steps, "bytes_in": self.counts["bytes_in"], "bytes_out": sent["bytes_out"],
            "bytes_in_per_step": self.counts["bytes_in"] / steps if steps else 0.0,
            "bytes_out_per_step": sent["bytes_out"] / steps if steps else 0.0,
            "staleness_histogram": dict(sorted(self.applier.staleness.items())),
            "clock_gap_histogram": dict(sorted(gaps.items())),
            "max_clock_gap": max(gaps) if gaps else 0,
            "idle_seconds": self.idle_seconds,
            "update_seconds": self.shard.update_seconds,
            "most_sends_in_flight": self.outbox.most_sends if self.outbox else 0,
            "most_pushes_in_flight": self.most_pushes_in_flight,
            "most_answers_in_flight": self.outbox.most_answers if self.outbox else 0,
            "answers_held": self.outbox.answers_held if self.outbox else 0,
            "optimizer_state_bytes": self.shard.state_bytes(),
            "clipped_versions": clipping.clipped if clipping else 0,
            "last_grad_norm": clipping.last_norm if clipping else None,
        }
