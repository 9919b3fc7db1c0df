"""gradsync bench ps: parameter server (sync, SSP, async) beside ring all-reduce DDP, same model, same run.

For each W (workers that train) and with or without one straggler:
    ps-sync, ssp (bound 2), ps-async   W workers + 1 server (W + 1 processes), pull -> compute -> push
    ring DDP                           W processes, gradsync DDP with algorithm="ring"
A straggler is the last worker: after every backward it sleeps ``delay_s``, the same fixed time in
every strategy: one forward + backward of the bare model, measured once in the parent process before
the runs (one thread, no communication), so it computes at about half speed. (Sleeping as long as
that step's own backward took would delay the ring's straggler more: DDP's all-reduce runs inside
backward, so its backward includes the wait for the other ranks.) Throughput = W x batch x steps / wall, wall = the slowest worker's time from
a common barrier to its last step (the async/SSP workers that finish early do not hide a late one).
Ring DDP takes two untimed, unmetered steps first: its first builds the buckets, its second rebuilds
them in the order backward made gradients ready (a one-off broadcast of that order).

Traffic per step, measured by the TrafficMeter beside the closed forms (M = model bytes):
    server link (in + out)    2 * W * M              every worker pushes M and pulls M
    ring rank (sent)          2 * (W-1)/W * M        reduce-scatter + all-gather (the mean over ranks)
"transport" says what carried each row's bytes: the parameter server's messages are tagged and
always travel over torch.distributed (tcp); ring DDP uses GRADSYNC_TRANSPORT's choice (shm or tcp).
The model is an MLP 256 -> 1024 -> 1024 -> 10 (1.33M float32 parameters), batch 64 per worker.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

import gradsync as gs
from gradsync.bench.collectives import carrier
from gradsync.train.models import MLP

PS_MODES = (("ps-sync", "sync", 0), ("ssp s=2", "ssp", 2), ("ps-async", "async", 0))


def _model_and_batch(batch: int):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    model = MLP(in_features=256, hidden=1024, layers=2)
    return model, torch.randn(batch, 256, generator=g), torch.randint(0, 10, (batch,), generator=g)


def straggler_delay(batch: int, reps: int = 5) -> float:
    """Seconds of one forward + backward of the benchmark model here: one thread, no communication
    (median of ``reps`` after one untimed step). The straggler sleeps this long every step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, y = _model_and_batch(batch)
        times = []
        for _ in range(reps + 1):
            started = time.perf_counter()
            nn.functional.cross_entropy(model(x), y).backward()
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return statistics.median(times[1:])


def _compute(model, x, y, delay_s: float) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
    if delay_s:
        time.sleep(delay_s)


def _slowest(seconds: float) -> float:
    return float(gs.all_gather(torch.tensor([seconds], dtype=torch.float64)).max())


def _ps_rank(batch: int, steps: int, delay_s: float) -> list[dict]:
    torch.set_num_threads(1)
    w = gs.world()
    workers = w.world_size - 1
    rows = []
    for label, mode, bound in PS_MODES:
        model, x, y = _model_and_batch(batch)
        ps = gs.ParameterServer(model, lambda p: torch.optim.SGD(p, lr=1e-3), num_servers=1, mode=mode,
                                staleness=bound)
        gs.traffic_reset()
        gs.all_reduce(torch.zeros(1), algorithm="native")   # common start
        started = time.perf_counter()
        if ps.is_server:
            ps.serve()
            wall = 0.0
        else:
            for _ in range(steps):
                ps.pull()
                _compute(model, x, y, delay_s if w.rank == w.world_size - 1 else 0.0)
                ps.push()
            wall = time.perf_counter() - started
            ps.close()
        wall = _slowest(wall)
        stats = ps.stats()
        if ps.is_server:
            model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            rows.append({"impl": label, "workers": workers, "straggler": delay_s > 0, "delay_s": delay_s, "wall_s": wall,
                         "samples_per_s": workers * batch * steps / wall, "step_ms": wall / steps * 1e3,
                         "link_bytes_per_step": (stats["bytes_in"] + stats["bytes_out"]) / steps,
                         "formula_bytes": 2 * workers * model_bytes, "model_bytes": model_bytes,
                         "staleness_max": max(stats["staleness_histogram"], default=0),
                         "transport": "tcp"})   # PS messages are tagged: torch.distributed on any transport
    return rows


def _ring_rank(batch: int, steps: int, delay_s: float) -> dict:
    torch.set_num_threads(1)
    w = gs.world()
    model, x, y = _model_and_batch(batch)
    ddp = gs.DistributedDataParallel(model, algorithm="ring")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(2):   # not timed: the first step builds DDP's buckets, the second rebuilds them in
        optimizer.zero_grad()   # the order backward made gradients ready (a one-off broadcast of it)
        _compute(ddp, x, y, 0.0)
        optimizer.step()
    gs.all_reduce(torch.zeros(1), algorithm="native")
    gs.traffic_reset()
    started = time.perf_counter()
    for _ in range(steps):
        optimizer.zero_grad()
        _compute(ddp, x, y, delay_s if w.rank == w.world_size - 1 else 0.0)
        optimizer.step()
    wall = time.perf_counter() - started
    # the mean over ranks: each chunk goes round N-1 times in each phase, so the ranks send 2(N-1) M
    # together, but one rank's share moves by a few elements with how its buckets split into N chunks
    sent = float(gs.all_gather(torch.tensor([float(gs.traffic()["bytes_sent"])], dtype=torch.float64)).mean())
    wall = _slowest(wall)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"impl": "ring DDP", "workers": w.world_size, "straggler": delay_s > 0, "delay_s": delay_s, "wall_s": wall,
            "samples_per_s": w.world_size * batch * steps / wall, "step_ms": wall / steps * 1e3,
            "link_bytes_per_step": sent / steps,
            "formula_bytes": 2 * (w.world_size - 1) / w.world_size * model_bytes, "model_bytes": model_bytes,
            "staleness_max": 0, "transport": carrier()}


def run(workers: list[int], batch: int = 64, steps: int = 20) -> list[dict]:
    """Rows for every W in ``workers``, without and with a straggler (see module docstring)."""
    if any(w < 2 for w in workers):
        raise ValueError(f"--workers: each W must be >= 2 (a straggler needs a peer), got {workers}")
    delay_s = straggler_delay(batch)
    rows = []
    for w in workers:
        for delay in (0.0, delay_s):
            rows += gs.spawn(_ps_rank, nprocs=w + 1, args=(batch, steps, delay))[0]
            rows.append(gs.spawn(_ring_rank, nprocs=w, args=(batch, steps, delay))[0])
    return rows
