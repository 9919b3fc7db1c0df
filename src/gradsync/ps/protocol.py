"""Parameter-server wire protocol: a fixed integer header, then raw tensor bytes. Nothing is unpickled.

Every message starts with a header of HEADER_WORDS int64 words, sent on the channel's header tag:

    word  name      meaning
    0     magic     MAGIC (0x6773_7073, "gsps"): anything else is not ours
    1     kind      PUSH, PULL, PARAMS, CLOSE, BYE, ABORT or ROWS in the low byte; flags above it
                    (FLAG_STOP << 8 on PUSH and PARAMS: see "Stopping early" below; FLAG_WHOLE_TABLE
                    << 8 on a pull's ROWS section: every row the server holds, sparse_wire.py;
                    FLAG_NONFINITE on PUSH and FLAG_SKIPPED on PARAMS: "Skipped updates" below)
    2     sender    rank of the sender (checked against the rank the transport saw)
    3     version   PUSH: server version the gradient was computed on; PULL: the worker's clock
                    (pushes done so far); PARAMS: the server's version; ABORT: the rank at fault or -1
    4     shard     shard id (= server rank) the message is about
    5     numel     elements of payload that follow (0 for PULL, CLOSE, BYE, ABORT)
    6     nbytes    payload length in bytes (numel * element size: the length check)
    7     checksum  sum of the payload's 64-bit words mod 2**64 (+ its last bytes), low 62 bits: checksum()

A PUSH and a PARAMS header are followed by one payload message of exactly ``numel`` elements of the
model's dtype on the channel's payload tag; the receiver validates the header before it posts the payload
receive, so a message whose length disagrees with the shard is refused, never read into a buffer of
the wrong size. Conversation:

    worker -> server   PULL                  answered by PARAMS + payload (when the consistency
                                             model allows: sync/SSP may hold the answer back)
    worker -> server   PUSH + payload        gradient of this server's shard; no answer
    worker -> server   CLOSE                 answered by BYE
    server -> worker   ABORT                 the server stopped on an error (``reason`` in numel)
    worker -> server   ABORT                 live jobs only (live/ps.py): this worker saw a member die
                                             (``reason`` REASON_MEMBER_DIED); the server rebuilds the world

A model with T sparse tables (sparse_wire.py) sends every header as a message of 1 + T headers:
after a PUSH, PULL or PARAMS header come its T ROWS section headers (version word = table index,
numel = rows), and every other kind is padded with T zero headers, so that every message on the
header tag has one length. The rows themselves follow on the payload tag (after the dense payload)
as one body. Dense payloads of 0 elements (a model with only sparse tables) are not sent.

Stopping early (a preemption, train/strategies/ps.py): a PUSH with FLAG_STOP asks the servers to end
the job; a PARAMS with FLAG_STOP tells the worker that the parameters it carries are the last ones
(sync: every worker gets it with the same version; server.py says when a server sets it).

Skipped updates (a gradient scaler's inf or NaN, train/precision.py): a PUSH with FLAG_NONFINITE
carries a gradient the worker found inf or NaN in. Sync: a version any such push is part of is not
applied by any server (each receives every worker's header, so all of them agree); the version still
steps, and every PARAMS of it carries FLAG_SKIPPED, so every worker learns the same verdict. Async and
ssp: that push alone is not applied (its worker's clock still counts it).

Headers travel as control traffic in the TrafficMeter; payloads as "ps/push" and "ps/pull".

Each ParameterServer instance talks on its own Channel: its own pair of tags (so messages left
over from a failed instance never reach the next one) and its own abort key in the rendezvous
store. ABORT travels out of band there too: gloo closes a rank's connections after a receive times
out (which is how a killed worker shows up), so a server that has just detected a dead worker can
no longer reach the others by message. A worker whose transfer fails reads the key before it
reports its own timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

MAGIC = 0x67737073
HEADER_WORDS = 8
CHECKSUM_MASK = (1 << 62) - 1
TAG_BASE = 7100

PUSH, PULL, PARAMS, CLOSE, BYE, ABORT, ROWS = 1, 2, 3, 4, 5, 6, 7
FLAG_STOP = 1
FLAG_WHOLE_TABLE = 2
FLAG_NONFINITE = 4
FLAG_SKIPPED = 8
FLAG_SHIFT = 8
FLAGS_OF = {PUSH: FLAG_STOP | FLAG_NONFINITE, PARAMS: FLAG_STOP | FLAG_SKIPPED, ROWS: FLAG_WHOLE_TABLE}
"""The flags each kind may carry (none for the others)."""
KIND_NAMES = {PUSH: "PUSH", PULL: "PULL", PARAMS: "PARAMS", CLOSE: "CLOSE", BYE: "BYE", ABORT: "ABORT",
              ROWS: "ROWS"}

# ABORT reasons (carried in the numel word)
REASON_DEAD_WORKER, REASON_PROTOCOL, REASON_SERVER_ERROR, REASON_MEMBER_DIED = 1, 2, 3, 4
REASON_NAMES = {REASON_DEAD_WORKER: "a worker stopped answering", REASON_MEMBER_DIED: "a member of a live job died",
                REASON_PROTOCOL: "a worker sent a malformed or unexpected message",
                REASON_SERVER_ERROR: "the server failed"}


class ProtocolError(RuntimeError):
    """A malformed or unexpected parameter-server message; ``sender`` is the rank that sent it."""

    def __init__(self, message: str, sender: int | None) -> None:
        super().__init__(message)
        self.sender = sender


class ServerAbortedError(RuntimeError):
    """A server stopped on an error and told this worker so; ``culprit`` is the rank at fault, if known."""

    def __init__(self, message: str, culprit: int | None) -> None:
        super().__init__(message)
        self.culprit = culprit


@dataclass(frozen=True)
class Header:
    kind: int
    sender: int
    version: int = 0
    shard: int = 0
    numel: int = 0
    nbytes: int = 0
    checksum: int = 0
    flags: int = 0
    """FLAG_STOP, FLAG_WHOLE_TABLE, FLAG_NONFINITE, FLAG_SKIPPED or 0 (FLAGS_OF); travels in the kind word,
    above the kind's byte."""

    def encode(self) -> torch.Tensor:
        return torch.tensor([MAGIC, self.kind | self.flags << FLAG_SHIFT, self.sender, self.version, self.shard, self.numel,
                             self.nbytes, self.checksum], dtype=torch.int64)

    def describe(self) -> str:
        return (f"{KIND_NAMES.get(self.kind, f'kind {self.kind}')} from rank {self.sender} "
                f"(version {self.version}, shard {self.shard}, {self.numel} elements, {self.nbytes} bytes)")


