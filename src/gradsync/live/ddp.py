"""LiveDDP: data-parallel training that goes on, without a restart, when ranks die.

    live = LiveDDP(module, optimizer, bucket_cap_mb=25, ...)   # DistributedDataParallel's options
    while live.step < total_steps:
        live.run_step(train_step)       # train_step(model) -> progress: forward + backward of this
                                        # rank's share, chosen from live.progress and live.world
    scores = live.collective(evaluate)  # other collectives: run again in the new world if one fails

One step, as a recipe: zero the gradients -> ``train_step(model)`` (forward, backward; the gradient
all-reduce runs inside backward) -> snapshot -> optimizer.step() -> commit (step + 1, the progress
train_step returned). When a member dies, the survivors' collectives fail (PeerError: the dead rank's
own transfers within LIVENESS_SLICE, 0.2 s, and everyone else's once the live world's check sees the
death: comm/transport.py's abandoned(), or the TCP connection of a survivor that has torn down).
Each survivor then recovers:

    declare_broken   the generation is over (store), so ranks waiting on live peers stop too
    tear_down        the DDP wrapper's communication thread, gradients (their shared-memory regions),
                     the transport (shared-memory segments unmapped, TCP connections closed) and
                     torch's process group: gradsync.shutdown()
    agree            the next generation's members (membership.py's quorum, through the store)
    rejoin           a new world of the survivors, ranks renumbered densely in member order, a new
                     transport (runtime.rejoin)
    agree_on_step    the step in flight is redone: a rank that committed it (it received every rank's
                     gradient before the death) rolls back to the snapshot taken just before its
                     optimizer step, so every survivor holds the state after step S = min over
                     survivors of their committed steps, and step S+1 is trained again by the
                     survivors with the dead ranks' samples re-sharded over them (the caller's
                     train_step reads live.progress and live.world). Committed steps differ by at
                     most one: no rank can finish step S+2's all-reduce before every rank has
                     finished step S+1's.
    rewrap           a new DistributedDataParallel on the same module, without the start-up
                     broadcast, so that check_replicas() (parameters, then optimizer state) checks
                     the rollback rather than hiding it

Why the snapshot: the state after step S must exist on every survivor, and only a rank that
committed S+1 has lost it; keeping one copy of the parameters and optimizer state, taken just
before optimizer.step(), is the price (about the model's size plus its optimizer state in memory, a
copy per step).

The store must outlive every rank: under gs.spawn the launcher hosts it (launch.py).
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from gradsync import runtime
from gradsync.comm.collectives import all_gather, all_reduce
from gradsync.comm.transport import PeerError, set_abandon_check
from gradsync.ddp.wrapper import DistributedDataParallel, ReplicaMismatchError
from gradsync.live.membership import PREFIX, Membership
from gradsync.replicas import first_mismatch


@dataclass
class Recovery:
    """What one recovery did (LiveDDP.recoveries)."""

    generation: int
    """The generation the survivors formed."""
    members: tuple[int, ...]
    """Its member ids (original ranks), in new-rank order."""
    lost: tuple[int, ...]
    """Member ids of the previous generation that are not in it."""
    step: int
    """Committed steps after the recovery (the step in flight, S+1, is trained next)."""
    rolled_back: bool
    """This rank had committed S+1 and went back to its snapshot."""
    seconds: float
    """From catching the failure to the rebuilt, checked world."""
    cause: str = field(default="", repr=False)
    """The first line of the error this rank caught."""


def _caused_by_peer(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, PeerError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class LiveDDP:
    """DistributedDataParallel whose world survives the death of its ranks (module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, quorum_timeout: float | None = None,
                 on_resize: Callable[["LiveDDP", int], None] | None = None, **ddp_options) -> None:
        w = runtime.world()
        if w.store is None or w.joined:
            raise RuntimeError("LiveDDP needs a world of gradsync's own (gs.spawn, gradsync.init()), whose "
                               "rendezvous store outlives its ranks")
        if "process_group" in ddp_options:
            raise RuntimeError("LiveDDP rebuilds its world when ranks die, so it cannot use a process_group")
        self.module, self.optimizer, self.ddp_options = module, optimizer, ddp_options
        self.on_resize = on_resize
        self.membership = Membership(w.store.underlying_store, w.rank, tuple(range(w.world_size)),
                                     quorum_timeout if quorum_timeout is not None else w.timeout)
        set_abandon_check(self.membership.broken)
        self.model = DistributedDataParallel(module, **ddp_options)
        self.step = 0
        """Optimizer steps committed."""
        self.progress: dict = {}
        """The caller's counters as of the last committed step (what train_step returned)."""
        self.recoveries: list[Recovery] = []
        self._snapshot: tuple | None = None

    @property
    def world(self) -> runtime.World:
        return runtime.world()

    @property
    def member(self) -> int:
        """This process's member id: its rank in the world it started in."""
        return self.membership.member

    # -- one step ------------------------------------------------------------------------------------
    def run_step(self, train_step: Callable[[nn.Module], dict]) -> bool:
        """Train one step; True when it was committed, False when a member died and the step is to be
        trained again in the new world (live.step and live.progress are then those of the last step
        every survivor holds)."""
        failure = None
        try:
            self.optimizer.zero_grad(set_to_none=False)
            progress = train_step(self.model)
            self._take_snapshot()
            self.optimizer.step()
        except Exception as exc:
            failure = self._failure(exc)
        if failure is not None:   # recovered outside the except clause, so the old world's frames are free
            self.recover(failure)
            return False
        self.step += 1
        self.progress = dict(progress)
        return True

    def collective(self, fn: Callable[[], object]):
        """``fn()`` (collectives outside a training step: evaluation, statistics), run again in the new
        world if a member dies during it. At most once per member of the current world."""
        for _ in range(len(self.membership.current.members)):
            try:
                return fn()
            except Exception as exc:
                failure = self._failure(exc)
            self.recover(failure)
        return fn()

    def _failure(self, exc: Exception) -> str:
        """The first line of ``exc`` when a member's death caused it; otherwise ``exc`` is raised again."""
        if not _caused_by_peer(exc) and self.membership.broken() is None:
            raise exc
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # A torch Future that failed holds its exception from C++, where Python's collector cannot see
        # the cycle exception -> traceback -> frames -> Future; cut the tracebacks so the old world's
        # process group, sockets and mappings are freed with it
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            exc.__traceback__ = None
            exc = exc.__cause__ or exc.__context__
        return text

    def _take_snapshot(self) -> None:
        params = [p.detach().clone() for p in self.module.parameters()]
        self._snapshot = (self.step, dict(self.progress), params, copy.deepcopy(self.optimizer.state_dict()))

    def _roll_back(self) -> None:
        step, progress, params, optimizer_state = self._snapshot
        with torch.no_grad():
            for p, saved in zip(self.module.parameters(), params):
                p.copy_(saved)
        self.optimizer.load_state_dict(optimizer_state)
        self.step, self.progress = step, progress

    # -- recovery ------------------------------------------------------------------------------------
    def recover(self, why: str) -> Recovery:
        """Form the next generation from the survivors and bring this rank's state to the step they
        all hold (module docstring). Every survivor calls it; ``why``: the error it caught."""
        started = time.monotonic()
        self.membership.declare_broken(why)
        before, previous = self.membership.current, runtime.world()
        self._tear_down()
        generation = self.membership.next_generation()
        self._rejoin(previous, generation)
        rolled_back = self._agree_on_step()
        self.model = DistributedDataParallel(self.module, init_sync=False, **self.ddp_options)
        self.check_replicas()
        record = Recovery(generation.index, generation.members,
                          tuple(m for m in before.members if m not in generation.members), self.step,
                          rolled_back, time.monotonic() - started, why)
        self.recoveries.append(record)
        if self.on_resize is not None:
            self.on_resize(self, len(before.members))
        return record

    def _tear_down(self) -> None:
        self.model.close()
        for p in self.module.parameters():
            p.grad = None   # views of the old buckets (shared-memory regions of the old transport)
        self.model = None
        runtime.shutdown()
        # The caught error's traceback and the old transport's kept error (its _broken) hold frames that
        # reference the old world's process group, mappings and sockets in cycles; free them now, not at
        # some later collection, so a recovery leaves no descriptor behind
        gc.collect()

    def _rejoin(self, previous: runtime.World, generation) -> None:
        hosts = {m: self.membership._location(m)[0] for m in generation.members}
        local = [m for m in generation.members if hosts[m] == hosts[self.member]]
        runtime.rejoin(previous, self.membership.store, generation.rank_of(self.member), len(generation.members),
                       local.index(self.member), len(local), prefix=f"{PREFIX}/{generation.index}/world")

    def _agree_on_step(self) -> bool:
        """Committed steps: max and min over the survivors; a rank ahead rolls back. True if this one did."""
        steps = torch.tensor([self.step, -self.step], dtype=torch.int64)
        all_reduce(steps, op="max")
        newest, oldest = int(steps[0]), -int(steps[1])
        assert newest - oldest <= 1, f"committed steps {oldest}..{newest} differ by more than one"
        if self.step == oldest:
            return False
        self._roll_back()
        assert self.step == oldest, (self.step, oldest)
        return True

    def check_replicas(self) -> None:
        """Raise ReplicaMismatchError unless parameters and optimizer state are bitwise the same on
        every rank."""
        self.model.check_replicas()
        state = [t for s in self.optimizer.state_dict()["state"].values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        if runtime.world().world_size > 1 and state:
            difference = first_mismatch([t.reshape(-1) for t in state], gather=all_gather)
            if difference is not None:
                raise ReplicaMismatchError(f"replicas diverged: optimizer state tensor #{difference[1]} differs "
                                           f"between rank 0 and rank {difference[0]}")

    def close(self) -> None:
        """Stop the wrapper's communication thread and the live world's check."""
        self.model.close()
        set_abandon_check(None)
