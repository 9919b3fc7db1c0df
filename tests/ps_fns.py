"""Rank functions for the parameter-server tests (module level so ranks can import them)."""

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

import gradsync as gs
from gradsync.ps import protocol as wire
from gradsync.comm.world_transport import default_transport
from gradsync.ps.sharding import gather_shard

import ddp_fns


class Uneven(nn.Module):
    """Layers of very different sizes: 64x200, 200, 200x30, 30, 30x3, 3 elements."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 200)
        self.b = nn.Linear(200, 30)
        self.c = nn.Linear(30, 3)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def optimizer_fn(kind):
    if kind == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1)
    if kind == "momentum":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return lambda params: torch.optim.Adam(params, lr=0.01)


def train(mode, opt_kind, steps, local_batch, num_servers, staleness=0, straggler=None, sleep_s=0.0,
          model_name="mlp", dtype=torch.float64, clip=None):
    """Servers serve; workers pull/backward/push on their slice of the global data, then one final pull.
    ``clip``: (max_grad_norm, norm_type) for the ParameterServer.

    Returns ("server", stats, traffic) or ("worker", params, stats, traffic)."""
    w = gs.world()
    model = ddp_fns.make_model(model_name, dtype, seed=w.rank) if model_name in ddp_fns.MODELS else Uneven().to(dtype)
    clipping = dict(max_grad_norm=clip[0], norm_type=clip[1]) if clip else {}
    ps = gs.ParameterServer(model, optimizer_fn(opt_kind), num_servers=num_servers, mode=mode, staleness=staleness,
                            **clipping)
    gs.traffic_reset()
    if ps.is_server:
        ps.serve()
        return "server", ps.stats(), gs.traffic()
    workers = w.world_size - num_servers
    index = w.rank - num_servers
    xs, ys = ddp_fns.global_data(steps, workers, local_batch, dtype)
    if model_name not in ddp_fns.MODELS:
        xs = torch.randn(steps, workers * local_batch, 64, dtype=dtype, generator=torch.Generator().manual_seed(3))
        ys = ys % 3
    loss_fn = nn.CrossEntropyLoss()
    for step in range(steps):
        ps.pull()
        loss_fn(model(xs[step].chunk(workers)[index]), ys[step].chunk(workers)[index]).backward()
        if w.rank == straggler:
            time.sleep(sleep_s)
        ps.push()
    ps.pull()
    traffic = gs.traffic()
    ps.close()
    return "worker", {n: p.detach().clone() for n, p in model.named_parameters()}, ps.stats(), traffic


def one_process_clipped(opt_kind, steps, workers, local_batch, max_norm, norm_type):
    """The oracle for clipping: one process, the global batch, torch.nn.utils.clip_grad_norm_ before
    each step. Returns the parameters and the norm of every step."""
    model = ddp_fns.make_model("mlp", torch.float64)
    optimizer = optimizer_fn(opt_kind)(list(model.parameters()))
    xs, ys = ddp_fns.global_data(steps, workers, local_batch, torch.float64)
    norms = []
    for step in range(steps):
        optimizer.zero_grad()
        nn.CrossEntropyLoss()(model(xs[step]), ys[step]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)))
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _mark(sync_dir, rank, clock):
    Path(sync_dir, f"{rank}.pull{clock}").touch()


def _wait_for_marks(sync_dir, ranks, clock, timeout=30.0):
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in ranks if not Path(sync_dir, f"{r}.pull{clock}").exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"workers {missing} did not reach their pull at clock {clock} within {timeout:.0f} s")
        time.sleep(0.002)


def paced(mode, staleness, steps, straggler, lead, sync_dir, grace_s=0.02, pace_s=5.0):
    """One server (rank 0), SGD; the straggler's pace set by the others' progress, not by sleeps.

    Every worker marks (a file in ``sync_dir``) that it is entering its pull at clock c. Before its
    push k, the straggler waits until every other worker has entered its pull at clock
    min(k + lead, steps), then ``grace_s`` more, so that a pull the server answers too early has been
    answered before the push starts. A server that holds a worker back before the bound would stop
    the others short of that clock: after ``pace_s`` seconds of waiting (well within the world's
    timeout) the straggler records the clock it gave up at and stops pacing, so the run ends and the
    test can say so. Workers record, on the monotonic clock (one clock for every process of the
    host), when each pull returned and when each push started.

    Returns ("server", stats, traffic) or ("worker", rank, pull_returned, push_started, gave_up_at),
    gave_up_at None when the straggler never gave up (and for the other workers)."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode=mode, staleness=staleness)
    gs.traffic_reset()
    if ps.is_server:
        ps.serve()
        return "server", ps.stats(), gs.traffic()
    others = [r for r in range(1, w.world_size) if r != w.rank]
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    pull_returned, push_started, gave_up_at = [], [], None
    for step in range(steps):
        _mark(sync_dir, w.rank, step)
        ps.pull()
        pull_returned.append(time.monotonic())
        nn.functional.cross_entropy(model(x), y).backward()
        if w.rank == straggler and gave_up_at is None:
            try:
                _wait_for_marks(sync_dir, others, min(step + lead, steps), timeout=pace_s)
                time.sleep(grace_s)
            except TimeoutError:
                gave_up_at = min(step + lead, steps)
        push_started.append(time.monotonic())
        ps.push()
    _mark(sync_dir, w.rank, steps)
    ps.pull()
    pull_returned.append(time.monotonic())
    ps.close()
    return "worker", w.rank, pull_returned, push_started, gave_up_at


