"""python -m gradsync.cluster ...: the same as `gradsync cluster ...` (its flags and run: cli/cluster.py)."""

import argparse
import sys

from gradsync.cli import cluster

parser = argparse.ArgumentParser(prog="python -m gradsync.cluster", description=cluster.__doc__.splitlines()[0])
cluster.add_arguments(parser)
sys.exit(cluster.run(parser.parse_args()))
