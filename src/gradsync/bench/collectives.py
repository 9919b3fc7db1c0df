"""gradsync bench collectives: an nccl-tests style table, ours beside torch.distributed in one run.

For every message size and algorithm, each rank times ``reps`` calls after ``warmup`` untimed calls
(the same number for ours and native; ours are metered on the last of them), each call preceded by
a barrier (each side's own, as MPI's calls start from MPI_Barrier: gloo's for torch's all-reduce,
the shared-memory transport's for ours on one host, gloo's otherwise; a barrier that lets ranks
leave far apart would charge the skew to the collective) and followed by one, untimed (as MPI's
side all-reduces each call's time right after the call): where ranks outnumber the cores, a rank
that has returned would otherwise go on to check its result and copy the next input while its
core-mate, still inside the call, waits for that core, and the core-mate's time would include that
work; a call's time is the slowest rank's (an all-reduce of the per-rank times with MAX, once after
the calls), and the table shows the median over calls. Every call, timed or not, starts from the
same input (reset outside the timed region: reducing one tensor in place again and again would
multiply it by N per call and reach inf in float32), and every timed call's result is checked after
it, on every side, against the closed form (every rank contributes ones, so every element is N).
Each side's timed calls run back to back (all of torch's, then all of each of ours), as MPI's do in
their own launch: a gloo collective between two of ours slows the next one of ours by tens of
microseconds at small sizes (gloo's threads take the same 2 cores), which is the other side's cost,
not ours.

    algbw = M / t                     (M: message bytes, t: median seconds)
    busbw = algbw * 2(N-1)/N          (nccl-tests' convention: comparable across N)
    ratio = busbw(ours) / busbw(native) from the same run

"transport" is what carried our algorithms' bytes: shm (comm/transport/shm/, ranks of one host) or tcp
(torch.distributed point-to-point over gloo); torch's own all_reduce always runs on gloo. Which one
is GRADSYNC_TRANSPORT's choice unless ``transport`` names one; naming one that contradicts a set
GRADSYNC_TRANSPORT is an error (``resolve_transport``), so a run never measures another transport
than the one its environment pins. The memory-copy bandwidth printed above the table is the
ceiling every transport on this host works under (``memory_copy_bandwidth``).

"auto" is a row of its own: what algorithm="auto" picks at that size (shown beside it, e.g.
"auto (shared_memory)") and what it costs, so a wrong choice shows as auto slower than another row.

"bytes/rank" is what the TrafficMeter measured on the busiest rank in one call; "formula" is
the prediction for that algorithm (the ring's exact uneven-chunk formula, sim/cost.py for the rest). torch's own all_reduce is not metered (its bytes
never pass through our transport), so its measured column is empty.

``gradsync bench collectives --peers gloo,mpi`` adds Open MPI as a second baseline: the same sizes, N,
warm-up and repetitions through mpirun + mpi4py (bench/mpi_peer.py), in a launch of its own right
after ours; ``add_mpi_rows`` gives every row its ratio to MPI. ``--rounds K`` repeats the whole run K
times, ours then MPI in turn, and ``combine_rounds`` keeps each row's median over the rounds (and
every round's median beside it): on a shared machine one minute can be much slower than the next
(docs/benchmarks.md, "The machine"), and taking turns puts such minutes on both sides.

``fit`` measures the link costs that algorithm="auto" and ``gradsync simulate --calibrated`` use:
alpha and beta from exchanges between ranks 0 and 1 through our transport, each sending M bytes to
the other while receiving M from it, as every step of the ring does (step time = alpha + M*beta,
least squares over sizes 8 B .. 4 MiB); gamma from timing an in-place add of 4 MiB. Why not a
one-way ping-pong: docs/benchmarks.md, "Cost model: prediction vs measurement".
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.comm.allreduce_ring import ring_bytes_sent
from gradsync.comm.collectives import here, resolve_algorithm
from gradsync.comm.world_transport import (TRANSPORTS, default_transport, direct_below, shares_memory,
                                           transport_choice)
from gradsync.comm.world_transport import carrier as world_carrier
from gradsync.sim.cost import Link, allreduce_bytes_per_rank

OURS = ("ring", "halving_doubling", "tree", "naive", "shared_memory", "auto")
SHARED_ONLY = ("shared_memory",)
"""Algorithms that need the shared-memory transport; a tcp run leaves them out."""
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4K', '4KB' or '4KiB' -> 4096; '16M' -> 16 MiB; '100' or '100B' -> 100 bytes (K, M, G are powers of 1024)."""
    number = text.strip().upper().removesuffix("IB").removesuffix("B")
    try:
        if number and number[-1] in UNITS:
            return int(float(number[:-1]) * UNITS[number[-1]])
        return int(number)
    except ValueError:
        raise ValueError(f"cannot read size {text.strip()!r}: use bytes or a K/M/G suffix (KiB, MiB, GiB), "
                         f"e.g. 4K,64K,1M,16M") from None


