"""gradsync bench faults: SIGKILL (or, with --preempt, SIGTERM) a rank of real training runs; detection time,
work lost, leftovers (bench/faults.py)."""

from __future__ import annotations

from rich.table import Table

from gradsync.cli.args import positive_int
from gradsync.cli.output import show


def add_parser(benches) -> None:
    faults = benches.add_parser("faults", help="SIGKILL a rank of real training runs; detection time, leftovers")
    faults.add_argument("--strategies", default="ddp,zero1,ps-sync,ps-async,ssp", help="comma-separated strategies")
    faults.add_argument("--trials", type=positive_int, default=10, help="kills per strategy")
    faults.add_argument("--workers", type=positive_int, default=3, help="processes per run")
    faults.add_argument("--timeout", type=float, default=10.0, help="the runs' --timeout in seconds")
    faults.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    faults.add_argument("--live", action="store_true",
                        help="kill ranks of `gradsync train --fault-tolerance live` instead: kill -> next step, steps "
                             "lost, samples lost or repeated, accuracy against an uninterrupted run, leaks")
    faults.add_argument("--scenarios", default="random,forward,optimizer,checkpoint,two,replace,ps-forward",
                        help="--live: comma-separated scenarios (random, forward, optimizer, checkpoint, two, replace, "
                             "ps-forward)")
    faults.add_argument("--epochs", type=positive_int, default=2, help="--live: the runs' --epochs")
    faults.add_argument("--preempt", action="store_true",
                        help="SIGTERM instead (every strategy; ps-*/ssp add one server to --workers): work lost, signal to exit, restart to "
                             "first resumed step, samples lost or repeated")


def run(args) -> int:
    from gradsync.bench import faults

    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
    if args.live:
        return _bench_live(args)
    if args.preempt:
        return _bench_preempt(args, strategies)
    rows = faults.run(strategies, args.trials, args.workers, args.timeout)
    table = Table(title=f"SIGKILL one random rank of `gradsync train --workers {args.workers} --timeout "
                        f"{args.timeout:g}`, {args.trials} trials per strategy")
    for column in ("strategy", "trials", "clean", "slowest detection (s)", "median (s)", "problems"):
        table.add_column(column, justify="right")
    for strategy in strategies:
        mine = [r for r in rows if r["strategy"] == strategy]
        times = sorted(r["detection_s"] for r in mine if "detection_s" in r)
        problems = "; ".join(sorted({r["why"] for r in mine if r["why"]})) or "-"
        table.add_row(strategy, str(len(mine)), str(sum(r["clean"] for r in mine)),
                      f"{times[-1]:.2f}" if times else "-", f"{times[len(times) // 2]:.2f}" if times else "-", problems)
    show(table, rows, args.json)
    return 0 if all(r["clean"] for r in rows) else 1


def _bench_preempt(args, strategies: list[str]) -> int:
    from gradsync.bench import faults

    if args.strategies == "ddp,zero1,ps-sync,ps-async,ssp":   # the SIGKILL default: take the preemption one
        strategies = list(faults.PREEMPT_STRATEGIES)
    rows = faults.preempt_run(strategies, args.trials, args.workers, args.timeout)
    table = Table(title=f"SIGTERM to the launcher or a rank of `gradsync train --workers {args.workers} --epochs 1 "
                        f"--batch-size 4` (digits; ps-*/ssp: 1 server + {args.workers} workers), then its resume "
                        f"command; {args.trials} trials per strategy")
    for column in ("strategy", "trials", "clean", "steps lost (max)", "seconds lost (max)",
                   "signal -> checkpoint s (median, max)", "signal -> exit s (median, max)",
                   "restart -> first step s (median, max)",
                   "samples missing / repeated", "problems"):
        table.add_column(column, justify="right")

    def spread(values: list[float]) -> str:
        values = sorted(v for v in values if v is not None)
        return f"{values[(len(values) - 1) // 2]:.2f}, {values[-1]:.2f}" if values else "-"

    for strategy in strategies:
        mine = [r for r in rows if r["strategy"] == strategy]
        table.add_row(strategy, str(len(mine)), str(sum(r["clean"] for r in mine)),
                      str(max((r.get("steps_lost", 0) for r in mine), default=0)),
                      f"{max((r.get('seconds_lost', 0.0) for r in mine), default=0.0):.3f}",
                      spread([r.get("signal_to_checkpoint_s") for r in mine]),
                      spread([r.get("signal_to_exit_s") for r in mine]),
                      spread([r.get("restart_to_first_step_s") for r in mine]),
                      f"{sum(r.get('samples_missing', 0) for r in mine)} / {sum(r.get('samples_repeated', 0) for r in mine)}",
                      "; ".join(sorted({r["why"] for r in mine if r["why"]})) or "-")
    show(table, rows, args.json)
    return 0 if all(r["clean"] for r in rows) else 1


def _bench_live(args) -> int:
    from gradsync.bench import faults_live

    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    rows = faults_live.run(scenarios, args.trials, args.workers, args.epochs, args.timeout)
    table = Table(title=f"SIGKILL ranks of `gradsync train --fault-tolerance live --workers {args.workers} --epochs "
                        f"{args.epochs} --timeout {args.timeout:g}` (two: {args.workers + 1} workers, two kills; "
                        f"ps-forward: --strategy ps-sync, 1 server + {args.workers} workers); "
                        f"{args.trials} trials per scenario")
    for column in ("scenario", "trials", "clean", "kill -> next step s (median, worst)", "rebuild s (median)",
                   "replacement join s (median, worst)",
                   "steps lost (max)", "samples missing / repeated", "accuracy - uninterrupted, points (worst)",
                   "leaks", "problems"):
        table.add_column(column, justify="right")
    for scenario in scenarios:
        mine = [r for r in rows if r["scenario"] == scenario]
        rebuild = sorted(s for r in mine for s in r.get("recovery_s", []))
        deltas = [r["accuracy_delta_points"] for r in mine if r.get("accuracy_delta_points") is not None]
        leaks = sum(bool(r.get("orphans") or r.get("leaked") or r.get("fd_growth")) for r in mine)
        table.add_row(scenario, str(len(mine)), str(sum(r["clean"] for r in mine)),
                      faults_live.median_and_worst([t for r in mine for t in r.get("kill_to_next_step_s", [])]),
                      f"{rebuild[len(rebuild) // 2]:.3f}" if rebuild else "-",
                      faults_live.median_and_worst([r["join_s"] for r in mine if "join_s" in r]),
                      str(max((r.get("steps_lost", 0) for r in mine), default=0)),
                      f"{sum(r.get('samples_missing', 0) for r in mine)} / {sum(r.get('samples_repeated', 0) for r in mine)}",
                      f"{max(deltas, key=abs):+.2f}" if deltas else "-", str(leaks),
                      "; ".join(sorted({r["why"] for r in mine if r["why"]})) or "-")
    show(table, rows, args.json)
    return 0 if all(r["clean"] for r in rows) else 1
