"""The gradsync command.

    gradsync train [--workers 2] [--strategy ddp] [--model cnn --dataset digits] ...  (see train/loop.py)
    gradsync bench collectives --workers 4 --sizes 4K,64K,1M,16M,64M [--transport tcp,shm] [--peers gloo,mpi] [--json out.json] [--fit]
    gradsync bench ps --workers 2,3,4 [--steps 20]
    gradsync bench zero1 --workers 2,4
    gradsync bench faults --trials 10
    gradsync simulate --params 7e9 --dtype bf16 --workers 64 --bandwidth 200Gbit --compute 250ms
    gradsync figures --out figs/ [--measured check.json]
    gradsync doctor RUN_DIR
    gradsync memory --params 70e9 --workers 64 [--optimizer adam --precision mixed]
    gradsync cluster --strategy ps-sync,ring --workers 2,4 --link 1gbit   (root: emulated hosts, cluster/sweep.py)
"""

from __future__ import annotations

import argparse
import json
import sys

from gradsync.sim.cost import STRATEGIES as STRATEGIES_SIM

from rich.console import Console
from rich.table import Table


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _sizes(text: str) -> list[int]:
    from gradsync.bench.collectives import parse_size

    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> float:
    """A parameter count: 70e9, 7000000, or with a K/M/B/T suffix (70B)."""
    scale = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
    raw = text.strip().upper()
    try:
        value = float(raw[:-1]) * scale[raw[-1]] if raw and raw[-1] in scale else float(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a count; use e.g. 70e9 or 70B") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the count must be > 0")
    return value


