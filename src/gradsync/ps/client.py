"""Worker side of the parameter server: pull parameters, push gradients, close.

    pull(rows)  one PULL header to every server, then from each: PARAMS header + payload, written into
              the model's parameters. Blocks while the server's consistency model holds the answer
              back (sync: until every worker pushed; ssp: while this worker is too far ahead).
              Sparse tables: ``rows`` maps a table's name to the row ids wanted (deduplicated here);
              each server gets a ROWS section naming its rows (r mod S == s) and answers with exactly
              those rows, written into the local table; other rows keep whatever they held. A table
              left out of ``rows`` fetches nothing; ``rows=None`` fetches every table whole, each
              section flagged FLAG_WHOLE_TABLE instead of listing the rows (a header's worth).
    push()    from each server's pieces of the gradients: PUSH header (the version the gradient was
              computed on, a checksum) + payload, then per sparse table the server's share of the
              gradient's unique touched rows (ids + values; sparse_wire.py). Then the gradients are
              cleared (set to None), as optimizer.zero_grad() would; a dense parameter without a
              gradient pushes zeros, a table without one pushes no rows.
    close()   CLOSE to every server, then wait for each one's BYE.

Stopping early: push(stop=True) sets FLAG_STOP on the PUSH headers; a PARAMS answer with FLAG_STOP
(from any server) sets ``stopping``: the parameters just pulled are the job's last, and the worker
should close() instead of computing another step (server.py says when the servers set it).
push(nonfinite=True) sets FLAG_NONFINITE (a gradient scaler found inf or NaN); a PARAMS answer with
FLAG_SKIPPED sets ``skipped``: sync mode's version just pulled was not applied (protocol.py).

A server that stopped on an error sends ABORT; the next pull() or close() raises ServerAbortedError
naming the rank at fault. A server that stops answering gives a PeerError after the timeout.
"""

from __future__ import annotations

import time

import torch

from gradsync.comm.transport import PeerError, Transport
from gradsync.ps import protocol as wire
from gradsync.ps.protocol import Header, ProtocolError, ServerAbortedError
from gradsync.ps import row_sharding, sparse_wire
from gradsync.ps.clipping import clip_push_
from gradsync.ps.sharding import ShardPlan, gather_shard, scatter_shard
from gradsync.ps.sparse_tables import TableSpec, coalesce_rows


