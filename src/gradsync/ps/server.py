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
           clock c (a reference kept per clock boundary, no copy), so every worker computes step c
           on the same parameters, as in sync; otherwise a late PULL could already see a faster
           worker's step-c update.

Pushes in flight: the server posts the receives of a push and reads the next message while it
comes in. async and ssp read one push at a time, so an answer to another worker goes out on the
link while the push comes in: the workers fall out of step and the server's upload and download
both work (a second push beside the first would keep the workers in step, pushing together and
then pulling together: W=2 at 1 Gbit/s, 423 -> 538 ms a step). sync reads two at once: its
workers push together anyway, and with S servers each splits its upload between them, so taking
one worker's push at a time would leave half of a server's download idle. Each push in flight has
its own buffer; how a push is applied, server_applying.py says. Answers go out through the
outbox, at most ANSWERS_IN_FLIGHT at once in async and ssp (server_answering.py).

Traffic: per step (W pushes) the server receives W*M_s payload bytes and sends W*M_s; with one
server M_s = M, so the server link carries 2*W*M per step against 2(N-1)/N*M per rank for ring
all-reduce.

Sparse tables (sparse_tables.py, sparse_wire.py): the server also holds rows s, s+S, ... of each
table (row_sharding.py). A PUSH carries each worker's unique touched rows, k_w of them:
(8 + D*esize) * k_w bytes; a PULL names the rows the worker wants next and is answered with exactly
those rows, D*esize bytes each (stepping them: server_applying.py).

Stopping early (preemption): ``serve(stop)`` polls ``stop()`` between messages, and a PUSH may
carry FLAG_STOP (protocol.py); either asks this server to end the job, and its answers say so
(server_answering.py). serve() still returns only when every worker has closed; ``stopped`` says
whether it ended early. part() and load_part() carry this server's state into a checkpoint and back
(resharding.py).

Failures: a worker that is not waiting on the server and sends nothing for ``timeout`` seconds is
declared dead; so is one whose transfer fails. A malformed or unexpected message is refused (never
applied). Either way every other open worker gets an ABORT header, then serve() raises naming the rank;
in a live job (live/ps.py) a lost worker sends no ABORT: the survivors rebuild the world and go on
(server_resizing.py).

The Server is this file's serving loop (reading messages, failures, checkpoints, counters) with
what it does to a push (server_applying.py), to a pull (server_answering.py) and to a lost worker
(server_resizing.py) beside it.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from gradsync.comm.transport import Handle, PeerError, Transport
from gradsync.ps import protocol as wire
from gradsync.ps.protocol import Header, ProtocolError
from gradsync.ps import resharding, sparse_wire
from gradsync.ps.clipping import ServerClipping
from gradsync.ps.outbox import Outbox
from gradsync.ps.row_history import RowHistory
from gradsync.ps.server_answering import Answering
from gradsync.ps.server_applying import Applying
from gradsync.ps.server_resizing import Resizing
from gradsync.ps.sharding import Piece, gather_shard
from gradsync.ps.sparse_optim import sparse_rule
from gradsync.ps.sparse_tables import TableBlock, TableSpec

MODES = ("sync", "async", "ssp")
PUSHES_IN_FLIGHT = {"sync": 2, "async": 1, "ssp": 1}
"""Pushes read at once, per mode (module docstring); each holds a receive buffer of the shard's size."""
ANSWERS_IN_FLIGHT = 2
"""async and ssp: answers moving at once (module docstring)."""


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


