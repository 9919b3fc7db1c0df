"""Rank functions for the spawn tests (module level: child processes import them)."""

import os
import signal
import time

import torch

import gradsync as gs


def identity_and_state(scale):
    w = gs.world()
    model = torch.nn.Linear(3, 2)
    torch.nn.init.constant_(model.weight, w.rank * scale)
    return {"rank": w.rank, "world_size": w.world_size, "state": model.state_dict(), "pid": os.getpid()}


def raise_on_rank(bad_rank):
    if gs.world().rank == bad_rank:
        raise ValueError(f"planted failure on rank {bad_rank}")
    time.sleep(30)  # the launcher must stop us long before this ends


def die_on_rank(bad_rank):
    if gs.world().rank == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(4)
    gs.all_reduce(t)  # blocks on the dead rank until its connection drops or the timeout fires
    return t


def record_pid_then_hang(path):
    with open(f"{path}.{gs.world().rank}", "w") as f:
        f.write(str(os.getpid()))
    if gs.world().rank == 0:
        raise RuntimeError("rank 0 gives up")
    time.sleep(120)


def stall_fail_and_wait():
    """Rank 3 raises; rank 0 stalls in Python; rank 1 waits on rank 0 inside an all-reduce."""
    w = gs.world()
    if w.rank == 3:
        time.sleep(1.5)
        raise ValueError("bad batch on rank 3")
    if w.rank == 0:
        time.sleep(60)
    gs.all_reduce(torch.ones(8), algorithm="ring")


def soak(calls, warmup, seed):
    """``calls`` collectives of random sizes and algorithms; private RSS and open fds after warm-up and at the end."""
    import random

    rng = random.Random(seed)   # the same sequence on every rank
    algorithms = ("ring", "halving_doubling", "tree", "naive", "native")
    page = os.sysconf("SC_PAGE_SIZE")

    def rss_and_fds():
        # private resident memory: resident minus shared pages, because the shared-memory transport's
        # rings are mapped once at init, fixed in size, and become resident as traffic first reaches them
        with open("/proc/self/statm") as f:
            resident, shared = (int(v) for v in f.read().split()[1:3])
        return (resident - shared) * page, len(os.listdir("/proc/self/fd"))

    w = gs.world()
    marks = {}
    for call in range(calls):
        if call == warmup:
            marks["after_warmup"] = rss_and_fds()
        numel = rng.choice((0, 1, 7, 1000, rng.randint(1, 1 << 16)))
        algorithm = rng.choice(algorithms)
        kind = rng.choice(("all_reduce", "all_reduce", "broadcast", "reduce_scatter"))
        t = torch.full((numel,), float(w.rank + 1))
        if kind == "all_reduce":
            gs.all_reduce(t, algorithm=algorithm)
            expected = w.world_size * (w.world_size + 1) / 2
            assert numel == 0 or float(t[0]) == expected
        elif kind == "broadcast":
            gs.broadcast(t, src=call % w.world_size)
            assert numel == 0 or float(t[0]) == call % w.world_size + 1
        else:
            gs.reduce_scatter(t)
    marks["end"] = rss_and_fds()
    return marks


def late_rank(late, seconds):
    """Rank ``late`` sleeps before a collective the others are already waiting in."""
    w = gs.world()
    if w.rank == late:
        time.sleep(seconds)
    t = torch.ones(10)
    gs.all_reduce(t, algorithm="ring")
    return float(t[0])
