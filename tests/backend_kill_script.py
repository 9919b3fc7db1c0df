"""torch's DDP on the "gradsync" backend while one rank is SIGKILLed mid-training (test_backend.py).

The last rank kills itself at step 3, after writing the time; every other rank records when its
training loop raised and what it said, and prints ``RESULT {json}``.
"""

import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

torch.set_num_threads(1)
dist.init_process_group(os.environ.get("KILL_TEST_BACKEND", "gradsync"), timeout=timedelta(seconds=float(os.environ["KILL_TEST_TIMEOUT"])))
rank, n = dist.get_rank(), dist.get_world_size()
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
error, raised_at = None, None
try:
    for step in range(1000):
        if rank == n - 1 and step == 3:
            with open(os.environ["KILL_TEST_STAMP"], "w") as stamp:
                stamp.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        model(torch.randn(16, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
except Exception as exc:  # what torch's DDP hands the program is what the test checks
    raised_at, error = time.time(), f"{type(exc).__name__}: {exc}"
os.write(sys.stdout.fileno(), ("RESULT " + json.dumps({"rank": rank, "error": error, "raised_at": raised_at}) + "\n").encode())
os._exit(0)  # the group cannot be torn down cleanly with a member gone
