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
