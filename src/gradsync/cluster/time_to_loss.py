"""`gradsync cluster --time-to-loss`: how long each strategy takes to reach ring DDP's charlm loss, per W and link.

    gradsync cluster --time-to-loss --strategy ring,ps-sync,powersgd,diloco --workers 2,3,4,5,6 \
        --link 1gbit,200mbit --loss-steps 96 --json ttl.json --figure docs/figs/cluster_time_to_loss.png

For each link rate and W, on a fresh emulated cluster per job (as the step-time sweep):
    1. ring DDP trains charlm --loss-steps steps (loss_worker.py, no target): its test loss at the
       last step is L_ring, and target = L_ring * (1 + --loss-margin) (2% by default)
    2. every strategy (ring too, from the curve of step 1) is timed to the first evaluation whose
       loss is <= target, within --step-cap x --loss-steps steps; a job that does not get there
       says so (no time)
A row: the training seconds to the target (the clock of loss_worker.py: evaluations left out), the
steps it took, the seconds per step over the whole run, and the busiest link's bytes (kernel counters
of each host's veth, payload and headers) over the run and per step, beside the traffic meter's payload.
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

from gradsync.cluster import netns
from gradsync.cluster.jobs import Job, run_job


def summarize(result: dict, rate: str) -> dict:
    """One time-to-loss row from run_job's result (module docstring)."""
    job: Job = result["job"]
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    workers = [r for r in ranks if r["role"] != "server"]
    evaluator = workers[0]
    hosts = []
    for host in range(job.hosts):
        leader = next(r for r in ranks if r["rank"] // job.ranks_per_host == host and r["local_rank"] == 0)
        hosts.append({"host": host, "kernel_tx": leader["link"]["tx_bytes"], "kernel_rx": leader["link"]["rx_bytes"]})
    busiest = max(hosts, key=lambda h: h["kernel_tx"] + h["kernel_rx"])
    steps = evaluator["steps"]
    return {"mode": "time-to-loss", "link": rate, "strategy": job.strategy, "workers": job.workers,
            "servers": job.servers if job.is_ps else 0, "hosts": job.hosts, "params": evaluator["params"],
            "target": job.target, "max_steps": job.max_steps, "steps": steps, "curve": evaluator["curve"],
            "final_loss": evaluator["curve"][-1]["loss"] if evaluator["curve"] else None,
            "time_to_loss_s": evaluator["reached_s"], "reached_step": evaluator["reached_step"],
            "trained_s": evaluator["trained_s"], "step_s": evaluator["trained_s"] / max(1, steps),
            "busiest": {**busiest, "kernel_tx_per_step": busiest["kernel_tx"] / max(1, steps),
                        "kernel_rx_per_step": busiest["kernel_rx"] / max(1, steps)},
            "meter_sent_max": max(r["bytes_sent"] for r in ranks), "sync_every": job.sync_every,
            "powersgd_rank": job.powersgd_rank, "outer_lr": job.outer_lr, "outer_momentum": job.outer_momentum,
            "inner_lr": job.inner_lr}


def reached_at(curve: list[dict], target: float) -> tuple[float | None, int | None]:
    """(training seconds, step) at the first evaluation of ``curve`` whose loss is <= ``target``."""
    point = next((p for p in curve if p["loss"] <= target), None)
    return (point["trained_s"], point["step"]) if point else (None, None)


def _run_one(job: Job, rate: str, timeout: float) -> dict:
    with netns.EmulatedCluster(job.hosts, rate) as cluster:
        return summarize(run_job(cluster, job, timeout), rate)


def run(args) -> tuple[list[dict], list[str]]:
    """Every (link, W): the ring's reference run, then each other strategy to its target."""
    rows, failures = [], []
    common = {"params": 0.0, "sync_every": args.sync_every, "powersgd_rank": args.powersgd_rank,
              "outer_lr": args.outer_lr, "outer_momentum": args.outer_momentum, "inner_lr": args.inner_lr}
    cap = int(args.step_cap * args.loss_steps)
    for rate in args.link:
        for w in args.workers:
            label = f"ring W={w} at {rate}, {args.loss_steps} steps (the reference)"
            print(f"[time-to-loss] {label}", file=sys.stderr, flush=True)
            try:
                ring = _run_one(Job("ring", w, max_steps=args.loss_steps, **common), rate, args.timeout)
            except RuntimeError as exc:
                failures.append(f"{label}: {exc}")
                continue
            target = ring["final_loss"] * (1 + args.loss_margin)
            ring["target"] = target
            ring["time_to_loss_s"], ring["reached_step"] = reached_at(ring["curve"], target)
            rows.append(ring)
            for strategy in (s for s in args.strategy if s != "ring"):
                label = f"{strategy} W={w} at {rate}, to loss {target:.4f} within {cap} steps"
                print(f"[time-to-loss] {label}", file=sys.stderr, flush=True)
                try:
                    rows.append(_run_one(Job(strategy, w, max_steps=cap, target=target, **common), rate, args.timeout))
                except RuntimeError as exc:
                    failures.append(f"{label}: {exc}")
                    print(f"  failed: {exc}", file=sys.stderr, flush=True)
    return rows, failures


SHOWN = (("ring", "C3", "ring DDP"), ("ps-sync", "C0", "sync PS, 1 server"), ("powersgd", "C4", "PowerSGD"),
         ("diloco", "C5", "DiLoCo"))


def figure(rows: list[dict], png: Path) -> Path:
    """Per link rate: seconds per step and seconds to the target vs W, a line per strategy (+ CSV)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png.parent.mkdir(parents=True, exist_ok=True)
    rates = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(len(rates), 2, figsize=(11, 3.8 * len(rates)), squeeze=False)
    for (per_step, to_loss), rate in zip(axes, rates):
        for strategy, colour, name in SHOWN:
            chosen = sorted((r for r in rows if r["link"] == rate and r["strategy"] == strategy),
                            key=lambda r: r["workers"])
            if not chosen:
                continue
            w = [r["workers"] for r in chosen]
            per_step.plot(w, [r["step_s"] for r in chosen], "o-", color=colour, label=name)
            reached = [r for r in chosen if r["time_to_loss_s"] is not None]
            to_loss.plot([r["workers"] for r in reached], [r["time_to_loss_s"] for r in reached], "o-",
                         color=colour, label=name)
            missed = [r for r in chosen if r["time_to_loss_s"] is None]
            if missed:
                to_loss.plot([r["workers"] for r in missed], [r["trained_s"] for r in missed], "x", color=colour,
                             label=f"{name}: not reached (x: its whole run)")
        per_step.set(title=f"{rate} links: seconds per step (charlm)", xlabel="workers W", ylabel="s / step")
        to_loss.set(title=f"{rate} links: seconds to ring DDP's loss (+2%)", xlabel="workers W",
                    ylabel="training seconds")
        for ax in (per_step, to_loss):
            ax.set_xticks(sorted({r["workers"] for r in rows if r["link"] == rate}))
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Emulated cluster (gradsync cluster --time-to-loss): charlm, 1 host per rank", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    with open(png.with_suffix(".csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["link", "strategy", "workers", "target", "final_loss", "time_to_loss_s", "reached_step",
                      "steps", "step_s", "busiest_kernel_tx_per_step", "meter_sent_max"])
        for r in rows:
            out.writerow([r["link"], r["strategy"], r["workers"], f"{r['target']:.4f}", f"{r['final_loss']:.4f}",
                          "" if r["time_to_loss_s"] is None else f"{r['time_to_loss_s']:.2f}",
                          r["reached_step"] or "", r["steps"], f"{r['step_s']:.4f}",
                          f"{r['busiest']['kernel_tx_per_step']:.0f}", r["meter_sent_max"]])
    return png


def median_rows(rows: list[dict]) -> list[dict]:
    """Rows of several runs of the same (link, strategy, W) -> one row each, holding the medians of
    time to loss (only if every run reached it) and seconds per step, and each run's values."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["link"], r["strategy"], r["workers"]), []).append(r)
    merged = []
    for group in groups.values():
        times = [r["time_to_loss_s"] for r in group]
        merged.append({**group[0], "runs": len(group), "runs_time_to_loss_s": times,
                       "time_to_loss_s": statistics.median(times) if None not in times else None,
                       "step_s": statistics.median(r["step_s"] for r in group)})
    return merged
