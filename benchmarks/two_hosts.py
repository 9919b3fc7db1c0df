"""Hierarchical vs flat all-reduce across two "hosts" (network namespaces), 2 ranks each.

Run by two_hosts.sh (one torchrun per namespace). Prints, from rank 0, the median time of each
algorithm per size, interleaved call by call, each call after a barrier, the slowest rank's time.
"""

import statistics
import time

import torch
import torch.distributed as dist

import gradsync as gs

torch.set_num_threads(1)
w = gs.init(timeout=60)
ALGORITHMS = ("native", "ring", "hierarchical")
rows = []
for size in (64 << 10, 1 << 20, 4 << 20, 16 << 20):
    x = torch.ones(size // 4)
    times = {a: [] for a in ALGORITHMS}
    for rep in range(8):
        for algorithm in ALGORITHMS:
            dist.barrier()
            started = time.perf_counter()
            gs.all_reduce(x, algorithm=algorithm)
            elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if rep >= 2:
                times[algorithm].append(float(elapsed))
    rows.append((size, {a: statistics.median(t) for a, t in times.items()}))
if w.rank == 0:
    print(f"hosts {w.hosts}")
    print("| size | native (gloo) | ring | hierarchical | hierarchical/native | hierarchical/ring |")
    print("|---|---|---|---|---|---|")
    for size, t in rows:
        print(f"| {size >> 10} KiB | {t['native'] * 1e3:.2f} ms | {t['ring'] * 1e3:.2f} ms | "
              f"{t['hierarchical'] * 1e3:.2f} ms | {t['native'] / t['hierarchical']:.2f}x | "
              f"{t['ring'] / t['hierarchical']:.2f}x |")
gs.shutdown()
