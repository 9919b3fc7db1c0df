"""The gradsync command: one module per command, each with its flags (add_parser) and what it does (run).

    gradsync train [--workers 2] [--strategy ddp] [--model cnn|pkg.mod:fn --data digits|pkg.mod:fn] [--config run.toml] ...
    gradsync bench collectives --workers 4 --sizes 4K,64K,1M,16M,64M [--transport tcp,shm] [--peers gloo,mpi] [--json out.json] [--fit]
    gradsync bench ddp --workers 2 [--backend gloo,gradsync] [--device cuda]
    gradsync bench ps --workers 2,3,4 [--steps 20]
    gradsync bench zero1 --workers 2,4
    gradsync bench slowlinks --workers 2 [--tasks digits,charlm] [--json out.json --figure out.png]
    gradsync bench faults --trials 10
    gradsync simulate --params 7e9 --dtype bf16 --workers 64 --bandwidth 200Gbit --compute 250ms
    gradsync figures --out figs/ [--measured check.json]
    gradsync doctor RUN_DIR
    gradsync export RUN_DIR [--format safetensors|pt] [--out FILE]
    gradsync memory --params 70e9 --workers 64 [--optimizer adam --precision mixed]
    gradsync cluster --strategy ps-sync,ring --workers 2,4 --link 1gbit   (root: emulated hosts, cli/cluster.py)

    train.py, bench.py (bench_collectives.py, bench_ddp.py, bench_ps.py, bench_zero1.py, bench_slowlinks.py,
    bench_faults.py, bench_scaling.py),
    simulate.py, figures.py, doctor.py, export.py, memory.py, cluster.py (cluster_tables.py): the commands
    args.py: the flags' types; output.py: tables and JSON

One rule for every command that measures: its module here owns the flags and everything it prints
(tables, Markdown); bench/, cluster/ and sim/ measure or compute and return rows (and write the
figures and JSON files drawn from them), printing at most a progress line.
"""

from __future__ import annotations

import argparse
import sys

from gradsync.cli import bench, cluster, doctor, export, figures, memory, simulate, train

COMMANDS = {"bench": bench, "simulate": simulate, "figures": figures, "doctor": doctor, "memory": memory,
            "cluster": cluster, "train": train, "export": export}
"""Each command's module, in the order `gradsync --help` lists them."""


class _OneLineErrors(argparse.ArgumentParser):
    """A command's bad flag is one line naming it and what is accepted (not the whole usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description="Data-parallel training runtime for PyTorch.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_OneLineErrors)
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)   # what was given, for commands that read it again
    try:
        return COMMANDS[args.command].run(args)
    except (ValueError, RuntimeError, TypeError) as exc:
        print(f"gradsync: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"gradsync {args.command}: interrupted", file=sys.stderr)
        return 130
