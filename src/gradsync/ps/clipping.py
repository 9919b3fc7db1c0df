"""Gradient clipping on the parameter server: ParameterServer(..., max_grad_norm=c, norm_type=2.0).

Where the norm is taken (clip.py has the formulas: power sums, one coefficient min(1, c/(norm+1e-6))):

    sync        the servers clip each version's averaged gradient, the one their optimizers apply,
                by its norm over the whole model. Server s takes the power sum of its part: its dense
                piece of the mean gradient and the mean rows of its stripes of the sparse tables. It
                sends that float64 scalar to each other server and receives theirs: S-1 scalars each
                way per version (8 bytes each, metered as "ps/clip", on the instance's payload
                tag), none with one server. Every server adds the S sums in server order, so all get
                the same total, bit for bit, and the same coefficient: the update of one process with
                the global batch under torch.nn.utils.clip_grad_norm_.
    async, ssp  every push is applied on its own, as gradient / W: there is no averaged gradient to
                take a norm of. The worker clips the gradient it pushes (dense and touched rows) by that
                gradient's own norm before sending it, with no message and no server work: each push
                then moves the parameters as a one-process step on that worker's batch would, scaled
                by 1/W. With one worker this is the sync rule.

A server whose receive of another server's sum fails (that server died: at once; it stalled: after
the timeout) stops, tells its workers (ABORT) and raises, naming that server and the version.
"""

from __future__ import annotations

import math

import torch

from gradsync import clip
from gradsync.comm.transport import Transport

OP = "ps/clip"


class ServerClipping:
    """Sync mode, on server ``rank`` of ``servers``: clip a version's mean gradient by the global norm."""

    def __init__(self, max_norm: float, norm_type: float, transport: Transport, servers: int, tag: int) -> None:
        self.max_norm, self.p = clip.check_arguments(max_norm, norm_type)
        self.transport = transport
        self.servers = servers
        self.tag = tag
        self.last_norm = math.nan
        self.clipped = 0   # versions whose coefficient was below 1

    def clip_(self, parts: list[torch.Tensor], dtype: torch.dtype) -> float:
        """Scale ``parts`` (this server's share of the version's mean gradient) in place; the total norm."""
        mine = clip.power_sum(parts, self.p).reshape(1)
        sums = self._exchange(mine)
        combined = torch.stack(sums).amax() if math.isinf(self.p) else sum(sums[1:], sums[0])
        norm = clip.total_norm(combined.reshape(()), self.p, dtype, error_if_nonfinite=False)
        scale = clip.coefficient(norm, self.max_norm)
        for part in parts:
            part.mul_(scale)
        self.last_norm = float(norm)
        self.clipped += int(float(scale) < 1.0)
        return self.last_norm

    def _exchange(self, mine: torch.Tensor) -> list[torch.Tensor]:
        """Every server's power sum, in server order (PeerError when one does not arrive in time)."""
        rank = self.transport.rank
        sums = [mine if server == rank else torch.empty(1, dtype=torch.float64) for server in range(self.servers)]
        sends = [self.transport.isend(mine, server, OP, tag=self.tag)
                 for server in range(self.servers) if server != rank]
        receives = [self.transport.irecv(sums[server], server, OP, tag=self.tag)
                    for server in range(self.servers) if server != rank]
        for handle in receives + sends:
            handle.wait()
        return sums


def clip_push_(max_norm: float, norm_type: float, dense: list[torch.Tensor | None],
               rows: list[torch.Tensor]) -> float:
    """Async and ssp, on the worker: clip the gradient about to be pushed by its own norm; the norm."""
    return float(clip.clip_local_([*dense, *rows], max_norm, norm_type))
