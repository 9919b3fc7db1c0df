"""ParameterServer: ranks 0..S-1 hold the parameters and the optimizer, the other ranks compute gradients.

    ps = gs.ParameterServer(model, optimizer_fn, num_servers=1, mode="sync", staleness=0)
    if ps.is_server:
        ps.serve()                        # returns when every worker has closed
    else:
        for x, y in batches:
            ps.pull()                     # newest parameters into the model
                                          # (ps.pull(rows={"emb.weight": ids}): only those rows of a sparse table)
            loss_fn(model(x), y).backward()
            ps.push()                     # gradients to the servers (then cleared)
        ps.close()
    ps.stats()                            # this rank's counters (see Server.stats / Client.stats)

Stopping early and checkpoints (a preemption: train/strategies/ps.py)
    ps.serve(stop=lambda: asked)          # a server polls stop() between messages
    ps.push(stop=True)                    # a worker asks; either way the servers answer the next
    if ps.stopping: ps.close()            # pulls with a stop flag (sync: all on the same version)
    state = ps.state_dict()               # collective, after serve()/close(): the whole state, no
                                          # trace of S (resharding.py), on every rank
    ps.load_state_dict(state)             # collective-free, before serve()/pull(), with any S and
                                          # the same W: each server takes its part, each worker its clock

Construction, as a recipe (collective: every rank calls it with the same arguments)
    verify_same_model   every rank built the same model (replicas.py)
    broadcast_state     rank 0's parameters become everyone's, so the servers' shards start equal
    plan_shards         the parameter space split over S servers (sharding.py)
    start_role          a Server (server.py) on ranks < S, a Client (client.py) on the others

``optimizer_fn(params)`` builds any torch.optim optimizer; each server runs it over its flat shard,
so element-wise optimizers (SGD, momentum, Adam, AdamW) behave exactly as on the whole model.
Modes: see server.py. W = world_size - S workers; per-worker batch b gives an effective batch W*b.

Clipping: ``max_grad_norm=c`` clips by the gradient's total ``norm_type``-norm, as
torch.nn.utils.clip_grad_norm_ (clipping.py says where: sync, the servers clip each version's
averaged gradient by its norm over all S shards, one scalar exchanged between servers per version,
equal to one process with the global batch; async and ssp, each worker clips the gradient it pushes).

Sparse tables: the weight of an nn.Embedding or nn.EmbeddingBag built with sparse=True is not part
of the flat shards. Its rows are striped over the servers (row r on server r mod S,
row_sharding.py), pushes carry only the touched rows and pulls fetch only the rows asked for
(sparse_wire.py), and the servers update them with the sparse rule of the optimizer_fn's class
(sparse_optim.py: SGD with lazy momentum, Adagrad, Adam as SparseAdam; others are refused here).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

import io

from gradsync import clip
from gradsync.group import runtime
from gradsync.comm.world_transport import default_transport
from gradsync.ps import resharding
from gradsync.ps.client import Client
from gradsync.ps.clipping import ServerClipping
from gradsync.ps.protocol import Channel
from gradsync.ps.server import MODES, Server
from gradsync.ps.sharding import plan_shards
from gradsync.ps.sparse_optim import sparse_rule
from gradsync.ps.sparse_tables import TableSpec, find_sparse
from gradsync.replicas import broadcast_coalesced, gather_bytes, verify_same_model

_INSTANCES = [0]


def _next_instance() -> int:
    """Instances are numbered in construction order, the same on every rank (construction is collective)."""
    _INSTANCES[0] += 1
    return _INSTANCES[0]


class ParameterServer:
    """See the module docstring."""

    def __init__(self, model: nn.Module, optimizer_fn: Callable, num_servers: int = 1, mode: str = "sync",
                 staleness: int = 0, max_grad_norm: float | None = None, norm_type: float = 2.0) -> None:
        if max_grad_norm is not None:
            clip.check_arguments(max_grad_norm, norm_type, "max_grad_norm")
        world = runtime.world()
        params = self._check(model, optimizer_fn, num_servers, mode, staleness, world)
        self.world = world
        self.model = model
        self.mode = mode
        self.num_servers = num_servers
        self.staleness = staleness
        verify_same_model(model, "ParameterServer")
        broadcast_coalesced(list(model.parameters()) + list(model.buffers()))
        sparse = find_sparse(model)
        dense = [p for p in params if all(p is not t for t in sparse.values())]
        tables = [(TableSpec(i, name, t.shape[0], t[0].numel() if t.shape[0] else 0, t.element_size()), t)
                  for i, (name, t) in enumerate(sparse.items())]
        self.tables = [spec for spec, _ in tables]
        self.dense = dense
        self.plan = plan_shards([p.numel() for p in dense], num_servers)
        self.workers = list(range(num_servers, world.world_size))
        self.is_server = world.rank < num_servers
        transport = default_transport()
        self._instance = _next_instance()
        channel = Channel(world.store, self._instance)
        server_clips = max_grad_norm is not None and mode == "sync"
        if self.is_server:
            clipping = (ServerClipping(max_grad_norm, norm_type, transport, num_servers, channel.payload_tag)
                        if server_clips else None)
            self._server = Server(transport, self.workers, self.plan.pieces[world.rank], dense, optimizer_fn,
                                  mode, staleness, world.timeout, channel, tables, num_servers, clipping)
            self._client = None
        else:
            self._server = None
            self._client = Client(transport, self.plan, dense, mode, channel, tables,
                                  None if server_clips or max_grad_norm is None else (max_grad_norm, norm_type))

    @staticmethod
    def _check(model, optimizer_fn, num_servers, mode, staleness, world) -> list[torch.Tensor]:
        if not isinstance(model, nn.Module):
            raise TypeError(f"ParameterServer needs an nn.Module, got {type(model).__name__}")
        if not callable(optimizer_fn):
            raise TypeError("optimizer_fn must be callable: optimizer_fn(params) -> torch.optim.Optimizer, "
                            "e.g. lambda params: torch.optim.SGD(params, lr=0.1)")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if not isinstance(staleness, int) or isinstance(staleness, bool) or staleness < 0:
            raise ValueError(f"staleness must be an integer >= 0 (versions a worker may run ahead), got {staleness!r}")
        if not isinstance(num_servers, int) or not 1 <= num_servers < world.world_size:
            raise ValueError(f"num_servers must be an integer in 1..world_size-1 = 1..{world.world_size - 1} so "
                             f"at least one rank is a worker; got {num_servers!r} (world of {world.world_size})")
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("ParameterServer needs a model with at least one parameter that requires grad")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1 or not params[0].is_floating_point():
            raise TypeError(f"ParameterServer needs parameters of one floating dtype, got "
                            f"{sorted(str(d).replace('torch.', '') for d in dtypes)}")
        if any(not p.is_contiguous() for p in params):
            raise ValueError("ParameterServer needs contiguous parameters")
        if find_sparse(model):   # every rank refuses an optimizer the sparse rules cannot follow, not only servers
            sparse_rule(optimizer_fn([nn.Parameter(torch.zeros(1, dtype=params[0].dtype))]))
        return params

    # -- server ------------------------------------------------------------------------------------
    def serve(self, stop: Callable[[], bool] | None = None) -> None:
        """Serve this rank's shard until every worker has closed (servers only). ``stop()``, polled
        between messages, asks to end the job early (see the module docstring)."""
        if not self.is_server:
            raise RuntimeError(f"rank {self.world.rank} is a worker (servers are ranks 0..{self.num_servers - 1}); "
                               f"workers call pull(), push() and close()")
        self._server.serve(stop)

    # -- worker ------------------------------------------------------------------------------------
    def pull(self, rows: dict | None = None) -> None:
        """Copy the newest parameters the consistency model allows into the model (workers only).

        ``rows`` maps a sparse table's name to a 1-D int64 tensor of the row ids needed next: only
        those rows are fetched (the others keep what they held); a table not named fetches nothing.
        ``rows=None`` fetches every table whole. Dense parameters are always fetched whole."""
        self._worker("pull").pull(rows)

    def push(self, stop: bool = False, nonfinite: bool = False) -> None:
        """Send this rank's gradients to the servers and clear them (workers only); ``stop`` asks the
        servers to end the job early: the next pulls answer with ``stopping`` set. ``nonfinite``: the
        gradients hold inf or NaN (a gradient scaler's check): the servers skip this push (sync: its
        whole version, and the next pulls answer with ``skipped`` set; protocol.py)."""
        self._worker("push").push(stop, nonfinite)

    @property
    def skipped(self) -> bool:
        """Worker, sync mode: the version the last pull returned was not applied (some worker's push in it
        was flagged nonfinite), the same answer on every worker."""
        return self._worker("skipped").skipped

    @property
    def stopping(self) -> bool:
        """Worker: a pull's answer said the job ends here (close() next). Server: the job was asked to end early."""
        return self._server.stopped if self.is_server else self._client.stopping

    def close(self) -> None:
        """Leave the parameter server; the servers' serve() returns once every worker has closed."""
        self._worker("close").close()

    def _worker(self, what: str) -> Client:
        if self.is_server:
            raise RuntimeError(f"rank {self.world.rank} is a server: call serve(); {what}() is for workers "
                               f"(ranks {self.num_servers}..{self.world.world_size - 1})")
        return self._client

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole state, the same on every rank (collective; call after serve() and close() have
        returned): dense parameters, tables, server optimizer state, version and every worker's clock,
        with no trace of the number of servers (resharding.py)."""
        buffer = io.BytesIO()
        if self.is_server:
            torch.save(self._server.part(), buffer)
        parts = [torch.load(io.BytesIO(data), weights_only=True)
                 for data in gather_bytes(buffer.getvalue())[:self.num_servers]]
        return resharding.whole_state(parts, [p.numel() for p in self.dense], [tuple(p.shape) for p in self.dense])

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state`` (state_dict() of a job with any number of servers and the same
        number of workers); every rank calls it after construction, before serve() or pull()."""
        if not isinstance(state, dict) or not {"version", "clocks", "params", "tables"} <= set(state):
            raise ValueError("load_state_dict needs what ParameterServer.state_dict() returned (keys version, "
                             "clocks, params, dense_state, param_groups, tables)")
        if len(state["clocks"]) != len(self.workers):
            raise ValueError(f"the parameter-server state was written with {len(state['clocks'])} workers, this job "
                             f"has {len(self.workers)}: each worker's data shard and clock are its own, so resume "
                             f"with {len(state['clocks'])} workers (the number of servers may change)")
        if self.is_server:
            self._server.load_part(state, self.plan.pieces[self.world.rank])
        else:
            self._client.load(state, self.world.rank - self.num_servers)

    # -- live jobs (live/ps.py) -------------------------------------------------------------------
    def rejoin(self, clocks: list[int], closed: list[bool], version: int) -> None:
        """Go on in the world rebuilt from the survivors (live/ps.py), after gradsync's rejoin: the
        servers keep ranks 0..S-1 and their state; ``clocks`` and ``closed`` say each surviving worker's
        agreed clock and whether it has left, in new-rank order; ``version`` is what every server
        holds (sync). Collective-free."""
        self.world = runtime.world()
        self.workers = list(range(self.num_servers, self.world.world_size))
        if len(clocks) != len(self.workers) or len(closed) != len(self.workers):
            raise ValueError(f"rejoin needs one clock and one closed flag per worker ({len(self.workers)}), got "
                             f"{len(clocks)} and {len(closed)}")
        transport, channel = default_transport(), Channel(self.world.store, self._instance)
        if self.is_server:
            self._server.rejoin(transport, channel, dict(zip(self.workers, clocks)),
                                {w for w, gone in zip(self.workers, closed) if not gone})
        else:
            index = self.world.rank - self.num_servers
            self._client.rejoin(transport, channel, clocks[index], version, closed[index])

    def stats(self) -> dict:
        """This rank's counters: bytes in/out per step, staleness histogram (servers), wait times (workers)."""
        return self._server.stats() if self.is_server else self._client.stats()