class Client:
    """One worker's view of the S servers."""

    def __init__(self, transport: Transport, plan: ShardPlan, params: list[torch.Tensor], mode: str,
                 channel: wire.Channel, tables: list[tuple[TableSpec, torch.Tensor]] = (),
                 clip_push: tuple[float, float] | None = None) -> None:
        self.transport = transport
        self.clip_push = clip_push   # (max_norm, norm_type): async and ssp clip each push here (clipping.py)
        self.last_norm: float | None = None
        self.channel = channel
        self.rank = transport.rank
        self.plan = plan
        self.params = params
        self.tables = list(tables)
        self.mode = mode
        dtype = (params or [t for _, t in self.tables])[0].dtype
        self.servers = list(range(len(plan.pieces)))
        self.buffers = [torch.empty(n, dtype=dtype) for n in plan.shard_numels]
        self.versions = [0] * len(self.servers)   # version of each shard the model now holds
        self.clock = 0
        self.pulled_since_push = True
        self.closed = False
        self.stopping = False
        self.skipped = False   # the version the last pull returned was not applied (protocol.py FLAG_SKIPPED)
        self.pull_wait_seconds = 0.0
        self.push_seconds = 0.0
        self.abort_notice_seconds = 5.0   # how long a failed transfer looks for a server's abort notice

    def pull(self, rows: dict | None = None) -> None:
        self._check_open("pull")
        wanted = self._split_rows(self._wanted_rows(rows))
        whole = rows is None
        started = time.monotonic()
        sends = []
        for server in self.servers:
            sections = [sparse_wire.section_header(sparse_wire.REQUEST_SECTION, self.rank, server, spec, ids, None,
                                                   whole=whole)
                        for (spec, _), ids in zip(self.tables, wanted[server])]
            sends.append((self._send_header(server, Header(wire.PULL, self.rank, self.clock, server), sections),
                          server))
            body = sparse_wire.pack([] if whole else wanted[server], [])
            if body.numel():
                sends.append((self.transport.isend(body, server, "ps/pull/ids", tag=self.channel.payload_tag), server))
        # Every server's answer is received at once: a receive posted only after the previous server's
        # answer had arrived would hold the next server's upload back (gloo moves a message once its
        # receive is posted), so with S servers the workers would drain them one after another.
        posted = [self._post_header(server) for server in self.servers]
        arriving = []
        self.skipped = False
        for server, (handle, message) in zip(self.servers, posted):
            header = self._take_header(server, handle, message, expect=wire.PARAMS)
            buffer = self.buffers[server]
            if header.shard != server:
                raise ProtocolError(f"worker rank {self.rank}: server rank {server} answered for shard "
                                    f"{header.shard}", server)
            wire.check_payload_header(header, buffer.numel(), buffer.element_size(), server)
            payload = (self.transport.irecv(buffer, server, "ps/pull", tag=self.channel.payload_tag)
                       if buffer.numel() else None)
            answers = self._post_answers(server, wanted[server], message) if self.tables else None
            arriving.append((server, header, payload, answers))
        for server, header, payload, answers in arriving:
            buffer = self.buffers[server]
            if payload is not None:
                self._wait(payload, server)
            wire.check_payload(header, buffer, server)
            scatter_shard(buffer, self.plan.pieces[server], self.params)
            if answers is not None:
                self._apply_answers(server, wanted[server], *answers)
            self.versions[server] = header.version
            self.stopping |= bool(header.flags & wire.FLAG_STOP)
            self.skipped |= bool(header.flags & wire.FLAG_SKIPPED)
        for handle, server in sends:
            self._wait(handle, server)
        self.pulled_since_push = True
        self.pull_wait_seconds += time.monotonic() - started

    def _post_answers(self, server: int, wanted: list[torch.Tensor], message: torch.Tensor):
        """Check the section headers in ``server``'s PARAMS message against the rows ``wanted`` from each
        table and post the receive of their one body: (headers, body, handle or None)."""
        where = f"worker rank {self.rank}"
        headers = sparse_wire.decode_sections(message, len(self.tables), server)
        for (spec, _), ids, header in zip(self.tables, wanted, headers):
            sparse_wire.check_section_header(header, sparse_wire.ANSWER_SECTION, spec, server, ids.numel(), server,
                                             where)
            if header.numel != ids.numel():
                raise ProtocolError(f"{where}: server rank {server} answered {header.numel} rows of table {spec.name}, "
                                    f"{ids.numel()} were asked for", server)
        body = torch.empty(sum(h.nbytes for h in headers), dtype=torch.uint8)   # each checked: k x row bytes
        handle = (self.transport.irecv(body, server, "ps/pull", tag=self.channel.payload_tag)
                  if body.numel() else None)
        return headers, body, handle

    def _apply_answers(self, server: int, wanted: list[torch.Tensor], headers, body, handle) -> None:
        """Wait for the body of ``server``'s answer, check each table's rows and write them into the tables."""
        if handle is not None:
            self._wait(handle, server)
        specs = [spec for spec, _ in self.tables]
        dtype = self.tables[0][1].dtype
        parts = sparse_wire.unpack(body, sparse_wire.ANSWER_SECTION, specs, [ids.numel() for ids in wanted], dtype)
        for header, (_, table), ids, (_, values) in zip(headers, self.tables, wanted, parts):
            sparse_wire.check_section_payload(header, None, values, server, f"worker rank {self.rank}")
            with torch.no_grad():
                table.index_copy_(0, ids, values)

    def _wanted_rows(self, rows: dict | None) -> list[torch.Tensor]:
        """Per table, the unique sorted row ids to fetch (every row when ``rows`` is None); ValueError on bad ids."""
        if rows is None:
            return [torch.arange(spec.rows, dtype=torch.int64) for spec, _ in self.tables]
        if not isinstance(rows, dict):
            raise TypeError(f"pull(rows=...) takes a dict {{table name: 1-D int64 tensor of row ids}} or None, got "
                            f"{type(rows).__name__}")
        names = [spec.name for spec, _ in self.tables]
        unknown = [name for name in rows if name not in names]
        if unknown:
            raise ValueError(f"pull(rows=...): {unknown} are not sparse tables of this model; the sparse tables "
                             f"(nn.Embedding/EmbeddingBag with sparse=True) are: {names or 'none'}")
        wanted = []
        for spec, _ in self.tables:
            ids = rows.get(spec.name)
            if ids is None:
                wanted.append(torch.empty(0, dtype=torch.int64))
                continue
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"pull(rows={{{spec.name!r}: ...}}) needs a 1-D int64 tensor of row ids, got "
                                 f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}"
                                 f"{' of shape ' + str(tuple(ids.shape)) if isinstance(ids, torch.Tensor) else ''}")
            ids = ids.to(torch.int64)
            bad = (ids < 0) | (ids >= spec.rows)
            if bool(bad.any()):
                raise ValueError(f"pull(rows=...): row id {int(ids[bad][0])} is out of range for table {spec.name}, "
                                 f"which has rows 0..{spec.rows - 1}")
            wanted.append(torch.unique(ids))
        return wanted

    def _split_rows(self, per_table: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """[server][table] -> the global ids that server holds (row_sharding.py)."""
        split = [[] for _ in self.servers]
        for ids in per_table:
            for server, positions in enumerate(row_sharding.split_by_owner(ids, len(self.servers))):
                split[server].append(ids[positions])
        return split

    def push(self, stop: bool = False, nonfinite: bool = False) -> None:
        self._check_open("push")
        if self.mode == "sync" and not self.pulled_since_push:
            raise RuntimeError(f"worker rank {self.rank}: push() twice without pull() in sync mode: the server "
                               f"takes one gradient per worker per version; call pull() before every push()")
        started = time.monotonic()
        grads = [p.grad for p in self.params]
        touched = [coalesce_rows(table, spec) for spec, table in self.tables]
        if self.clip_push is not None:
            self.last_norm = clip_push_(*self.clip_push, grads, [values for _, values in touched])
        owners = [row_sharding.split_by_owner(ids, len(self.servers)) for ids, _ in touched]
        handles = []
        for server in self.servers:
            payload = gather_shard(grads, self.plan.pieces[server], self.buffers[server])
            header = Header(wire.PUSH, self.rank, self.versions[server], server, payload.numel(),
                            payload.numel() * payload.element_size(), wire.checksum(payload),
                            (wire.FLAG_STOP if stop else 0) | (wire.FLAG_NONFINITE if nonfinite else 0))
            rows = [(ids[positions[server]], values[positions[server]])
                    for (ids, values), positions in zip(touched, owners)]
            sections = [sparse_wire.section_header(sparse_wire.PUSH_SECTION, self.rank, server, spec, ids, values)
                        for (spec, _), (ids, values) in zip(self.tables, rows)]
            handles.append((self._send_header(server, header, sections), server))
            if payload.numel():
                handles.append((self.transport.isend(payload, server, "ps/push", tag=self.channel.payload_tag),
                                server))
            body = sparse_wire.pack([ids for ids, _ in rows], [values for _, values in rows])
            if body.numel():
                handles.append((self.transport.isend(body, server, "ps/push", tag=self.channel.payload_tag), server))
        for handle, server in handles:
            self._wait(handle, server)
        for p in self.params + [table for _, table in self.tables]:
            p.grad = None
        self.clock += 1
        self.pulled_since_push = False
        self.push_seconds += time.monotonic() - started

    def load(self, whole: dict, index: int) -> None:
        """Continue as worker ``index`` of a whole state (resharding.py): its clock, the servers' version."""
        self.clock = whole["clocks"][index]
        self.versions = [whole["version"]] * len(self.servers)
        self.pulled_since_push = False

    def rejoin(self, transport: Transport, channel: wire.Channel, clock: int, version: int, closed: bool) -> None:
        """Go on in a rebuilt world (live/ps.py): its transport, this worker's agreed clock, and the
        version every server holds (sync; in async and ssp the servers' versions differ, only pull()
        reads them). Whatever was in flight is forgotten."""
        self.transport, self.channel, self.rank = transport, channel, transport.rank
        self.clock, self.closed = clock, closed
        self.versions = [version] * len(self.servers)
        self.pulled_since_push = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        sends = [self._send_header(s, Header(wire.CLOSE, self.rank, self.clock, s)) for s in self.servers]
        byes = [self._post_header(server, "ps/close") for server in self.servers]
        for server, (handle, message) in zip(self.servers, byes):
            self._take_header(server, handle, message, expect=wire.BYE)
        for handle, server in zip(sends, self.servers):
            self._wait(handle, server)

    # -- helpers -----------------------------------------------------------------------------------
    def _check_open(self, what: str) -> None:
        if self.closed:
            raise RuntimeError(f"worker rank {self.rank}: {what}() after close(); this worker has left the "
                               f"parameter server")

    def _send_header(self, server: int, header: Header, sections: list[Header] = ()):
        return self.transport.isend(wire.message(header, list(sections), len(self.tables)), server, "ps/header",
                                    control=True, tag=self.channel.header_tag)

    def _post_header(self, server: int, op: str = "ps/pull"):
        """Post the receive of ``server``'s next header message: (handle, message)."""
        message = wire.empty_header(len(self.tables))
        return self.transport.irecv(message, server, op, control=True, tag=self.channel.header_tag), message

    def _take_header(self, server: int, handle, message: torch.Tensor, expect: int) -> Header:
        """Wait for a posted header message; its header, which must be of kind ``expect`` (ABORT raises)."""
        self._wait(handle, server)
        header = wire.decode(message, server)
        if header.kind == wire.ABORT:
            raise self._aborted(server, header)
        if header.kind != expect:
            raise ProtocolError(f"worker rank {self.rank}: expected {wire.KIND_NAMES[expect]} from server rank "
                                f"{server}, got {header.describe()}", server)
        return header

    def _aborted(self, server: int, header: Header) -> ServerAbortedError:
        culprit = header.version if header.version >= 0 else None
        why = wire.REASON_NAMES.get(header.numel, f"reason {header.numel}")
        who = f" (rank {culprit})" if culprit is not None else ""
        posted = self.channel.read_abort(wait_seconds=min(1.0, self.abort_notice_seconds))
        detail = f": {posted[1]}" if posted else ""
        return ServerAbortedError(f"worker rank {self.rank}: parameter server rank {server} stopped: "
                                  f"{why}{who}{detail}", culprit)

    def _wait(self, handle, server: int) -> None:
        """Wait for a transfer; if it fails, report the server's abort notice when there is one."""
        try:
            handle.wait()
        except PeerError as exc:
            posted = self.channel.read_abort(wait_seconds=self.abort_notice_seconds)
            if posted is None:
                raise
            culprit, message = posted
            raise ServerAbortedError(f"worker rank {self.rank}: a parameter server stopped: {message}",
                                     culprit) from exc

    def stats(self) -> dict:
        return {"role": "worker", "rank": self.rank, "mode": self.mode, "steps": self.clock,
                "pull_wait_seconds": self.pull_wait_seconds, "push_seconds": self.push_seconds,
                "last_grad_norm": self.last_norm}
