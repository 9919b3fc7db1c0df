"""gradsync cluster: strategies x workers x link rates on emulated hosts, the cost model beside each.

Runbook (root; every namespace it makes is deleted again, also on Ctrl-C, SIGTERM and failure):

    gradsync cluster --strategy ring --workers 4 --link 1gbit                  # one job, 4 hosts
    gradsync cluster --strategy ps-sync,ps-async,ssp,ring,hierarchical --workers 2,3,4,5,6 \
        --servers 1,2 --link 1gbit,10gbit --params 4M --json sweep.json --figure docs/figs/cluster_step_time.png
    gradsync cluster --clean                                                   # leftovers of a SIGKILLed run
    gradsync cluster --time-to-loss --strategy ring,ps-sync,powersgd,diloco --workers 2,4 --link 200mbit
                                                 # seconds to ring DDP's charlm loss (cluster/time_to_loss.py)

Each job gets a fresh cluster of job.hosts hosts (jobs.py): PS strategies put S servers and W
workers on S+W hosts, ring W hosts, hierarchical W/L hosts of L = max(2, --ranks-per-host) ranks.
ps-sync runs once per S in --servers; ps-async and ssp with the first S. A row's step time is the
median of --reps reps of --steps steps (worker.py); its bytes are per step on the busiest link
(results.py); "predicted" is sim/cost.py for the same M, W, S, link rate, the job's fitted alpha and
measured compute.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys

from gradsync.cluster import netns
from gradsync.cluster.jobs import Job, run_job
from gradsync.cluster.results import PAIR_PRICED, summarize
from gradsync.cluster.worker import PS_MODES, STRATEGIES
from gradsync.train.config import TrainConfig


def _list(kind):
    def parse(text: str) -> list:
        items = [kind(part.strip()) for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
        return items
    return parse


def _count(text: str) -> float:
    scale = {"K": 1e3, "M": 1e6, "B": 1e9}
    raw = text.strip().upper()
    try:
        return float(raw[:-1]) * scale[raw[-1]] if raw[-1:] in scale else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; use e.g. 4M or 4e6") from None


def _strategies(text: str) -> list[str]:
    chosen = _list(str)(text)
    bad = [s for s in chosen if s not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(STRATEGIES)}")
    return chosen


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0")
    return value


def _rates(text: str) -> list[str]:
    rates = _list(str)(text)
    for rate in rates:
        try:
            netns.parse_rate(rate)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return rates


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--strategy", type=_strategies, default=["ps-sync", "ring"],
                        help=f"comma-separated subset of {', '.join(STRATEGIES)} (default ps-sync,ring)")
    parser.add_argument("--workers", type=_list(int), default=[2, 4], help="comma-separated W (default 2,4)")
    parser.add_argument("--servers", type=_list(int), default=[1], help="ps-sync: comma-separated S (default 1)")
    parser.add_argument("--link", type=_rates, default=["1gbit"],
                        help="comma-separated tc rates of every host's link, each way (default 1gbit)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks per emulated host (hierarchical: >= 2)")
    parser.add_argument("--params", type=_count, default=4e6, help="model parameters, e.g. 4M (default)")
    parser.add_argument("--steps", type=int, default=4, help="steps per timed rep")
    parser.add_argument("--reps", type=int, default=3, help="timed reps per job (median)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--figure", metavar="PNG", help="also draw measured and predicted step time vs W (+ CSV)")
    parser.add_argument("--from-json", metavar="PATH", action="append", default=[],
                        help="instead of running: the rows of earlier --json files (repeatable), predictions redone "
                             "with today's model; for tables and figures")
    parser.add_argument("--fit-host", metavar="PATH", action="append", default=[],
                        help="predict with the host term fitted from the sync-PS rows of these --json "
                             "files (repeatable; default: the value fitted on this machine under load, "
                             "cluster/results.py)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown (docs/benchmarks.md)")
    parser.add_argument("--clean", action="store_true",
                        help="only delete namespaces left by cluster runs (of any process) and exit")
    parser.add_argument("--sync-every", type=int, default=TrainConfig.sync_every, metavar="H",
                        help="diloco: H (default %(default)s)")
    parser.add_argument("--powersgd-rank", type=int, default=TrainConfig.powersgd_rank, metavar="R",
                        help="powersgd: r (default %(default)s)")
    slow = parser.add_argument_group("time to loss (charlm; cluster/time_to_loss.py)")
    slow.add_argument("--time-to-loss", action="store_true",
                      help="instead of step time: seconds to reach ring DDP's charlm loss, for ring, ps-sync, "
                           "powersgd, diloco")
    slow.add_argument("--loss-steps", type=int, default=96, help="steps of the ring's reference run (default 96)")
    slow.add_argument("--step-cap", type=_fraction, default=3.0,
                      help="the others stop after this many times --loss-steps (default 3)")
    slow.add_argument("--loss-margin", type=_fraction, default=0.02, help="target = ring's loss x (1 + this)")
    slow.add_argument("--outer-lr", type=_fraction, default=TrainConfig.outer_lr,
                      help="diloco's outer lr (default %(default)s, gradsync train's; the paper's: 0.7)")
    slow.add_argument("--outer-momentum", type=float, default=TrainConfig.outer_momentum,
                      help="diloco's outer Nesterov momentum in [0, 1); 0: plain SGD (default %(default)s)")
    slow.add_argument("--inner-lr", type=_fraction, default=None,
                      help="diloco's inner AdamW lr (default: 1e-3, every strategy's lr)")


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


def achieved_gbit(row: dict) -> float:
    """What the busiest link carried while the job ran, in Gbit/s: max(tx, rx) bytes per step over
    the step time. Near the link rate: the network sets the pace; far below it: something else does."""
    b = row["busiest"]
    return max(b["kernel_tx"], b["kernel_rx"]) * 8 / row["step_s"] / 1e9


def _update_ms(row: dict) -> str:
    """The servers' update per step (results.py), "-" for ring rows and runs saved without it."""
    return f"{row['update_s'] * 1e3:.1f}" if row.get("update_s") else "-"


