"""The step-time sweep behind `gradsync cluster` (its flags and tables: cli/cluster.py): every
strategy x W x link rate asked for, each job on a fresh emulated cluster, one row each.

Each job gets job.hosts hosts (jobs.py): PS strategies put S servers and W workers on S+W hosts,
ring W hosts, hierarchical W/L hosts of L = max(2, --ranks-per-host) ranks. ps-sync runs once per S
in --servers; ps-async and ssp with the first S. A row's step time is the median of --reps reps of
--steps steps (worker.py); its bytes are per step on the busiest link (results.py); "predicted" is
sim/cost.py for the same M, W, S, link rate, the job's fitted alpha and measured compute.
"""

from __future__ import annotations

import contextlib
import signal
import sys

from gradsync.cluster import netns
from gradsync.cluster.jobs import Job, run_job
from gradsync.cluster.results import summarize
from gradsync.cluster.worker import PS_MODES


def plan(args) -> list[tuple[str, Job]]:
    """(link rate, job) for every combination asked for; impossible layouts are skipped with a note."""
    jobs = []
    for rate in args.link:
        for strategy in args.strategy:
            servers = args.servers if strategy == "ps-sync" else args.servers[:1]
            for w in args.workers:
                for s in servers if strategy in PS_MODES else [1]:
                    per_host = max(2, args.ranks_per_host) if strategy == "hierarchical" else args.ranks_per_host
                    try:
                        jobs.append((rate, Job(strategy, w, args.params, servers=s, ranks_per_host=per_host,
                                               steps=args.steps, reps=args.reps, sync_every=args.sync_every,
                                               powersgd_rank=args.powersgd_rank)))
                    except ValueError as exc:
                        print(f"skipped: {exc}", file=sys.stderr)
    return jobs


@contextlib.contextmanager
def signals_interrupt():
    """SIGTERM and SIGHUP raise KeyboardInterrupt (as Ctrl-C does), so every finally block runs."""
    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")
    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run(args) -> tuple[list[dict], list[str]]:
    """Every planned job on a fresh cluster; rows and failures (each failure names its job)."""
    rows, failures = [], []
    jobs = plan(args)
    with signals_interrupt():
        for index, (rate, job) in enumerate(jobs, 1):
            label = (f"{job.strategy}{f' S={job.servers}' if job.is_ps else ''} W={job.workers} at {rate} "
                     f"({job.hosts} hosts x {job.ranks_per_host} ranks)")
            print(f"[{index}/{len(jobs)}] {label}", file=sys.stderr, flush=True)
            try:
                with netns.EmulatedCluster(job.hosts, rate) as cluster:
                    rows.append(summarize(run_job(cluster, job, args.timeout), rate))
            except RuntimeError as exc:
                failures.append(f"{label}: {exc}")
                print(f"  failed: {exc}", file=sys.stderr, flush=True)
    return rows, failures
