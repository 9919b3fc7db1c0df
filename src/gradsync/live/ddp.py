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

A network partition (docs/reliability.md, "The network partitions"):
    the side with the store   finds the members cut off silent within about 3 s (watch.py: their
                              heartbeats stop), ends its waits at once (Transport.interrupt) and forms
                              the next generation without them, as after a death
    a member cut off          cannot reach the store: once it has had no answer for the world's
                              timeout it raises LostContact (one line; gradsync train exits
                              failures.EXIT_LOST_CONTACT), wherever it was waiting
    the heal                  a member that comes back within the timeout finds itself left out of the
                              generation (membership.Evicted) and rejoins: it drops its own state, takes
                              a ticket as a replacement does, is admitted at the next step boundary and
                              receives the state from rank 0; a boundary looks for a joiner whenever the
                              world is smaller than the job was at its start, so that a rejoin costs
                              nothing while the world is whole
    the floor                 a generation with fewer than ``min_workers`` members (default: half of
                              the members the job started with, rounded up; failures.default_floor says
                              why) is rebuilt and its step agreed, and then BelowFloor is raised: the
                              caller checkpoints and stops (gradsync train: exit status 75) rather than
                              train on with a remnant

The store must outlive every rank: under gs.spawn the launcher hosts it (launch.py).
"""

from __future__ import annotations

import copy
import gc
import os
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from gradsync.group import agent_barrier, runtime
from gradsync.group.bounded_store import StoreUnreachable
from gradsync.comm.collectives import all_gather, all_reduce
from gradsync.comm.transport import set_abandon_check
from gradsync.comm.world_transport import default_transport
from gradsync.ddp.wrapper import DistributedDataParallel, ReplicaMismatchError
from gradsync.group.launch import NotNeeded
from gradsync.live import growth, transfer
from gradsync.live.catch_up import CatchUp
from gradsync.live.failures import (EXIT_LOST_CONTACT, BelowFloor, LostContact, StepUndone, caused_by_peer,
                                    default_floor, first_line_freed)
from gradsync.live.membership import PREFIX, Evicted, Generation, Membership
from gradsync.observe import stall
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
    """Member ids that joined (growth.py): a growth rather than a recovery from a death. On a member that
    was left out and came back, its own id: it rejoined (``cause`` says why it was left out)."""
    in_step: bool = False
    """Some survivor met the failure inside a training step: it had gone past any collective outside a step
    that another survivor was still in (a ring all-reduce can end on one rank while another still waits for
    the lost peer's piece), so that collective is not run again (LiveDDP.collective)."""
    caught_up: bool = False
    """This rank had finished the collective outside a step that another survivor was still in, and was in
    the next one: it ran the finished one again in the new world with the others first (LiveDDP.collective)."""


class LiveDDP:
    """DistributedDataParallel whose world survives the death of its ranks (module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, quorum_timeout: float | None = None,
                 on_resize: Callable[["LiveDDP", int], None] | None = None, progress: dict | None = None,
                 shared: dict | None = None, admit_joiners: bool = True, min_workers: int | None = None,
                 **ddp_options) -> None:
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
        """False: while the world is as large as it started, no step boundary asks whether a replacement waits
        (growth.py's one-element all-reduce a step is saved; for a job that starts none, e.g. gs.spawn
        without replacements). A world that lost members always asks, so a member left out by a
        partition can rejoin. A joiner that comes to a whole world waits for admission until
        growth.ADMISSION_TIMEOUT, then raises."""
        if min_workers is not None and (not isinstance(min_workers, int) or isinstance(min_workers, bool)
                                        or min_workers < 1):
            raise ValueError(f"min_workers must be an integer >= 1 (the fewest members that train on), got "
                             f"{min_workers!r}")
        self.sizes = {"started": 0, "floor": 0}
        """The members the job started with and the floor (min_workers, or failures.default_floor of them); a
        joiner receives them."""
        self._snapshot: tuple | None = None
        self._in_step = False   # inside run_step: a recovery's agreement tells the others (Recovery.in_step)
        self._survivor_in_step = self._caught_up = False
        self._outside = CatchUp()   # the collectives outside a step since the last one began (collective())
        self.model = None
        joining = runtime.replacement()
        if joining is not None:
            self._join(*joining, quorum_timeout)
            return
        w = runtime.world()
        if w.store is None or w.joined:
            raise RuntimeError("LiveDDP needs a world of gradsync's own (gs.spawn, gradsync.init()), whose "
                               "rendezvous store outlives its ranks")
        floor = default_floor(w.world_size) if min_workers is None else min_workers
        if floor > w.world_size:
            raise ValueError(f"min_workers={floor} is more than the {w.world_size} ranks of the world: a job must "
                             f"be able to train with the members it starts with")
        self.sizes.update(started=w.world_size, floor=floor)
        self._settings, self._has_state = w, True
        self.membership = self._membership(w.store.underlying_store, w.rank, tuple(range(w.world_size)), w,
                                           quorum_timeout)
        self.door = growth.Door(self.membership.store)
        self.model = DistributedDataParallel(module, **ddp_options)
        self.membership.watch.arm(0, default_transport())

    def _membership(self, store, member: int, members: tuple[int, ...], settings: runtime.World,
                    quorum_timeout: float | None) -> Membership:
        """This member's Membership, its watch installed as the live world's check and the stall inspector's."""
        membership = Membership(store, member, members, quorum_timeout if quorum_timeout is not None
                                else settings.timeout, timeout=settings.timeout,
                                address=f"{settings.master_addr}:{settings.master_port}")
        set_abandon_check(membership.broken)
        stall.watch_with(self._last_seen, membership.contact.silent_since)
        return membership

    def _last_seen(self, rank: int) -> str | None:
        """The stall inspector's word on a rank that posted nothing, from its heartbeat: where it is (it may be in
        the same collective, and unable to post: cut off from the store), or how long it has been silent and
        where it was last seen."""
        membership = getattr(self, "membership", None)
        if membership is None or rank >= len(membership.current.members):
            return None
        member = membership.current.members[rank]
        if member not in membership.listener.heard():
            return None
        doing = membership.listener.last_seen(member)
        where = f"in {doing}" if doing else "outside any collective"
        silent = membership.listener.silent_for(member)
        return (f"no heartbeat for {silent:.1f} s: last seen {where}" if silent >= 1.0
                else f"posted nothing; its heartbeat says it is {where}")

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
        self._in_step = True
        self._outside.step_began()
        try:
            joiner = self.door.decide(self.world.rank) if self._admits() else None   # the boundary (growth.py)
            if joiner is None:
                self.optimizer.zero_grad(set_to_none=False)
                progress = train_step(self.model)
                self._take_snapshot()
                (apply or self.optimizer.step)()
        except Exception as exc:
            failure = self._failure(exc)
        if failure is not None:   # recovered outside the except clause, so the old world's frames are free
            try:
                self.recover(failure)
            finally:
                self._in_step = False
            return False
        self._in_step = False
        if joiner is not None:
            self.grow(joiner)
            return False
        self.step += 1
        self.progress = dict(progress)
        return True

    def _admits(self) -> bool:
        """Whether this boundary asks for a joiner (the same answer on every member: admit_joiners, and the
        sizes every member holds)."""
        return self.admit_joiners or len(self.membership.current.members) < self.sizes["started"]

    def collective(self, fn: Callable[[], object]):
        """``fn()`` (collectives outside a training step: evaluation, statistics), run again in the new
        world if a member dies during it. At most once per member of the current world. StepUndone when the
        recovery took back this rank's last step (failures.py): the caller trains it again first.

        Every member runs the same collectives outside a step, in the same order, but a death can leave
        the survivors one collective apart (a ring all-reduce ends on a rank once it has its pieces): one
        still in the boundary's verdict, another past it in the next collective or in the next step. The
        recovery's agreement says how far each had got (_agree_on_step): one in the next step sends the others
        back to training (StepUndone); one in the next collective first runs the one it had finished again,
        with the others, its result set aside (catch_up.py)."""
        def recover(why: str) -> None:
            record = self.recover(why)
            if record.rolled_back or self.member in record.joined:
                raise StepUndone(f"member {self.member}: the recovery took this rank back to step {self.step} "
                                 f"({'rolled back' if record.rolled_back else 'rejoined'}): train step "
                                 f"{self.step + 1} again before {getattr(fn, '__name__', 'the collective')}")
            if record.in_step:   # another survivor had finished this collective: meet it in the next step
                raise StepUndone(f"member {self.member}: a survivor had gone on to step {self.step + 1} past "
                                 f"{getattr(fn, '__name__', 'the collective')}: train that step")

        return self._outside.run(fn, len(self.membership.current.members), self._failure, recover)

    def _failure(self, exc: Exception) -> str:
        """The first line of ``exc`` when a member's death caused it (failures.py); otherwise ``exc`` is
        raised again."""
        if isinstance(exc, StoreUnreachable):
            raise self._lost_contact() from None
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
        all hold (module docstring). Every survivor calls it; ``why``: the error it caught. A member left
        out of that generation rejoins (module docstring); LostContact when the store stays silent;
        BelowFloor when the generation is smaller than the floor."""
        started = time.monotonic()
        try:
            self.membership.declare_broken(why)
            before = self.membership.current
            self._tear_down()
            try:
                generation = self.membership.next_generation()
            except Evicted as evicted:
                return self._rejoin_after(evicted, started)
            rolled_back = self._enter(generation, len(before.members))
        except StoreUnreachable:
            raise self._lost_contact() from None
        record = self._record(before, generation, rolled_back, started, why)
        self._check_floor(generation)
        return record

    def _lost_contact(self) -> LostContact:
        """This member's LostContact (its one line); the watch no longer needs to end the process itself."""
        self.membership.watch.delivered()
        return LostContact(self.membership.lost_contact_line())

    def _check_floor(self, generation: Generation) -> None:
        if len(generation.members) < self.sizes["floor"]:
            raise BelowFloor(f"member {self.member}: generation {generation.index} has {len(generation.members)} "
                             f"member(s) {list(generation.members)} of the {self.sizes['started']} the job started "
                             f"with, fewer than the floor of {self.sizes['floor']} (min_workers): it trains no "
                             f"further on this side; checkpoint the agreed step {self.step} and start the job "
                             f"again", generation.members, self.sizes["floor"])

    def _rejoin_after(self, evicted: Evicted, started: float) -> Recovery:
        """Member left out of the generation after ``evicted.left`` while it lived: it drops its state and
        joins the running world as a replacement does (growth.py), receiving rank 0's."""
        store = self.membership.store
        self._has_state = False
        admitted = self._admission(store, self.member)
        generation = Generation(admitted, self.membership.agreed(admitted - 1))
        self.membership.current = generation
        failure = self._enter_or_fail(generation, len(generation.members) - 1, self.member)
        if failure is not None:
            return self.recover(failure)
        record = self._record(evicted.left, generation, False, started, str(evicted))
        record.joined = (self.member,)
        return record

    def _admission(self, store, member: int) -> int:
        """Take tickets until a boundary admits ``member`` (growth.py); the generation it was admitted to.
        NotNeeded when the run finished first; LostContact when, under torchrun, the run's end also
        counted this member's node out of the agents' exit barrier (group/agent_barrier.py)."""
        while True:
            ticket = growth.announce(store, member)
            admitted = growth.wait_for_admission(store, member, ticket)
            if admitted is not None:
                self.door.seen = ticket + 1
                return admitted
            if growth.is_closed(store):
                if not agent_barrier.claim_own_check_in(store):
                    raise LostContact(f"member {member}: the run finished while this member was left out, and its "
                                      f"end counted node {os.environ.get('GROUP_RANK')} out of torchrun's exit "
                                      f"barrier: exit status {EXIT_LOST_CONTACT}, so that this node's agent does "
                                      f"not check in a second time")
                raise NotNeeded(f"member {member}: the run finished before this member could join")

    def grow(self, joiner: int) -> Recovery:
        """Admit member ``joiner`` (growth.py): every member calls it at the boundary that decided it."""
        started = time.monotonic()
        before = self.membership.current
        self._tear_down()
        try:
            generation = self.membership.propose((*before.members, joiner))
            self.door.answer(joiner, generation)
        except StoreUnreachable:
            raise self._lost_contact() from None
        failure = self._enter_or_fail(generation, len(before.members), joiner)
        if failure is not None:   # a death during the join (growth.py): recovered like any other
            return self.recover(failure)
        return self._record(before, generation, self._rolled_back, started, "")

    def _join(self, member: int, settings: runtime.World, quorum_timeout: float | None) -> None:
        """A replacement process joins the running world as ``member`` (growth.py's protocol, the joiner's side)."""
        started = time.monotonic()
        self._settings, self._has_state = settings, False
        self.membership = self._membership(runtime.connect_store(settings), member, (), settings, quorum_timeout)
        self.door = growth.Door(self.membership.store)
        admitted = self._admission(self.membership.store, member)
        generation = Generation(admitted, self.membership.agreed(admitted - 1))
        self.membership.current = generation
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
        self.membership.watch.arm(generation.index, default_transport())
        rolled_back, missing, self._survivor_in_step, self._caught_up = self._agree_on_step()
        if self._has_state and self.on_resize is not None and old_world != len(generation.members):
            self.on_resize(self, old_world)
        if missing:
            self.step = transfer.share_state(self.world.rank, self.module, self.optimizer, self.step, self.progress,
                                             self.shared, receive=not self._has_state, live=self.sizes)
            self._has_state = True
        self.model = DistributedDataParallel(self.module, init_sync=False, **self.ddp_options)
        self.check_replicas()
        return rolled_back

    def _record(self, before: Generation, generation: Generation, rolled_back: bool, started: float,
                why: str) -> Recovery:
        record = Recovery(generation.index, generation.members,
                          tuple(m for m in before.members if m not in generation.members), self.step,
                          rolled_back, time.monotonic() - started, why,
                          tuple(m for m in generation.members if m not in before.members), self._survivor_in_step,
                          self._caught_up)
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
        self.membership.watch.disarm()
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
        runtime.rejoin(previous, self.membership.store.store, generation.rank_of(self.member), len(generation.members),
                       local.index(self.member), len(local), prefix=f"{PREFIX}/{generation.index}/world",
                       generation=generation.index)

    def _agree_on_step(self) -> tuple[bool, bool, bool, bool]:
        """Committed steps: max and min over the ranks holding the state; a rank ahead rolls back; and the
        collectives outside a step the ranks in one had finished (min over them). Returns (this rank rolled
        back, some rank has no state: a joiner, some rank was inside a step, this rank had finished a
        collective outside a step that another is still in)."""
        step = self.step if self._has_state else MISSING
        outside = self._outside
        steps = torch.tensor([step, -step if self._has_state else MISSING, 0 if self._has_state else 1,
                              int(self._in_step), -outside.finished if outside.inside else MISSING],
                             dtype=torch.int64)   # MISSING: a rank in no collective takes no part in the min
        all_reduce(steps, op="max")
        newest, oldest, missing, in_step = int(steps[0]), -int(steps[1]), bool(steps[2]), bool(steps[3])
        fewest_finished = -int(steps[4])
        if newest == MISSING:
            raise RuntimeError(f"member {self.member}: no member of generation {self.membership.current.index} "
                               f"holds the training state (every one that did died during a join)")
        assert newest - oldest <= 1, f"committed steps {oldest}..{newest} differ by more than one"
        caught_up = outside.settle(None if fewest_finished == -MISSING else fewest_finished, in_step)
        if not self._has_state or self.step == oldest:
            return False, missing, in_step, caught_up
        self._roll_back()
        assert self.step == oldest, (self.step, oldest)
        return True, missing, in_step, caught_up

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
        """Stop the wrapper's communication thread, the live world's check, the watch and the heartbeat; a
        joiner still waiting is not needed any more (growth.py). Under torchrun, rank 0 checks in at the
        agents' exit barrier for the nodes that are gone (group/agent_barrier.py)."""
        self.door.close()
        if self.world.rank == 0:
            agent_barrier.check_in_for_gone_nodes(self.membership.store, self._nodes_here())
        self.membership.watch.disarm()
        self.model.close()
        set_abandon_check(None)
        stall.watch_with(None, None)
        self.membership.close()

    def _nodes_here(self) -> set[str]:
        """torchrun's node ranks (GROUP_RANK) of the current generation's members."""
        nodes = set()
        for member in self.membership.current.members:
            self.membership.location(member)
            nodes.add(self.membership.node_of(member))
        return nodes