def in_step(mode, steps, sync_dir, settle_s=0.05, late_answer_s=0.0):
    """One server (rank 0), the other ranks workers. After each push, and after each pull, a worker
    marks it (a file in ``sync_dir``), waits for every other worker's mark of the same step, then
    ``settle_s`` more before its next message: so every worker's PUSH header reaches the server
    before any worker's next message (what finishes a push on its worker's account), and every
    worker's PULL before any worker's next message (what settles the answer to it).
    ``late_answer_s``: each worker posts the receive of a pull's answer only that long after sending
    the PULL; gloo completes a send only once its receive is posted, so every answer the server sends
    meanwhile stays moving, and how many it sends at once is its own choice, not timing.
    Returns ("server", stats) or ("worker", rank)."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode=mode)
    if ps.is_server:
        ps.serve()
        return "server", ps.stats()
    others = [r for r in range(1, w.world_size) if r != w.rank]
    if late_answer_s:
        post_now = ps._client._post_header

        def post_late(server, op="ps/pull"):
            if op == "ps/pull":
                time.sleep(late_answer_s)
            return post_now(server, op)

        ps._client._post_header = post_late

    def together(what):
        Path(sync_dir, f"{w.rank}.{what}").touch()
        deadline = time.monotonic() + 30.0
        while not all(Path(sync_dir, f"{other}.{what}").exists() for other in others):
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker rank {w.rank}: the other workers did not reach {what} within 30 s")
            time.sleep(0.002)
        time.sleep(settle_s)

    x, y = torch.randn(4, 8, dtype=torch.float64), torch.zeros(4, dtype=torch.long)
    for step in range(steps):
        ps.pull()
        together(f"pulled{step}")
        nn.functional.cross_entropy(model(x), y).backward()
        ps.push()
        together(f"pushed{step}")
    ps.pull()
    ps.close()
    return "worker", w.rank


def _serve_or_work(ps, model, kill_at_step=None, kill_at_pull=None):
    """A server serves; a worker pulls, computes on a fixed batch and pushes (sync: up to 100 steps;
    async and ssp: until the server stops the job), and SIGKILLs itself after its backward at step
    ``kill_at_step``, or right after sending its PULL at step ``kill_at_pull`` (so the server's answer
    to it is moving in the outbox, ps/outbox.py, when it dies); None: never. Returns what the rank saw."""
    if ps.is_server:
        ps.serve()
        return "served without noticing"
    x = torch.randn(4, 8, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.long)
    for step in range(100 if ps.mode == "sync" else 10**6):
        if step == kill_at_pull:
            ps._client._post_header = lambda *_: os.kill(os.getpid(), signal.SIGKILL)
        ps.pull()
        nn.functional.cross_entropy(model(x), y).backward()
        if step == kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        ps.push()
    ps.close()
    return "worker finished"


def dead_worker(victim, steps_before_death, mode="sync"):
    """The victim SIGKILLs itself after some steps; the others report what they saw. sync: after its
    backward (the server waits for its push, the other worker for the version). async and ssp: right
    after sending a PULL (_serve_or_work); the other worker trains on until the server stops the job."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode=mode)
    victim_step = steps_before_death if w.rank == victim else None
    if mode == "sync":
        return _serve_or_work(ps, model, kill_at_step=victim_step)
    return _serve_or_work(ps, model, kill_at_pull=victim_step)


