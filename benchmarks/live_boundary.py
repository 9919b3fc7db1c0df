"""The cost of LiveDDP's step boundary: the one-element int64 all-reduce that carries rank 0's answer to
"is a joiner admitted now?" (live/growth.py Door.decide; rank 0's store lookup at most every 0.2 s).

    PYTHONPATH=src python benchmarks/live_boundary.py [ranks] [steps]

Each rank times the boundary alone and a whole run_step (which includes it) of a tiny model
(5 -> 4 -> 1, float64, 2 samples per rank) and prints the medians, so the boundary's share of a step
is read beside the step it is added to.
"""

import statistics
import sys
import time

import torch

import gradsync as gs
from gradsync.live import LiveDDP


def rank(steps: int) -> dict:
    torch.set_num_threads(1)
    module = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    live = LiveDDP(module, torch.optim.SGD(module.parameters(), lr=0.01, momentum=0.9), bucket_cap_mb=1)
    x = torch.randn(2, 5, dtype=torch.float64)
    boundary, step = [], []
    for _ in range(steps):
        started = time.perf_counter()
        live.door.decide(live.world.rank)
        boundary.append(time.perf_counter() - started)
        started = time.perf_counter()
        live.run_step(lambda ddp: (ddp(x).sum().backward(), {})[1])
        step.append(time.perf_counter() - started)
    live.close()
    return {"rank": gs.world().rank, "boundary_us": statistics.median(boundary) * 1e6,
            "run_step_us": statistics.median(step) * 1e6}


if __name__ == "__main__":
    ranks = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    for r in gs.spawn(rank, nprocs=ranks, args=(steps,), fault_tolerance="live"):
        print(f"rank {r['rank']}: boundary {r['boundary_us']:.0f} us, run_step (boundary included) "
              f"{r['run_step_us']:.0f} us, median of {steps}")
