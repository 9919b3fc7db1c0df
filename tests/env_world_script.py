"""One rank of a world the environment describes (Slurm's srun variables, torchrun's, Kubernetes'
PyTorchJob's): gs.init() with no arguments, one all-reduce, and a line `RESULT {json}` saying what the
world is. The tests start it under srun, in network namespaces and as plain processes."""

import json
import os
import sys

import torch

import gradsync as gs

if __name__ == "__main__":
    torch.set_num_threads(1)
    w = gs.init(timeout=float(os.environ.get("ENV_WORLD_TIMEOUT", "30")))
    total = torch.tensor([float(w.rank + 1)], dtype=torch.float64)
    gs.all_reduce(total)
    print("RESULT " + json.dumps({
        "rank": w.rank, "world_size": w.world_size, "local_rank": w.local_rank,
        "local_world_size": w.local_world_size, "master_addr": w.master_addr, "master_port": w.master_port,
        "hosts": [list(h) for h in w.hosts], "sum": float(total), "node": os.environ.get("SLURMD_NODENAME"),
        "slurm_procid": os.environ.get("SLURM_PROCID"), "slurm_localid": os.environ.get("SLURM_LOCALID"),
    }), flush=True)
    gs.shutdown()
    sys.exit(0)