class Server(Applying, Answering, Resizing):
    """Serves shard ``rank`` of the parameters to ``workers`` until all of them have closed."""

    def __init__(self, transport: Transport, workers: list[int], pieces: list[Piece], params: list[torch.Tensor],
                 optimizer_fn: Callable, mode: str, staleness_bound: int, timeout: float,
                 channel: wire.Channel, tables: list[tuple[TableSpec, torch.Tensor]] = (),
                 num_servers: int = 1, clipping: ServerClipping | None = None) -> None:
        self.transport = transport
        self.clipping = clipping   # sync: clip each version's mean gradient by the norm over all servers
        self.channel = channel
        self.rank = transport.rank
        self.workers = list(workers)
        self.mode = mode
        self.staleness_bound = staleness_bound
        self.timeout = timeout
        dtype = (list(params) or [full for _, full in tables])[0].dtype
        numel = sum(p.length for p in pieces)
        self.shard = nn.Parameter(gather_shard(params, pieces, torch.empty(numel, dtype=dtype)))
        self.num_servers = num_servers
        self.tables = [TableBlock(spec, full, self.rank, num_servers, "SGD", {}) for spec, full in tables]
        # one torch optimizer holds the dense shard and the table blocks (which never get a .grad): a
        # schedule that sets its param groups' lr reaches the sparse rules too (sparse_optim.py)
        self.optimizer = optimizer_fn(([self.shard] if numel or not self.tables else []) +
                                      [t.block for t in self.tables])
        for table in self.tables:   # torch's Adagrad fills its state for every parameter it is given at
            self.optimizer.state.pop(table.block, None)   # construction; the sparse rules keep their own
        if self.tables:
            rule = sparse_rule(self.optimizer)
            for table in self.tables:
                table.optimizer.rule = rule
                table.optimizer.group = next(g for g in self.optimizer.param_groups
                                             if any(p is table.block for p in g["params"]))
        self.published = self.shard.detach().clone()    # what PULLs return; replaced, never mutated
        self.answer_checksum: tuple[torch.Tensor | None, int] = (None, 0)   # (payload, its checksum)
        self.incoming = [torch.empty_like(self.published) for _ in range(PUSHES_IN_FLIGHT[mode])]
        self.grad_sum = torch.zeros_like(self.published) if mode == "sync" else None
        self.version = 0
        self.clock = {w: 0 for w in self.workers}
        self.open = set(self.workers)
        self.pushed_this_version: set[int] = set()
        self.nonfinite_this_version = False   # sync: a push of this version was flagged FLAG_NONFINITE
        self.skipped_versions: set[int] = set()   # sync: versions reached without an update (answers say so)
        self.pending_pulls: set[int] = set()
        self.last_seen = {w: time.monotonic() for w in self.workers}
        self.min_clock = 0
        self.snapshot_tables = mode == "ssp" and staleness_bound == 0
        self.histories = [RowHistory(t.block.detach()) for t in self.tables] if self.snapshot_tables else []
        self.published_tables = self._publish_tables()
        self.pending_rows: dict[int, list[torch.Tensor]] = {}   # worker -> local rows wanted, per table
        self.boundary = {0: (0, self.published, self.published_tables)}   # ssp, bound 0: clock -> (version, ...)
        self._keep_snapshots()
        self.outbox: Outbox | None = None   # made by serve(): the answers and BYEs to workers
        self.most_pushes_in_flight = 0
        self.in_flight: list[_Push] = []   # pushes being read, oldest first
        self.counts = Counter()
        self.staleness = Counter()
        self.gaps = Counter()
        self.idle_seconds = 0.0
        self.update_seconds = 0.0   # in _step: the optimizer, the tables, the published copy
        self.stop_asked = False
        self.final_version: int | None = None   # sync: the version from which answers carry FLAG_STOP
        self.abort_on_loss = True   # tell the other workers when one is lost (live/ps.py: no, the job goes on)

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
                self._answer_pulls()
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

    def _next_message(self) -> tuple[Header, torch.Tensor]:
        """The next header message from any worker: its header, and the message (section headers follow)."""
        buffer = wire.empty_header(len(self.tables))
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
            self.pending_rows[sender] = self._pull_request(sender, message)
            self.pending_pulls.add(sender)
        elif header.kind == wire.CLOSE:
            self.open.discard(sender)
            self.pending_pulls.discard(sender)
            self.pending_rows.pop(sender, None)
            self.outbox.send(sender, [self._header_part(wire.Header(wire.BYE, self.rank, self.version, self.rank))],
                             answer=False)
            self._maybe_step_sync()
            self._advance_boundary()
        else:
            raise ProtocolError(f"server rank {self.rank}: a worker may not send {header.describe()}; refused",
                                sender)

    def _on_push(self, header: Header, message: torch.Tensor) -> None:
        """Check a PUSH header and post the receives of its payload and rows; the push stays in flight
        (_finish_push) while the server reads the next message (module docstring)."""
        sender = header.sender
        wire.check_payload_header(header, self.shard.numel(), self.shard.element_size(), sender)
        if header.version > self.version:
            raise ProtocolError(f"server rank {self.rank}: {header.describe()} claims a version from the future "
                                f"(server is at {self.version}); refused", sender)
        if self.mode == "sync" and (header.version != self.version or sender in self.pushed_this_version):
            raise ProtocolError(
                f"server rank {self.rank}: unexpected {header.describe()}: in sync mode each worker pushes once per "
                f"version, on the version it pulled (server is at {self.version}); call pull() before every "
                f"push(); refused", sender)
        sections = self._section_headers(sender, sparse_wire.PUSH_SECTION, message)
        body = torch.empty(sum(h.nbytes for h in sections), dtype=torch.uint8)
        in_use = [push.incoming for push in self.in_flight]
        incoming = next(buffer for buffer in self.incoming if all(buffer is not used for used in in_use))
        receives = [self.transport.irecv(buffer, sender, "ps/push", tag=self.channel.payload_tag)
                    for buffer in (incoming, body) if buffer.numel()]
        self.in_flight.append(_Push(header, sections, incoming, body, receives))
        self.most_pushes_in_flight = max(self.most_pushes_in_flight, len(self.in_flight))

    def _section_headers(self, sender: int, section: str, message: torch.Tensor) -> list[Header]:
        """The T ROWS section headers in a header message from ``sender``, each checked (sparse_wire.py)."""
        headers = sparse_wire.decode_sections(message, len(self.tables), sender)
        for table, header in zip(self.tables, headers):
            sparse_wire.check_section_header(header, section, table.spec, self.rank, table.rows_held, sender,
                                             f"server rank {self.rank}")
        return headers

    def _checked_sections(self, sender: int, section: str, headers: list[Header],
                          body: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Per table, (local row ids, gradient rows or None for a pull request) out of a received body,
        once its checksums and ids are checked."""
        where = f"server rank {self.rank}"
        parts = sparse_wire.unpack(body, section, [t.spec for t in self.tables],
                                   [sparse_wire.listed_rows(h) for h in headers], self.shard.dtype)
        checked = []
        for table, header, (ids, values) in zip(self.tables, headers, parts):
            sparse_wire.check_section_payload(header, ids, values, sender, where)
            if sparse_wire.whole_table(header):   # every row held, in local order
                checked.append((torch.arange(table.rows_held, dtype=torch.int64), values))
                continue
            sparse_wire.check_ids(ids, table.spec, self.rank, self.num_servers, sender, where,
                                  unique=values is not None)
            checked.append((table.local(ids), values))
        return checked

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

    # -- failures ----------------------------------------------------------------------------------
    def _quietest(self) -> int | None:
        """The open worker that is not waiting on us and has been silent longest (the likely dead one)."""
        candidates = [w for w in self.open if w not in self.pending_pulls] or list(self.open)
        return min(candidates, key=lambda w: self.last_seen[w]) if candidates else None

    def _check_liveness(self) -> None:
        worker = self._quietest()
        if worker is not None and worker not in self.pending_pulls:
            silent = time.monotonic() - self.last_seen[worker]
            if silent > self.timeout:
                raise self._lost(worker, f"it sent nothing for {silent:.1f} s")

    def _lost(self, worker: int | None, why: str) -> WorkerLostError:
        who = f"worker rank {worker}" if worker is not None else "a worker"
        return WorkerLostError(
            f"parameter server rank {self.rank}: {who} is lost: {why} (timeout {self.timeout:.0f} s); it may have "
            f"died or stalled. Open workers: {sorted(self.open)}; server version {self.version}.", worker)

    def _abort(self, reason: int, culprit: int | None, message: str) -> None:
        """Tell every other open worker that this server stopped: the notice, then an ABORT header each."""
        if self.outbox is not None:
            self.outbox.abandon()
        self.channel.post_abort(culprit, message)
        header = Header(wire.ABORT, self.rank, -1 if culprit is None else culprit, self.rank, reason)
        dead = {culprit} if reason == wire.REASON_DEAD_WORKER else set()
        for worker in sorted(self.open - dead):
            try:
                self.transport.isend(wire.message(header, [], len(self.tables)), worker, "ps/header", control=True,
                                     tag=self.channel.header_tag).wait(timeout=2.0)
            except (PeerError, RuntimeError):  # gloo refuses to send on a connection it closed
                pass

    # -- checkpoints (resharding.py) ---------------------------------------------------------------
    def _dense_index(self) -> int | None:
        """The shard's index among the torch optimizer's parameters (None: it is not one of them)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return next((i for i, p in enumerate(params) if p is self.shard), None)

    def part(self) -> dict:
        """This server's state (after serve() has returned: nothing is in flight)."""
        saved = self.optimizer.state_dict()
        index = self._dense_index()
        dense_state = saved["state"].get(index, {}) if index is not None else {}
        return {"shard": self.shard.detach().clone(), "version": self.version,
                "clocks": [self.clock[w] for w in self.workers],
                "dense_state": {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dense_state.items()},
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]],
                "tables": {t.spec.name: {"block": t.block.detach().clone(), "t": t.optimizer.t,
                                         "state": {k: v.clone() for k, v in t.optimizer.state.items()}}
                           for t in self.tables}}

    def load_part(self, whole: dict, pieces: list) -> None:
        """Take this server's part of a whole state (before serve()); ``pieces`` are this server's."""
        shard, dense_state = resharding.dense_part(whole, pieces, self.shard.numel())
        with torch.no_grad():
            self.shard.copy_(shard)
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
            table.optimizer.group = next(g for g in self.optimizer.param_groups
                                         if any(p is table.block for p in g["params"]))
        self.version = whole["version"]
        self.clock = dict(zip(self.workers, whole["clocks"]))
        self.min_clock = min(self.clock.values())
        self.published = self.shard.detach().clone()
        self.published_tables = self._publish_tables()
        self.boundary = {self.min_clock: (self.version, self.published, self.published_tables)}
        for history in self.histories:
            history.drop(set())
        self._keep_snapshots()

    # -- reporting ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        steps = self.counts["pushes"] / len(self.workers)
        shard_bytes = self.shard.numel() * self.shard.element_size()
        return {
            "role": "server", "rank": self.rank, "mode": self.mode, "staleness_bound": self.staleness_bound,
            "workers": list(self.workers), "shard_elements": self.shard.numel(), "shard_bytes": shard_bytes,
            "version": self.version, "pushes": self.counts["pushes"], "pulls": self.counts["pulls"],
            "tables": {t.spec.name: t.rows_held for t in self.tables},
            "rows_in": self.counts["rows_in"], "rows_out": self.counts["rows_out"],
            "steps": steps, "bytes_in": self.counts["bytes_in"], "bytes_out": self.counts["bytes_out"],
            "bytes_in_per_step": self.counts["bytes_in"] / steps if steps else 0.0,
            "bytes_out_per_step": self.counts["bytes_out"] / steps if steps else 0.0,
            "staleness_histogram": dict(sorted(self.staleness.items())),
            "clock_gap_histogram": dict(sorted(self.gaps.items())),
            "max_clock_gap": max(self.gaps) if self.gaps else 0,
            "idle_seconds": self.idle_seconds,
            "update_seconds": self.update_seconds,
            "most_sends_in_flight": self.outbox.most_sends if self.outbox else 0,
            "most_pushes_in_flight": self.most_pushes_in_flight,
            "most_answers_in_flight": self.outbox.most_answers if self.outbox else 0,
            "answers_held": self.outbox.answers_held if self.outbox else 0,
            "optimizer_state_bytes": self._state_bytes(),
            "clipped_versions": self.clipping.clipped if self.clipping else 0,
            "last_grad_norm": self.clipping.last_norm if self.clipping else None,
        }

    def _state_bytes(self) -> int:
        """Bytes of per-element optimizer state this server holds (torch's and the sparse rules'; scalars apart)."""
        tensors = [v for state in self.optimizer.state.values() for v in state.values()]
        tensors += [v for t in self.tables for v in t.optimizer.state.values()]
        return sum(v.numel() * v.element_size() for v in tensors if isinstance(v, torch.Tensor) and v.dim() > 0)
