"""LivePS: a parameter-server job that goes on, without a restart, when a worker dies.

    live = LivePS(model, optimizer_fn, num_servers=S, mode="sync")   # ParameterServer's arguments
    if live.is_server:
        live.serve()                        # until every worker has closed, rebuilding on the way
    else:
        while True:
            if live.step < total_steps:
                live.run_step(train_step)   # pull -> train_step(model) -> push; train_step chooses this
                                            # worker's samples from live.progress and live.world
            elif live.finish():             # the final pull and close (False: a step is to be redone)
                break
    scores = live.collective(evaluate)      # collectives after training: run again in the new world
    live.close()

Vocabulary: members, generations and the quorum as in membership.py; servers are members 0..S-1
and keep ranks 0..S-1 in every generation, the surviving workers are renumbered S, S+1, ... in
member order. A worker's step is its clock: pushes it has completed.

When a member dies, the survivors' transfers fail. The parameter server's messages are tagged, so
they travel over torch.distributed (gloo) even between ranks of one host: a transfer with the dead
rank fails at once (its connection closes). A server waiting for its next message from any worker
is not woken by gloo, so the others tell it (_Relay, _tell): a worker sends each server an ABORT
header (REASON_MEMBER_DIED) once the live world's check (membership.broken: a member of this host
dead in /proc, or the generation marked broken in the store; asked every CHECK_SECONDS) sees the
death, or as soon as its own transfer failed; a server that caught a failure tells the workers
waiting for its answers. Each survivor then, as a recipe (LiveDDP's, live/ddp.py, plus the parts
of a parameter server):

    declare_broken   the generation is over (store)
    tell             the other side, as above
    tear_down        gradsync.shutdown() closes the transport (a server's outbox thread ended with serve());
                     a worker drops its gradients (a push that failed leaves them on the parameters, and
                     the step trained again would add its new share's to them)
    agree            the next generation's members (membership.py's quorum); every member alive (a
                     transfer timed out on a stalled rank) ends the job with that error
    end_if_a_server_died  a dead server's shard and optimizer state exist nowhere else: every survivor
                     raises ServerLostError naming the server rank, what was lost and its version
    rejoin           a new world of the survivors (runtime.rejoin), the parameter server re-pointed at
                     it (ParameterServer.rejoin)
    agree_on_clocks  one all-gather of each rank's version, clock, closed flag and pushes applied (below)

The step in flight, sync: the survivors train it again. The servers' versions differ by at most
one; a server that closed version V_min + 1 rolls back (ps/versioned_shard.py), every worker's clock
becomes V_min, and a worker that had pushed step V_min takes back its progress. Step V_min is then
trained by the W - 1 survivors on their shares of all its samples (the caller's train_step re-shards
them by live.world) and closed with the mean of their W - 1 pushes; the dead worker's gradient for
it is dropped wherever it had arrived. So no sample is lost or trained twice, and with a step's loss
scaled to the whole step's mean (loss x W / step samples) the run equals one process with the
global batch, up to floating-point reassociation.

async and ssp: the dead worker is dropped; each server applies a push as gradient / W' from then on
and SSP's bound counts the open workers only, so nothing waits for the dead worker's clock. A
survivor's clock is the most pushes any server applied from it (a push whose sends failed after a
server had read it counts, with the progress train_step returned for it); a server that had not
read the last of them sets its clock there too, so that push is applied on the servers that read
it and not on the others. The dead worker's pushes stay where they were applied; what happens to
the samples it had not trained is the caller's choice (train/strategies/ps.py tasks_of deals its remaining
steps to the open survivors, by PSRecovery.lost_clocks and open_workers).

Stopping early (a preemption): serve(stop) and run_step(train_step, stop) pass it on to the
ParameterServer, whose answers then say ``stopping``; the worker calls finish(), which closes without
another pull. The caller then gathers ps.state_dict() through collective() and writes its
checkpoint; ps.load_state_dict() after construction continues it (train/strategies/live_ps.py).

The floor (``min_workers``, default: half of the workers the job started with, rounded up; live/failures.py
default_floor says why): when a recovery leaves fewer workers, the job stops as a preemption does, at the
next version every rank agrees on (the servers' answers say ``stopping``; ``below_floor`` says why), so the
caller checkpoints it and exits (gradsync train: 75). A worker left out of a generation while it lived (a
partition) does not rejoin a parameter-server job: it raises membership.Evicted. A member that cannot
reach the store for the world's timeout raises LostContact (live/ddp.py's module docstring).

What this leaves out: sparse tables (refused), clipping (ParameterServer's max_grad_norm), rejoining.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from gradsync.group import runtime
from gradsync.group.bounded_store import StoreUnreachable
from gradsync.comm.collectives import all_gather, all_reduce
from gradsync.comm.transport import set_abandon_check
from gradsync.comm.world_transport import default_transport
from gradsync.live.ddp import Recovery
from gradsync.live.catch_up import CatchUp
from gradsync.live.failures import LostContact, caused_by_peer, default_floor, first_line_freed
from gradsync.live.membership import CHECK_SECONDS, PREFIX, Membership
from gradsync.ps import protocol as wire
from gradsync.ps.parameter_server import ParameterServer
from gradsync.ps.sparse_tables import find_sparse


class ServerLostError(RuntimeError):
    """A parameter server died; ``servers`` are their ranks (= member ids). The live job ends."""

    def __init__(self, message: str, servers: tuple[int, ...]) -> None:
        super().__init__(message)
        self.servers = servers


@dataclass
class PSRecovery(Recovery):
    """What one recovery did (LivePS.recoveries): LiveDDP's record, where ``step`` is a worker's agreed
    clock (a server's version) and ``rolled_back`` says that this server undid the version it had
    closed, or that this worker took back its last step (sync)."""

    version: int = 0
    """Sync: the version every server holds afterwards (step ``version`` is trained next)."""
    caught_at: float = 0.0
    """When this rank caught the failure (time.time(): compare with the death's)."""
    lost_clocks: dict = field(default_factory=dict)
    """Per lost worker (member id): the most pushes any server applied from it."""
    open_workers: tuple[int, ...] = ()
    """Member ids of the workers of the new generation that have not closed."""


TELL_SECONDS = 0.5
"""How long a survivor waits for its word that the generation broke to leave (_tell)."""


def _tell(transport, channel, rank: int, peers: list[int]) -> None:
    """Send each of ``peers`` an ABORT header (REASON_MEMBER_DIED) on the parameter server's header
    tag, waiting at most TELL_SECONDS in all; a peer that is gone needs no word."""
    header = wire.message(wire.Header(wire.ABORT, rank, -1, 0, wire.REASON_MEMBER_DIED), [], 0)
    sends = []
    for peer in peers:
        try:
            sends.append(transport.isend(header, peer, "ps/header", control=True, tag=channel.header_tag))
        except Exception:   # noqa: BLE001 - the connection to a dead peer is closed
            pass
    deadline = time.monotonic() + TELL_SECONDS
    for send in sends:
        try:
            send.wait(timeout=max(0.01, deadline - time.monotonic()))
        except Exception:   # noqa: BLE001 - as above; the world is torn down next anyway
            pass


class _Relay(threading.Thread):
    """Worker side: once the live world's check (membership.broken) says the generation broke, tell
    the servers (_tell). A server waits for its next message with a receive from any worker over
    torch.distributed, which gloo does not fail when one peer dies, and which cannot be polled (gloo
    marks it done only inside wait()); this header ends that wait within CHECK_SECONDS of the death
    instead of the timeout. A worker whose own transfer failed tells them as it starts to recover, a
    server tells its workers (they may be waiting for it). ``lock`` keeps the thread off a world being
    torn down."""

    def __init__(self, live: "LivePS") -> None:
        super().__init__(name=f"gradsync-live-ps-relay-{live.member}", daemon=True)
        self.live, self.lock, self.stopped = live, threading.Lock(), threading.Event()
        self.relayed = -1   # the last generation relayed

    def run(self) -> None:
        while not self.stopped.wait(CHECK_SECONDS):
            with self.lock:
                if self.live.membership.broken() is not None:
                    self.tell_servers()

    def tell_servers(self) -> None:
        """Tell the servers, once per generation (hold ``lock``)."""
        generation = self.live.membership.current.index
        if self.relayed != generation:
            self.relayed = generation
            client = self.live.ps._client
            _tell(client.transport, client.channel, client.rank, client.servers)


class _Interrupter:
    """What the watch (watch.py) interrupts in a parameter-server world: on a worker, first the word to the
    servers (_Relay.tell_servers: a server's receive from any worker is ended by nothing else, since gloo
    does not wake it when its connections close, measured as it waited out its whole timeout), then the
    transport (Transport.interrupt: every other wait ends at once)."""

    def __init__(self, live: "LivePS", transport) -> None:
        self.live, self.transport = live, transport

    def interrupt(self, why: str) -> None:
        relay = self.live._relay
        if relay is not None and relay.lock.acquire(blocking=False):   # held: recover() is telling them itself
            try:
                relay.tell_servers()
            finally:
                relay.lock.release()
        self.transport.interrupt(why)


class LivePS:
    """ParameterServer whose job survives the death of its workers (module docstring)."""

    def __init__(self, model: nn.Module, optimizer_fn: Callable, num_servers: int = 1, mode: str = "sync",
                 staleness: int = 0, *, quorum_timeout: float | None = None, min_workers: int | None = None) -> None:
        w = runtime.world()
        if w.store is None or w.joined:
            raise RuntimeError("LivePS needs a world of gradsync's own (gs.spawn, gradsync.init()), whose "
                               "rendezvous store outlives its ranks")
        if find_sparse(model):
            raise RuntimeError(f"LivePS does not support sparse tables ({', '.join(find_sparse(model))}): their rows "
                               f"in flight are not recovered; use dense parameters or --fault-tolerance restart")
        self.model = model
        self.ps = ParameterServer(model, optimizer_fn, num_servers=num_servers, mode=mode, staleness=staleness)
        self.num_servers, self.mode = num_servers, mode
        self.member = w.rank
        """This process's member id: its rank in the world it started in."""
        workers = w.world_size - num_servers
        if min_workers is not None and (not isinstance(min_workers, int) or isinstance(min_workers, bool)
                                        or not 1 <= min_workers <= max(workers, 1)):
            raise ValueError(f"min_workers must be an integer from 1 to the {workers} workers of the job (the fewest "
                             f"workers that train on), got {min_workers!r}")
        self.floor = default_floor(workers) if min_workers is None else min_workers
        """The fewest open workers that train on (module docstring)."""
        self.below_floor: str | None = None
        """Why the job stops at the next version: a recovery left fewer workers than the floor."""
        self.membership = Membership(w.store.underlying_store, w.rank, tuple(range(w.world_size)),
                                     quorum_timeout if quorum_timeout is not None else w.timeout,
                                     timeout=w.timeout, address=f"{w.master_addr}:{w.master_port}")
        set_abandon_check(self.membership.broken)
        if self.is_server:
            self.ps._server.abort_on_loss = False
            self.ps._server.shard.keep_previous = mode == "sync"
        else:
            self.ps._client.abort_notice_seconds = 0.0   # no server posts one: a lost worker ends nothing
        self._relay = None if self.is_server else _Relay(self)
        self.step = 0
        """Worker: steps committed (its clock)."""
        self.progress: dict = {}
        """Worker: the caller's counters as of the last committed step (what train_step returned)."""
        self.closed = False
        """Worker: close() completed (every server said BYE)."""
        self.recoveries: list[PSRecovery] = []
        self._previous_progress: dict = {}
        self._pending_progress: dict | None = None
        self._outside = CatchUp()   # every rank runs the same collectives, none inside a step: counted from the start
        if self._relay is not None:
            self._relay.start()
        self.membership.watch.arm(0, _Interrupter(self, default_transport()))
        # every rank holds its parameters before any trains: an async worker that dies in its first steps
        # must not take with it a broadcast another rank is still reading (that would end the job)
        all_reduce(torch.zeros(1))

    @property
    def is_server(self) -> bool:
        return self.ps.is_server

    @property
    def world(self) -> runtime.World:
        return runtime.world()

    # -- serving and training ------------------------------------------------------------------------
    def serve(self, stop: Callable[[], bool] | None = None) -> None:
        """Serve until every worker has closed, rebuilding the world each time a worker dies. ``stop()``
        asks to end the job early, as ParameterServer.serve's."""
        def stopping() -> bool:
            return self.below_floor is not None or (stop is not None and bool(stop()))

        while True:
            try:
                self.ps.serve(stopping)
                return
            except Exception as exc:
                failure = self._failure(exc)
            self.recover(failure)

    def run_step(self, train_step: Callable[[nn.Module], dict], stop: bool = False,
                 nonfinite: Callable[[], bool] | None = None) -> bool:
        """Pull, ``train_step(model)`` (forward and backward of this worker's share), push; True when
        committed, False when a member died and the world was rebuilt (live.step and live.progress are
        then the agreed ones: train the step they say next) or when the pull said the job stops here
        (``stopping``: finish() next). ``stop`` asks the servers to end the job early (push(stop));
        ``nonfinite()``, asked before the push, flags a gradient with inf or NaN (push(nonfinite))."""
        self._pending_progress = None
        try:
            self.ps.pull()
            if self.ps.stopping:   # these parameters are the job's last: nothing more is trained
                return False
            self._pending_progress = dict(train_step(self.model))
            self.ps.push(stop or self.below_floor is not None,
                         nonfinite=nonfinite() if nonfinite is not None else False)
        except Exception as exc:
            failure = self._failure(exc)
        else:
            self._commit(self._pending_progress)
            return True
        self.recover(failure)
        return False

    def finish(self) -> bool:
        """The final pull (the parameters every server ends with) and close(); False when a member died
        and a step is to be trained again (live.step went back), True once closed."""
        try:
            if not self.closed:
                if not self.ps.stopping:   # a stopped job's last pull was the one that said so
                    self.ps.pull()
                self.ps.close()
                self.closed = True
        except Exception as exc:
            failure = self._failure(exc)
        else:
            return True
        self.recover(failure)
        return self.closed

    @property
    def stopping(self) -> bool:
        """Worker: a pull said the job ends early (finish() next); server: it was asked to."""
        return self.ps.stopping

    def collective(self, fn: Callable[[], object]):
        """``fn()`` (a collective before or after training: the layout, evaluation, statistics), run again
        in the new world if a member dies during it (failures.rerun); a rank that had finished the one
        another survivor is still in runs it again with it first (catch_up.py). After training every worker
        has closed, so a server that recovers there has no one left to serve."""
        return self._outside.run(fn, len(self.membership.current.members), self._failure, self.recover)

    def _commit(self, progress: dict) -> None:
        self._previous_progress, self.progress = self.progress, progress
        self.step += 1

    def _failure(self, exc: Exception) -> str:
        """The first line of ``exc`` when a member's death caused it; otherwise ``exc`` is raised again."""
        if isinstance(exc, StoreUnreachable):
            self.membership.watch.delivered()
            raise LostContact(self.membership.lost_contact_line()) from None
        if not caused_by_peer(exc) and not self._broken_soon():
            raise exc
        return first_line_freed(exc)

    def _broken_soon(self) -> bool:
        """Whether the generation is broken, asking the store once more (membership.py looks at most every
        CHECK_SECONDS): a peer that tore down after declaring it fails gloo's next send at once."""
        deadline = time.monotonic() + 2 * CHECK_SECONDS
        while self.membership.broken() is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    # -- recovery ------------------------------------------------------------------------------------
    def recover(self, why: str) -> PSRecovery:
        """Form the next generation from the survivors and agree on every worker's clock (module
        docstring). Every survivor calls it; ``why``: the error it caught."""
        try:
            return self._recover(why)
        except StoreUnreachable:
            self.membership.watch.delivered()
            raise LostContact(self.membership.lost_contact_line()) from None

    def _recover(self, why: str) -> PSRecovery:
        started, caught_at = time.monotonic(), time.time()
        self.membership.declare_broken(why)
        before, previous = self.membership.current, runtime.world()
        self.membership.watch.disarm()
        with self._relay.lock if self._relay is not None else contextlib.nullcontext():
            if self._relay is not None:   # this worker may have seen the death first
                self._relay.tell_servers()
            else:   # the workers waiting for this server's answer
                server = self.ps._server
                _tell(server.transport, server.channel, server.rank,
                      [w for w in sorted(server.open) if not self.membership.known_dead(before.members[w])])
            runtime.shutdown()
            if not self.is_server:
                self.model.zero_grad(set_to_none=True)   # the client clears them only once a push is sent
            gc.collect()   # the caught error's frames hold the old world's process group, mappings and sockets
            generation = self.membership.next_generation()
            lost = tuple(m for m in before.members if m not in generation.members)
            if not lost:   # every member registered: a transfer timed out on a stalled rank
                raise RuntimeError(f"member {self.member}: generation {before.index} of the live job broke ({why}), "
                                   f"but every member is alive: a stall, not a death, and live mode recovers "
                                   f"from deaths only")
            self._end_if_a_server_died(lost, why)
            hosts = {m: self.membership.location(m)[0] for m in generation.members}
            local = [m for m in generation.members if hosts[m] == hosts[self.member]]
            runtime.rejoin(previous, self.membership.store.store, generation.rank_of(self.member),
                           len(generation.members), local.index(self.member), len(local),
                           prefix=f"{PREFIX}/{generation.index}/ps-world", generation=generation.index)
            self.membership.watch.arm(generation.index, _Interrupter(self, default_transport()))
            version, rolled_back, lost_clocks, open_workers, caught_up = self._agree_on_clocks(before, lost)
            if len(open_workers) < self.floor and self.below_floor is None:
                self.below_floor = (f"member {self.member}: generation {generation.index} has {len(open_workers)} "
                                    f"open worker(s) {list(open_workers)}, fewer than the floor of {self.floor} "
                                    f"(min_workers): the job stops at the next version, as a preemption")
        record = PSRecovery(generation.index, generation.members, lost, version if self.is_server else self.step,
                            rolled_back, time.monotonic() - started, why, version=version, caught_at=caught_at,
                            lost_clocks=lost_clocks, open_workers=open_workers, caught_up=caught_up)
        self.recoveries.append(record)
        return record

    def _end_if_a_server_died(self, lost: tuple[int, ...], why: str) -> None:
        servers = tuple(m for m in lost if m < self.num_servers)
        if not servers:
            return
        plan = self.ps.plan
        shards = ", ".join(f"rank {s}: {plan.shard_numels[s]} of {sum(plan.shard_numels)} parameter elements"
                           for s in servers)
        version = f"version {self.ps._server.version}" if self.is_server else f"step {self.step}"
        raise ServerLostError(
            f"member {self.member}: parameter server rank {', '.join(map(str, servers))} died ({why}); lost with "
            f"it: its shard of the parameters and its optimizer state ({shards}), which no other rank holds, so "
            f"the live job ends here (this rank at {version}); run it again, or without --fault-tolerance live",
            servers)

    def _agree_on_clocks(self, before, lost: tuple[int, ...]) -> tuple[int, bool, dict, tuple[int, ...], bool]:
        """One all-gather: per rank [is server, version, clock, closed, collectives finished (while in one;
        else -1: catch_up.py), then per member of the previous generation the pushes this server applied
        from it]; returns V_min, whether this rank stepped back, the lost workers' clocks (the most pushes
        any server applied from each), the open workers and whether this rank runs a finished collective
        again first."""
        members = len(before.members)
        row = torch.full((5 + members,), -1, dtype=torch.int64)
        if self.is_server:
            server = self.ps._server
            row[:2] = torch.tensor([1, server.version])
            for old_rank, clock in server.clock.items():
                row[5 + old_rank] = clock
        else:
            row[:4] = torch.tensor([0, -1, self.step, int(self.closed)])
        if self._outside.inside:
            row[4] = self._outside.finished
        table = all_gather(row).view(-1, 5 + members)
        finished = [int(f) for f in table[:, 4] if f >= 0]
        caught_up = self._outside.settle(min(finished) if finished else None, in_step=False)
        servers, workers = table[:self.num_servers], table[self.num_servers:]
        low, high = int(servers[:, 1].min()), int(servers[:, 1].max())
        assert high - low <= 1, f"server versions {low}..{high} differ by more than one"
        old_ranks = [before.rank_of(m) for m in self.membership.current.members[self.num_servers:]]
        if self.mode == "sync":
            clocks = [low] * len(old_ranks)
        else:   # the most pushes any server applied from the worker, or its own count
            clocks = [max(int(w[2]), int(servers[:, 5 + r].max())) for w, r in zip(workers, old_ranks)]
        stepped_back = False
        if self.is_server:
            if self.mode == "sync" and self.ps._server.version == high > low:
                self.ps._server.shard.roll_back()
                stepped_back = True
        else:
            mine = clocks[self.world.rank - self.num_servers]
            if mine == self.step - 1:
                self.step, self.progress, stepped_back = mine, self._previous_progress, True
            elif mine == self.step + 1 and self._pending_progress is not None:
                self._commit(self._pending_progress)   # a push whose sends failed after a server read it
            assert self.step == mine, f"member {self.member}: clock {self.step}, agreed {mine}"
        self.ps.rejoin(clocks, [bool(w[3]) for w in workers], low)
        lost_clocks = {m: int(servers[:, 5 + before.rank_of(m)].max()) for m in lost}
        members = self.membership.current.members[self.num_servers:]
        return low, stepped_back, lost_clocks, tuple(m for m, w in zip(members, workers) if not w[3]), caught_up

    def stats(self) -> dict:
        return self.ps.stats()

    def close(self) -> None:
        """Stop the relay, the live world's check, the watch and the heartbeat."""
        if self._relay is not None:
            self._relay.stopped.set()
            self._relay.join()
        self.membership.watch.disarm()
        set_abandon_check(None)
        self.membership.close()
