"""gradsync bench ps: the parameter server (sync, SSP, async) beside ring DDP, with a straggler; sparse with
--model word2vec (bench/ps.py, bench/ps_sparse.py)."""

from __future__ import annotations

from rich.table import Table

from gradsync.cli.args import int_list, positive_int
from gradsync.cli.output import show


def add_parser(benches) -> None:
    ps = benches.add_parser("ps", help="parameter server (sync, SSP, async) beside ring DDP, with a straggler")
    ps.add_argument("--workers", type=int_list, default=[2, 3, 4],
                    help="comma-separated worker counts W (the server is extra)")
    ps.add_argument("--batch-size", type=positive_int, default=None, help="samples per worker (64; word2vec 256)")
    ps.add_argument("--steps", type=positive_int, default=20, help="steps per worker and configuration")
    ps.add_argument("--model", choices=("mlp", "word2vec"), default="mlp",
                    help="word2vec: sparse PS (1 and 2 servers, sync and async) beside dense ring DDP and torch's "
                         "sparse DDP (bench/ps_sparse.py)")
    ps.add_argument("--rounds", type=positive_int, default=3, help="word2vec: runs per configuration (median)")
    ps.add_argument("--json", metavar="PATH", help="also write the rows as JSON")


def run(args) -> int:
    if args.model == "word2vec":
        return _run_sparse(args)
    from gradsync.bench import ps

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
    show(table, rows, args.json, 130)
    return 0


def _run_sparse(args) -> int:
    """--model word2vec: each row beside ring DDP of the same W (bench/ps_sparse.py)."""
    from gradsync.bench import ps_sparse

    batch = args.batch_size or 256
    rows = ps_sparse.run(args.workers, batch, args.steps, args.rounds)
    first = rows[0]
    table = Table(title=f"word2vec, two {first['table_rows']:,} x {first['dim']} float32 tables, Adagrad, batch {batch}"
                        f"/worker, {args.steps} steps; median of {args.rounds} runs; bytes: busiest link (sent + "
                        f"received), torch DDP's from the all-gather form (*)")
    for column in ("W", "implementation", "step ms", "vs ring", "MiB/step", "ring/this", "held-out loss",
                   "vs dense", "max stale"):
        table.add_column(column, justify="right")
    for r in rows:
        ring = next(q for q in rows if q["impl"] == "ring DDP (dense)" and q["workers"] == r["workers"])
        table.add_row(str(r["workers"]), r["impl"], f"{r['step_ms']:.1f}", f"{ring['step_ms'] / r['step_ms']:.2f}x",
                      f"{r['busiest_link_bytes'] / 2**20:.3f}{'' if r['metered'] else '*'}",
                      f"{ring['busiest_link_bytes'] / r['busiest_link_bytes']:.1f}x", f"{r['held_out_loss']:.4f}",
                      f"{(r['held_out_loss'] / ring['held_out_loss'] - 1) * 100:+.2f}%", str(r["staleness_max"]))
    show(table, rows, args.json, 130)
    return 0
