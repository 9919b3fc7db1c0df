"""ROWS sections: how the rows of sparse tables travel, raw and checked (protocol.py for the header).

Every PUSH, PULL and PARAMS header carries, in the same message (protocol.message), T ROWS section
headers, one per sparse table in the order of TableSpec.index (decode_sections):

    word  version = table index;  shard = server;  numel = k rows;  nbytes = k * bytes per row;
          checksum = checksum(ids) + checksum(values)

After the dense payload (when the shard has one) comes, when any k > 0, one body on the payload tag:
the bytes of every section's ids (int64, table by table), then of every section's values (k x D,
table by table), so the ids stay 8-byte aligned and the receiver takes each part as a view of the
one buffer (pack, unpack):

    section            direction          parts in the body               bytes per row   meter op
    push               worker -> server   ids (k int64), values (k x D)   8 + D*esize     ps/push
    pull request       worker -> server   ids (k int64)                   8               ps/pull/ids
    whole-table pull   worker -> server   nothing (FLAG_WHOLE_TABLE)      0               -
    pull answer        server -> worker   values (k x D), in request order D*esize        ps/pull

A pull of a whole table (``pull()``, rows=None) names no rows: its section carries FLAG_WHOLE_TABLE
(protocol.py), k = every row the server holds and nbytes 0, and the server answers its block in
local order (global ids s, s+S, ...). Listing them would cost 8 bytes a row per pull for nothing:
160 kB per worker per pull of a 20,000-row table, all received by the server.

Section headers inside the header message and one body for all tables, rather than a message per
header and per part: every message of the transport costs a round of its own (on
torch.distributed's gloo a send waits for the receiver's ready). A word2vec step (two tables, no
dense parameters) moves 6 messages between a worker and a server, where a message per part made it 17.

Ids are global row ids (row_sharding.py), each owned by the server it is sent to. The receiver checks
every header before posting the receive (table index, k at most the rows that server holds, nbytes),
then each section's checksum, then its ids: in range, owned by this server and, in a push, unique.
Anything else is a ProtocolError naming the sender, and nothing of that push is applied.
"""

from __future__ import annotations

import torch

from gradsync.ps import protocol as wire
from gradsync.ps.protocol import Header, ProtocolError
from gradsync.ps.sparse_tables import TableSpec

PUSH_SECTION, REQUEST_SECTION, ANSWER_SECTION = "push", "pull request", "pull answer"


def bytes_per_row(section: str, spec: TableSpec) -> int:
    return {PUSH_SECTION: 8 + spec.row_bytes, REQUEST_SECTION: 8, ANSWER_SECTION: spec.row_bytes}[section]


def section_header(section: str, sender: int, server: int, spec: TableSpec, ids: torch.Tensor | None,
                   values: torch.Tensor | None, whole: bool = False) -> Header:
    """The ROWS header of one table's section; ``whole``: a pull request for every row ``server`` holds
    (``ids`` are those rows: only their count travels)."""
    k = (ids if ids is not None else values).shape[0]
    if whole:
        return Header(wire.ROWS, sender, spec.index, server, k, 0, 0, wire.FLAG_WHOLE_TABLE)
    total = (wire.checksum(ids) if ids is not None else 0) + (wire.checksum(values) if values is not None else 0)
    return Header(wire.ROWS, sender, spec.index, server, k, k * bytes_per_row(section, spec), total)


def whole_table(header: Header) -> bool:
    """A pull request for every row the server holds (its ids do not travel)."""
    return bool(header.flags & wire.FLAG_WHOLE_TABLE)


def listed_rows(header: Header) -> int:
    """Rows of the section whose ids travel in the body: none for a whole-table request."""
    return 0 if whole_table(header) else header.numel


def decode_sections(message: torch.Tensor, tables: int, seen_from: int) -> list[Header]:
    """The T section headers that follow the header in one received header message."""
    words = message[wire.HEADER_WORDS:].view(-1, wire.HEADER_WORDS)
    return [wire.decode(words[index], seen_from) for index in range(tables)]


