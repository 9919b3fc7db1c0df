"""One rank of a `gradsync cluster` job: train a communication-heavy model, time it, count its bytes.

Run by torchrun inside each emulated host (cluster/jobs.py starts it; not meant to be run by hand):

    python -m torch.distributed.run --nnodes H --nproc-per-node L --node-rank i --master-addr A \
        -m gradsync.cluster.worker --strategy ring --params 4M --steps 4 --reps 3 --out DIR

Vocabulary
    model     two Linear(d, d) layers, d = round(sqrt(P/2)) rounded to even (P = --params), batch 8:
              little compute per byte of gradient, so the network sets the pace
    rep       ``steps`` training steps between two barriers; rep 0 is an untimed warm-up of one step (two
              for DDP, whose second step rebuilds its buckets once)
    wall      a rep's time on the slowest rank, from the barrier to its last step (PS workers: to
              close(), which returns once the server has taken every push)
    update    a server's seconds in its optimizer steps during a rep (Server.stats()["update_seconds"]:
              the optimizer, and the copy of the shard its answers send)
    window    the same span, for the byte counters: the meter (payload and control bytes this rank
              sent and received) and, on each host's local rank 0, the kernel counters of the host's
              link (/sys/class/net/$GLOO_SOCKET_IFNAME/statistics; `ip netns exec` mounts the
              namespace's own sysfs, so these are the emulated host's counters)
    compute   forward + backward of the bare model, all ranks at once after a barrier (they share
              the machine's cores as they do while training), median of 5; for ring and hierarchical
              also the optimizer's update, which each of their ranks runs on the whole model (a PS
              worker leaves it to the servers: the model's host term), and the copy of the
              gradients into one flat buffer, as DDP's hooks copy every new gradient into its
              bucket (zero_grad(set_to_none=True) leaves none to reuse)

Strategies: ps-sync, ps-async, ssp (bound --staleness) with ranks 0..S-1 serving (--servers S) and the
others working; ring and hierarchical are gradsync DDP with that all-reduce algorithm; powersgd is
ring DDP with the PowerSGD hook (rank --powersgd-rank, compressing from the third step, so every timed
step is compressed); diloco trains without a wrapper under gs.DiLoCo (H = --sync-every), each rep H
steps, so a rep's bytes are one outer step's all-reduce of M (a time-to-loss job: loss_worker.py).
Before the reps, PS jobs only: ``duplex``, the first server's link both ways at once against one
way (the model's duplex factor; both at once, one stream in and one out, is the async model's
pair: results.py), and ``fan``, every worker sending a shard of M/S bytes to every server at once,
every server one to every worker, and both at once (the pushes and the answers of a step without
the server's work between them, through the transport the parameter server uses; medians of 5),
the sync model's seconds per byte through a server's link; ring jobs, and hierarchical jobs on
more than one host: ``exchange``, one step of the ring (every rank at once sends a chunk of M/N
bytes to its right neighbour and receives one from its left, through the transport the ring
all-reduce uses; for hierarchical the neighbours on its rail, L ranks away; median of 9), the
model's seconds per byte a ring rank sends (results.py). After the reps: ``alpha_s``,
the median of 20 one-element ring all-reduces divided by 2(N-1).
Writes DIR/rank<r>.json (results.py reads them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.comm.world_transport import default_transport
from gradsync.ddp.powersgd import PowerSGDState, bytes_per_step, powersgd_hook

PS_MODES = {"ps-sync": "sync", "ps-async": "async", "ssp": "ssp"}
DDP_ALGORITHMS = {"ring": "ring", "hierarchical": "hierarchical"}
SLOW_LINK = ("powersgd", "diloco")
"""Ring-based ways to send less: ring DDP with the PowerSGD hook; DiLoCo (one ring all-reduce every H steps)."""
STRATEGIES = (*PS_MODES, *DDP_ALGORITHMS, *SLOW_LINK)
RING_BASED = ("ring", *SLOW_LINK)
BATCH = 8


def build_model(params: float) -> nn.Module:
    """Two Linear(d, d) layers with about ``params`` parameters (d even: sizes split evenly)."""
    d = max(2, 2 * round(math.sqrt(params / 2) / 2))
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))


def _batch(model: nn.Module, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    d = model[0].in_features
    g = torch.Generator().manual_seed(rank)
    return torch.randn(BATCH, d, generator=g), torch.randn(BATCH, d, generator=g)


def _loss(model, x, y) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def barrier() -> None:
    dist.barrier()


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def link_counters() -> dict[str, int] | None:
    """The host link's kernel counters, read by local rank 0 only (one reading per host)."""
    if gs.world().local_rank != 0:
        return None
    base = Path("/sys/class/net") / os.environ["GLOO_SOCKET_IFNAME"] / "statistics"
    return {name: int((base / name).read_text()) for name in ("tx_bytes", "rx_bytes")}


