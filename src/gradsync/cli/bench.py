"""gradsync bench: benchmarks, ours beside torch.distributed in the same run; one module per benchmark."""

from __future__ import annotations

from gradsync.cli import (bench_collectives, bench_ddp, bench_faults, bench_ps, bench_scaling, bench_slowlinks,
                          bench_zero1)

BENCHES = {"collectives": bench_collectives, "ddp": bench_ddp, "ps": bench_ps, "zero1": bench_zero1,
           "slowlinks": bench_slowlinks, "faults": bench_faults, "scaling": bench_scaling}
"""Each benchmark's module, in the order `gradsync bench --help` lists them."""


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmarks: ours beside torch.distributed, same run")
    benches = bench.add_subparsers(dest="bench", required=True)
    for one in BENCHES.values():
        one.add_parser(benches)


def run(args) -> int:
    return BENCHES[args.bench].run(args)
