"""gradsync cluster: strategies x workers x link rates on emulated hosts, the cost model beside each.
Needs root. This module holds the flags and what is printed (cluster_tables.py); cluster/ builds the
hosts (network namespaces, shaped links), runs the jobs and returns the rows.

Runbook (root; every namespace it makes is deleted again, also on Ctrl-C, SIGTERM and failure):

    gradsync cluster --strategy ring --workers 4 --link 1gbit                  # one job, 4 hosts
    gradsync cluster --strategy ps-sync,ps-async,ssp,ring,hierarchical --workers 2,3,4,5,6 \\
        --servers 1,2 --link 1gbit,10gbit --params 4M --json sweep.json --figure docs/figs/cluster_step_time.png
    gradsync cluster --clean                                                   # leftovers of a SIGKILLed run
    gradsync cluster --time-to-loss --strategy ring,ps-sync,powersgd,diloco --workers 2,4 --link 200mbit
                                                 # seconds to ring DDP's charlm loss (cluster/time_to_loss.py)
"""

from __future__ import annotations

import argparse
import json
import sys

from gradsync.cli.args import count, int_list, link_rates, positive_float
from gradsync.train.config import TrainConfig


def _strategies(text: str) -> list[str]:
    from gradsync.cluster.worker import STRATEGIES

    chosen = [part.strip() for part in text.split(",") if part.strip()]
    if not chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
    bad = [s for s in chosen if s not in STRATEGIES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(STRATEGIES)}")
    return chosen


def add_parser(commands) -> None:
    cluster = commands.add_parser("cluster", help="emulated hosts (network namespaces, shaped links): step time "
                                  "and per-link bytes beside the cost model; needs root")
    add_arguments(cluster)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's flags (also `python -m gradsync.cluster`'s)."""
    from gradsync.cluster.worker import STRATEGIES

    parser.add_argument("--strategy", type=_strategies, default=["ps-sync", "ring"],
                        help=f"comma-separated subset of {', '.join(STRATEGIES)} (default ps-sync,ring)")
    parser.add_argument("--workers", type=int_list, default=[2, 4], help="comma-separated W (default 2,4)")
    parser.add_argument("--servers", type=int_list, default=[1], help="ps-sync: comma-separated S (default 1)")
    parser.add_argument("--link", type=link_rates, default=["1gbit"],
                        help="comma-separated tc rates of every host's link, each way (default 1gbit)")
    parser.add_argument("--ranks-per-host", type=int, default=1, help="ranks per emulated host (hierarchical: >= 2)")
    parser.add_argument("--params", type=count, default=4e6, help="model parameters, e.g. 4M (default)")
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
    slow.add_argument("--step-cap", type=positive_float, default=3.0,
                      help="the others stop after this many times --loss-steps (default 3)")
    slow.add_argument("--loss-margin", type=positive_float, default=0.02, help="target = ring's loss x (1 + this)")
    slow.add_argument("--outer-lr", type=positive_float, default=TrainConfig.outer_lr,
                      help="diloco's outer lr (default %(default)s, gradsync train's; the paper's: 0.7)")
    slow.add_argument("--outer-momentum", type=float, default=TrainConfig.outer_momentum,
                      help="diloco's outer Nesterov momentum in [0, 1); 0: plain SGD (default %(default)s)")
    slow.add_argument("--inner-lr", type=positive_float, default=None,
                      help="diloco's inner AdamW lr (default: 1e-3, every strategy's lr)")


def run(args) -> int:
    from gradsync.cli.cluster_tables import print_step_times
    from gradsync.cluster import netns

    reason = netns.unavailable()
    if reason and not args.from_json:
        print(f"gradsync cluster: {reason}", file=sys.stderr)
        return 2
    if args.clean:
        swept = netns.sweep_stale(everything=True)
        print(f"deleted {len(swept)} namespace(s){': ' + ', '.join(swept) if swept else ''}")
        return 0
    if args.time_to_loss:
        return _run_time_to_loss(args)
    host = None
    if args.fit_host:
        from gradsync.cluster.results import fit_host_s_per_byte

        host = fit_host_s_per_byte([row for path in args.fit_host for row in json.load(open(path))["rows"]])
        print(f"host term fitted from {', '.join(args.fit_host)}: {host * 1e9:.2f} ns/B")
    if args.from_json:
        rows = [row for path in args.from_json for row in json.load(open(path))["rows"]]
        failures = []
    else:
        from gradsync.cluster import sweep

        rows, failures = sweep.run(args)
    if args.from_json or host is not None:
        from gradsync.cluster.results import HOST_S_PER_BYTE, with_predictions

        rows = [with_predictions(row, HOST_S_PER_BYTE if host is None else host) for row in rows]
    if rows:
        print_step_times(rows, markdown=args.markdown)
    from gradsync.cluster.figure import step_time_vs_workers

    return _finish(args, rows, failures, step_time_vs_workers)


def _run_time_to_loss(args) -> int:
    from gradsync.cli.cluster_tables import print_times_to_loss
    from gradsync.cluster import sweep, time_to_loss
    from gradsync.cluster.loss_worker import STRATEGIES as LOSS_STRATEGIES

    bad = [s for s in args.strategy if s not in LOSS_STRATEGIES]
    if bad:
        raise ValueError(f"--time-to-loss trains charlm with {', '.join(LOSS_STRATEGIES)}; not {', '.join(bad)}")
    if args.from_json:
        rows = time_to_loss.median_rows([r for path in args.from_json for r in json.load(open(path))["rows"]])
        failures = []
    else:
        with sweep.signals_interrupt():
            rows, failures = time_to_loss.run(args)
    if rows:
        print_times_to_loss(rows, markdown=args.markdown)
    return _finish(args, rows, failures, time_to_loss.figure)


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