def _int_list(text: str) -> list[int]:
    """'2,3,4' -> [2, 3, 4] (each >= 1)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 2,3,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1, e.g. 2,3,4")
    return values


def _show(table: Table, rows, json_path: str | None, width: int = 100) -> None:
    """Print a result table (on a terminal at least ``width`` columns wide; in a pipe or file at its
    natural width or COLUMNS, see gradsync/display.py) and, with --json, write the rows."""
    from gradsync import display

    display.console(width).print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=2)


def _human_count(count: float) -> str:
    return next((f"{count / scale:g}{unit}" for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6))
                 if count >= scale), f"{count:g}")


def _bandwidth(text: str) -> float:
    """Bytes per second from 200Gbit, 100Mbit, 25GB/s, 400MB/s (bits: 'bit'; bytes: 'B/s')."""
    raw = text.strip()
    units = {"tbit": 1e12 / 8, "gbit": 1e9 / 8, "mbit": 1e6 / 8, "tb/s": 1e12, "gb/s": 1e9, "mb/s": 1e6}
    for unit, scale in units.items():
        if raw.lower().endswith(unit):
            try:
                value = float(raw[:-len(unit)]) * scale
            except ValueError:
                break
            if value > 0:
                return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a bandwidth; use e.g. 200Gbit, 100Mbit or 25GB/s")


def _duration(text: str) -> float:
    """Seconds from 250ms, 5us, 1.5s."""
    raw = text.strip().lower()
    for unit, scale in (("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9), ("s", 1.0)):
        if raw.endswith(unit):
            try:
                value = float(raw[:-len(unit)]) * scale
            except ValueError:
                break
            if value >= 0:
                return value
    raise argparse.ArgumentTypeError(f"{text!r} is not a duration; use e.g. 250ms, 5us or 1.5s")


def _transports(text: str) -> list[str]:
    from gradsync.comm.transport import TRANSPORTS

    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in chosen if t not in TRANSPORTS]
    if not chosen or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: choose transports from {', '.join(TRANSPORTS)}, comma-separated")
    return chosen


PEERS = ("gloo", "mpi")


def _peers(text: str) -> list[str]:
    """'gloo,mpi' -> ["gloo", "mpi"]; gloo is always one (it runs in the same processes as ours)."""
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PEERS]
    if bad or "gloo" not in chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: choose baselines from {', '.join(PEERS)}, comma-separated, "
                                         f"gloo always among them (it runs in the same processes as ours), e.g. gloo,mpi")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description="Data-parallel training runtime for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="benchmarks: ours beside torch.distributed, same run")
    benches = bench.add_subparsers(dest="bench", required=True)
    coll = benches.add_parser("collectives", help="all-reduce time, algbw, busbw, bytes per rank")
    coll.add_argument("--workers", type=_positive_int, default=2, help="local ranks (default 2)")
    coll.add_argument("--sizes", type=_sizes, default=_sizes("4K,64K,1M,16M,64M"),
                      help="message sizes, e.g. 4K,64K,1M,16M,64M")
    coll.add_argument("--algorithms", default="ring,halving_doubling,tree,naive,shared_memory,auto",
                      help="comma-separated subset of ring,halving_doubling,tree,naive,shared_memory,auto "
                           "(shared_memory only on the shm transport; auto shows what it picked)")
    coll.add_argument("--reps", type=_positive_int, default=10, help="timed calls per size and algorithm (median)")
    coll.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    coll.add_argument("--transport", type=_transports, default=None,
                      help="comma-separated: auto, tcp, shm; one run each, e.g. tcp,shm (default: GRADSYNC_TRANSPORT, "
                           "else auto; a value that contradicts a set GRADSYNC_TRANSPORT is an error)")
    coll.add_argument("--peers", type=_peers, default=["gloo"],
                      help="baselines, comma-separated: gloo (torch.distributed, always), mpi (Open MPI's "
                           "MPI_Allreduce via mpirun + mpi4py, the bench extra; adds an ours/MPI column)")
    coll.add_argument("--fit", action="store_true",
                      help="measure alpha/beta/gamma on this machine and save them for algorithm='auto'")
    coll.add_argument("--rounds", type=_positive_int, default=1,
                      help="whole runs, each ours then the MPI peer, taking turns; the table shows the median "
                           "of the rounds' medians and each round's (default 1)")
    ddp = benches.add_parser("ddp", help="training step time, ours beside torch DDP (gloo)")
    ddp.add_argument("--workers", type=_positive_int, default=2)
    ddp.add_argument("--model", choices=("mlp", "cnn", "charlm"), default="mlp")
    ddp.add_argument("--batch-size", type=_positive_int, default=64, help="samples per rank")
    ddp.add_argument("--bucket-mb", default="1,25", help="comma-separated bucket caps for ours, in MiB")
    ddp.add_argument("--steps", type=_positive_int, default=15, help="timed steps per implementation (median)")
    ddp.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ddp.add_argument("--torch-hook", action="store_true",
                     help="also ours with torch's allreduce_hook registered (its buckets over gloo)")
    ddp.add_argument("--compile", action="store_true",
                     help="also torch.compile (inductor) over torch DDP, over ours and under ours; with --backend: "
                          "torch.compile(DDP(model)) and the compiled floor on each backend")
    ddp.add_argument("--backend", metavar="LIST", help="instead: torch's own DDP on each torch.distributed backend "
                     "listed (e.g. gloo,gradsync), the first one the baseline; plus the torch API layer's cost")
    ddp.add_argument("--rounds", type=_positive_int, default=3, help="with --backend: alternating runs per backend")
    ps = benches.add_parser("ps", help="parameter server (sync, SSP, async) beside ring DDP, with a straggler")
    ps.add_argument("--workers", type=_int_list, default=[2, 3, 4],
                    help="comma-separated worker counts W (the server is extra)")
    ps.add_argument("--batch-size", type=_positive_int, default=None, help="samples per worker (64; word2vec 256)")
    ps.add_argument("--steps", type=_positive_int, default=20, help="steps per worker and configuration")
    ps.add_argument("--model", choices=("mlp", "word2vec"), default="mlp",
                    help="word2vec: sparse PS (1 and 2 servers, sync and async) beside dense ring DDP and torch's "
                         "sparse DDP (bench/ps_sparse.py)")
    ps.add_argument("--rounds", type=_positive_int, default=3, help="word2vec: runs per configuration (median)")
    ps.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    zero1 = benches.add_parser("zero1", help="ZeRO-1 step time and optimizer-state bytes beside DDP")
    zero1.add_argument("--workers", type=_int_list, default=[2, 4], help="comma-separated rank counts")
    zero1.add_argument("--model", choices=("charlm", "mlp"), default="charlm",
                       help="charlm (0.47M parameters) or the DDP bench's mlp (10.5M)")
    zero1.add_argument("--batch-size", type=_positive_int, default=16, help="samples per rank")
    zero1.add_argument("--steps", type=_positive_int, default=10, help="timed steps per implementation (median)")
    zero1.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    sim = commands.add_parser("simulate", help="alpha-beta cost model of every strategy at any scale")
    sim.add_argument("--params", type=_count, default=None,
                     help="parameters, e.g. 7e9 or 7B (required unless --sparse-rows)")
    sim.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="gradient dtype on the wire")
    sim.add_argument("--workers", type=_positive_int, required=True, help="workers W (data-parallel ranks)")
    sim.add_argument("--bandwidth", type=_bandwidth, default=_bandwidth("200Gbit"), help="per-link, e.g. 200Gbit")
    sim.add_argument("--latency", type=_duration, default=_duration("5us"), help="alpha per message, e.g. 5us")
    sim.add_argument("--compute", type=_duration, default=_duration("250ms"), help="forward+backward per step")
    sim.add_argument("--strategy", default=",".join(STRATEGIES_SIM), help=f"comma-separated subset of {', '.join(STRATEGIES_SIM)}")
    sim.add_argument("--servers", type=_positive_int, default=1, help="parameter servers (ps, ps-async)")
    sim.add_argument("--ranks-per-host", type=_positive_int, default=8, help="hierarchical: ranks per host")
    sim.add_argument("--intra-bandwidth", type=_bandwidth, default=None, help="hierarchical: intra-host link (default: --bandwidth)")
    sim.add_argument("--bucket-mb", type=float, default=25.0, help="ddp bucket size in MiB")
    sim.add_argument("--powersgd-ratio", type=float, default=0.01,
                     help="powersgd: the share of the gradient sent (sum of (n+m)r / (n m) over the matrices)")
    sim.add_argument("--sync-every", type=_positive_int, default=8, help="diloco: steps between outer steps (H)")
    sim.add_argument("--calibrated", action="store_true",
                     help="use this machine's measured alpha/beta/gamma (gradsync bench collectives --fit)")
    sim.add_argument("--check", metavar="N,N,...", type=_int_list, default=None,
                     help="with --calibrated: measure ring all-reduce and DDP steps on N local ranks and print "
                          "them beside the prediction")
    sim.add_argument("--json", metavar="PATH", help="with --check: also write the rows as JSON")
    sim.add_argument("--sparse-rows", type=_count, default=None,
                     help="instead: a sparse table of this many rows (sim/sparse.py): sparse PS vs dense ring vs "
                          "sparse all-gather, and the crossover in touched rows")
    sim.add_argument("--touched-rows", type=_count, default=1000, help="with --sparse-rows: unique rows per worker per step")
    sim.add_argument("--dim", type=_positive_int, default=128, help="with --sparse-rows: elements per row")
    figs = commands.add_parser("figures", help="PNG figures + CSV from the cost model (and this machine's check)")
    figs.add_argument("--out", default="figs", help="output directory (default figs/)")
    figs.add_argument("--measured", metavar="JSON", default=None,
                      help="rows from gradsync simulate --calibrated --check 2,3,4 --json JSON, for the "
                           "measured-vs-predicted figure")
    faults = benches.add_parser("faults", help="SIGKILL a rank of real training runs; detection time, leftovers")
    faults.add_argument("--strategies", default="ddp,zero1,ps-sync,ps-async,ssp", help="comma-separated strategies")
    faults.add_argument("--trials", type=_positive_int, default=10, help="kills per strategy")
    faults.add_argument("--workers", type=_positive_int, default=3, help="processes per run")
    faults.add_argument("--timeout", type=float, default=10.0, help="the runs' --timeout in seconds")
    faults.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    faults.add_argument("--preempt", action="store_true",
                        help="SIGTERM instead (every strategy; ps-*/ssp add one server to --workers): work lost, signal to exit, restart to "
                             "first resumed step, samples lost or repeated")
    doctor = commands.add_parser("doctor", help="the DDP performance checklist, read from a run directory")
    doctor.add_argument("run_dir", help="a --out directory of gradsync train")
    memory = commands.add_parser("memory", help="bytes per rank of model state: plain DP and ZeRO stages 1-3")
    memory.add_argument("--params", type=_count, required=True, help="parameters, e.g. 70e9 or 70B")
    memory.add_argument("--workers", type=_positive_int, required=True, help="data-parallel ranks N")
    memory.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    memory.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    cluster = commands.add_parser("cluster", help="emulated hosts (network namespaces, shaped links): step time "
                                  "and per-link bytes beside the cost model; needs root")
    from gradsync.cluster.sweep import add_arguments as add_cluster_arguments

    add_cluster_arguments(cluster)
    _add_train(commands)
    return parser


def _add_train(commands) -> None:
    from gradsync.train.config import COMPRESSION, LR_SCALING, PREEMPT_SIGNALS, STRATEGIES, TrainConfig
    from gradsync.comm.collectives import ALGORITHMS
    from gradsync.train.datasets import DATASETS
    from gradsync.train.models import MODELS

    defaults = TrainConfig.__dataclass_fields__
    train = commands.add_parser("train", help="N local workers train a real model on real data")
    train.add_argument("--workers", type=_positive_int, default=defaults["workers"].default, help="local worker processes")
    train.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    train.add_argument("--algorithm", choices=ALGORITHMS, default="auto")
    train.add_argument("--servers", type=_positive_int, default=1, help="how many of the --workers processes serve parameters (ps-sync, ps-async, ssp)")
    train.add_argument("--staleness", type=int, default=2, help="SSP bound in versions")
    train.add_argument("--model", choices=MODELS, default=None, help="default: the dataset's natural model")
    train.add_argument("--dataset", choices=DATASETS, default=None, help="default: digits (or stdlib-text for charlm)")
    train.add_argument("--epochs", type=_positive_int, default=defaults["epochs"].default)
    train.add_argument("--steps", type=_positive_int, default=None, help="total optimizer steps (overrides --epochs)")
    train.add_argument("--batch-size", type=_positive_int, default=32, help="samples per worker per micro-batch")
    train.add_argument("--grad-accum", type=_positive_int, default=1, help="micro-batches per optimizer step")
    train.add_argument("--lr", type=float, default=None, help="base learning rate for one worker's batch")
    train.add_argument("--lr-scaling", choices=LR_SCALING, default="linear")
    train.add_argument("--warmup-steps", type=int, default=defaults["warmup_steps"].default)
    train.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket cap in MiB")
    train.add_argument("--compress", choices=COMPRESSION, default="none",
                       help="gradient compression on the wire (ddp): fp16, bf16, or powersgd (rank-r factors)")
    train.add_argument("--powersgd-rank", type=_positive_int, default=2, metavar="R",
                       help="PowerSGD's approximation rank (--compress powersgd)")
    train.add_argument("--sync-every", type=_positive_int, default=8, metavar="H",
                       help="--strategy diloco: inner steps each worker takes alone between outer steps")
    train.add_argument("--outer-lr", type=float, default=0.7, help="--strategy diloco: the outer Nesterov SGD's lr")
    train.add_argument("--outer-momentum", type=float, default=0.9, help="--strategy diloco: its momentum")
    train.add_argument("--clip-grad", type=float, default=None, metavar="X",
                       help="clip the averaged gradient to total 2-norm X before each optimizer step, as torch's "
                            "clip_grad_norm_ on one process (ps-sync: on the servers; ps-async, ssp: each push)")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--out", default="runs/latest", help="directory for metrics.jsonl, trace.json, checkpoints")
    train.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    train.add_argument("--trace", action="store_true", help="write a Chrome trace timeline (trace.json)")
    train.add_argument("--timeout", type=float, default=60.0, help="seconds any wait between ranks may take")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    train.add_argument("--max-restarts", type=int, default=0,
                       help="after a failure, restart the workers from the last checkpoint up to this many times")
    train.add_argument("--checkpoint-every", default="", metavar="N|TIME",
                       help="also checkpoint every N steps (200) or every span of time (30s, 5m, 1h)")
    train.add_argument("--preempt-signal", choices=PREEMPT_SIGNALS, default="SIGTERM",
                       help="on this signal (to the launcher or any rank) stop at the next step with a checkpoint "
                            "and exit 75 (default SIGTERM; none: the signal's default action)")


def _train(args) -> int:
    from gradsync.train.config import TrainConfig
    from gradsync.train.loop import run

    import signal

    from gradsync.train.preempt import EXIT_PREEMPTED, signal_number

    fields = TrainConfig.__dataclass_fields__
    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    results = run(cfg)
    if cfg.model == "word2vec" and not any(r.get("preempted") for r in results):
        from gradsync.train.word2vec import print_neighbours

        print_neighbours(results)
    signum = signal_number(cfg.preempt_signal)
    if signum is not None:   # training is over: a preemption signal now must not turn success into a kill
        signal.signal(signum, signal.SIG_IGN)
    return EXIT_PREEMPTED if any(r.get("preempted") for r in results) else 0


def _bench_collectives(args) -> int:
    from gradsync import display
    from gradsync.bench import collectives, mpi_peer
    from gradsync.comm import select

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    transports = [collectives.resolve_transport(t) for t in (args.transport or [None])]  # checked before any run
    if args.fit and len(transports) > 1:
        raise ValueError(f"--fit calibrates one transport; got --transport {','.join(transports)}: pick one")
    if args.rounds > 1 and (args.fit or len(transports) > 1):
        raise ValueError(f"--rounds {args.rounds} repeats one run: use it without --fit and with one --transport")
    console = display.console()
    ceiling = collectives.memory_copy_bandwidth()
    console.print(f"memory copy on this host (one thread, 64 MiB): {ceiling / 1e9:.1f} GB/s -- the ceiling for "
                  f"moving bytes between local ranks")
    result = {"rows": [], "fit": None, "memory_copy_GBps": ceiling / 1e9, "rounds": args.rounds}
    with_mpi = "mpi" in args.peers and _mpi_available(result, console)
    ours, theirs = [], []
    for _ in range(args.rounds):
        rows = []
        for transport in transports:
            one = collectives.run(args.workers, args.sizes, algorithms, reps=args.reps, fit=args.fit,
                                  transport=transport)
            rows += one["rows"]
            result["fit"] = one["fit"] or result["fit"]
        ours.append(rows)
        if with_mpi:
            theirs.append(_run_mpi_peer(args, result, console))
    result["rows"] = ours[0] if args.rounds == 1 else collectives.combine_rounds(ours)
    if with_mpi:
        result["rows"] = collectives.add_mpi_rows(result["rows"], theirs[0] if args.rounds == 1
                                                  else collectives.combine_rounds(theirs))
    rounds = (f"; median of {args.rounds} rounds" + (", each ours then MPI" if with_mpi else "")) if args.rounds > 1 else ""
    table = Table(title=f"all_reduce, {args.workers} ranks, float32, median of {args.reps}{rounds}")
    for column in ("size", "transport", "algorithm", "time (us)", *(["each round (us)"] if args.rounds > 1 else []),
                   "algbw GB/s", "busbw GB/s", "bytes/rank", "formula", "ours/native", *(["ours/MPI"] if with_mpi else [])):
        table.add_column(column, justify="right")
    baselines_first = {"native": 0, mpi_peer.ALGORITHM: 1}
    for r in sorted(result["rows"], key=lambda r: (r["size"], baselines_first.get(r["algorithm"], 2), r["transport"])):
        name = f"auto ({r['picked']})" if r["algorithm"] == "auto" else r["algorithm"]
        cells = [collectives.human_bytes(r["size"]), r["transport"], name, f"{r['time_s'] * 1e6:,.0f}",
                 *([" / ".join(f"{t * 1e6:,.0f}" for t in r["round_times_s"])] if args.rounds > 1 else []),
                 f"{r['algbw_GBps']:.3f}", f"{r['busbw_GBps']:.3f}",
                 "-" if r["bytes_per_rank"] is None else f"{r['bytes_per_rank']:,}",
                 "-" if r["formula_bytes"] is None else f"{r['formula_bytes']:,.0f}",
                 "1.00 (baseline)" if r["algorithm"] == "native" else _ratio(r["ratio_vs_native"])]
        if with_mpi:
            cells.append("1.00 (baseline)" if r["algorithm"] == mpi_peer.ALGORITHM else _ratio(r["ratio_vs_mpi"]))
        table.add_row(*cells)
    display.console(130).print(table)
    wrong = sorted({f"{r['algorithm']} at {collectives.human_bytes(r['size'])}" for r in result["rows"]
                    if not r["result_correct"]})
    if wrong:
        console.print(f"[red]wrong all-reduce result (expected N everywhere): {', '.join(wrong)}[/]")
    if result["fit"]:
        link = collectives.fitted_link(result["fit"])
        path = select.save_calibration(link, {"measured_with": f"gradsync bench collectives --workers {args.workers} --fit",
                                              "transport": result["fit"]["transport"]})
        console.print(f"fitted link ({result['fit']['transport']}): alpha={link.alpha * 1e6:.1f} us, "
                      f"bandwidth={1 / link.beta / 1e9:.2f} GB/s, reduce={1 / link.gamma / 1e9:.2f} GB/s -> saved to {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if wrong else 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _mpi_available(result: dict, console) -> bool:
    """False, with the reason printed and recorded, when mpi4py or mpirun is missing."""
    from gradsync.bench import mpi_peer

    reason = mpi_peer.unavailable()
    if reason:
        console.print(f"MPI columns skipped: {reason}")
        result["mpi_skipped"] = reason
    return reason is None


def _run_mpi_peer(args, result: dict, console) -> list[dict]:
    """Open MPI's all-reduce on the same sizes, N and repetitions (bench/mpi_peer.py): its rows."""
    from gradsync.bench import mpi_peer

    peer = mpi_peer.run(args.workers, args.sizes, args.reps)
    if "mpi_command" not in result:
        console.print(f"MPI peer: {peer['command']}" + (f"; set {', '.join(peer['notes'])}" if peer["notes"] else "")
                      + f"; {mpi_peer.pages()}")
    result["mpi_command"] = peer["command"]
    result["mpi_pages"] = mpi_peer.pages()
    return peer["rows"]


