"""gradsync simulate --calibrated --check: the cost model's predictions beside measurements on this machine.

For each N the ring all-reduce is measured (bench/collectives.py, median of ``reps`` calls) and
predicted by sim/cost.py with the calibrated link (``gradsync bench collectives --fit``, measured
with two ranks). The DDP step of the benchmark MLP (bench/ddp.py, 25 MiB buckets) is predicted from
its compute time, measured here in one process.

CPU sharing (this machine only, not part of the cluster model): over loopback every byte moved is a
CPU copy, so with N ranks on C cores each rank computes *and* copies at min(1, C/N) of full speed.
Compute time, beta and gamma are therefore scaled by f = max(1, N/C); alpha is not.
error = predicted / measured - 1.

Transport: every measurement of one check runs over one transport, GRADSYNC_TRANSPORT's choice (or
``transport``), and every row names it; a calibration fitted over another transport is refused
(its alpha and beta describe another link).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from gradsync.bench import collectives, ddp
from gradsync.sim.cost import Link, allreduce_time, ddp_step_time


def _compute_seconds(batch: int, reps: int = 5) -> float:
    """Forward + backward + SGD step of the benchmark MLP, one thread, no communication."""
    torch.set_num_threads(1)
    model, x, y = ddp.model_and_batch("mlp", batch)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(reps + 1):
        started = time.perf_counter()
        opt.zero_grad()
        ddp.step_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def shared_link(link: Link, ranks: int, cores: int) -> Link:
    """The link as N ranks see it when they share C cores (see module docstring)."""
    f = max(1.0, ranks / cores)
    return Link(alpha=link.alpha, beta=link.beta * f, gamma=link.gamma * f)


def run(link: Link, workers: list[int], sizes: list[int], reps: int = 5, batch: int = 64,
        transport: str | None = None, calibrated_over: str | None = None) -> dict:
    """Measured and predicted rows for every N in ``workers``, all over one transport (``transport``;
    None: GRADSYNC_TRANSPORT's choice). ``calibrated_over``: the transport ``link`` was fitted on
    (the calibration file's "transport"), refused if it is not the one measured here."""
    transport = collectives.resolve_transport(transport)
    if calibrated_over and transport != "auto" and transport != calibrated_over:
        raise ValueError(_mismatch(calibrated_over, transport))
    rows = []
    cores = os.cpu_count() or 1
    with collectives.pinned_transport(transport):   # the DDP runs below choose their transport from it too
        for n in workers:
            for r in collectives.run(n, sizes, ["ring"], reps=reps, transport=transport)["rows"]:
                if r["algorithm"] != "ring":
                    continue
                predicted = allreduce_time("ring", r["size"], n, shared_link(link, n, cores))
                rows.append({"what": "ring all-reduce", "workers": n, "size": r["size"], "measured_s": r["time_s"],
                             "predicted_s": predicted, "error": predicted / r["time_s"] - 1,
                             "transport": r["transport"]})
        compute_1 = _compute_seconds(batch)
        model, _, _ = ddp.model_and_batch("mlp", batch)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        for n in workers:
            ours = next(r for r in ddp.run(n, "mlp", batch, [25.0], steps=5) if r["impl"].startswith("gradsync"))
            compute_n = compute_1 * max(1.0, n / cores)
            predicted, _ = ddp_step_time(nbytes, n, shared_link(link, n, cores), compute_n, 25 * 2**20)
            rows.append({"what": "DDP step (mlp, 25 MiB)", "workers": n, "size": nbytes, "measured_s": ours["step_s"],
                         "predicted_s": predicted, "error": predicted / ours["step_s"] - 1, "compute_s": compute_n,
                         "transport": ours["transport"]})
    measured_over = {r["transport"] for r in rows}
    if len(measured_over) > 1:
        raise RuntimeError(f"one check measured over several transports {sorted(measured_over)}; "
                           f"set GRADSYNC_TRANSPORT=tcp or shm")
    if calibrated_over and measured_over and measured_over != {calibrated_over}:
        raise ValueError(_mismatch(calibrated_over, measured_over.pop()))
    return {"rows": rows, "link": {"alpha": link.alpha, "beta": link.beta, "gamma": link.gamma},
            "transport": next(iter(measured_over), None)}


def _mismatch(calibrated_over: str, measured_over: str) -> str:
    return (f"the calibration was fitted over {calibrated_over} but this check measures {measured_over}; "
            f"refit with GRADSYNC_TRANSPORT={measured_over} gradsync bench collectives --workers 2 --sizes 1M --fit, "
            f"or check with GRADSYNC_TRANSPORT={calibrated_over}")
