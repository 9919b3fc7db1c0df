"""One rank of a world the environment describes (Slurm's srun variables, torchrun's, Kubernetes'
PyTorchJob's): gs.init() with no arguments, one all-reduce, and a line `RESULT {json}` saying what the
world is (also in ENV_WORLD_RESULTS/{task|torchrun}.{rank}.json where that directory is given). The
tests start it under srun, in network namespaces and as plain processes."""

import time

STARTED = time.monotonic()

import json  # noqa: E402 - the clock starts before the imports
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

import gradsync as gs  # noqa: E402

if __name__ == "__main__":
    torch.set_num_threads(1)
    w = gs.init(timeout=float(os.environ.get("ENV_WORLD_TIMEOUT", "30")))
    total = torch.tensor([float(w.rank + 1)], dtype=torch.float64)
    gs.all_reduce(total)
    result = json.dumps({
        "rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank,
        "local_world_size": w.local_world_size, "master_addr": w.master_addr, "master_port": w.master_port,
        "hosts": [list(h) for h in w.hosts], "sum": float(total), "node": os.environ.get("SLURMD_NODENAME"),
        "slurm_procid": os.environ.get("SLURM_PROCID"), "slurm_localid": os.environ.get("SLURM_LOCALID"),
        "under_torchrun": "TORCHELASTIC_RUN_ID" in os.environ, "seconds": time.monotonic() - STARTED,
    })
    print("RESULT " + result, flush=True)
    if os.environ.get("ENV_WORLD_RESULTS"):   # a file per rank: srun may interleave the tasks' output lines
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "task"
        (Path(os.environ["ENV_WORLD_RESULTS"]) / f"{launcher}.{w.rank}.json").write_text(result)
    gs.shutdown()
    sys.exit(0)
