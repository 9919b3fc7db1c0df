"""gradsync cluster: emulated hosts (network namespaces, shaped links), step time and per-link bytes beside
the cost model; needs root (cluster/sweep.py has the flags and the run)."""

from __future__ import annotations


def add_parser(commands) -> None:
    cluster = commands.add_parser("cluster", help="emulated hosts (network namespaces, shaped links): step time "
                                  "and per-link bytes beside the cost model; needs root")
    from gradsync.cluster.sweep import add_arguments as add_cluster_arguments

    add_cluster_arguments(cluster)


def run(args) -> int:
    from gradsync.cluster.sweep import main

    return main(args)
