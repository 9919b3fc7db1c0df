"""What a parameter server (server.py) does when its job loses a worker and goes on (live/ps.py).

Vocabulary
    V        this server's version: sync steps closed (server.py)
    previous (sync) the state just before the last version was closed: V - 1, the shard and the
             optimizer state; one copy of the shard and its optimizer state, replaced each version
    rejoin   the world was rebuilt from the survivors: a new transport, the workers renumbered
             densely in member order (servers keep ranks 0..S-1), each worker's clock as agreed

The step in flight, sync: the servers' versions differ by at most one (a server closes V + 1 only
once every worker pulled V from every server). A server that closed the step the others did not
rolls it back to ``previous``, so every server holds V_min, and the survivors train step V_min
again on their new shares of its samples (live/ps.py): the dead worker's gradient for it is
dropped, the version closes with the mean of the W - 1 survivors' pushes.

async and ssp keep no previous state: each push stays applied; a rejoin takes the workers' clocks
as the survivors agreed them (live/ps.py says how).
"""

from __future__ import annotations

import copy
import time

import torch

from gradsync.comm.transport import Transport
from gradsync.ps import protocol as wire


class Resizing:
    """The Server's part in a live job (module docstring); its state is made by Server.__init__."""

    keep_previous = False
    """Sync, live: keep the state before each version is closed (roll_back); set by live/ps.py."""
    previous: tuple | None = None

    def _before_step(self) -> None:
        if self.keep_previous:
            self.previous = (self.version, self.shard.detach().clone(), copy.deepcopy(self.optimizer.state_dict()))

    def roll_back(self) -> None:
        """Undo the last version closed (sync, keep_previous): the shard and the optimizer state as before it."""
        assert self.previous is not None and self.previous[0] == self.version - 1, (
            f"server rank {self.rank}: no state kept from before version {self.version}")
        version, shard, state = self.previous
        with torch.no_grad():
            self.shard.copy_(shard)
        self.optimizer.load_state_dict(state)
        self.version = version
        self.published = self.shard.detach().clone()
        self.published_tables = self._publish_tables()
        self.previous = None

    def rejoin(self, transport: Transport, channel: wire.Channel, clocks: dict[int, int], open_workers: set[int]) -> None:
        """Serve the rebuilt world: ``clocks`` maps each surviving worker's new rank to its clock, and
        ``open_workers`` are those that have not closed. Whatever was in flight is forgotten."""
        self.transport, self.channel = transport, channel
        if self.clipping is not None:
            self.clipping.transport = transport
        self.workers = sorted(clocks)
        self.clock = dict(clocks)
        self.open = set(open_workers)
        self.pushed_this_version = set()
        self.nonfinite_this_version = False
        self.pending_pulls = set()
        self.pending_rows = {}
        self.in_flight = []
        self.last_seen = {w: time.monotonic() for w in self.workers}
        if self.grad_sum is not None:
            self.grad_sum.zero_()
        self.min_clock = min(self.clock.values(), default=0)
        self.boundary = {self.min_clock: (self.version, self.published, self.published_tables)}
        self._keep_snapshots()
