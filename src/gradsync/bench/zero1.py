"""gradsync bench zero1: ZeRO-1 (ShardedOptimizer) beside gradsync DDP + the full optimizer, same run.

Each rank builds the model (charlm, or the DDP bench's 10.5M-parameter mlp) twice (same seed): one
trained by DDP + AdamW, one by a plain local backward + ShardedOptimizer(AdamW). Steps alternate
between the two so machine noise hits both alike; a step's time is the slowest rank's, preceded by
a barrier; the table shows medians. Gradients are zeroed in place (zero_grad(set_to_none=False)), as
gradsync train and the DDP bench do.

    state bytes  optimizer state tensors held by one rank (AdamW: m and v, 8 bytes per parameter
                 unsharded; ZeRO-1 holds 1/N of them)
    ratio        zero1 / ddp
"""

from __future__ import annotations

import statistics

import torch

import gradsync as gs
from gradsync.bench.ddp import model_and_batch, timed_step


def _state_bytes(optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def _bench_rank(batch: int, steps: int, warmup: int, model: str = "charlm") -> list[dict]:
    torch.set_num_threads(1)
    w = gs.world()
    torch.manual_seed(0)
    ddp_model, x, y = model_and_batch(model, batch)
    ddp = gs.DistributedDataParallel(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    zero_model, _, _ = model_and_batch(model, batch)
    zero_opt = gs.ShardedOptimizer(zero_model.parameters(), torch.optim.AdamW, lr=1e-3)
    runners = {"ddp + AdamW": (ddp, ddp_opt), "zero1 AdamW": (zero_model, zero_opt)}

    def step(label: str) -> float:
        model, opt = runners[label]
        return timed_step(model, opt, x, y, set_to_none=False)   # as gradsync train: grads stay in place

    for _ in range(warmup):
        for label in runners:
            step(label)
    times = {label: [] for label in runners}
    sent = {}
    for _ in range(steps):
        for label in runners:
            gs.traffic_reset()
            times[label].append(step(label))
            sent[label] = gs.traffic()["bytes_sent"]
    params = sum(p.numel() for p in zero_model.parameters())
    return [{"impl": label, "workers": w.world_size, "params": params, "step_s": statistics.median(times[label]),
             "state_bytes": _state_bytes(ddp_opt if label.startswith("ddp") else zero_opt.optimizer),
             "bytes_sent_per_step": sent[label]} for label in runners]


def run(workers: list[int], batch: int = 16, steps: int = 10, warmup: int = 2, model: str = "charlm") -> list[dict]:
    rows = []
    for n in workers:
        if n < 2:
            raise ValueError(f"--workers: each N must be >= 2, got {workers}")
        pair = gs.spawn(_bench_rank, nprocs=n, args=(batch, steps, warmup, model))[0]
        for r in pair:
            r["time_ratio"] = r["step_s"] / pair[0]["step_s"]
            r["state_ratio"] = r["state_bytes"] / pair[0]["state_bytes"]
        rows += pair
    return rows
