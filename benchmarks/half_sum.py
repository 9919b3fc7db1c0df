"""bfloat16 all-reduce: float32 accumulation (the default) beside the narrow running sum, in one run.

    PYTHONPATH=src python benchmarks/half_sum.py                       # error at N=2,4,8; time at N=2,4
    PYTHONPATH=src python benchmarks/half_sum.py --rounds 3 --reps 40 --ranks 2,4,8 --time-ranks 2,4

Both sides are gs.all_reduce(t, op="sum") of a bfloat16 tensor on one host (algorithm auto: the
shared-memory all-reduce, native core) in the same world: every rank switches between float32 (add in
float32, round once: comm/reduce_ops.py) and narrow (round after every add, as gloo and the code before
float32 accumulation did; GRADSYNC_HALF_SUM=narrow, set here between calls on every rank at once), call
by call, alternating which goes first, so both sides share the same pages, caches and minutes of this
shared machine.

error   every rank draws 64K standard normal values (its seed), rounded to bfloat16; the result's
        distance from the exact float64 sum of those inputs in units of bfloat16's last place at the
        exact value; the 99th percentile and the largest over the elements. One rounding is <= 0.5.
bytes   what the traffic meter counted on rank 0 for that call (payload sent; control bytes apart).
time    per size, ``reps`` calls of each side after ``warmup`` of each, each call between two barriers
        of the transport's own, each call's time the slowest rank's; the median per world, then the
        median over ``rounds`` worlds. The ratio is float32's time over narrow's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODES = ("float32", "narrow")
SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
ELEMENTS = 64 << 10


def ulps(result: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|result - exact| in units of bfloat16's spacing at ``exact`` (8 significand bits)."""
    _, exponent = torch.frexp(exact)
    spacing = torch.ldexp(torch.ones_like(exact), exponent - 8).clamp(min=2.0 ** -133)
    return (result.double() - exact).abs() / spacing


def rank_inputs(rank: int, numel: int) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(torch.bfloat16)


def use(mode: str) -> None:
    """Sum float16/bfloat16 as ``mode`` says from the next call on, on this rank (every rank switches at
    the same point between calls): the Python path's setting and the native core's."""
    from gradsync.comm import reduce_ops
    from gradsync.comm.transport.shm import native

    os.environ[reduce_ops.HALF_SUM_ENV] = mode
    reduce_ops.forget_half_sum()
    core, _ = native.load()
    if core is not None:
        core.set_narrow_half_sums(mode == "narrow")