def _measure_compute(model, x, y, ddp: bool, reps: int = 5) -> float:
    """Seconds of forward + backward (+ with ``ddp``, the copy of the gradients into one flat buffer
    and the SGD update; lr 0 leaves the model as it is and moves the same bytes) without
    communication (module docstring)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    bucket = torch.empty(sum(p.numel() for p in model.parameters())) if ddp else None
    barrier()
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        _loss(model, x, y).backward()
        if ddp:
            torch.cat([p.grad.reshape(-1) for p in model.parameters()], out=bucket)
            optimizer.step()
        times.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def _window(run_steps, steps: int) -> dict:
    """Barrier, counters, ``run_steps(steps)``, barrier, counters: one rep (see module docstring)."""
    barrier()
    gs.traffic_reset()
    before = link_counters()
    started = time.perf_counter()
    elapsed = run_steps(steps)
    if elapsed is None:
        elapsed = time.perf_counter() - started
    wall = _slowest(elapsed)
    barrier()
    after = link_counters()
    meter = gs.traffic()
    link = {k: after[k] - before[k] for k in after} if after else None
    return {"wall_s": wall, "steps": steps, "bytes_sent": meter["bytes_sent"],
            "bytes_received": meter["bytes_received"], "control_sent": meter["control_bytes_sent"],
            "control_received": meter["control_bytes_received"], "per_peer": meter["per_peer"], "link": link}


def _ps_reps(args, model, x, y) -> tuple[list[dict], str]:
    reps, role = [], ""
    for rep in range(args.reps + 1):
        ps = gs.ParameterServer(model, lambda p: torch.optim.SGD(p, lr=1e-4), num_servers=args.servers,
                                mode=PS_MODES[args.strategy], staleness=args.staleness)
        role = "server" if ps.is_server else "worker"

        def run_steps(steps: int, ps=ps):
            if ps.is_server:
                ps.serve()
                return 0.0   # the rep's wall is the slowest worker's
            started = time.perf_counter()
            for _ in range(steps):
                ps.pull()
                _loss(model, x, y).backward()
                ps.push()
            ps.close()
            return time.perf_counter() - started

        result = _window(run_steps, 1 if rep == 0 else args.steps)
        if rep:
            reps.append({**result, "update_s": ps.stats()["update_seconds"] if ps.is_server else 0.0})
    return reps, role


def _ddp_reps(args, model, x, y) -> tuple[list[dict], str]:
    ddp = gs.DistributedDataParallel(model, algorithm=DDP_ALGORITHMS.get(args.strategy, "ring"))
    if args.strategy == "powersgd":   # compressing from the third step: the timed reps are all compressed
        ddp.register_comm_hook(PowerSGDState(rank=args.powersgd_rank, start_iter=2, algorithm="ring"), powersgd_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)

    def run_steps(steps: int):
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            _loss(ddp, x, y).backward()
            optimizer.step()

    # warm-up of two steps: the second one's forward rebuilds the buckets in the ready order (once,
    # a broadcast of the order, as torch's DDP does), so the timed reps hold only the steady state
    reps = [_window(run_steps, 2 if rep == 0 else args.steps) for rep in range(args.reps + 1)]
    return reps[1:], "rank"


def _diloco_reps(args, model, x, y) -> tuple[list[dict], str]:
    """DiLoCo: each rep H steps (so each holds exactly one outer step), after one untimed step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    diloco = gs.DiLoCo(model, optimizer, sync_every=args.sync_every, algorithm="ring")

    def run_steps(steps: int):
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            _loss(model, x, y).backward()
            optimizer.step()
            diloco.step()

    reps = [_window(run_steps, 1 if rep == 0 else args.sync_every) for rep in range(args.reps + 1)]
    return reps[1:], "rank"