def human_bytes(nbytes: float) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def _timed(fn, tensor: torch.Tensor, source: torch.Tensor, barrier=dist.barrier) -> float:
    tensor.copy_(source)   # every call reduces the same input; the copy is not timed
    barrier()
    started = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - started
    barrier()   # no rank checks the result or copies the next input before every rank has returned
    return elapsed


def _slowest(times: list[float]) -> list[float]:
    """Each call's time on the slowest rank: one all-reduce (MAX) of this rank's list after the calls,
    not one per call (a gloo collective between two of our calls slows the next one by tens of
    microseconds: its threads compete for the same cores)."""
    elapsed = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.tolist()


def _own_barrier():
    """The barrier each of our timed calls starts from: the shared-memory transport's own (as MPI's
    calls start from MPI_Barrier and gloo's from gloo's), else torch.distributed's."""
    transport = default_transport()
    if shares_memory(transport):
        return lambda: transport.barrier("bench/barrier", spin=True)
    return dist.barrier


def _bench_rank(sizes: list[int], algorithms: list[str], reps: int, warmup: int) -> list[dict]:
    w = gs.world()
    rows = []
    for nbytes in sizes:
        source = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        tensor = torch.empty_like(source)
        runners = {"native": lambda: dist.all_reduce(tensor)}
        barriers = {name: dist.barrier if name == "native" else _own_barrier() for name in ["native", *algorithms]}
        runners.update({a: (lambda a=a: gs.all_reduce(tensor, algorithm=a)) for a in algorithms})
        measured_bytes = {}
        for name, run in runners.items():
            for call in range(warmup):
                if call == warmup - 1:   # meter ours on the last warm-up call, so no side gets an extra one
                    gs.traffic_reset()
                _timed(run, tensor, source, barriers[name])
            if name != "native":
                sent = torch.tensor([gs.traffic()["bytes_sent"]], dtype=torch.int64)
                dist.all_reduce(sent, op=dist.ReduceOp.MAX)
                measured_bytes[name] = int(sent)
        times = {name: [] for name in runners}
        correct = {}
        for name, run in runners.items():   # each side's calls back to back, as MPI's run in a launch of their own
            for _ in range(reps):
                times[name].append(_timed(run, tensor, source, barriers[name]))
                correct[name] = bool(torch.all(tensor == w.world_size)) and correct.get(name, True)   # ones from N ranks: N
        times = {name: _slowest(values) for name, values in times.items()}
        for name in runners:
            picked = resolve_algorithm(here(), tensor, name) if name != "native" else None
            rows.append({"size": tensor.numel() * 4, "workers": w.world_size, "algorithm": name, "picked": picked,
                         "time_s": statistics.median(times[name]), "times_s": times[name],
                         "bytes_per_rank": measured_bytes.get(name), "warmup_calls": warmup,
                         "result_correct": correct[name]})
    return rows


