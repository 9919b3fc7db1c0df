"""gradsync figures: PNG figures and the CSV behind each, from the cost model and this machine's check
(sim/figures.py)."""

from __future__ import annotations


def add_parser(commands) -> None:
    figs = commands.add_parser("figures", help="PNG figures + CSV from the cost model (and this machine's check)")
    figs.add_argument("--out", default="figs", help="output directory (default figs/)")
    figs.add_argument("--measured", metavar="JSON", default=None,
                      help="rows from gradsync simulate --calibrated --check 2,3,4 --json JSON, for the "
                           "measured-vs-predicted figure")


def run(args) -> int:
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