def _duplex(row: dict) -> str:
    """The server link's duplex factor (results.py), "-" where none was measured."""
    return f"{row['duplex']:.2f}" if "duplex" in row and row["servers"] else "-"


def _measured_ns_per_byte(row: dict) -> str:
    """What the row's prediction measured per byte, in ns (results.py): a ring step's x, a PS
    server's fan in/out (sync), or its pair (async, ssp; the fan's both at once in rows saved
    without the pair); "-" where none was measured."""
    if row.get("exchange_s_per_byte"):
        return f"{row['exchange_s_per_byte'] * 1e9:.2f}"
    if row.get("pair_s_per_byte") and row["strategy"] in PAIR_PRICED:
        return f"{row['pair_s_per_byte'] * 1e9:.2f}"
    fan = row.get("fan_s_per_byte")
    if not fan:
        return "-"
    kinds = ("in", "out") if row["strategy"] == "ps-sync" else ("both",)
    return "/".join(f"{fan[kind] * 1e9:.2f}" for kind in kinds)


COLUMNS = ("strategy", "S", "W", "hosts", "step ms", "reps ms", "wire only ms", "predicted ms", "error",
           "compute ms", "update ms", "duplex", "step ns/B", "comm share", "formula MB", "meter out/in",
           "kernel tx/rx", "link Gbit/s")
"""The tables' columns (Markdown puts the reps beside the step, in one cell)."""


def _cells(r: dict) -> list[str]:
    """One row's cells, in COLUMNS' order."""
    b = r["busiest"]
    return [r["strategy"], str(r["servers"] or "-"), str(r["workers"]), f"{r['hosts']}x{r['ranks_per_host']}",
            f"{r['step_s'] * 1e3:.0f}", "/".join(f"{t * 1e3:.0f}" for t in r["reps_step_s"]),
            f"{r['wire_only_s'] * 1e3:.0f}", f"{r['predicted_s'] * 1e3:.0f}", f"{r['error']:+.0%}",
            f"{r['compute_s'] * 1e3:.1f}", _update_ms(r), _duplex(r), _measured_ns_per_byte(r), f"{r['comm_share']:.0%}",
            "-" if b["formula"] is None else f"{b['formula'] / 1e6:.2f}",
            f"{b['meter_sent'] / 1e6:.2f}/{b['meter_received'] / 1e6:.2f}",
            f"{b['kernel_tx'] / 1e6:.2f}/{b['kernel_rx'] / 1e6:.2f}", f"{achieved_gbit(r):.2f}"]