def _fit_rank() -> dict | None:
    """Simultaneous exchanges between ranks 0 and 1 through our transport; see module docstring."""
    w = gs.world()
    transport = default_transport()
    samples = []
    for nbytes in (8, 1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22):
        buf = torch.zeros(max(1, nbytes // 4))
        rounds = 30 if nbytes <= 1 << 17 else 8
        incoming = torch.zeros_like(buf)
        step_times = []
        for _ in range(rounds + 2):
            dist.barrier()
            started = time.perf_counter()
            if w.rank in (0, 1):   # one ring step: send to the peer and receive from it at once
                peer = 1 - w.rank
                handles = [transport.isend(buf, peer, "fit"), transport.irecv(incoming, peer, "fit")]
                for handle in handles:
                    handle.wait()
            step_times.append(time.perf_counter() - started)
        samples.append((buf.numel() * 4, statistics.median(step_times[2:])))
    if w.rank != 0:
        return None
    xs, ys = [s[0] for s in samples], [s[1] for s in samples]
    x_mean, y_mean = statistics.fmean(xs), statistics.fmean(ys)
    beta = sum((x - x_mean) * (y - y_mean) for x, y in samples) / sum((x - x_mean) ** 2 for x in xs)
    alpha = max(min(ys), y_mean - beta * x_mean)
    a, b = torch.ones(1 << 20), torch.ones(1 << 20)
    add_times = []
    for _ in range(20):
        started = time.perf_counter()
        a.add_(b)
        add_times.append(time.perf_counter() - started)
    gamma = statistics.median(add_times) / (4 << 20)
    return {"alpha": alpha, "beta": beta, "gamma": gamma, "samples": samples}


def memory_copy_bandwidth(nbytes: int = 64 << 20, reps: int = 7) -> float:
    """Bytes per second that one thread copies (torch copy_ of ``nbytes``, median of ``reps``): the
    ceiling any transport on this host works under, since every byte moved is at least one copy."""
    source, target = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    target.copy_(source)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            target.copy_(source)
            times.append(time.perf_counter() - started)
    finally:
        torch.set_num_threads(threads)
    return nbytes / statistics.median(times)


def resolve_transport(requested: str | None) -> str:
    """The transport a run measures: ``requested``, or GRADSYNC_TRANSPORT's choice when None.

    Raises ValueError when ``requested`` contradicts a set GRADSYNC_TRANSPORT (a table labelled with
    one transport must not be measured on another)."""
    pinned = os.environ.get("GRADSYNC_TRANSPORT", "").strip()
    chosen = transport_choice()   # checks the variable's value
    if requested is None:
        return chosen
    if requested not in TRANSPORTS:
        raise ValueError(f"unknown transport {requested!r}; choose from {', '.join(TRANSPORTS)}")
    if pinned and requested != chosen:
        raise ValueError(f"--transport {requested} contradicts GRADSYNC_TRANSPORT={pinned}: unset the variable "
                         f"or drop --transport (it defaults to the variable)")
    return requested


@contextlib.contextmanager
def pinned_transport(transport: str):
    """GRADSYNC_TRANSPORT=``transport`` while the block runs (ranks spawned in it choose their
    transport from the variable), restored afterwards."""
    saved = os.environ.get("GRADSYNC_TRANSPORT")
    os.environ["GRADSYNC_TRANSPORT"] = transport
    try:
        yield
    finally:
        if saved is None:
            del os.environ["GRADSYNC_TRANSPORT"]
        else:
            os.environ["GRADSYNC_TRANSPORT"] = saved


def run(workers: int, sizes: list[int], algorithms: list[str] | None = None, reps: int = 5,
        warmup: int = 1, fit: bool = False, transport: str | None = None) -> dict:
    """Run the benchmark on ``workers`` local ranks over ``transport`` (one of TRANSPORTS; None:
    GRADSYNC_TRANSPORT's choice, see ``resolve_transport``); returns {"rows": [...], "fit": {...} | None};
    every row names the transport that carried it."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (ours are metered on the last warm-up call), got {warmup}")
    transport = resolve_transport(transport)
    algorithms = list(algorithms or OURS)
    unknown = set(algorithms) - set(OURS)
    if unknown:
        raise ValueError(f"unknown algorithm(s) {sorted(unknown)}; choose from {', '.join(OURS)}")
    if transport == "tcp":
        algorithms = [a for a in algorithms if a not in SHARED_ONLY]
    with pinned_transport(transport):
        results = gs.spawn(_bench_job, nprocs=workers, args=(sizes, algorithms, reps, warmup, fit))
    rows, fitted = results[0]
    for r in rows:
        r["formula_bytes"] = _formula_bytes(r.get("picked") or r["algorithm"], r["size"], r["workers"])
    _add_native_ratios(rows)
    return {"rows": rows, "fit": fitted}


def combine_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Rows of several rounds of one run's sizes and algorithms (each round a list of rows as ``run``
    or the MPI peer return them, in the same order) -> one row per position: ``time_s`` the median of
    the rounds' medians, ``round_times_s`` those medians in round order, ``result_correct`` only if
    every round's was; bandwidths and ``ratio_vs_native`` from the combined times (the MPI peer's
    rows, which have no native row beside them, get theirs from ``add_mpi_rows``). Rounds take
    turns with the MPI peer (``gradsync bench collectives --rounds``), so a slow minute on this
    shared machine lands on both sides."""
    if not rounds:
        raise ValueError("combine_rounds needs at least one round")
    keys = [[(r["size"], r["algorithm"], r["transport"]) for r in rows] for rows in rounds]
    if any(k != keys[0] for k in keys[1:]):
        raise ValueError("rounds measured different sizes, algorithms or transports; combine rounds of one run only")
    combined = []
    for same in zip(*rounds):
        row = dict(same[0])
        row["round_times_s"] = [r["time_s"] for r in same]
        row["time_s"] = statistics.median(row["round_times_s"])
        row["times_s"] = [t for r in same for t in r["times_s"]]
        row["result_correct"] = all(r["result_correct"] for r in same)
        combined.append(row)
    _add_native_ratios(combined)
    return combined


def _add_native_ratios(rows: list[dict]) -> None:
    """Every row's bandwidths, and its ratio to torch's all-reduce of the same size where ``rows``
    hold one (None otherwise)."""
    native = {r["size"]: r["time_s"] for r in rows if r["algorithm"] == "native"}
    for r in rows:
        _add_bandwidths(r)
        r["ratio_vs_native"] = native[r["size"]] / r["time_s"] if r["size"] in native and r["time_s"] > 0 else None


def _add_bandwidths(row: dict) -> None:
    n, m, t = row["workers"], row["size"], row["time_s"]
    row["algbw_GBps"] = m / t / 1e9 if t > 0 else 0.0
    row["busbw_GBps"] = row["algbw_GBps"] * (2 * (n - 1) / n if n > 1 else 1.0)


def add_mpi_rows(rows: list[dict], mpi_rows: list[dict]) -> list[dict]:
    """``rows`` (from ``run``, any transports) and the MPI peer's rows (bench/mpi_peer.py), with
    every row's ratio_vs_mpi = MPI's median / the row's at that size; the MPI rows' ratio_vs_native
    divides gloo's median (over the runs of ``rows``) by MPI's. MPI ran in its own launch right
    after ours, so these ratios are of the same minute, not of interleaved calls."""
    mpi = {r["size"]: r["time_s"] for r in mpi_rows}
    for r in mpi_rows:
        _add_bandwidths(r)
        native = [x["time_s"] for x in rows if x["algorithm"] == "native" and x["size"] == r["size"]]
        r["formula_bytes"] = None
        r["ratio_vs_native"] = statistics.median(native) / r["time_s"] if native and r["time_s"] > 0 else None
    merged = rows + mpi_rows
    for r in merged:
        r["ratio_vs_mpi"] = mpi[r["size"]] / r["time_s"] if r["size"] in mpi and r["time_s"] > 0 else None
    return merged


def _formula_bytes(algorithm: str, nbytes: int, n_ranks: int) -> float | None:
    """Predicted bytes sent by the busiest rank; exact uneven chunking for the ring (float32)."""
    if algorithm == "ring":
        return max(ring_bytes_sent(nbytes // 4, n_ranks, rank, 4) for rank in range(n_ranks))
    if algorithm == "shared_memory":  # bytes read out of other ranks' memory (allreduce_one_shot.py, allreduce_two_shot.py, allreduce_in_place.py)
        direct = nbytes < direct_below(n_ranks)
        return (n_ranks - 1) * nbytes if direct else 2 * (n_ranks - 1) / n_ranks * nbytes
    return allreduce_bytes_per_rank(algorithm, nbytes, n_ranks) if algorithm in OURS else None


def carrier() -> str:
    """What carries our bytes in the current world: "shm" or "tcp" (see the module docstring)."""
    return world_carrier()


def _bench_job(sizes, algorithms, reps, warmup, fit):
    torch.set_num_threads(1)
    rows = _bench_rank(sizes, algorithms, reps, warmup)
    ours = carrier()
    for r in rows:
        r["transport"] = "gloo" if r["algorithm"] == "native" else ours
    fitted = _fit_rank() if fit and gs.world().world_size >= 2 else None
    if fitted is not None:
        fitted["transport"] = ours
    return rows, fitted


def fitted_link(fitted: dict) -> Link:
    return Link(alpha=fitted["alpha"], beta=fitted["beta"], gamma=fitted["gamma"])