def measure(timed: bool, warmup: int, reps: int, sizes: tuple[int, ...] = SIZES) -> dict:
    """One world: the error case under each mode, then (``timed``) each size's call times, the modes
    interleaved call by call."""
    import gradsync as gs
    from gradsync.comm.world_transport import default_transport

    w = gs.world()
    out = {"result": {}, "bytes_sent": {}, "times": {}}
    for mode in MODES:
        use(mode)
        t = rank_inputs(w.rank, ELEMENTS)
        gs.traffic_reset()
        gs.all_reduce(t, op="sum")
        out["result"][mode] = t.view(torch.int16).tolist() if w.rank == 0 else None
        out["bytes_sent"][mode] = gs.traffic()["bytes_sent"]
    if not timed:
        return out
    transport = default_transport()
    for nbytes in sizes:
        source = torch.randn(nbytes // 2).to(torch.bfloat16)
        tensor = source.clone()
        elapsed = {mode: [] for mode in MODES}
        for call in range(warmup + reps):
            for mode in (MODES if call % 2 == 0 else MODES[::-1]):
                use(mode)
                tensor.copy_(source)   # the same input every call (not timed)
                transport.barrier("bench/half_sum", True)
                started = time.perf_counter()
                gs.all_reduce(tensor, op="sum")
                if call >= warmup:
                    elapsed[mode].append(time.perf_counter() - started)
                transport.barrier("bench/half_sum", True)
        for mode in MODES:
            slowest = torch.tensor(elapsed[mode], dtype=torch.float64)
            gs.all_reduce(slowest, op="max")
            out["times"].setdefault(mode, {})[nbytes] = statistics.median(slowest.tolist())
    use("float32")
    return out


def one_world(ranks: int, timed: bool, warmup: int, reps: int, sizes: str = "") -> dict:
    """Run ``measure`` in a world of ``ranks`` (a process of its own)."""
    with tempfile.TemporaryDirectory() as folder:
        answer = Path(folder) / "answer.json"
        command = [sys.executable, __file__, "--world", str(ranks), "--timed", str(int(timed)), "--warmup",
                   str(warmup), "--reps", str(reps), "--sizes", sizes, "--answer", str(answer)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
        if done.returncode != 0:
            raise RuntimeError(f"N={ranks} failed:\n{done.stderr[-3000:]}")
        return json.loads(answer.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8", help="world sizes of the error table")
    parser.add_argument("--time-ranks", default="2,4", help="world sizes of the time table")
    parser.add_argument("--rounds", type=int, default=3, help="worlds per N of the time table")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--sizes", default="", help="message sizes in bytes, e.g. 65536,16777216 (default: 64K to 16M)")
    parser.add_argument("--world", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--answer", default="", help=argparse.SUPPRESS)
    parser.add_argument("--timed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.world:   # inside one world's process
        import gradsync as gs

        sizes = tuple(int(size) for size in args.sizes.split(",")) if args.sizes else SIZES
        results = gs.spawn(measure, nprocs=args.world, args=(bool(args.timed), args.warmup, args.reps, sizes),
                           timeout=300)
        Path(args.answer).write_text(json.dumps(results[0]))
        return
    error_ranks = [int(n) for n in args.ranks.split(",")]
    time_ranks = [int(n) for n in args.time_ranks.split(",")]
    print(f"host: {os.cpu_count()} CPUs, torch {torch.__version__}; bfloat16 sum, algorithm auto (shared memory)")
    print("\nerror of the result against the exact sum, units of bfloat16's last place (64K elements)")
    print(f"{'N':>3} {'float32 p99':>12} {'max':>6} {'narrow p99':>11} {'max':>6} {'bytes sent (both)':>18}")
    for n in error_ranks:
        exact = sum(rank_inputs(r, ELEMENTS).double() for r in range(n))
        answer = one_world(n, False, 0, 0)
        row = {}
        for mode in MODES:
            error = ulps(torch.tensor(answer["result"][mode], dtype=torch.int16).view(torch.bfloat16), exact)
            row[mode] = (float(torch.quantile(error, 0.99)), float(error.max()), answer["bytes_sent"][mode])
        same = row["float32"][2] == row["narrow"][2]
        print(f"{n:>3} {row['float32'][0]:>12.2f} {row['float32'][1]:>6.1f} {row['narrow'][0]:>11.2f} "
              f"{row['narrow'][1]:>6.1f} {row['float32'][2]:>18,}{'' if same else ' != ' + str(row['narrow'][2])}")
    for n in time_ranks:
        per_round = {mode: {} for mode in MODES}
        for _ in range(args.rounds):
            answer = one_world(n, True, args.warmup, args.reps, args.sizes)
            for mode in MODES:
                for size, seconds in answer["times"][mode].items():
                    per_round[mode].setdefault(int(size), []).append(seconds)
        print(f"\nN={n}: bfloat16 all-reduce time, us (median over {args.rounds} worlds of the median of "
              f"{args.reps} calls a side, interleaved)")
        print(f"{'size':>8} {'float32':>9} {'narrow':>9} {'ratio':>6}   each world's ratio")
        for size in sorted(per_round["float32"]):
            wide, narrow = (statistics.median(per_round[mode][size]) for mode in MODES)
            ratios = " ".join(f"{a / b:.2f}" for a, b in zip(per_round["float32"][size], per_round["narrow"][size]))
            print(f"{size >> 10:>7}K {wide * 1e6:>9.0f} {narrow * 1e6:>9.0f} {wide / narrow:>6.2f}   {ratios}")


if __name__ == "__main__":
    main()
