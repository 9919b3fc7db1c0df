"""gradsync bench collectives: all-reduce time, algbw, busbw and bytes per rank, ours beside torch.distributed
(and Open MPI with --peers gloo,mpi) in the same run (bench/collectives.py)."""

from __future__ import annotations

import json

from rich.table import Table

from gradsync.cli.args import peers, positive_int, sizes, transports
from gradsync.cli.output import ratio


def add_parser(benches) -> None:
    coll = benches.add_parser("collectives", help="all-reduce time, algbw, busbw, bytes per rank")
    coll.add_argument("--workers", type=positive_int, default=2, help="local ranks (default 2)")
    coll.add_argument("--sizes", type=sizes, default=sizes("4K,64K,1M,16M,64M"),
                      help="message sizes, e.g. 4K,64K,1M,16M,64M")
    coll.add_argument("--algorithms", default="ring,halving_doubling,tree,naive,shared_memory,auto",
                      help="comma-separated subset of ring,halving_doubling,tree,naive,shared_memory,auto "
                           "(shared_memory only on the shm transport; auto shows what it picked)")
    coll.add_argument("--reps", type=positive_int, default=10, help="timed calls per size and algorithm (median)")
    coll.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    coll.add_argument("--transport", type=transports, default=None,
                      help="comma-separated: auto, tcp, shm; one run each, e.g. tcp,shm (default: GRADSYNC_TRANSPORT, "
                           "else auto; a value that contradicts a set GRADSYNC_TRANSPORT is an error)")
    coll.add_argument("--peers", type=peers, default=["gloo"],
                      help="baselines, comma-separated: gloo (torch.distributed, always), mpi (Open MPI's "
                           "MPI_Allreduce via mpirun + mpi4py, the bench extra; adds an ours/MPI column)")
    coll.add_argument("--fit", action="store_true",
                      help="measure alpha/beta/gamma on this machine and save them for algorithm='auto'")
    coll.add_argument("--rounds", type=positive_int, default=1,
                      help="whole runs, each ours then the MPI peer, taking turns; the table shows the median "
                           "of the rounds' medians and each round's (default 1)")


def run(args) -> int:
    from gradsync.observe import display
    from gradsync.bench import collectives, mpi_peer
    from gradsync.comm import select

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    transports = [collectives.resolve_transport(t) for t in (args.transport or [None])]  # checked before any run
    if args.fit and len(transports) > 1:
        raise ValueError(f"--fit calibrates one transport; got --transport {','.join(transports)}: pick one")
    if args.rounds > 1 and (args.fit or len(transports) > 1):
        raise ValueError(f"--rounds {args.rounds} repeats one run: use it without --fit and with one --transport")
    with_mpi = "mpi" in args.peers
    if with_mpi:
        _require_mpi()
    console = display.console()
    ceiling = collectives.memory_copy_bandwidth()
    console.print(f"memory copy on this host (one thread, 64 MiB): {ceiling / 1e9:.1f} GB/s -- the ceiling for "
                  f"moving bytes between local ranks")
    result = {"rows": [], "fit": None, "memory_copy_GBps": ceiling / 1e9, "rounds": args.rounds}
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
                 "1.00 (baseline)" if r["algorithm"] == "native" else ratio(r["ratio_vs_native"])]
        if with_mpi:
            cells.append("1.00 (baseline)" if r["algorithm"] == mpi_peer.ALGORITHM else ratio(r["ratio_vs_mpi"]))
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


def _require_mpi() -> None:
    """--peers ...,mpi asks for the MPI peer: before anything runs, an error saying why it cannot run here
    and the exact install command, when mpi4py or mpirun is missing."""
    from gradsync.bench import mpi_peer

    reason = mpi_peer.unavailable()
    if reason:
        raise RuntimeError(f"--peers mpi: the MPI peer cannot run here: {reason}; or leave mpi out of --peers")


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
