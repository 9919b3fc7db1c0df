"""gradsync bench ddp --backend gloo,gradsync: torch's own DDP on each torch.distributed backend.

The program is the same for every backend: init_process_group(backend), torch's
DistributedDataParallel around the benchmark model, timed full steps (bench/ddp.py's timed_step:
barrier, forward, backward with the bucket all-reduces, optimizer step; the slowest rank's time).
Each backend runs in its own torchrun, alternately, ``rounds`` times, so machine noise hits them
alike; a row's step time is the median over every round's median.

    ratio    = step time on this backend / step time on the first backend listed (gloo)

On the gradsync backend the same run also times the torch API layer: ``dist.all_reduce(t)``
through the ProcessGroup (c10d/) beside ``gs.all_reduce(t)`` called directly on the same ranks
(gradsync joins the program's world), median of ``reps`` calls per size:

    api / direct = what the ProcessGroup, its Work and its communication thread add
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

API_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
"""Bytes of the float32 tensors for the API-layer rows."""


def run(workers: int, model: str, batch: int, steps: int, backends: list[str], rounds: int = 3,
        reps: int = 20) -> tuple[list[dict], list[dict]]:
    """Step rows (one per backend) and API rows (one per size), from ``rounds`` alternating runs."""
    step_medians: dict[str, list[float]] = {backend: [] for backend in backends}
    api: dict[int, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for backend in backends:
            result = _torchrun(workers, ["--backend", backend, "--model", model, "--batch", str(batch),
                                         "--steps", str(steps), "--reps", str(reps)])
            step_medians[backend].append(result["step_ms"])
            for size, times in result.get("api", {}).items():
                for key, value in times.items():
                    api.setdefault(int(size), {}).setdefault(key, []).append(value)
    baseline = statistics.median(step_medians[backends[0]])
    step_rows = [{"backend": backend, "workers": workers, "model": model, "step_ms": statistics.median(times),
                  "runs_ms": times, "ratio": statistics.median(times) / baseline}
                 for backend, times in step_medians.items()]
    api_rows = []
    for size, times in sorted(api.items()):
        through_api, direct = statistics.median(times["api_us"]), statistics.median(times["direct_us"])
        api_rows.append({"bytes": size, "workers": workers, "api_us": through_api, "direct_us": direct,
                         "ratio": through_api / direct})
    return step_rows, api_rows


def _torchrun(workers: int, args: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                          str(workers), "-m", "gradsync.bench.backend", *args],
                         capture_output=True, text=True, timeout=900, env=env)
    if out.returncode != 0 or "RESULT " not in out.stdout:
        raise RuntimeError(f"bench backend run {' '.join(args)} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.split("RESULT ", 1)[1].splitlines()[0])


def _worker(backend: str, model_name: str, batch: int, steps: int, reps: int) -> None:
    import torch.distributed as dist
    from torch import nn

    from gradsync.bench.ddp import _model_and_batch, timed_step

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    model, x, y = _model_and_batch(model_name, batch)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    for _ in range(3):  # warm-up: buffers, buckets, connections
        timed_step(ddp, optimizer, x, y)
    step_ms = statistics.median(timed_step(ddp, optimizer, x, y) for _ in range(steps)) * 1e3
    result = {"step_ms": step_ms}
    if backend == "gradsync":
        result["api"] = _api_layer(reps)
    if dist.get_rank() == 0:
        os.write(sys.stdout.fileno(), ("RESULT " + json.dumps(result) + "\n").encode())
    dist.destroy_process_group()


def _api_layer(reps: int) -> dict:
    """Median microseconds of dist.all_reduce (through the ProcessGroup) and gs.all_reduce (direct)."""
    import torch.distributed as dist

    import gradsync as gs

    rows = {}
    for size in API_SIZES:
        fresh = torch.ones(size // 4)
        tensor = fresh.clone()
        times = {"api_us": [], "direct_us": []}
        sides = [("api_us", dist.all_reduce), ("direct_us", gs.all_reduce)]
        for rep in range(reps + 2):  # both sides: the same two untimed warm-up calls, a fresh input each call
            for key, call in (sides if rep % 2 else sides[::-1]):  # which side goes first alternates
                tensor.copy_(fresh)
                dist.barrier()
                started = time.perf_counter()
                call(tensor)
                times[key].append((time.perf_counter() - started) * 1e6)
        rows[size] = {key: statistics.median(values[2:]) for key, values in times.items()}
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--reps", type=int, default=20)
    options = parser.parse_args()
    _worker(options.backend, options.model, options.batch, options.steps, options.reps)
