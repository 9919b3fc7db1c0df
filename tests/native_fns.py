"""Functions the native-core tests run on every rank (module level, so child processes import them)."""

import json
import os
import signal
import time

import torch

import gradsync as gs
from gradsync.comm.collectives import all_gather_in_place, shared_allocator
from gradsync.comm.transport import PeerError
from gradsync.comm.world_transport import default_transport


def path_and_bands():
    """Which path this rank's transport runs ("native" or "python"), and what decides the bands:
    the one-shot bound in bytes and the staging half's size."""
    from gradsync.comm.allreduce_two_shot import direct_below

    transport = default_transport()
    return ("native" if transport.core is not None else "python", direct_below(transport), transport.stage_bytes)


def random_input(rank: int, case: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Values of every magnitude (normal x 10^k, k in -3..3), a NaN, +inf and -inf now and then on
    floating dtypes, +-0 mixed in; integers of either sign near the dtype's width (sums wrap)."""
    g = torch.Generator().manual_seed(7919 * rank + case)
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (numel,), generator=g)
        special = torch.randint(0, 97, (numel,), generator=g)
        x[special == 0] = float("nan")
        x[special == 1] = float("inf")
        x[special == 2] = float("-inf")
        x[special == 3] = -0.0
        x[special == 4] = 0.0
        return x.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min // 2, info.max // 2, (numel,), generator=g, dtype=torch.int64).to(dtype)


def all_reduce_cases(batch: list[tuple], in_region: bool):
    """Each (case, dtype, op, numel) all-reduced twice in a row from this rank's random input (a
    plain tensor, or one in a shared region with ``in_region``); returns [(input, first, second)]."""
    w = gs.world()
    allocate = shared_allocator(w) if in_region else None
    out = []
    for case, dtype, op, numel in batch:
        x = random_input(w.rank, case, numel, dtype)
        results = []
        for _ in range(2):
            if allocate is not None:
                t = allocate(numel, dtype)
                t.copy_(x)
            else:
                t = x.clone()
            gs.all_reduce(t, op=op)
            results.append(t.clone())
        out.append((x, *results))
    return out


def killed_while_waiting_in_the_core(victim: int, report: str):
    """Every rank but ``victim`` enters a one-shot all-reduce (the native core's barrier) that the
    victim never joins; the victim writes the time to ``report`` and SIGKILLs itself 0.5 s later.
    Each survivor writes (seconds from the kill to its error, the error) to ``report``.<rank>."""
    w = gs.world()
    if w.rank == victim:
        time.sleep(0.5)
        with open(report, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        gs.all_reduce(torch.ones(64))
        failed_at, error = time.time(), "no error"
    except PeerError as exc:
        failed_at, error = time.time(), str(exc)
    with open(report) as f:
        killed_at = float(f.read())
    with open(f"{report}.{w.rank}", "w") as f:
        json.dump([failed_at - killed_at, error], f)


def affinity_while_in_the_core():
    """The main thread's affinity as a watcher thread samples it during native all-reduces, and after
    each: (own_core, before, [(name, affinities sampled inside, affinity after)]). "late peer": the
    last rank enters 50 ms late, so the others sleep in the core's barrier (pinned before they sleep);
    "4 MiB": a two-shot all-reduce of HOLD_BELOW_BYTES, the last rank late too (held as well)."""
    import threading

    transport = default_transport()
    last = gs.world().rank == gs.world().world_size - 1
    before = sorted(os.sched_getaffinity(0))
    main = threading.get_native_id()
    seen = []
    for name, numel, late in (("late peer", 1 << 10, True), ("4 MiB", 1 << 20, True), ("small", 1 << 10, False)):
        samples, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                samples.append(sorted(os.sched_getaffinity(main)))
                time.sleep(0.002)

        transport.barrier("test/line up")
        watcher = threading.Thread(target=watch)
        watcher.start()
        if late and last:
            time.sleep(0.05)
        gs.all_reduce(torch.ones(numel))
        stop.set()
        watcher.join()
        seen.append((name, samples, sorted(os.sched_getaffinity(0))))
    return transport.own_core, before, seen


def scatter_gather_cases(batch: list[tuple], in_region: bool):
    """Each (case, dtype, op, numel): reduce_scatter of this rank's random input (plain, or in a
    shared region with ``in_region``), then all_gather of the shards (plain), or, in a region, an
    in-place all-gather of a tensor whose chunk r this rank wrote from its shard; each twice.
    Returns [(input, shard, gathered, shard again, gathered again)]."""
    from gradsync.comm.allreduce_ring import ring_chunks

    w = gs.world()
    allocate = shared_allocator(w) if in_region else None
    out = []
    for case, dtype, op, numel in batch:
        x = random_input(w.rank, case, numel, dtype)
        results = [x]
        for _ in range(2):
            source = allocate(numel, dtype) if allocate is not None else x.clone()
            source.copy_(x)
            shard = gs.reduce_scatter(source, op=op)
            if allocate is not None:
                full = allocate(numel, dtype)
                ring_chunks(numel, w.world_size).view(full, w.rank).copy_(shard)
                all_gather_in_place(full)
            else:
                full = gs.all_gather(shard)
            results += [shard.clone(), full.clone()]
        out.append(tuple(results))
    return out
