"""LiveDDP: data-parallel training that goes on, without a restart, when ranks die.

    live = LiveDDP(module, optimizer, bucket_cap_mb=25, ...,   # DistributedDataParallel's options
                   progress={"epoch": 0, "position": 0})      # numbers a replacement receives
    while live.step < total_steps:
        live.run_step(train_step)       # train_step(model) -> progress: forward + backward of this
                                        # rank's share, chosen from live.progress and live.world
    scores = live.collective(evaluate)  # other collectives: run again in the new world if one fails

One step, as a recipe: the boundary (rank 0 says in a one-element all-reduce whether a joiner is
admitted now: growth.py; if so the world grows and run_step returns False) -> zero the gradients ->
``train_step(model)`` (forward, backward; the gradient
all-reduce runs inside backward) -> snapshot -> optimizer.step() -> commit (step + 1, the progress
train_step returned). When a member dies, the survivors' collectives fail (PeerError: the dead rank's
own transfers within LIVENESS_SLICE, 0.2 s, and everyone else's once the live world's check sees the
death: comm/transport/__init__.py's abandoned(), or the TCP connection of a survivor that has torn down).
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

A replacement rank (gs.spawn's ``replacements``) runs the same program: its LiveDDP(...) joins the
running world (growth.py: announce, admission at a boundary, rejoin) and returns once it holds rank
0's parameters, buffers, optimizer state, step, ``progress`` and ``shared`` (transfer.py) and
check_replicas() passed. It then steps with the others.

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

from gradsync.group import runtime
from gradsync.comm.collectives import all_gather, all_reduce
from gradsync.comm.transport import set_abandon_check
from gradsync.ddp.wrapper import DistributedDataParallel, ReplicaMismatchError
from gradsync.group.launch import NotNeeded
from gradsync.live import growth, transfer
from gradsync.live.failures import caused_by_peer, first_line_freed, rerun
from gradsync.live.membership import PREFIX, Generation, Membership
from gradsync.replicas import first_mismatch

MISSING = -(1 << 62)
"""The committed step a rank without the training state (a joiner) puts in the step agreement."""


@dataclass
class Recovery:
    """What one change of the world did (LiveDDP.recoveries): a recovery from deaths, or a growth (joined)."""

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
    joined: tuple[int, ...] = ()
    """Member ids that joined (growth.py): a growth rather than a recovery from a death."""


class LiveDDP:
    """DistributedDataParallel whose world survives the death of its ranks (module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, quorum_timeout: float | None = None,
                 on_resize: Callable[["LiveDDP", int], None] | None = None, progress: dict | None = None,
                 shared: dict | None = None, admit_joiners: bool = True, **ddp_options) -> None:
        if "process_group" in ddp_options:
            raise RuntimeError("LiveDDP rebuilds its world when ranks die, so it cannot use a process_group")
        self.module, self.optimizer, self.ddp_options = module, optimizer, ddp_options
        self.on_resize = on_resize
        """``on_resize(live, old_world_size)``: after the world changed size, on every rank that held the
        training state, before a joiner receives it (so what it sets in ``shared`` reaches the joiner)."""
        self.step = 0
        """Optimizer steps committed."""
        self.progress: dict = {} if progress is None else progress
        """The caller's counters as of the last committed step (what train_step returned); a joiner
        receives them (numbers only: give every key its starting value)."""
        self.shared: dict = {} if shared is None else shared
        """The caller's other numbers every rank must share (the batch policy's global batch and learning
        rate); a joiner receives them, updated in place."""
        self.recoveries: list[Recovery] = []
        """Every change of the world: recoveries from deaths and growths (Recovery.joined)."""
        self.admit_joiners = admit_joiners
        """False: no step boundary asks whether a replacement waits (growth.py's one-element all-reduce a
        step is saved; for a job that starts none, e.g. gs.spawn without replacements). A joiner that
        comes anyway waits for admission until growth.ADMISSION_TIMEOUT, then raises."""
        self._snapshot: tuple | None = None
        self.model = None
        joining = runtime.replacement()
        if joining is not None:
            self._join(*joining, quorum_timeout)
            return
        w = runtime.world()
        if w.store is None or w.joined:
            raise RuntimeError("LiveDDP needs a world of gradsync's own (gs.spawn, gradsync.init()), whose "
                               "rendezvous store outlives its ranks")
        self._settings, self._has_state = w, True
        self.membership = Membership(w.store.underlying_store, w.rank, tuple(range(w.world_size)),
                                     quorum_timeout if quorum_timeout is not None else w.timeout)
        self.door = growth.Door(self.membership.store)
        set_abandon_check(self.membership.broken)
        self.model = DistributedDataParallel(module, **ddp_options)

    @property
    def world(self) -> runtime.World:
        return runtime.world()

    @property
    def member(self) -> int:
        """This process's member id: its rank in the world it started in."""
        return self.membership.member

    # -- one step ------------------------------------------------------------------------------------
    def run_step(self, train_step: Callable[[nn.Module], dict], apply: Callable[[], object] | None = None) -> bool:
        """Train one step; True when it was committed, False when a member died and the step is to be
        trained again in the new world (live.step and live.progress are then those of the last step
        every survivor holds). ``apply``: what steps the optimizer once the gradients are reduced
        (default optimizer.step(); a gradient scaler's unscale, check and step)."""
        failure = joiner = None
        try:
            joiner = self.door.decide(self.world.rank) if self.admit_joiners else None   # the boundary (growth.py)
            if joiner is None:
                self.optimizer.zero_grad(set_to_none=False)
                progress = train_step(self.model)
                self._take_snapshot()
                (apply or self.optimizer.step)()
        except Exception as exc:
            failure = self._failure(exc)
        if failure is not None:   # recovered outside the except clause, so the old world's frames are free
            self.recover(failure)
            return False
        if joiner is not None:
            self.grow(joiner)
            return False
        self.step += 1
        self.progress = dict(progress)
        return True

    def collective(self, fn: Callable[[], object]):
        """``fn()`` (collectives outside a training step: evaluation, statistics), run again in the new
        world if a member dies during it. At most once per member of the current world."""
        return rerun(fn, len(self.membership.current.members), self._failure, self.recover)

    def _failure(self, exc: Exception) -> str:
        """The first line of ``exc`` when a member's death caused it (failures.py); otherwise ``exc`` is
        raised again."""
        if not caused_by_peer(exc) and self.membership.broken() is None:
            raise exc
        return first_line_freed(exc)

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
        before = self.membership.current
        self._tear_down()
        generation = self.membership.next_generation()
        rolled_back = self._enter(generation, len(before.members))
        return self._record(before, generation, rolled_back, started, why)

    def grow(self, joiner: int) -> Recovery:
        """Admit member ``joiner`` (growth.py): every member calls it at the boundary that decided it."""
        started = time.monotonic()
        before = self.membership.current
        self._tear_down()
        generation = self.membership.propose((*before.members, joiner))
        self.door.answer(joiner, generation)
        failure = self._enter_or_fail(generation, len(before.members), joiner)
        if failure is not None:   # a death during the join (growth.py): recovered like any other
            return self.recover(failure)
        return self._record(before, generation, self._rolled_back, started, "")

    def _join(self, member: int, settings: runtime.World, quorum_timeout: float | None) -> None:
        """A replacement process joins the running world as ``member`` (growth.py's protocol, the joiner's side)."""
        started = time.monotonic()
        store = runtime.connect_store(settings)
        self._settings, self._has_state = settings, False
        self.membership = Membership(store, member, (), quorum_timeout if quorum_timeout is not None
                                     else settings.timeout)
        self.door = growth.Door(store)
        while True:
            ticket = growth.announce(store, member)
            admitted = growth.wait_for_admission(store, member, ticket)
            if admitted is not None:
                break
            if growth.is_closed(store):
                raise NotNeeded(f"member {member}: the run finished before this replacement could join")
        self.door.seen = ticket + 1
        generation = Generation(admitted, self.membership.agreed(admitted - 1))
        self.membership.current = generation
        set_abandon_check(self.membership.broken)
        before = Generation(admitted - 1, tuple(m for m in generation.members if m != member))
        failure = self._enter_or_fail(generation, len(before.members), member)
        if failure is not None:
            self.recover(failure)
        else:
            self._record(before, generation, self._rolled_back, started, "")

    def _enter_or_fail(self, generation: Generation, old_world: int, joiner: int) -> str | None:
        """_enter (its roll-back flag in self._rolled_back), or why it failed."""
        try:
            self._rolled_back = self._enter(generation, old_world)
        except Exception as exc:
            return f"the join of member {joiner} failed: {first_line_freed(exc)}"
        return None

    def _enter(self, generation: Generation, old_world: int) -> bool:
        """The rebuilt world's recipe: rejoin -> agree on the step -> on_resize -> state to a joiner ->
        rewrap -> check_replicas. True if this rank rolled back."""
        self._rejoin(self._settings, generation)
        rolled_back, missing = self._agree_on_step()
        if self._has_state and self.on_resize is not None and old_world != len(generation.members):
            self.on_resize(self, old_world)
        if missing:
            self.step = transfer.share_state(self.world.rank, self.module, self.optimizer, self.step, self.progress,
                                             self.shared, receive=not self._has_state)
            self._has_state = True
        self.model = DistributedDataParallel(self.module, init_sync=False, **self.ddp_options)
        self.check_replicas()
        return rolled_back

    def _record(self, before: Generation, generation: Generation, rolled_back: bool, started: float,
                why: str) -> Recovery:
        record = Recovery(generation.index, generation.members,
                          tuple(m for m in before.members if m not in generation.members), self.step,
                          rolled_back, time.monotonic() - started, why,
                          tuple(m for m in generation.members if m not in before.members))
        self.recoveries.append(record)
        return record

    def pending_joiners(self) -> int:
        """Joiners that took a ticket and were not yet dealt with (a store lookup; growth.py)."""
        return growth.tickets(self.membership.store) - self.door.seen

    def await_joiner(self, timeout: float = 60.0) -> None:
        """Block until a joiner has asked to join (tests and benchmarks: so that a replacement joins before
        a short run ends); raises after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.pending_joiners():
            if time.monotonic() > deadline:
                raise RuntimeError(f"member {self.member}: no replacement asked to join within {timeout:.0f} s")
            time.sleep(0.01)

    def _tear_down(self) -> None:
        if self.model is not None:
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
        hosts = {m: self.membership.location(m)[0] for m in generation.members}
        local = [m for m in generation.members if hosts[m] == hosts[self.member]]
        runtime.rejoin(previous, self.membership.store, generation.rank_of(self.member), len(generation.members),
                       local.index(self.member), len(local), prefix=f"{PREFIX}/{generation.index}/world",
                       generation=generation.index)

    def _agree_on_step(self) -> tuple[bool, bool]:
        """Committed steps: max and min over the ranks holding the state; a rank ahead rolls back. Returns
        (this rank rolled back, some rank has no state: a joiner)."""
        step = self.step if self._has_state else MISSING
        steps = torch.tensor([step, -step if self._has_state else MISSING, 0 if self._has_state else 1],
                             dtype=torch.int64)
        all_reduce(steps, op="max")
        newest, oldest, missing = int(steps[0]), -int(steps[1]), bool(steps[2])
        if newest == MISSING:
            raise RuntimeError(f"member {self.member}: no member of generation {self.membership.current.index} "
                               f"holds the training state (every one that did died during a join)")
        assert newest - oldest <= 1, f"committed steps {oldest}..{newest} differ by more than one"
        if not self._has_state or self.step == oldest:
            return False, missing
        self._roll_back()
        assert self.step == oldest, (self.step, oldest)
        return True, missing

    def check_replicas(self) -> None:
        """Raise ReplicaMismatchError unless parameters and optimizer state are bitwise the same on
        every rank."""
        self.model.check_replicas()
        state = [t for s in self.optimizer.state_dict()["state"].values() for t in s.values()
                 if isinstance(t, torch.Tensor)]
        if runtime.world().world_size == 1:
            return
        counts = torch.tensor([len(state), -len(state)], dtype=torch.int64)
        all_reduce(counts, op="max")
        if int(counts[0]) != -int(counts[1]):
            raise ReplicaMismatchError(f"replicas diverged: ranks hold {-int(counts[1])} to {int(counts[0])} optimizer "
                                       f"state tensors (rank {runtime.world().rank}: {len(state)})")
        if state:
            difference = first_mismatch([t.reshape(-1) for t in state], gather=all_gather)
            if difference is not None:
                raise ReplicaMismatchError(f"replicas diverged: optimizer state tensor #{difference[1]} differs "
                                           f"between rank 0 and rank {difference[0]}")

    def close(self) -> None:
        """Stop the wrapper's communication thread, the live world's check and the heartbeat; a joiner
        still waiting is not needed any more (growth.py)."""
        self.door.close()
        self.model.close()
        set_abandon_check(None)
        self.membership.close()
