"""Link rates as people write them: one parser for the command line's --bandwidth and --link flags.

    200Gbit, 10gbit, 200mbit, 500kbit      bits per second (tc's spelling, any case)
    25GB/s, 400MB/s                        bytes per second
"""

from __future__ import annotations

_BITS_PER_SECOND = {"tbit": 1e12, "gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "tb/s": 8e12, "gb/s": 8e9, "mb/s": 8e6}


def bits_per_second(text: str) -> float:
    """The rate ``text`` names, in bits per second; ValueError saying what is accepted otherwise."""
    raw = text.strip().lower()
    for unit, scale in _BITS_PER_SECOND.items():
        if raw.endswith(unit):
            try:
                value = float(raw[:-len(unit)]) * scale
            except ValueError:
                break
            if value > 0:
                return value
    raise ValueError(f"{text!r} is not a bandwidth (a link rate); use e.g. 200Gbit, 1gbit, 200mbit or 25GB/s")
