"""gradsync simulate: the alpha-beta cost model of every strategy at any scale (sim/cost.py), a sparse table's
crossover (sim/sparse.py), or, with --calibrated --check, the model beside this machine."""

from __future__ import annotations

import json

from rich.table import Table

from gradsync.cli.args import bandwidth, count, duration, int_list, positive_int
from gradsync.cli.output import human_count, show
from gradsync.sim.cost import STRATEGIES as STRATEGIES_SIM
from gradsync.train.config import TrainConfig


def add_parser(commands) -> None:
    sim = commands.add_parser("simulate", help="alpha-beta cost model of every strategy at any scale")
    sim.add_argument("--params", type=count, default=None,
                     help="parameters, e.g. 7e9 or 7B (required unless --sparse-rows)")
    sim.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="gradient dtype on the wire")
    sim.add_argument("--workers", type=positive_int, required=True, help="workers W (data-parallel ranks)")
    sim.add_argument("--bandwidth", type=bandwidth, default=bandwidth("200Gbit"), help="per-link, e.g. 200Gbit")
    sim.add_argument("--latency", type=duration, default=duration("5us"), help="alpha per message, e.g. 5us")
    sim.add_argument("--compute", type=duration, default=duration("250ms"), help="forward+backward per step")
    sim.add_argument("--strategy", default=",".join(STRATEGIES_SIM), help=f"comma-separated subset of {', '.join(STRATEGIES_SIM)}")
    sim.add_argument("--servers", type=positive_int, default=1, help="parameter servers (ps, ps-async)")
    sim.add_argument("--ranks-per-host", type=positive_int, default=8, help="hierarchical: ranks per host")
    sim.add_argument("--intra-bandwidth", type=bandwidth, default=None, help="hierarchical: intra-host link (default: --bandwidth)")
    sim.add_argument("--bucket-mb", type=float, default=25.0, help="ddp bucket size in MiB")
    sim.add_argument("--powersgd-ratio", type=float, default=0.01,
                     help="powersgd: the share of the gradient sent (sum of (n+m)r / (n m) over the matrices)")
    sim.add_argument("--sync-every", type=positive_int, default=TrainConfig.sync_every,
                     help="diloco: steps between outer steps (H)")
    sim.add_argument("--calibrated", action="store_true",
                     help="use this machine's measured alpha/beta/gamma (gradsync bench collectives --fit)")
    sim.add_argument("--check", metavar="N,N,...", type=int_list, default=None,
                     help="with --calibrated: measure ring all-reduce and DDP steps on N local ranks and print "
                          "them beside the prediction")
    sim.add_argument("--json", metavar="PATH", help="with --check: also write the rows as JSON")
    sim.add_argument("--sparse-rows", type=count, default=None,
                     help="instead: a sparse table of this many rows (sim/sparse.py): sparse PS vs dense ring vs "
                          "sparse all-gather, and the crossover in touched rows")
    sim.add_argument("--touched-rows", type=count, default=1000, help="with --sparse-rows: unique rows per worker per step")
    sim.add_argument("--dim", type=positive_int, default=128, help="with --sparse-rows: elements per row")


