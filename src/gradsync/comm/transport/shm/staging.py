"""The fingerprint slots and staging halves of a ShmTransport (transport.py): what the shared-memory
collectives build on besides the barrier (waiting.py).

Fingerprints: before a collective, every local rank writes what it is about to do into one of its
two fingerprint slots (agree.py's staged check) and, for single-copy reads, where its tensor lies;
after the barrier that follows, each reads the others' straight out of their segments. The slots
alternate, so a slot is rewritten two agreements later, once every rank has passed the barrier in
between and so has read it.

Staging halves: each rank's contribution to a collective that reads every rank's memory directly
(allreduce_two_shot.py and its kin) is copied into one of its two halves of S bytes; the halves
alternate across calls, so a rank may fill one while slower ranks still read the other.

Metering: bytes read out of a peer's segment are counted as received from it and, by symmetry
(it reads ours), as many sent; fingerprints are control bytes.
"""

from __future__ import annotations

import struct

import torch

from gradsync.comm.transport.shm import single_copy
from gradsync.comm.transport.shm.ring import FRAME
from gradsync.group.liveness import process_alive
from gradsync.comm.transport import PeerError

_FINGERPRINT = struct.Struct("8q")
"""A fingerprint slot: up to 8 int64 values (comm/agree.py's Fingerprint.values, FINGERPRINT_BYTES)."""
_ADDRESS = struct.Struct("Q")
"""Beside it, one FRAME further: where the rank's tensor lies (single-copy reads)."""


class Staging:
    """A ShmTransport's fingerprint slots and staging halves (module docstring), over its segments;
    ``counters`` are the transport's (the native core's once it runs, so that both paths alternate
    slots and halves alike)."""

    def __init__(self, rank: int, segments, counters, meter) -> None:
        self.rank = rank
        self.meter = meter
        self.counters = counters
        self.stage_bytes = segments.stage_bytes
        self._segments = segments
        offset = segments.fingerprint_offset()
        self._fingerprint_slots = (offset, offset + 2 * FRAME)
        self._views: dict[tuple, list[torch.Tensor]] = {}
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def publish(self, values: tuple[int, ...], address: int = 0) -> None:
        """Write this rank's fingerprint for the next barrier into its next slot (the slots alternate:
        a slot is rewritten two agreements later, after every rank has passed the barrier in between
        and so has read it), and ``address``: where its tensor lies, for single-copy reads."""
        counters = self.counters
        counters.published += 1
        offset = self._fingerprint_slots[counters.published & 1]   # _published_offset(), one call less
        own = self._segments.mappings[self.rank]
        own[offset:offset + _FINGERPRINT.size] = (_FINGERPRINT.pack(*values) if len(values) == 8
                                                  else _FINGERPRINT.pack(*values, *(0,) * (8 - len(values))))
        _ADDRESS.pack_into(own, offset + FRAME, address)

    def first_differing(self, op: str, metered: bool = True) -> int | None:
        """The lowest local rank whose fingerprint for the agreement this rank last published differs
        from this rank's, byte for byte; None when all are equal. Metered as ``published``, once for
        every peer (unless ``metered`` is False: the caller counts those bytes itself)."""
        segments = self._segments
        if metered:
            self.meter.record_exchanges(((peer, _FINGERPRINT.size) for peer in segments.pids), op=op, control=True)
        start = self._published_offset()
        end = start + _FINGERPRINT.size
        mappings = segments.mappings
        mine = mappings[self.rank][start:end]   # as published, by this path or the native core's
        for peer in segments.ordered_peers:
            if mappings[peer][start:end] != mine:
                return peer
        return None

    def published(self, rank: int, op: str) -> tuple[int, ...]:
        """Local rank ``rank``'s fingerprint for the agreement this rank last published (read it after
        the barrier that follows ``publish``). Metered as control bytes read out of ``rank``'s memory
        and, by symmetry (``rank`` reads ours), as many sent."""
        self.meter.record_exchange(peer=rank, received=_FINGERPRINT.size, sent=_FINGERPRINT.size, op=op, control=True)
        return _FINGERPRINT.unpack_from(self._segments.mappings[rank], self._published_offset())

    def published_address(self, rank: int, op: str) -> int:
        """The address local rank ``rank`` published with its last fingerprint (metered as control
        bytes, like the fingerprint)."""
        self.meter.record_exchange(peer=rank, received=_ADDRESS.size, sent=_ADDRESS.size, op=op, control=True)
        return _ADDRESS.unpack_from(self._segments.mappings[rank], self._published_offset() + FRAME)[0]

    def read_from(self, rank: int, address: int, into: torch.Tensor, op: str) -> None:
        """Single-copy read of ``into``'s size from ``address`` in local rank ``rank``'s memory."""
        pids = self._segments.pids
        try:
            single_copy.read(pids[rank], address, into)
        except single_copy.SingleCopyError as exc:
            gone = "" if process_alive(pids[rank]) else f" (rank {rank} has exited)"
            raise PeerError(f"rank {self.rank}: {op}: reading rank {rank}'s tensor failed{gone}: {exc}",
                            rank=self.rank, peer=rank, op=op) from exc

    def scratch(self, nbytes: int) -> torch.Tensor:
        """A private buffer of at least ``nbytes``, kept between calls (uint8)."""
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes]

    def _published_offset(self) -> int:
        return self._fingerprint_slots[self.counters.published & 1]

    def next_half(self) -> int:
        """The staging half the next piece uses: they alternate, across calls too, so a rank may
        fill one half while slower ranks still read the other (allreduce_two_shot.py)."""
        counters = self.counters
        counters.half ^= 1
        counters.split_in_half = False
        return counters.half

    def restart_halves(self) -> None:
        """After a collective mismatch, which every rank raises after the same barrier: ranks that took
        different algorithms may have moved to different halves, so every one starts again from half 0
        (nothing staged is read after a mismatch, and everything staged before it was read before
        that barrier)."""
        self.counters.half = 0
        self.counters.split_in_half = False

    def split_half(self) -> int:
        """The staging half for the split all-reduce's pieces: the last one when the split used it last
        (its regions lie at fixed places, so a split may follow a split in the same half:
        allreduce_two_shot.py), else the next."""
        counters = self.counters
        if not counters.split_in_half:
            counters.half ^= 1
            counters.split_in_half = True
        return counters.half

    def stage(self, rank: int, half: int) -> torch.Tensor:
        """Local rank ``rank``'s staging half ``half`` (S bytes, uint8), readable and writable here."""
        return self._segments.stages[rank].narrow(0, half * self.stage_bytes, self.stage_bytes)

    def staged_views(self, half: int, nbytes: int, dtype: torch.dtype) -> list[torch.Tensor]:
        """The first ``nbytes`` of every local rank's staging half ``half`` as ``dtype``, in rank order;
        cached per (half, bytes, dtype), since small collectives repeat the same few shapes and making
        the views costs more than the copy."""
        key = (half, nbytes, dtype)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            views = [self.stage(r, half)[:nbytes].view(dtype) for r in self._segments.local_ranks]
            self._views[key] = views
        return views

    def close(self) -> None:
        """Forget the views (the segments are unmapped after)."""
        self._views = {}