def _bench_backends(args) -> int:
    from gradsync.bench import backend

    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if len(backends) < 1 or any(b not in ("gloo", "gradsync") for b in backends):
        raise ValueError(f"--backend {args.backend!r}: give a comma-separated list of gloo and gradsync, e.g. gloo,gradsync")
    steps, api = backend.run(args.workers, args.model, args.batch_size, args.steps, backends, args.rounds,
                             compiled=args.compile)
    table = Table(title=f"torch DDP step, {args.model}, {args.workers} ranks, batch {args.batch_size}/rank; median "
                        f"of {args.rounds} alternating runs (each the median of {args.steps} steps); floor: the bare "
                        f"model's step in the same runs")
    for column in ("backend", "program", "step (ms)", f"/{backends[0]}", "vs floor", "each run (ms)"):
        table.add_column(column, justify="right")
    for r in steps:
        table.add_row(r["backend"], r["program"], f"{r['step_ms']:.1f}", f"{r['ratio']:.2f}x", f"{r['vs_floor']:.2f}x",
                      ", ".join(f"{t:.1f}" for t in r["runs_ms"]))
    _show(table, steps, None, 110)
    if api:
        table = Table(title="all_reduce through torch's API on the gradsync backend beside gs.all_reduce, same ranks")
        for column in ("bytes", "dist.all_reduce (us)", "gs.all_reduce (us)", "api/direct"):
            table.add_column(column, justify="right")
        for r in api:
            table.add_row(f"{r['bytes']:,}", f"{r['api_us']:.0f}", f"{r['direct_us']:.0f}", f"{r['ratio']:.2f}x")
        _show(table, api, None, 110)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": steps, "api": api}, f, indent=2)
    return 0