def pack(ids: list[torch.Tensor | None], values: list[torch.Tensor | None]) -> torch.Tensor:
    """One body (uint8): every section's ids, then every section's values (None: the section has no such part)."""
    parts = [t.contiguous().reshape(-1).view(torch.uint8) for t in [*ids, *values] if t is not None]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(body: torch.Tensor, section: str, specs: list[TableSpec], rows: list[int],
           dtype: torch.dtype) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Per table, (ids, values) as views of ``body`` for sections of ``rows[i]`` rows (None: no such part)."""
    has_ids, has_values = section != ANSWER_SECTION, section != REQUEST_SECTION
    offset, ids, values = 0, [], []
    for k in rows:
        ids.append(body[offset:offset + 8 * k].view(torch.int64) if has_ids else None)
        offset += 8 * k if has_ids else 0
    for spec, k in zip(specs, rows):
        size = k * spec.dim * dtype.itemsize if has_values else 0
        values.append(body[offset:offset + size].view(dtype).view(k, spec.dim) if has_values else None)
        offset += size
    return list(zip(ids, values))


def check_section_header(header: Header, section: str, spec: TableSpec, server: int, rows_held: int,
                         seen_from: int, where: str) -> None:
    """Refuse a ROWS header that is not the expected section of table ``spec`` before reading its payload."""
    if header.kind != wire.ROWS or header.version != spec.index or header.shard != server:
        raise ProtocolError(f"{where}: expected the ROWS section of table {spec.name} (#{spec.index}) for shard "
                            f"{server}, got {header.describe()}; refused", seen_from)
    if whole_table(header):
        if section != REQUEST_SECTION or header.numel != rows_held or header.nbytes or header.checksum:
            raise ProtocolError(f"{where}: {header.describe()}: a whole-table flag belongs only on a pull request, "
                                f"for all {rows_held} rows shard {server} holds of table {spec.name}, with no bytes "
                                f"and no checksum; refused", seen_from)
        return
    if header.numel > rows_held or header.nbytes != header.numel * bytes_per_row(section, spec):
        raise ProtocolError(
            f"{where}: {header.describe()}: a {section} section of table {spec.name} carries at most {rows_held} "
            f"rows (those shard {server} holds) of {bytes_per_row(section, spec)} bytes each; refused and not "
            f"applied", seen_from)


def check_section_payload(header: Header, ids: torch.Tensor | None, values: torch.Tensor | None, seen_from: int,
                          where: str) -> None:
    total = (wire.checksum(ids) if ids is not None else 0) + (wire.checksum(values) if values is not None else 0)
    if total != header.checksum:
        raise ProtocolError(f"{where}: {header.describe()}: payload checksum {total} does not match the header's "
                            f"{header.checksum}; the message was refused and not applied", seen_from)


def check_ids(ids: torch.Tensor, spec: TableSpec, server: int, servers: int, seen_from: int, where: str,
              unique: bool) -> None:
    """Ids in 0..R-1, owned by ``server`` (id mod S), and unique when ``unique``; else ProtocolError."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= spec.rows)
    if bool(bad.any()):
        raise ProtocolError(f"{where}: rank {seen_from} sent row id {int(ids[bad][0])} for table {spec.name}, "
                            f"which has rows 0..{spec.rows - 1}; refused, the table is unchanged", seen_from)
    foreign = ids % servers != server
    if bool(foreign.any()):
        raise ProtocolError(f"{where}: rank {seen_from} sent row {int(ids[foreign][0])} of table {spec.name} to "
                            f"server {server}, but row r lives on server r mod {servers}; refused, the table is "
                            f"unchanged", seen_from)
    if unique:
        distinct, counts = torch.unique(ids, return_counts=True)
        if distinct.numel() != ids.numel():
            raise ProtocolError(f"{where}: rank {seen_from} pushed row {int(distinct[counts > 1][0])} of table "
                                f"{spec.name} more than once in one push (a push carries each touched row once, "
                                f"coalesced); refused, the table is unchanged", seen_from)
