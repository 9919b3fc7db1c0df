"""Rank functions for the live parameter-server tests (module level: child processes import them)."""

import os
import signal
import time
from pathlib import Path

import torch

from gradsync.data import EpochCursor
from gradsync.live.ps import LivePS, ServerLostError
from gradsync.ps import protocol as wire
from tests.live_fns import GLOBAL_BATCH, LR, MOMENTUM, N_SAMPLES, dataset, model, two_collectives


def _die(log_dir: str) -> None:
    (Path(log_dir) / "died").write_text(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def _optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


class _DieBeforePullingFromServer1:
    """Test hack on the victim's transport: the PULL header to server 1 is never sent. The one to
    server 0 is delivered first, so server 0 closes the version the victim pushed for and server 1
    cannot: the survivors' servers then disagree by one version, the case that rolls one back."""

    def __init__(self, inner, log_dir: str) -> None:
        self.inner, self.log_dir = inner, log_dir
        self.rank, self.world_size = inner.rank, inner.world_size
        self.sent_to_0 = []

    def isend(self, tensor, dst, op, **kw):
        if op == "ps/header" and wire.decode(tensor, self.rank).kind == wire.PULL:
            if dst == 1:
                for handle in self.sent_to_0:
                    handle.wait()
                time.sleep(0.3)   # server 0 reads the PULL before it can see the death
                _die(self.log_dir)
            handle = self.inner.isend(tensor, dst, op, **kw)
            self.sent_to_0.append(handle)
            return handle
        return self.inner.isend(tensor, dst, op, **kw)

    def irecv(self, *args, **kw):
        return self.inner.irecv(*args, **kw)


def train_with_a_kill(num_servers: int, mode: str, victim: int, kill_step: int, where: str, epochs: int,
                      log_dir: str, late_pusher: int | None = None) -> dict:
    """Train ``epochs`` epochs of live_fns' recipe on a LivePS; member ``victim`` dies in step
    ``kill_step`` (0-based): where="forward" after its forward, "pull" in the next pull, after its
    PULL to server 0 (_DieBeforePullingFromServer1), where="server" SIGKILLs a server member after
    its ``kill_step``-th version. ``late_pusher``: in step ``kill_step``, after its backward, that member
    waits until server member 0 has torn down its world (it registered as a survivor), then pushes: the
    push fails with its gradient still on the parameters. Each worker appends "step id id ..." per committed step to
    log_dir/samples.<member> (a step taken back and trained again is written again: the last line of
    a step counts)."""
    x, y = dataset()
    live = LivePS(model(), _optimizer, num_servers=num_servers, mode=mode)
    cursor = EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0)
    total = epochs * cursor.steps_from(0)
    out = {"member": live.member, "server": live.is_server}
    try:
        if live.is_server:
            if where == "server" and live.member == victim:
                live.ps._server.shard.optimizer.register_step_post_hook(
                    lambda *_: _die(log_dir) if live.ps._server.version == kill_step else None)
            live.serve()
        else:
            _train(live, x, y, cursor, total, victim, kill_step, where, log_dir, late_pusher)
        out["check"] = float(live.collective(lambda: _sum_over_ranks(live)))
    except ServerLostError as exc:
        out.update(error=str(exc), servers_lost=exc.servers, at=time.time())
        return out
    live.close()
    out.update(rank=live.world.rank, world_size=live.world.world_size, step=live.step,
               recoveries=[r.__dict__ for r in live.recoveries], stats=live.stats(),
               params=[p.detach().clone() for p in live.model.parameters()])
    return out


def _await_server_teardown(live, timeout: float = 30.0) -> None:
    """Until server member 0 has registered as a survivor of generation 0 (membership.py: it does so
    after tearing its world down), at most ``timeout`` seconds."""
    from gradsync.live.membership import PREFIX

    deadline = time.monotonic() + timeout
    while not live.membership.store.check([f"{PREFIX}/0/here/0"]):
        assert time.monotonic() < deadline, f"member {live.member}: server member 0 never tore down"
        time.sleep(0.01)
    time.sleep(0.2)   # its connections closed


def _sum_over_ranks(live) -> torch.Tensor:
    import gradsync as gs

    total = torch.ones(1, dtype=torch.float64)
    gs.all_reduce(total)
    return total


def _train(live, x, y, cursor, total, victim, kill_step, where, log_dir, late_pusher=None) -> None:
    live.progress = {"epoch": 0, "position": 0}
    workers_at_start = live.world.world_size - live.num_servers
    log = open(Path(log_dir) / f"samples.{live.member}", "a", buffering=1)  # noqa: SIM115 - the victim never closes it
    trained = {}

    def train_step(module):
        epoch, position = live.progress["epoch"], live.progress["position"]
        w, servers = live.world, live.num_servers
        if live.mode == "sync":   # the step's samples over the workers there are now
            share = cursor.share(cursor.order(epoch), position, w.world_size - servers, w.rank - servers)
        else:   # async, ssp: each worker keeps the share of its first rank; the dead one's are not trained
            share = cursor.share(cursor.order(epoch), position, workers_at_start, live.member - servers)
        step_size = cursor.step_size(position)
        out = module(x[share])
        if live.member == victim and live.step == kill_step:
            if where == "forward":
                _die(log_dir)
            if where == "pull":   # push last (the servers finish a push once a later message arrives)
                time.sleep(0.5)
                live.ps._client.transport = _DieBeforePullingFromServer1(live.ps._client.transport, log_dir)
        # sum of per-sample losses x W / G: the workers' average is the step's mean loss
        loss = ((out - y[share]) ** 2).sum() * ((w.world_size - servers) / step_size)
        loss.backward()
        if live.member == late_pusher and live.step == kill_step and not live.recoveries:
            _await_server_teardown(live)
        trained[live.step + 1] = share
        position += step_size
        return {"epoch": epoch + 1, "position": 0} if position >= cursor.n else {"epoch": epoch, "position": position}

    while True:
        if live.step < total:
            if live.run_step(train_step):
                log.write(f"{live.step} {' '.join(map(str, trained[live.step]))}\n")
        elif live.finish():
            break
    log.close()


def collectives_apart_after_training(steps: int, log_dir: str) -> dict:
    """1 server, 3 workers train ``steps`` steps of live_fns' recipe (sync), then, in the collectives after
    training, member 3 dies and the others stand one collective apart (live_fns.train_two_collectives_apart's
    scene): member 2 has finished the first (here by returning at once) and is in the second, members 0 and 1
    are still in the first; both are 2-element int64 sums. Returns each collective's (world size, result)."""
    x, y = dataset()
    live = LivePS(model(), _optimizer, num_servers=1, mode="sync")
    seen: dict[str, list] = {"verdict": [], "statistics": []}
    if live.is_server:
        live.serve()
    else:
        _train(live, x, y, EpochCursor(N_SAMPLES, GLOBAL_BATCH, seed=0), steps, None, -1, "", log_dir)
    if live.member == 3:
        _die(log_dir)
    two_collectives(live, seen, ahead=2)
    live.close()
    return {"member": live.member, "world_size": live.world.world_size, "step": live.step, "seen": seen,
            "recoveries": [r.__dict__ for r in live.recoveries]}