def _bench_ddp(args) -> int:
    from gradsync.bench import ddp

    if args.backend:
        return _bench_backends(args)

    try:
        caps = [float(c) for c in args.bucket_mb.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--bucket-mb {args.bucket_mb!r}: expected comma-separated numbers of MiB, e.g. 1,25") from None
    rows = ddp.run(args.workers, args.model, args.batch_size, caps, args.steps, torch_hook=args.torch_hook,
                   compiled=args.compile)
    ours = next(r["transport"] for r in rows if r["impl"].startswith("gradsync"))
    table = Table(title=f"DDP step, {args.model} ({rows[0]['params'] / 1e6:.1f}M params), {args.workers} ranks, "
                        f"batch {args.batch_size}/rank, median of {args.steps}; ours over {ours}, torch DDP over gloo")
    for column in ("implementation", "buckets", "step (ms)", "ours/torch", "vs floor", "overlap", "bytes/rank/step"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["impl"], "-" if r["buckets"] is None else str(r["buckets"]), f"{r['step_s'] * 1e3:.1f}",
                      "1.00 (baseline)" if r["impl"] == "torch DDP" else f"{r['ratio_vs_torch']:.2f}x",
                      f"{r['ratio_vs_floor']:.2f}x",
                      "-" if r["overlap"] is None else f"{r['overlap']:.0%}",
                      "-" if r["bytes_per_step"] is None else f"{r['bytes_per_step']:,}")
    _show(table, rows, args.json, 100)
    return 0


def _bench_ps(args) -> int:
    from gradsync.bench import ps

    if args.model == "word2vec":
        from gradsync.bench import ps_sparse

        batch = args.batch_size or 256
        rows = ps_sparse.run(args.workers, batch, args.steps, args.rounds)
        _show(ps_sparse.table(rows, batch, args.steps, args.rounds), rows, args.json, 130)
        return 0
    args.batch_size = args.batch_size or 64
    rows = ps.run(args.workers, args.batch_size, args.steps)
    delay_ms = max(r["delay_s"] for r in rows) * 1e3
    table = Table(title=f"parameter server (1 server) vs ring DDP: MLP {rows[0]['model_bytes'] / 4e6:.2f}M params, "
                        f"batch {args.batch_size}/worker, {args.steps} steps; the straggler sleeps {delay_ms:.1f} ms "
                        f"after each backward; bytes: server link (in+out) for PS, sent per rank for ring")
    for column in ("W", "straggler", "strategy", "transport", "samples/s", "vs ring", "step ms", "MiB/step", "formula",
                   "max stale"):
        table.add_column(column, justify="right")
    for r in rows:
        ring = next(q for q in rows if q["impl"] == "ring DDP" and q["workers"] == r["workers"]
                    and q["straggler"] == r["straggler"])
        table.add_row(str(r["workers"]), "yes" if r["straggler"] else "no", r["impl"], r["transport"],
                      f"{r['samples_per_s']:,.0f}",
                      f"{r['samples_per_s'] / ring['samples_per_s']:.2f}x", f"{r['step_ms']:.1f}",
                      f"{r['link_bytes_per_step'] / 2**20:.2f}", f"{r['formula_bytes'] / 2**20:.2f}",
                      str(r["staleness_max"]))
    _show(table, rows, args.json, 130)
    return 0


def _bench_zero1(args) -> int:
    from gradsync.bench import zero1

    rows = zero1.run(args.workers, args.batch_size, args.steps, model=args.model)
    table = Table(title=f"ZeRO-1 vs DDP, {args.model} ({rows[0]['params'] / 1e6:.2f}M params), AdamW, "
                        f"batch {args.batch_size}/rank, median of {args.steps} steps")
    for column in ("N", "implementation", "step (ms)", "time ratio", "optimizer state/rank", "state ratio",
                   "bytes sent/step"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["workers"]), r["impl"], f"{r['step_s'] * 1e3:.1f}", f"{r['time_ratio']:.2f}x",
                      f"{r['state_bytes']:,}", f"{r['state_ratio']:.3f}x", f"{r['bytes_sent_per_step']:,}")
    _show(table, rows, args.json)
    return 0


