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
    """Every rank writes its pid to ``path.RANK``; rank 0 gives up once all have (were it to give up
    at once, the launcher could stop a rank that has not written its pid yet), the others hang."""
    w = gs.world()
    with open(f"{path}.{w.rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.{w.rank}.tmp", f"{path}.{w.rank}")
    if w.rank == 0:
        deadline = time.monotonic() + 30.0
        while not all(os.path.exists(f"{path}.{r}") for r in range(w.world_size)):
            if time.monotonic() > deadline:
                raise TimeoutError("not every rank wrote its pid within 30 s")
            time.sleep(0.01)
        raise RuntimeError("rank 0 gives up")
    time.sleep(120)


def record_pid_and_wait(path):
    """Write this rank's pid to ``path.RANK``, then wait (for a launcher that will be killed)."""
    with open(f"{path}.{gs.world().rank}.tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(f"{path}.{gs.world().rank}.tmp", f"{path}.{gs.world().rank}")
    time.sleep(120)


def what_the_launcher_gave(name):
    """Print a line, and return the environment variable ``name`` and a draw of numpy's global stream."""
    import numpy

    print(f"rank {gs.world().rank} writes to the launcher's stdout", flush=True)
    return os.environ.get(name), int(numpy.random.randint(2**31))


def what_init_did():
    """Whether the package's public names were loaded before this function ran (this module imports
    only the package, and the forkserver preloads only that), and the class of the world's transport
    as init() left it, before this rank asked for one (None: not made yet). Both reach the rank with
    the launcher's init hooks."""
    import sys

    loaded = all(module in sys.modules for module in ("gradsync.ddp.wrapper", "gradsync.ps", "gradsync.zero"))
    from gradsync.group import runtime
    from gradsync.comm import world_transport

    made = world_transport._TRANSPORTS.get(id(runtime.world()))
    return loaded, None if made is None else type(made).__name__


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
    """``calls`` collectives drawn from one seeded sequence (the same on every rank): all_reduce with
    each of collectives.ALGORITHMS ("auto" and "shared_memory" included), broadcast from a rotating
    root, and reduce_scatter followed by all_gather of its shard; 0, 1, 7, 1000 or 1..65,536 float32
    elements. Rank r holds i + r at element i, and every result is compared whole with its closed
    form (all sums are integers below 2^24, exact in float32 in any order). Returns the transport's
    class, private RSS and open fds after warm-up and at the end, and the calls per (kind, algorithm)."""
    import random
    from collections import Counter

    from gradsync.comm.collectives import ALGORITHMS
    from gradsync.comm.world_transport import default_transport

    rng = random.Random(seed)
    page = os.sysconf("SC_PAGE_SIZE")

    def rss_and_fds():
        # private resident memory: resident minus shared pages, because the shared-memory transport's
        # rings are mapped once at init, fixed in size, and become resident as traffic first reaches them
        with open("/proc/self/statm") as f:
            resident, shared = (int(v) for v in f.read().split()[1:3])
        return (resident - shared) * page, len(os.listdir("/proc/self/fd"))

    def check(got, expected, call, what):
        if got.shape != expected.shape:
            raise AssertionError(f"call {call}: {what}: {got.numel()} elements, expected {expected.numel()}")
        if not torch.equal(got, expected):
            k = (got != expected).nonzero()[0].item()
            raise AssertionError(f"call {call}: {what}: element {k} is {got[k].item()}, expected {expected[k].item()}")

    w = gs.world()
    n, rank = w.world_size, w.rank
    marks, counts = {}, Counter()
    for call in range(calls):
        if call == warmup:
            marks["after_warmup"] = rss_and_fds()
        numel = rng.choice((0, 1, 7, 1000, rng.randint(1, 1 << 16)))
        algorithm = rng.choice(ALGORITHMS)
        kind = rng.choice(("all_reduce", "all_reduce", "broadcast", "reduce_scatter"))
        index = torch.arange(numel, dtype=torch.float32)
        t = index + rank
        total = n * index + n * (n - 1) // 2                  # sum over ranks r of (i + r)
        if kind == "all_reduce":
            gs.all_reduce(t, algorithm=algorithm)
            check(t, total, call, f"all_reduce ({algorithm}) of {numel}")
            counts[kind, algorithm] += 1
        elif kind == "broadcast":
            root = call % n
            gs.broadcast(t, src=root)
            check(t, index + root, call, f"broadcast from rank {root} of {numel}")
            counts[kind, ""] += 1
        else:
            shard = gs.reduce_scatter(t)
            base, extra = divmod(numel, n)                     # the first numel mod N ranks hold one more
            start, size = rank * base + min(rank, extra), base + (rank < extra)
            check(shard, total[start:start + size], call, f"reduce_scatter of {numel}, rank {rank}'s shard")
            check(gs.all_gather(shard), total, call, f"all_gather of reduce_scatter's shards of {numel}")
            counts[kind, ""] += 1
    marks["end"] = rss_and_fds()
    return type(default_transport()).__name__, marks, dict(counts)


def late_rank(late, seconds):
    """Rank ``late`` sleeps before a collective the others are already waiting in."""
    w = gs.world()
    if w.rank == late:
        time.sleep(seconds)
    t = torch.ones(10)
    gs.all_reduce(t, algorithm="ring")
    return float(t[0])


def absent_rank(absent: int):
    """Every rank but ``absent`` all-reduces 10 floats; ``absent`` stays alive but never calls it: it
    waits (in the rendezvous store, up to 60 s) until the others have given up. The others return
    (error type, message, seconds from the call to the error)."""
    from datetime import timedelta

    w = gs.world()
    others = [f"test/absent/{rank}" for rank in range(w.world_size) if rank != absent]
    if w.rank == absent:
        w.store.wait(others, timedelta(seconds=60))
        return None
    started = time.monotonic()
    try:
        gs.all_reduce(torch.ones(10))
        result = "no error", "", time.monotonic() - started
    except Exception as exc:  # noqa: BLE001 - the error is the result
        result = type(exc).__name__, str(exc), time.monotonic() - started
    w.store.set(f"test/absent/{w.rank}", "gave up")
    return result


def odd_rank_out(odd: int):
    """Rank ``odd`` all-reduces 13 floats where the others all-reduce 12; every rank returns the
    error it got (type, message)."""
    try:
        gs.all_reduce(torch.ones(13 if gs.world().rank == odd else 12))
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return type(exc).__name__, str(exc)
    return "no error", ""


def post_to_a_dead_peer():
    """Over TCP (TorchTransport), rank 1 leaves after one all-reduce; rank 0 keeps posting sends to it
    (and waiting for each) until one fails, then posts one more on the connection now known closed
    (gloo refuses that one as it is posted). Rank 0 returns, for each failure, (error type, message,
    the PeerError's peer)."""
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    gs.all_reduce(torch.ones(4))
    if w.rank == 1:
        os._exit(0)
    transport = default_transport()
    failures = []
    deadline = time.monotonic() + 20
    while len(failures) < 2 and time.monotonic() < deadline:
        try:
            transport.isend(torch.ones(1 << 16), 1, "probe").wait(5.0)
        except Exception as exc:  # noqa: BLE001 - the error is the result
            failures.append((type(exc).__name__, str(exc), getattr(exc, "peer", None)))
        time.sleep(0.01)
    return failures
