"""Argument types of the gradsync command: each turns one flag's text into a value, or says what is
accepted (argparse prints the message and exits with 2)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def sizes(text: str) -> list[int]:
    from gradsync.bench.collectives import parse_size

    try:
        return [parse_size(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def count(text: str) -> float:
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


def int_list(text: str) -> list[int]:
    """'2,3,4' -> [2, 3, 4] (each >= 1)."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers, e.g. 2,3,4") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected integers >= 1, e.g. 2,3,4")
    return values


def bandwidth(text: str) -> float:
    """Bytes per second from 200Gbit, 100Mbit, 25GB/s, 400MB/s (sim/rates.py)."""
    from gradsync.sim.rates import bits_per_second

    try:
        return bits_per_second(text) / 8
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def link_rates(text: str) -> list[str]:
    """'1gbit,200mbit' -> ["1gbit", "200mbit"]: link rates as written, each one sim/rates.py reads."""
    from gradsync.sim.rates import bits_per_second

    rates = [part.strip() for part in text.split(",") if part.strip()]
    if not rates:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list")
    for rate in rates:
        try:
            bits_per_second(rate)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return rates


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number > 0")
    return value


def duration(text: str) -> float:
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


def transports(text: str) -> list[str]:
    from gradsync.comm.world_transport import TRANSPORTS

    chosen = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in chosen if t not in TRANSPORTS]
    if not chosen or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: choose transports from {', '.join(TRANSPORTS)}, comma-separated")
    return chosen


PEERS = ("gloo", "mpi")


def peers(text: str) -> list[str]:
    """'gloo,mpi' -> ["gloo", "mpi"]; gloo is always one (it runs in the same processes as ours)."""
    chosen = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in chosen if p not in PEERS]
    if bad or "gloo" not in chosen:
        raise argparse.ArgumentTypeError(f"{text!r}: choose baselines from {', '.join(PEERS)}, comma-separated, "
                                         f"gloo always among them (it runs in the same processes as ours), e.g. gloo,mpi")
    return chosen


def keyword_arguments(flag: str):
    """--model-args / --data-args: 'depth=4,width=256' -> {"depth": 4, "width": 256} (train/factory.py)."""
    def parse(text: str) -> dict:
        from gradsync.train.factory import parse_arguments

        try:
            return parse_arguments(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None
    parse.__name__ = flag
    return parse
