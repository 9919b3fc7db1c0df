"""gradsync bench ddp --backend gloo,gradsync: torch's own DDP on each torch.distributed backend.

The program is the same for every backend: init_process_group(backend), torch's
DistributedDataParallel around the benchmark model, timed full steps (bench/ddp.py's timed_step:
barrier, forward, backward with the bucket all-reduces, optimizer step; the slowest rank's time).
In the same run, interleaved step by step in a rotating order, the bare model's step on every rank
at once (no communication: the floor), torch's DDP with a comm hook that returns each bucket as it is
(no-op hook: everything DDP does itself, the bucket copies, its autograd hooks and futures, and no
communication: the least any backend can reach), torch's DDP with gradient_as_bucket_view=True (the
gradients are views of the buckets: DDP copies each gradient into its bucket once instead of in and
out), and with ``compiled`` torch DDP and the floor again under torch.compile
(compile(DDP(model)), the order torch's docs use, so DDPOptimizer splits the graph at the buckets;
inductor). Each backend runs in its own torchrun, alternately, ``rounds`` times, so machine noise
hits them alike; a row's step time is the median over every round's median.

    ratio     = step time on this backend / the same row's step time on the first backend (gloo)
    vs floor  = step time / the floor's in the same runs (compiled rows: the compiled floor's)
    comm (ms) = torch DDP's step time - the no-op hook's in the same runs: what the backend's
                communication adds to DDP's own work (the torch DDP row alone: the others'
                DDP work differs from the no-op hook's)

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


TORCH_DDP, FLOOR = "torch DDP", "no communication"
NO_OP_HOOK, BUCKET_VIEW = "torch DDP, no-op hook", "torch DDP, bucket views"
COMPILED = " (compiled)"


def _no_op_hook(state, bucket):
    """A comm hook that communicates nothing: the bucket comes back as it went in."""
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def run(workers: int, model: str, batch: int, steps: int, backends: list[str], rounds: int = 3,
        reps: int = 20, compiled: bool = False) -> tuple[list[dict], list[dict]]:
    """Step rows (one per backend and program) and API rows (one per size), from ``rounds``
    alternating runs."""
    step_medians: dict[tuple[str, str], list[float]] = {}
    api: dict[int, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for backend in backends:
            result = _torchrun(workers, ["--backend", backend, "--model", model, "--batch", str(batch),
                                         "--steps", str(steps), "--reps", str(reps)]
                               + (["--compile"] if compiled else []))
            for label, step_ms in result["step_ms"].items():
                step_medians.setdefault((backend, label), []).append(step_ms)
            for size, times in result.get("api", {}).items():
                for key, value in times.items():
                    api.setdefault(int(size), {}).setdefault(key, []).append(value)
    step_rows = []
    for (backend, label), times in step_medians.items():
        median = statistics.median(times)
        floor = statistics.median(step_medians[(backend, FLOOR + (COMPILED if label.endswith(COMPILED) else ""))])
        no_op = statistics.median(step_medians[(backend, NO_OP_HOOK)])
        step_rows.append({"backend": backend, "program": label, "workers": workers, "model": model,
                          "step_ms": median, "runs_ms": times,
                          "ratio": median / statistics.median(step_medians[(backends[0], label)]),
                          "vs_floor": median / floor,
                          "comm_ms": median - no_op if label == TORCH_DDP else None})
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


def _worker(backend: str, model_name: str, batch: int, steps: int, reps: int, compiled: bool) -> None:
    import torch.distributed as dist
    from torch import nn

    from gradsync.bench.ddp import model_and_batch, timed_step

    torch.set_num_threads(1)
    dist.init_process_group(backend)
    runners = {}
    for label in (TORCH_DDP, FLOOR, NO_OP_HOOK, BUCKET_VIEW) + ((TORCH_DDP + COMPILED, FLOOR + COMPILED) if compiled
                                                                else ()):
        torch.manual_seed(0)
        model, x, y = model_and_batch(model_name, batch)
        wrapped = (model if label.startswith(FLOOR) else
                   nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=label == BUCKET_VIEW))
        if label == NO_OP_HOOK:
            wrapped.register_comm_hook(None, _no_op_hook)
        if label.endswith(COMPILED):
            wrapped = torch.compile(wrapped)
        runners[label] = (wrapped, torch.optim.SGD(model.parameters(), lr=0.01), x, y)
    for wrapped, optimizer, x, y in runners.values():
        for _ in range(3):  # warm-up: buffers, buckets, connections, compilation
            timed_step(wrapped, optimizer, x, y)
    times: dict[str, list[float]] = {label: [] for label in runners}
    labels = list(runners)
    for index in range(steps):  # interleaved, in an order that rotates every step (bench/ddp.py)
        turn = index % len(labels)
        for label in labels[turn:] + labels[:turn]:
            times[label].append(timed_step(*runners[label]))
    result = {"step_ms": {label: statistics.median(values) * 1e3 for label, values in times.items()}}
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
    parser.add_argument("--compile", action="store_true")
    options = parser.parse_args()
    _worker(options.backend, options.model, options.batch, options.steps, options.reps, options.compile)