def print_table(rows: list[dict]) -> None:
    from rich.table import Table

    from gradsync.observe import display

    for rate in dict.fromkeys(r["link"] for r in rows):
        chosen = [r for r in rows if r["link"] == rate]
        first = chosen[0]
        table = Table(title=f"emulated cluster, {rate} links: {first['params'] / 1e6:.2f}M params "
                            f"({first['model_bytes'] / 1e6:.1f} MB), median of {first['reps']} reps x "
                            f"{first['steps']} steps; bytes per step on the busiest link (MB)")
        for column in COLUMNS:
            table.add_column(column, justify="right")
        for r in chosen:
            table.add_row(*_cells(r))
        display.console(170).print(table)


def print_markdown(rows: list[dict]) -> None:
    """The same rows as print_table, as Markdown: one table per link rate."""
    step = COLUMNS.index("step ms")
    header = [*COLUMNS[:step], "step ms (reps)", *COLUMNS[step + 2:]]
    for rate in dict.fromkeys(r["link"] for r in rows):
        chosen = [r for r in rows if r["link"] == rate]
        print(f"\n{rate} links, {chosen[0]['params'] / 1e6:.2f}M params ({chosen[0]['model_bytes'] / 1e6:.1f} MB); "
              f"bytes per step on the busiest link, MB\n")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in chosen:
            cells = _cells(r)
            cells[step:step + 2] = [f"{cells[step]} ({cells[step + 1]})"]
            print("| " + " | ".join(cells) + " |")


def main(args) -> int:
    reason = netns.unavailable()
    if reason and not args.from_json:
        print(f"gradsync cluster: {reason}", file=sys.stderr)
        return 2
    if args.clean:
        swept = netns.sweep_stale(everything=True)
        print(f"deleted {len(swept)} namespace(s){': ' + ', '.join(swept) if swept else ''}")
        return 0
    if args.time_to_loss:
        return _main_time_to_loss(args)
    host = None
    if args.fit_host:
        from gradsync.cluster.results import fit_host_s_per_byte

        host = fit_host_s_per_byte([row for path in args.fit_host for row in json.load(open(path))["rows"]])
        print(f"host term fitted from {', '.join(args.fit_host)}: {host * 1e9:.2f} ns/B")
    if args.from_json:
        rows = [row for path in args.from_json for row in json.load(open(path))["rows"]]
        failures = []
    else:
        rows, failures = run(args)
    if args.from_json or host is not None:
        from gradsync.cluster.results import HOST_S_PER_BYTE, with_predictions

        rows = [with_predictions(row, HOST_S_PER_BYTE if host is None else host) for row in rows]
    if rows:
        (print_markdown if args.markdown else print_table)(rows)
    from gradsync.cluster.figure import step_time_vs_workers

    return _finish(args, rows, failures, step_time_vs_workers)


def _finish(args, rows: list[dict], failures: list[str], draw) -> int:
    """--json, --figure (``draw(rows, png)``), the failures; the exit status."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "failures": failures, "argv": sys.argv}, f, indent=2)
    if args.figure and rows:
        from pathlib import Path

        print(f"wrote {draw(rows, Path(args.figure))}")
    for failure in failures:
        print(f"gradsync cluster: failed: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _main_time_to_loss(args) -> int:
    from gradsync.cluster import time_to_loss
    from gradsync.cluster.loss_worker import STRATEGIES as LOSS_STRATEGIES

    bad = [s for s in args.strategy if s not in LOSS_STRATEGIES]
    if bad:
        raise ValueError(f"--time-to-loss trains charlm with {', '.join(LOSS_STRATEGIES)}; not {', '.join(bad)}")
    if args.from_json:
        rows = time_to_loss.median_rows([r for path in args.from_json for r in json.load(open(path))["rows"]])
        failures = []
    else:
        with signals_interrupt():
            rows, failures = time_to_loss.run(args)
    if rows:
        time_to_loss.print_table(rows, markdown=args.markdown)
    return _finish(args, rows, failures, time_to_loss.figure)
