"""gradsync bench ps --model word2vec: sparse parameter server beside dense ring all-reduce and torch's
sparse DDP, on skip-gram word2vec over the stdlib's tokens (train/word2vec.py, train/tokens.py).

Vocabulary
    V x D   each of the two tables (in, out): V = the vocabulary (capped at 50,000), D = 128, float32
    W       workers that train;  S  parameter servers (W + S processes);  b  samples per worker per step
    k_w     unique rows worker w's batch touches (about b * (2 + K) at most, K = 5 negatives)

Implementations, each on the same samples (global batch s = W*b samples, worker w takes the w-th
piece), the same Adagrad (lr 0.2), the same initial tables:
    sparse PS  S=1,2  sync | async    pull(rows=the batch's rows) -> backward -> push(touched rows)
    ring DDP (dense)                  gradsync DDP, algorithm="ring": every row of both tables, every step
    torch DDP (sparse, gloo)          torch's DistributedDataParallel over sparse gradients: gloo's sparse
                                      all-reduce (an all-gather of every rank's indices and values)

Bytes per step on the busiest link (one rank's bytes sent + received; TrafficMeter):
    sparse PS   a server's link carries, per step, sum_w (8 + D*4) * k_w,s in and D*4 * k_w,s out
                (k_w,s: the rows of worker w's batch that server s holds) plus 8 per requested id
    ring        2 * 2(W-1)/W * 2*V*D*4 per rank
    torch DDP   not metered (gloo's own sockets): the all-gather form, 2 * sum_{r != me} (8 + D*4) * k_r,
                i.e. every other rank's rows reach this rank and are forwarded once
Step time: the slowest worker's wall time over ``steps`` steps, from a common barrier, / steps.
Held-out loss: mean negative-sampling loss on the first 20,000 held-out samples after the run, on
the parameters the workers end with (sync: all equal; async: the first worker after a full pull).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

import gradsync as gs
from gradsync.train import tokens
from gradsync.train.word2vec import SkipGram, negative_sampling_loss

DIM = 128
LR = 0.2
BENCH_TOKENS = 4_000_000
"""Enough of the stdlib that the vocabulary reaches the 50,000-token cap."""
HELD_OUT_SAMPLES = 20_000
PS_CONFIGS = (("sparse PS S=1 sync", 1, "sync"), ("sparse PS S=1 async", 1, "async"),
              ("sparse PS S=2 sync", 2, "sync"), ("sparse PS S=2 async", 2, "async"))


def _data(seed: int = 0):
    train, held_out = tokens.stdlib_tokens(seed=seed, max_tokens=BENCH_TOKENS)
    return train.tensors[0], held_out.tensors[0][:HELD_OUT_SAMPLES], len(tokens.vocabulary(BENCH_TOKENS))


def _batches(samples: torch.Tensor, workers: int, batch: int, steps: int) -> list[list[torch.Tensor]]:
    """[worker][step]: each worker's piece of each global batch (the same for every implementation);
    built once in the parent and handed to the ranks, which never load the corpus."""
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(1))[:steps * workers * batch]
    steps_of = [samples[order[s * workers * batch:(s + 1) * workers * batch]].chunk(workers) for s in range(steps)]
    return [[pieces[index].clone() for pieces in steps_of] for index in range(workers)]


def _quiet() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")


def _model(vocab: int) -> SkipGram:
    torch.manual_seed(0)
    return SkipGram(vocab, DIM)


@torch.no_grad()
def _held_out_loss(model: SkipGram, held_out: torch.Tensor) -> float:
    return float(negative_sampling_loss(model(held_out)))


def _common_start() -> None:
    gs.all_reduce(torch.zeros(1), algorithm="native")


def _slowest(seconds: float) -> float:
    return float(gs.all_gather(torch.tensor([seconds], dtype=torch.float64)).max())


def _link_bytes(traffic: dict) -> float:
    return traffic["bytes_sent"] + traffic["bytes_received"]


def _ps_rank(label: str, servers: int, mode: str, data: tuple) -> dict:
    _quiet()
    w = gs.world()
    workers = w.world_size - servers
    by_worker, held_out, vocab = data
    steps = len(by_worker[0])
    model = _model(vocab)
    model.make_sparse()
    ps = gs.ParameterServer(model, lambda p: torch.optim.Adagrad(p, lr=LR), num_servers=servers, mode=mode)
    batches = by_worker[max(w.rank - servers, 0)]
    _common_start()
    gs.traffic_reset()
    started = time.perf_counter()
    wall, traffic, loss = 0.0, None, -1.0
    if ps.is_server:
        ps.serve()
    else:
        for x in batches:
            ps.pull(rows=model.rows_needed(x))
            negative_sampling_loss(model(x)).backward()
            ps.push()
        wall = time.perf_counter() - started
        traffic = gs.traffic()          # before the final whole-table pull, which is not a training step
        ps.pull()
        ps.close()
        loss = _held_out_loss(model, held_out)
    wall = _slowest(wall)
    # the link of server s carries what every worker sent to and received from s
    per_server = torch.zeros(w.world_size, dtype=torch.float64)
    if traffic is not None:
        per_server[w.rank] = _link_bytes(traffic)
        for peer, c in traffic["per_peer"].items():
            if int(peer) < servers:
                per_server[int(peer)] += c["sent"] + c["received"]
    gs.all_reduce(per_server, op="sum")
    losses = gs.all_gather(torch.tensor([loss], dtype=torch.float64))
    stats = ps.stats()
    return {"impl": label, "workers": workers, "servers": servers, "step_ms": wall / steps * 1e3,
            "busiest_link_bytes": float(per_server.max()) / steps, "held_out_loss": float(losses[servers]),
            "staleness_max": max(stats.get("staleness_histogram", {}) or {0: 0}), "metered": True,
            "table_rows": vocab, "dim": DIM}


def _ring_rank(data: tuple) -> dict:
    _quiet()
    w = gs.world()
    by_worker, held_out, vocab = data
    batches, steps = by_worker[w.rank], len(by_worker[0])
    model = _model(vocab)
    ddp = gs.DistributedDataParallel(model, algorithm="ring")
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    _common_start()
    gs.traffic_reset()
    started = time.perf_counter()
    for x in batches:
        optimizer.zero_grad()
        negative_sampling_loss(ddp(x)).backward()
        optimizer.step()
    # the gradient all-reduces' bytes (per_op), taken before the gathers below: the second step's
    # one-off broadcast of the ready order, when DDP rebuilds its buckets, is not a step's traffic
    traffic = gs.traffic()
    elapsed = time.perf_counter() - started
    link = sum(c["sent"] + c["received"] for op, c in traffic["per_op"].items() if op.startswith("all_reduce"))
    wall = _slowest(elapsed)
    link = float(gs.all_gather(torch.tensor([link], dtype=torch.float64)).max())
    return {"impl": "ring DDP (dense)", "workers": w.world_size, "servers": 0, "step_ms": wall / steps * 1e3,
            "busiest_link_bytes": link / steps, "held_out_loss": _held_out_loss(model, held_out),
            "staleness_max": 0, "metered": True, "table_rows": vocab, "dim": DIM}


def _torch_sparse_rank(data: tuple) -> dict:
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    _quiet()
    w = gs.world()
    by_worker, held_out, vocab = data
    batches, steps = by_worker[w.rank], len(by_worker[0])
    model = _model(vocab)
    model.make_sparse()
    ddp = TorchDDP(model)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=LR)
    row_bytes = 8 + DIM * 4
    rows = torch.tensor([float(sum(torch.unique(x[:, 0]).numel() + torch.unique(x[:, 1:]).numel() for x in batches))],
                        dtype=torch.float64)
    _common_start()
    started = time.perf_counter()
    for x in batches:
        optimizer.zero_grad()
        negative_sampling_loss(ddp(x)).backward()
        optimizer.step()
    wall = _slowest(time.perf_counter() - started)
    per_rank_rows = gs.all_gather(rows)
    link = max(2 * float(per_rank_rows.sum() - per_rank_rows[r]) * row_bytes for r in range(w.world_size))
    return {"impl": "torch DDP (sparse, gloo)", "workers": w.world_size, "servers": 0, "step_ms": wall / steps * 1e3,
            "busiest_link_bytes": link / steps, "held_out_loss": _held_out_loss(model, held_out),
            "staleness_max": 0, "metered": False, "table_rows": vocab, "dim": DIM}


def run(workers: list[int], batch: int = 256, steps: int = 30, rounds: int = 3) -> list[dict]:
    """One row per (W, implementation): the median of ``rounds`` runs of each (see module docstring)."""
    if any(w < 1 for w in workers):
        raise ValueError(f"--workers: each W must be >= 1, got {workers}")
    samples, held_out, vocab = _data()
    rows = []
    for w in workers:
        data = (_batches(samples, w, batch, steps), held_out, vocab)
        runs: dict[str, list[dict]] = {}
        for _ in range(rounds):
            for label, servers, mode in PS_CONFIGS:
                runs.setdefault(label, []).append(gs.spawn(_ps_rank, nprocs=w + servers,
                                                           args=(label, servers, mode, data))[0])
            runs.setdefault("ring", []).append(gs.spawn(_ring_rank, nprocs=w, args=(data,))[0])
            runs.setdefault("torch", []).append(gs.spawn(_torch_sparse_rank, nprocs=w, args=(data,))[0])
        for results in runs.values():
            row = dict(results[0])
            for key in ("step_ms", "busiest_link_bytes", "held_out_loss"):
                row[key] = statistics.median(r[key] for r in results)
                row[f"{key}_runs"] = [r[key] for r in results]
            rows.append(row)
    return rows