def _simulate(args) -> int:
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
    table = Table(title=f"one step: {_human_count(args.params)} params, {args.dtype} gradients = {human(nbytes)}, "
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
    _show(table, None, None, 140)
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
    _show(table, None, None, 140)
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
    _show(table, result, args.json)
    return 0


def _figures(args) -> int:
    from pathlib import Path

    from gradsync.sim import figures

    measured = Path(args.measured) if args.measured else None
    if measured is not None and not measured.is_file():
        raise ValueError(f"--measured {args.measured}: no such file; make it with "
                         f"gradsync simulate --params 1 --workers 2 --calibrated --check 2,3,4 --json {args.measured}")
    for path in figures.write_all(Path(args.out), measured):
        print(f"wrote {path} (+ {path.with_suffix('.csv').name})")
    if measured is None:
        print("measured_vs_predicted.png skipped: pass --measured JSON from gradsync simulate --calibrated --check")
    return 0


def _bench_faults(args) -> int:
    from gradsync.bench import faults

    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
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
    _show(table, rows, args.json)
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
    _show(table, rows, args.json)
    return 0 if all(r["clean"] for r in rows) else 1


def _doctor(args) -> int:
    from gradsync.doctor import examine

    findings = examine(args.run_dir)
    table = Table(title=f"gradsync doctor: {args.run_dir}")
    for column in ("check", "verdict", "finding"):
        table.add_column(column)
    colours = {"OK": "green", "WARN": "yellow", "INFO": "cyan"}
    for f in findings:
        table.add_row(f.check, f"[{colours[f.verdict]}]{f.verdict}[/]", f.detail)
    _show(table, None, None, 120)
    return 0


def _memory(args) -> int:
    from gradsync.sim import memory

    p, g, k = memory.bytes_per_parameter(args.optimizer, args.precision)
    table = Table(title=f"model state per rank: {_human_count(args.params)} parameters, {args.workers} ranks, "
                        f"{args.optimizer} {args.precision} (P={p}, G={g}, K={k} bytes per parameter)")
    for column in ("stage", "formula", "params", "grads", "optimizer", "total per rank", "vs plain DP"):
        table.add_column(column, justify="right")
    formulas = {"plain DP": "Psi*(P+G+K)", "ZeRO-1": "Psi*(P+G+K/N)", "ZeRO-2": "Psi*(P+(G+K)/N)",
                "ZeRO-3": "Psi*(P+G+K)/N"}
    plain = memory.model_state_bytes(args.params, args.workers, "plain DP", args.optimizer, args.precision).total
    for stage in memory.STAGES:
        b = memory.model_state_bytes(args.params, args.workers, stage, args.optimizer, args.precision)
        table.add_row(stage, formulas[stage], memory.human(b.param), memory.human(b.grad), memory.human(b.optimizer),
                      memory.human(b.total), f"{b.total / plain:.3f}x")
    _show(table, None, None)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "bench" and args.bench == "collectives":
            return _bench_collectives(args)
        if args.command == "bench" and args.bench == "ddp":
            return _bench_ddp(args)
        if args.command == "bench" and args.bench == "ps":
            return _bench_ps(args)
        if args.command == "bench" and args.bench == "zero1":
            return _bench_zero1(args)
        if args.command == "bench" and args.bench == "faults":
            return _bench_faults(args)
        if args.command == "train":
            return _train(args)
        if args.command == "memory":
            return _memory(args)
        if args.command == "simulate":
            return _simulate(args)
        if args.command == "figures":
            return _figures(args)
        if args.command == "doctor":
            return _doctor(args)
        if args.command == "cluster":
            from gradsync.cluster.sweep import main as cluster_main

            return cluster_main(args)
    except (ValueError, RuntimeError, TypeError) as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