def dead_server_while_clipping(victim, version):
    """Two servers clip in sync mode; server ``victim`` SIGKILLs itself when it is about to exchange its
    power sum for ``version`` (the version's pushes all in). The others report what they saw."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=2, mode="sync", max_grad_norm=0.01)
    if w.rank == victim:   # fault injection: the exchange is where the other server waits for this one
        clipping, exchange = ps._server.applier.clipping, ps._server.applier.clipping._exchange
        clipping._exchange = lambda mine: (os.kill(os.getpid(), signal.SIGKILL) if ps._server.version == version
                                           else exchange(mine))
    return _serve_or_work(ps, model)


def malformed(kind):
    """Rank 2 sends one bad message to the server; the server must refuse it and name rank 2."""
    w = gs.world()
    model = ddp_fns.make_model("mlp", torch.float64)
    ps = gs.ParameterServer(model, optimizer_fn("sgd"), num_servers=1, mode="sync")
    before = [p.detach().clone() for p in model.parameters()]
    if ps.is_server:
        try:
            ps.serve()
        except Exception as exc:  # noqa: BLE001 - the error is the result
            server = ps._server
            initial = gather_shard(before, ps.plan.pieces[0], torch.empty_like(server.shard.published))
            unchanged = torch.equal(server.shard.dense.detach(), initial)
            return type(exc).__name__, str(exc), getattr(exc, "sender", None), ps._server.version, unchanged
        return "no error", "", None, ps._server.version, None
    try:
        if w.rank == 2:
            transport = default_transport()
            numel = sum(p.numel() for p in model.parameters())
            payload = torch.ones(numel, dtype=torch.float64)
            if kind == "bad_magic":
                header = wire.Header(wire.PUSH, 2, 0, 0, numel, numel * 8, 0).encode()
                header[0] = 12345
                transport.isend(header, 0, "test", control=True, tag=ps._client.channel.header_tag).wait()
            elif kind == "bad_checksum":
                header = wire.Header(wire.PUSH, 2, 0, 0, numel, numel * 8, wire.checksum(payload) + 1).encode()
                transport.isend(header, 0, "test", control=True, tag=ps._client.channel.header_tag).wait()
                transport.isend(payload, 0, "test", tag=ps._client.channel.payload_tag).wait()
            elif kind == "wrong_length":
                header = wire.Header(wire.PUSH, 2, 0, 0, numel - 1, (numel - 1) * 8, 0).encode()
                transport.isend(header, 0, "test", control=True, tag=ps._client.channel.header_tag).wait()
            elif kind == "push_twice":
                nn.functional.cross_entropy(model(torch.randn(4, 8, dtype=torch.float64)),
                                            torch.zeros(4, dtype=torch.long)).backward()
                ps._client.push()
                ps._client.pulled_since_push = True   # bypass the client-side check to reach the server's
                model.zero_grad()
                ps._client.push()
        else:   # rank 1 pushes a valid step, then waits in pull for a version rank 2 never completes validly
            ps.pull()
            nn.functional.cross_entropy(model(torch.randn(4, 8, dtype=torch.float64)),
                                        torch.zeros(4, dtype=torch.long)).backward()
            ps.push()
        ps.pull()
        ps.close()
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc), getattr(exc, "culprit", None), None, None
    return "no error", "", None, None, None
