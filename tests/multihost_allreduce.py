"""Run by tests/test_multihost.py under torchrun on each of two namespaces ("hosts"), 2 ranks each:
hierarchical all-reduce against its closed form, and where its bytes went. Prints one JSON line."""

import json
import os

import torch

import gradsync as gs
from gradsync.comm.world_transport import default_transport

w = gs.init(timeout=60)
n = 1 << 20  # 8 MiB of float64: exact sums
expected = torch.arange(n, dtype=torch.float64) * (w.world_size * (w.world_size + 1) // 2)
results = {}
for algorithm in ("hierarchical", "auto", "ring"):
    x = torch.arange(n, dtype=torch.float64) * (w.rank + 1)
    gs.traffic_reset()
    gs.all_reduce(x, algorithm=algorithm)
    per_peer = gs.traffic()["per_peer"]
    results[algorithm] = {
        "exact": bool(torch.equal(x, expected)),
        "off_host_sent": sum(c["sent"] for p, c in per_peer.items() if p not in w.host_ranks),
        "on_host_sent": sum(c["sent"] for p, c in per_peer.items() if p in w.host_ranks),
    }
line = "RESULT " + json.dumps({"rank": w.rank, "hosts": w.hosts, "transport": type(default_transport()).__name__,
                              "results": results}) + "\n"
os.write(1, line.encode())  # one write: the node's ranks share the pipe, and a print() may be split

gs.shutdown()
