"""python -m gradsync.cluster ...: the same as `gradsync cluster ...` (see sweep.py)."""

import argparse
import sys

from gradsync.cluster import sweep

parser = argparse.ArgumentParser(prog="python -m gradsync.cluster", description=sweep.__doc__.splitlines()[0])
sweep.add_arguments(parser)
sys.exit(sweep.main(parser.parse_args()))