def run(args) -> int:
    from gradsync.comm import select
    from gradsync.sim import cost
    from gradsync.sim.memory import human

    strategies = [x.strip() for x in args.strategy.split(",") if x.strip()]
    unknown = [x for x in strategies if x not in cost.STRATEGIES]
    if unknown or not strategies:
        raise ValueError(f"--strategy {args.strategy!r}: unknown {unknown}; choose from {', '.join(cost.STRATEGIES)}")
    if args.calibrated:
        link = select.load_calibration()
        source = f"calibrated on this machine ({select.calibration_path()})"
    else:
        link = cost.Link(alpha=args.latency, beta=1 / args.bandwidth, gamma=0.0)
        source = f"{args.bandwidth * 8 / 1e9:g} Gbit/s, alpha {args.latency * 1e6:g} us"
    if args.check:
        if not args.calibrated:
            raise ValueError("--check compares the calibrated model with this machine: add --calibrated")
        return _simulate_check(args, link)
    if args.sparse_rows is not None:
        return _simulate_sparse(args, link, source)
    if args.params is None:
        raise ValueError("gradsync simulate needs --params (model size), or --sparse-rows for the sparse-table comparison")
    intra = cost.Link(alpha=link.alpha, beta=1 / args.intra_bandwidth, gamma=link.gamma) if args.intra_bandwidth else link
    nbytes = args.params * {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]
    table = Table(title=f"one step: {human_count(args.params)} params, {args.dtype} gradients = {human(nbytes)}, "
                        f"{args.workers} workers, compute {args.compute * 1e3:g} ms; link: {source}")
    for column in ("strategy", "busiest link bytes/step", "comm (s)", "step (s)", "comm:compute", "efficiency", "note"):
        table.add_column(column, justify="right")
    for name in strategies:
        r = cost.strategy_cost(name, nbytes, args.workers, link, args.compute, servers=args.servers,
                               ranks_per_host=args.ranks_per_host, intra=intra,
                               bucket_bytes=args.bucket_mb * 2**20, powersgd_ratio=args.powersgd_ratio,
                               sync_every=args.sync_every)
        table.add_row(name, human(r.busiest_link_bytes), f"{r.comm_s:.3f}", f"{r.step_s:.3f}",
                      f"{r.comm_s / args.compute:.1f}:1", f"{r.efficiency:.1%}", r.note)
    show(table, None, None, 140)
    return 0


def _simulate_sparse(args, link, source: str) -> int:
    from gradsync.sim import sparse
    from gradsync.sim.memory import human

    element_size = {"fp32": 4, "bf16": 2, "fp16": 2}[args.dtype]
    rows, touched = int(args.sparse_rows), float(args.touched_rows)
    crossover = sparse.crossover_rows(rows, args.dim, args.workers, link, servers=args.servers, element_size=element_size)
    table = Table(title=f"one step of a sparse table: {rows:,} x {args.dim} {args.dtype}, {touched:,.0f} rows touched per "
                        f"worker, {args.workers} workers, {args.servers} server(s); link: {source}; sparse PS beats the "
                        f"dense ring below {crossover:,.0f} touched rows per worker ({crossover / rows:.2%} of the table)")
    for column in ("strategy", "busiest link bytes/step", "comm (s)", "step (s)", "vs ring"):
        table.add_column(column, justify="right")
    costs = sparse.sparse_costs(rows, args.dim, touched, args.workers, link, args.compute, servers=args.servers,
                                element_size=element_size)
    ring = next(c for c in costs if "ring" in c.name)
    for c in costs:
        table.add_row(c.name, human(c.busiest_link_bytes), f"{c.comm_s:.4f}", f"{c.step_s:.4f}",
                      f"{ring.step_s / c.step_s:.2f}x")
    show(table, None, None, 140)
    return 0


def _simulate_check(args, link) -> int:
    from gradsync.bench import predict
    from gradsync.bench.collectives import human_bytes
    from gradsync.comm import select

    try:   # which transport the saved fit measured (files written before it was recorded do not say)
        calibrated_over = json.loads(select.calibration_path().read_text()).get("transport")
    except (OSError, ValueError, AttributeError):
        calibrated_over = None
    result = predict.run(link, args.check, [1 << 20, 16 << 20, 64 << 20], calibrated_over=calibrated_over)
    table = Table(title=f"calibrated model ({calibrated_over or 'transport not recorded'}) vs this machine over "
                        f"{result['transport']}: alpha {link.alpha * 1e6:.1f} us, "
                        f"{1 / link.beta / 1e9:.2f} GB/s, reduce {1 / link.gamma / 1e9:.1f} GB/s")
    for column in ("what", "N", "size", "transport", "measured (ms)", "predicted (ms)", "error"):
        table.add_column(column, justify="right")
    for r in result["rows"]:
        table.add_row(r["what"], str(r["workers"]), human_bytes(r["size"]), r["transport"],
                      f"{r['measured_s'] * 1e3:.2f}", f"{r['predicted_s'] * 1e3:.2f}", f"{r['error']:+.0%}")
    show(table, result, args.json)
    return 0
