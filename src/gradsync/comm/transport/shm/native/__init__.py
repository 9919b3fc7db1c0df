"""The native core of the shared-memory transport: its hot path in plain C, the Python path beside it.

What it is: a small C extension (module.c and the files beside it, and each collective's C variant
beside its Python variant in comm/; one module, built by setup.py at
``pip install -e .``, optional, no torch headers, the GIL released while it works) that runs the
shared-memory collectives' phases on the same shared memory as the Python path: the barrier
counters, doorbells, fingerprint slots and staging halves of segment.py. A call costs a handful
of Python operations around one C call, where the Python path spends about 2 us on each of its
copies, folds, barriers and slot reads (docs/studies/small-call-cost.md).

    signal.c              doorbells, barriers, fingerprint slots: who writes which cache line, when;
                          waiting (poll, yield, futex sleep) and why no wake-up is lost
    hold.c                the collective's thread held on its rank's core (hold.py's state, shared)
    reduce.c              sum, avg, max, min on float32/64, float16, bfloat16, int32/64, bit for bit
                          as the Python path computes them (float16/bfloat16 sums in float32,
                          rounded once: reduce_ops.py)
    module.c              Core and Plan, as Python calls them: a Plan runs one collective's C variant
    comm/allreduce_one_shot.c, allreduce_two_shot.c, allreduce_in_place.c, reduce_scatter_staged.c,
    reduce_scatter_in_place.c, all_gather_in_place.c
                          the collectives, each beside its Python variant of the same name, which is
                          its fallback and its oracle (core.h declares them)

Results are bit-identical to the Python path's for every dtype and op the core takes (the same
memory, the same order of operations, the same rounding); product, the bitwise ops, bool and 8-bit
dtypes stay on the Python path. The Python path is the fallback and the oracle: the tests run both.

Which path runs: the core's wherever every local rank loaded it (agreed when the transport
connects: segment.py), unless GRADSYNC_NATIVE=0; without a built core (no C compiler at install)
the Python path runs and rank 0 says so in one line. The float16/bfloat16 sums' rounding is the
transport's to set when it starts the core (GRADSYNC_HALF_SUM, read by comm/reduce_ops.py and passed down).
"""

from __future__ import annotations

import os
import sys

import torch

ENV = "GRADSYNC_NATIVE"
"""GRADSYNC_NATIVE=0 runs the Python path even where the native core is built (1, the default: the core)."""

DTYPE_CODES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3, torch.int32: 4,
               torch.int64: 5}
"""The dtypes the core reduces (core.h's enum dtype)."""
OP_CODES = {"sum": 0, "avg": 1, "max": 2, "min": 3}
"""The reductions the core computes (core.h's enum op)."""
ONE_SHOT, TWO_SHOT, IN_PLACE, REDUCE_SCATTER_STAGED, REDUCE_SCATTER_IN_PLACE, ALL_GATHER_IN_PLACE = range(6)
"""Core.plan's algorithms (core.h's enum algorithm)."""

_LOADED: list = []


def load():
    """(the extension module, None), or (None, why the Python path runs instead)."""
    if not _LOADED:
        setting = os.environ.get(ENV, "1").strip()
        if setting not in ("0", "1", ""):
            raise ValueError(f"{ENV}={setting!r}: give 1 (the native core, the default) or 0 (the Python path)")
        if setting == "0":
            _LOADED[:] = [None, f"{ENV}=0"]
        else:
            try:
                from gradsync.comm.transport.shm.native import _core
                _LOADED[:] = [_core, None]
            except ImportError as exc:
                _LOADED[:] = [None, f"the native core is not built ({exc})"]
    return _LOADED[0], _LOADED[1]


def forget() -> None:
    """Read GRADSYNC_NATIVE again at the next load() (tests switch paths within one process)."""
    _LOADED.clear()


_SAID: list[bool] = []


def notice(why: str) -> None:
    """One line, once per process, where the core was expected but is missing."""
    if not _SAID and not why.startswith(ENV):
        _SAID.append(True)
        print(f"gradsync: the Python path runs the shared-memory collectives: {why}; reinstall with a C "
              f"compiler (pip install -e .) for the native core", file=sys.stderr)


def supports(dtype: torch.dtype, op: str) -> bool:
    """Whether the core reduces ``dtype`` with ``op``."""
    return dtype in DTYPE_CODES and op in OP_CODES


class NativeHold:
    """hold.py's CoreHold, kept by the core (hold.c), so that the core's own collectives and the
    Python path's share one hold."""

    __slots__ = ("core", "enter", "leave", "before_sleep")

    def __init__(self, native_core, own_core: int) -> None:
        self.core = own_core
        self.enter = native_core.hold_enter
        self.leave = native_core.hold_leave
        self.before_sleep = native_core.hold_before_sleep


class Counters:
    """The transport's counters where no native core keeps them (the same names as Core's)."""

    __slots__ = ("barriers", "published", "half", "split_in_half")

    def __init__(self) -> None:
        self.barriers = self.published = self.half = self.split_in_half = 0


def plan(transport, algorithm: int, numel: int, dtype: torch.dtype, op: str, fingerprint, name: str, spin: bool,
         hold: bool, piece_bytes: int = 0):
    """A native Plan for one collective's shape on ``transport`` (module.c), or None where the
    transport has no core or the core does not reduce ``dtype`` with ``op`` (the Python path runs;
    an all-gather's op is "none"). ``fingerprint``: the agreement's Fingerprint (its sequence number
    is the run's), or None."""
    core = transport.core
    op = "sum" if algorithm == ALL_GATHER_IN_PLACE else op
    if core is None or not supports(dtype, op):
        return None
    values = None if fingerprint is None else fingerprint.values()
    return core.plan(algorithm, numel, DTYPE_CODES[dtype], OP_CODES[op], values, name, spin, hold, piece_bytes)