def empty_header(tables: int = 0) -> torch.Tensor:
    """A receive buffer for one header message of a model with ``tables`` sparse tables."""
    return torch.zeros((1 + tables) * HEADER_WORDS, dtype=torch.int64)


def message(header: "Header", sections: list["Header"], tables: int) -> torch.Tensor:
    """One header message: ``header``, then its section headers, zero-padded to ``tables`` of them."""
    words = empty_header(tables)
    for index, part in enumerate([header, *sections]):
        words[index * HEADER_WORDS:(index + 1) * HEADER_WORDS] = part.encode()
    return words


def checksum(payload: torch.Tensor) -> int:
    """Sum of the payload's 64-bit words modulo 2**64, plus its last bytes when the length is not a
    multiple of 8, kept to the low 62 bits (so two of them add up within an int64 header word).
    A 64-bit sum needs no widening: 0.02 ns/B here, against 0.3-0.9 for 32-bit words summed in 64
    bits, which was most of a parameter server's CPU per step at 10 Gbit/s (docs/studies/ps-server.md)."""
    raw = payload.detach().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole] if raw.storage_offset() % 8 == 0 else raw[:whole].clone()   # int64 views need alignment
    return (int(words.view(torch.int64).sum()) + int(raw[whole:].sum(dtype=torch.int64))) & CHECKSUM_MASK


