"""Rank functions for tests/test_shm.py (module level, so spawned ranks can import them)."""

import os
import signal
import time
from pathlib import Path

import torch

import gradsync as gs
from gradsync.comm.transport import PeerError, default_transport


def job_names() -> list[str]:
    """This job's names in /dev/shm, seen from inside the running job."""
    job = os.environ["GRADSYNC_JOB_ID"]
    return sorted(p.name for p in Path("/dev/shm").glob(f"gradsync-{job}*"))


def transport_and_names():
    x = torch.arange(10.0) * (gs.world().rank + 1)
    gs.all_reduce(x)
    return type(default_transport()).__name__, job_names(), x


def size_mismatch():
    """Rank 0 sends 2 floats where rank 1 expects 4: rank 1 must say so, not hang or corrupt."""
    transport = default_transport()
    if gs.world().rank == 0:
        transport.isend(torch.ones(2), 1, "test/mismatch").wait()
        return None
    try:
        transport.irecv(torch.empty(4), 0, "test/mismatch").wait()
    except PeerError as exc:
        return str(exc)
    return "no error"


def killed_mid_collective():
    """Rank 1 SIGKILLs itself inside a run of all-reduces; rank 0 reports how long it took to notice."""
    w = gs.world()
    x = torch.ones(1 << 20)
    for step in range(1000):
        if w.rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.monotonic()
        try:
            gs.all_reduce(x, op="avg")
        except PeerError as exc:
            return time.monotonic() - started, str(exc), job_names()
    return None


def shared_memory_refused():
    """algorithm="shared_memory" over TCP must say why it cannot run."""
    try:
        gs.all_reduce(torch.ones(4), algorithm="shared_memory")
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def shared_memory_pieces(stage_numel: int):
    """A tensor of several staging pieces, twice in a row, with the bytes read from other ranks."""
    w = gs.world()
    n = 3 * stage_numel + 5
    results = []
    for _ in range(2):
        x = torch.arange(n, dtype=torch.float64) * (w.rank + 1)
        gs.traffic_reset()
        gs.all_reduce(x, op="avg", algorithm="shared_memory")
        results.append((x, gs.traffic()["bytes_received"], gs.traffic()["bytes_sent"]))
    return results


def detect_death(report_dir: str):
    """Rank 1 SIGKILLs itself while rank 0 waits in an all-reduce; no launcher is involved (the test
    pool does not stop the others), so rank 0 must notice by itself. Each side writes its clock."""
    w = gs.world()
    if w.rank == 1:
        time.sleep(0.5)
        Path(report_dir, "killed").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        gs.all_reduce(torch.ones(8))
    except PeerError as exc:
        Path(report_dir, "noticed").write_text(repr(time.time()) + "\n" + str(exc))
    return None


def shm_send_while_waiting_on_tcp():
    """Rank 0 posts a shared-memory send larger than the ring, then waits for a tagged (TCP) message
    that rank 1 sends only after receiving all of it: the TCP wait must keep the shm send moving."""
    transport = default_transport()
    big = torch.arange(1 << 20, dtype=torch.float64)   # 8 MiB through a 2 MiB ring
    if gs.world().rank == 0:
        send = transport.isend(big, 1, "test/big")
        reply = torch.zeros(1, dtype=torch.float64)
        transport.irecv(reply, 1, "test/reply", tag=5).wait()
        send.wait()
        return float(reply)
    incoming = torch.empty_like(big)
    transport.irecv(incoming, 0, "test/big").wait()
    transport.isend(incoming.sum().reshape(1), 0, "test/reply", tag=5).wait()
    return None


def reinit_three_times():
    """shutdown() then init() again inside one job: each world gets fresh keys and a fresh transport."""
    out = []
    for generation in range(3):
        if generation:
            gs.shutdown()
            gs.init()
        x = torch.ones(5) * (gs.world().rank + 1)
        gs.all_reduce(x)
        out.append((gs.world().generation, type(default_transport()).__name__, x))
    return out