def _timed_transfers(post) -> float:
    """The slowest rank's seconds from a barrier until the transfers ``post()`` starts (a list of
    handles; none on a rank that takes no part) are done. A send is done once its bytes are in the
    kernel's buffers: a transfer ends when its receiver has them, hence the slowest rank's time."""
    barrier()
    started = time.perf_counter()
    handles = post()
    for handle in handles:
        handle.wait()
    return _slowest(time.perf_counter() - started if handles else 0.0)


def _measure_duplex(nbytes: int, servers: int, reps: int = 5) -> dict[str, float]:
    """The first server's link both ways at once against one way (module docstring):
    medians of ``reps`` of receiving ``nbytes`` from the first worker, sending ``nbytes`` to the
    next one (the same one when there is only one), and both at once, through torch.distributed's
    gloo as the parameter server's transfers go; each time from a barrier until the last rank's
    transfers are done. Every rank takes part; the dict is filled on the server rank alone."""
    rank, world = dist.get_rank(), dist.get_world_size()
    source, sink = servers, min(servers + 1, world - 1)
    inbox, outbox = torch.empty(nbytes // 4), torch.zeros(nbytes // 4)
    times: dict[str, list[float]] = {"in_s": [], "out_s": [], "both_s": []}

    def post(kind: str) -> list:
        handles = []
        if kind != "out_s" and rank in (0, source):   # into the server, from source
            handles.append(dist.irecv(inbox, source) if rank == 0 else dist.isend(outbox, 0))
        if kind != "in_s" and rank in (0, sink):      # out of the server, to sink
            handles.append(dist.isend(outbox, sink) if rank == 0 else dist.irecv(inbox, 0))
        return handles

    for _ in range(reps):
        for kind in times:
            times[kind].append(_timed_transfers(lambda: post(kind)))
    return {kind: statistics.median(t) for kind, t in times.items()} if rank == 0 else {}


def _measure_fan(model_bytes: int, servers: int, reps: int = 5) -> dict[str, float]:
    """The servers' links as a step meets them (module docstring): medians of ``reps``, after one
    untimed, of the slowest rank's time, from a barrier, for every worker to send a shard of M/S
    float32 bytes to every server at once ("in_s": the pushes), for every server to send one to
    every worker at once ("out_s": the pulls), and both at once ("both_s"), through the transport
    the parameter server uses. The dict (and "shard_bytes") on every rank."""
    transport = default_transport()
    rank, world = transport.rank, transport.world_size
    shard = max(1, model_bytes // 4 // servers)
    workers, serving = range(servers, world), range(servers)
    outbox = torch.zeros(shard)
    inboxes = {peer: torch.empty(shard) for peer in (workers if rank < servers else serving)}

    def post(kind: str) -> list:
        handles = []
        for peer, inbox in inboxes.items():
            into_server = (rank < servers) == (kind != "out_s")   # this rank receives
            if kind == "both_s" or into_server:
                handles.append(transport.irecv(inbox, peer, "cluster/fan"))
            if kind == "both_s" or not into_server:
                handles.append(transport.isend(outbox, peer, "cluster/fan"))
        return handles

    times: dict[str, list[float]] = {"in_s": [], "out_s": [], "both_s": []}
    for rep in range(reps + 1):
        for kind in times:
            seconds = _timed_transfers(lambda: post(kind))
            if rep:
                times[kind].append(seconds)
    return {**{kind: statistics.median(t) for kind, t in times.items()}, "shard_bytes": shard * 4}


def _measure_exchange(model_bytes: int, hop: int = 1, reps: int = 9) -> dict[str, float]:
    """One ring step (module docstring): the median over ``reps``, after one untimed, of the slowest
    rank's time, from a barrier, to send a chunk of M/N float32 bytes to the right neighbour (rank +
    ``hop``) and receive one from the left (rank - ``hop``), every rank at once, through the ring's own
    transport (so each direction between two ranks of different hosts has its connection, as in the
    all-reduce). hop = L: the hierarchical all-reduce's rails, L rings of M/L over the hosts, whose
    chunks are M/L/H = M/N too, L of them through a host's link at once. Outside the counted reps."""
    transport = default_transport()
    rank, world = transport.rank, transport.world_size
    chunk = max(1, model_bytes // 4 // world)
    outbox, inbox = torch.zeros(chunk), torch.empty(chunk)

    def post() -> list:
        return [transport.isend(outbox, (rank + hop) % world, "cluster/exchange"),
                transport.irecv(inbox, (rank - hop) % world, "cluster/exchange")]

    times = [_timed_transfers(post) for _ in range(reps + 1)]
    return {"exchange_s": statistics.median(times[1:]), "chunk_bytes": chunk * 4}


def _powersgd_ratio(model: nn.Module, rank: int) -> float:
    """rho: the share of the gradient a compressed PowerSGD step sends (ddp/powersgd.py's closed form)."""
    sent, whole = bytes_per_step(list(model.parameters()), rank)
    return sent / whole


def _fit_alpha(calls: int = 20) -> float:
    """Seconds per message: one-element ring all-reduces, 2(N-1) messages each (median of ``calls``)."""
    n = gs.world().world_size
    times = []
    one = torch.zeros(1)
    for _ in range(calls):
        barrier()
        started = time.perf_counter()
        gs.all_reduce(one, algorithm="ring")
        times.append(_slowest(time.perf_counter() - started))
    return statistics.median(times) / (2 * (n - 1)) if n > 1 else 0.0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=STRATEGIES, required=True)
    parser.add_argument("--params", type=float, required=True, help="model parameters (about)")
    parser.add_argument("--steps", type=int, default=4, help="steps per timed rep")
    parser.add_argument("--reps", type=int, default=3, help="timed reps (after one warm-up rep)")
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--staleness", type=int, default=2)
    parser.add_argument("--sync-every", type=int, default=8, help="diloco: H (a rep is H steps)")
    parser.add_argument("--powersgd-rank", type=int, default=2, help="powersgd: r")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--out", required=True, help="directory for rank<r>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    w = gs.init(timeout=args.timeout)
    model = build_model(args.params)
    x, y = _batch(model, w.rank)
    compute_s = _measure_compute(model, x, y, ddp=args.strategy in (*DDP_ALGORITHMS, *SLOW_LINK))
    params = sum(p.numel() for p in model.parameters())
    duplex = _measure_duplex(params * 4, args.servers) if args.strategy in PS_MODES else {}
    fan = _measure_fan(params * 4, args.servers) if args.strategy in PS_MODES else {}
    per_host = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    exchange = {}
    if args.strategy in RING_BASED or (args.strategy == "hierarchical" and w.world_size > per_host):
        exchange = _measure_exchange(params * 4, hop=1 if args.strategy == "ring" else per_host)
    if args.strategy in PS_MODES:
        reps, role = _ps_reps(args, model, x, y)
    elif args.strategy == "diloco":
        reps, role = _diloco_reps(args, model, x, y)
    else:
        reps, role = _ddp_reps(args, model, x, y)
    alpha_s = _fit_alpha()
    result = {"rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank,
              "host": int(os.environ.get("GROUP_RANK", "0")), "hosts": [list(h) for h in w.hosts], "role": role,
              "strategy": args.strategy, "params": params, "model_bytes": params * 4, "compute_s": compute_s,
              "alpha_s": alpha_s, "duplex": duplex, "fan": fan, "exchange": exchange,
              "powersgd_ratio": _powersgd_ratio(model, args.powersgd_rank), "sync_every": args.sync_every,
              "reps": reps}
    Path(args.out, f"rank{w.rank}.json").write_text(json.dumps(result))
    gs.shutdown()
    # About one job in twenty, a rank aborted after this point, in the interpreter's own teardown
    # ("terminate called without an active exception", SIGABRT), with its results written and
    # gradsync shut down; torchrun then failed the job. Nothing is left to run: leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