def decode(buffer: torch.Tensor, seen_from: int) -> Header:
    """Parse a received header (the first HEADER_WORDS words of ``buffer``); ``seen_from`` is the rank the
    transport received it from.

    Raises ProtocolError naming ``seen_from`` when the magic, kind or sender word is wrong.
    """
    words = buffer[:HEADER_WORDS].tolist()
    if words[0] != MAGIC:
        raise ProtocolError(f"rank {seen_from} sent a message that is not a gradsync parameter-server header "
                            f"(magic {words[0]:#x}, expected {MAGIC:#x}); refused", seen_from)
    kind, flags = words[1] & ((1 << FLAG_SHIFT) - 1), words[1] >> FLAG_SHIFT
    if kind not in KIND_NAMES or flags & ~(FLAG_STOP | FLAG_WHOLE_TABLE | FLAG_NONFINITE | FLAG_SKIPPED):
        raise ProtocolError(f"rank {seen_from} sent an unknown message kind {words[1]} "
                            f"(known: {', '.join(f'{k}={n}' for k, n in KIND_NAMES.items())}, with "
                            f"FLAG_STOP << {FLAG_SHIFT} on PUSH and PARAMS, FLAG_WHOLE_TABLE << {FLAG_SHIFT} on "
                            f"ROWS, FLAG_NONFINITE << {FLAG_SHIFT} on PUSH, FLAG_SKIPPED << {FLAG_SHIFT} on PARAMS); "
                            f"refused", seen_from)
    if flags & ~FLAGS_OF.get(kind, 0):
        raise ProtocolError(f"rank {seen_from} sent {KIND_NAMES[kind]} with flags {flags}; only PUSH and PARAMS "
                            f"carry FLAG_STOP, only ROWS carries FLAG_WHOLE_TABLE, only PUSH FLAG_NONFINITE and "
                            f"only PARAMS FLAG_SKIPPED; refused", seen_from)
    header = Header(kind, *words[2:], flags=flags)
    if header.sender != seen_from:
        raise ProtocolError(f"rank {seen_from} sent a header that claims to come from rank {header.sender}; refused",
                            seen_from)
    if header.numel < 0 or header.nbytes < 0:
        raise ProtocolError(f"rank {seen_from} sent a negative length: {header.describe()}; refused", seen_from)
    return header


def check_payload_header(header: Header, expected_numel: int, element_size: int, seen_from: int) -> None:
    """Refuse a payload header whose length disagrees with the shard it claims to be about."""
    if header.numel != expected_numel or header.nbytes != expected_numel * element_size:
        raise ProtocolError(
            f"{header.describe()}: shard {header.shard} has {expected_numel} elements "
            f"({expected_numel * element_size} bytes); the message was refused and not applied", seen_from)


def check_payload(header: Header, payload: torch.Tensor, seen_from: int) -> None:
    """Refuse a payload whose checksum disagrees with its header."""
    actual = checksum(payload)
    if actual != header.checksum:
        raise ProtocolError(f"{header.describe()}: payload checksum {actual} does not match the header's "
                            f"{header.checksum}; the message was refused and not applied", seen_from)


class Channel:
    """One parameter-server instance's tags and out-of-band abort key (instances numbered 1, 2, ...)."""

    def __init__(self, store, instance: int) -> None:
        self.store = store
        self.header_tag = TAG_BASE + 2 * instance
        self.payload_tag = TAG_BASE + 2 * instance + 1
        self.key = f"gradsync/ps/{instance}/abort"

    def post_abort(self, culprit: int | None, message: str) -> None:
        if self.store is not None:
            self.store.set(self.key, f"{-1 if culprit is None else culprit}|{message}")

    def read_abort(self, wait_seconds: float) -> tuple[int | None, str] | None:
        """(culprit, server's message) once posted, polling up to ``wait_seconds``; None if never posted."""
        if self.store is None:
            return None
        deadline = time.monotonic() + wait_seconds
        while True:
            if self.store.check([self.key]):
                culprit, message = self.store.get(self.key).decode().split("|", 1)
                return (None if int(culprit) < 0 else int(culprit)), message
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)
