"""What a parameter server (server.py) does with a push that arrived whole and checked: apply it to its
shard (versioned_shard.py) as its consistency model says.

Per mode (server.py's consistency models):
    sync       the push is added to the version's sum; when every open worker has pushed, the mean
               (sum / W) is clipped where asked (clipping.py: by its norm over every server) and
               applied in one optimizer step, and the version steps
    async, ssp the push is applied at once, as one step on gradient / W; staleness = the version
               at apply - the version it was computed on, recorded per update

A push flagged FLAG_NONFINITE (a worker's gradient scaler found inf or NaN, protocol.py) is not
applied: sync skips the whole version (every server sees every worker's flag, so all skip it; the
version steps with the parameters unchanged and its answers carry FLAG_SKIPPED); async and ssp skip
that push alone. Sparse rows are averaged like the dense payload: sync over the W pushes, async as
each push's rows / W.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

import torch

from gradsync.comm.transport import PeerError, Transport
from gradsync.ps import protocol as wire
from gradsync.ps.clipping import ServerClipping
from gradsync.ps.protocol import Header, ProtocolError
from gradsync.ps.versioned_shard import VersionedShard

Rows = list[tuple[torch.Tensor, torch.Tensor]]
"""Per table: (local row ids, their gradient rows)."""


class PushApplier:
    """Applies pushes to ``shard`` in ``mode`` (module docstring). ``clipping``: sync only, clip each
    version's mean gradient by its norm over every server; ``abort(reason, culprit, message)`` tells the
    workers the server stops (a peer server lost while clipping)."""

    def __init__(self, shard: VersionedShard, mode: str, clipping: ServerClipping | None,
                 abort: Callable[[int, int | None, str], None], timeout: float) -> None:
        self.shard = shard
        self.mode = mode
        self.clipping = clipping
        self.abort = abort
        self.timeout = timeout
        self.grad_sum = torch.zeros_like(shard.published) if mode == "sync" else None
        self.pushed_this_version: set[int] = set()
        self.nonfinite_this_version = False   # sync: a push of this version was flagged FLAG_NONFINITE
        self.staleness = Counter()   # version at apply - version computed on, per update

    def check(self, header: Header) -> None:
        """Refuse a push this mode cannot take (ProtocolError): a version from the future; in sync a
        second push for one version, or one for another version."""
        sender, version = header.sender, self.shard.version
        if header.version > version:
            raise ProtocolError(f"server rank {self.shard.rank}: {header.describe()} claims a version from the "
                                f"future (server is at {version}); refused", sender)
        if self.mode == "sync" and (header.version != version or sender in self.pushed_this_version):
            raise ProtocolError(
                f"server rank {self.shard.rank}: unexpected {header.describe()}: in sync mode each worker pushes once "
                f"per version, on the version it pulled (server is at {version}); call pull() before every "
                f"push(); refused", sender)

    def apply(self, header: Header, gradient: torch.Tensor, rows: Rows, workers: int,
              open_workers: set[int]) -> bool:
        """Apply the push ``header`` announced (``gradient`` may be overwritten); ``workers``: W, the
        divisor of an async push. Returns whether a sync version closed."""
        nonfinite = bool(header.flags & wire.FLAG_NONFINITE)
        if self.mode == "sync":
            self.nonfinite_this_version |= nonfinite
            if not self.nonfinite_this_version:   # a skipped version's sum is never read: it is zeroed
                self.grad_sum.add_(gradient)
            for table, (local, grad) in zip(self.shard.tables, rows):
                table.add(header.sender, local, grad)
            self.pushed_this_version.add(header.sender)
            return self.close_version(open_workers)
        if not nonfinite:
            self.staleness[self.shard.version - header.version] += 1
            self.shard.step(gradient.div_(workers), [(local, grad / workers) for local, grad in rows])
        return False

    def close_version(self, open_workers: set[int]) -> bool:
        """Sync: once every open worker has pushed, step the version with their mean gradient (or skip
        it, a push being not finite). Returns whether a version closed."""
        if self.mode != "sync" or not self.pushed_this_version or not open_workers <= self.pushed_this_version:
            return False
        self.staleness[0] += len(self.pushed_this_version)
        pushers = len(self.pushed_this_version)
        gradient, table_rows = self.grad_sum.div_(pushers), [table.take_mean(pushers) for table in self.shard.tables]
        if self.nonfinite_this_version:   # every server skips it alike: each saw every worker's flag
            self.shard.skip()
        else:
            if self.clipping is not None:
                self._clip(gradient, table_rows)
            self.shard.step(gradient, table_rows)
        self.grad_sum.zero_()
        self.nonfinite_this_version = False
        self.pushed_this_version.clear()
        return True

    def _clip(self, gradient: torch.Tensor, table_rows: Rows) -> None:
        """Clip the version's mean gradient by its norm over every server (clipping.py)."""
        try:
            self.clipping.clip_(([gradient] if gradient.numel() else []) + [grad for _, grad in table_rows],
                                gradient.dtype)
        except PeerError as exc:
            message = (f"parameter server rank {self.shard.rank}: no power sum from server rank {exc.peer} for "
                       f"clipping version {self.shard.version}; it may have died or stalled (timeout "
                       f"{self.timeout:.0f} s): {exc}")
            self.abort(wire.REASON_SERVER_ERROR, exc.peer, message)
            raise RuntimeError(message) from exc

    def rejoin(self, transport: Transport) -> None:
        """Forget the version's pushes (the world was rebuilt: whatever was in flight is gone)."""
        if self.clipping is not None:
            self.clipping.transport = transport
        self.pushed_this_version = set()
        self.nonfinite_this_version = False
        if self.grad_sum is not None:
            self.grad_sum.zero_()
