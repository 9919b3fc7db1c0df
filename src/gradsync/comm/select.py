"""algorithm="auto": pick the all-reduce algorithm with the least predicted time.

The prediction is sim/cost.py's alpha-beta model. Its link costs come from a measurement:
``gradsync bench collectives --fit`` times point-to-point ping-pongs and all-reduces on this
machine, fits alpha, beta and gamma by least squares and saves them to the calibration file
($GRADSYNC_CALIBRATION, default ~/.cache/gradsync/calibration.json). Without that file the
built-in ``Link()`` defaults apply, themselves measured on the 2-core CI machine (docs/benchmarks.md).

The fit measures whatever transport carries ranks 0 and 1: on one host that is shared memory,
where "auto" does not consult the model anyway (every rank on one host uses the shared-memory
all-reduce). To calibrate the network between hosts, fit with GRADSYNC_TRANSPORT=tcp.

All ranks must pick the same algorithm for the same message, or the collective would mismatch.
So rank 0 reads the calibration once and publishes it through the rendezvous store; every other
rank reads rank 0's copy.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from gradsync.group import runtime
from gradsync.sim.cost import ALGORITHMS, Link, allreduce_time

_STORE_KEY = "gradsync/calibration"
_SHARED: dict[int, Link] = {}


def calibration_path() -> Path:
    """Where the measured link costs are cached."""
    override = os.environ.get("GRADSYNC_CALIBRATION")
    return Path(override) if override else Path.home() / ".cache" / "gradsync" / "calibration.json"


def load_calibration() -> Link:
    """The saved link costs, or the built-in defaults when none were measured here."""
    path = calibration_path()
    try:
        data = json.loads(path.read_text())
        return Link(alpha=float(data["alpha"]), beta=float(data["beta"]), gamma=float(data["gamma"]))
    except FileNotFoundError:
        return Link()
    except (ValueError, KeyError, TypeError) as exc:
        raise RuntimeError(f"calibration file {path} is unreadable ({exc}); delete it or rerun "
                           f"`gradsync bench collectives --fit`") from exc


def save_calibration(link: Link, extra: dict | None = None) -> Path:
    """Write link costs (plus how they were measured) atomically to the calibration file."""
    path = calibration_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**asdict(link), **(extra or {})}, indent=2))
    os.replace(tmp, path)
    return path


def shared_link(w: runtime.World | None = None) -> Link:
    """Rank 0's calibration, identical on every rank of ``w`` (default: the current world)."""
    w = w or runtime.world()
    link = _SHARED.get(id(w))
    if link is None:
        if w.world_size == 1 or w.store is None:
            link = load_calibration()
        elif w.rank == 0:
            link = load_calibration()
            w.store.set(_STORE_KEY, json.dumps(asdict(link)))
        else:
            link = Link(**json.loads(w.store.get(_STORE_KEY)))
        _SHARED.clear()
        _SHARED[id(w)] = link
    return link


HIERARCHICAL_FROM_BYTES = 1 << 20
"""Across hosts with several ranks each, hierarchical all-reduce from 1 MiB up: it puts 1/L of the
ring's bytes on the network. Evidence: the two-namespace run in docs/benchmarks.md."""


def choose(nbytes: int, n_ranks: int, link: Link | None = None, hosts: tuple[tuple[int, ...], ...] = (),
           shared_memory: bool = False) -> str:
    """The algorithm with the smallest predicted all-reduce time for this message size and N
    (``hosts``: the job's host layout; several hosts of equal size > 1 admit hierarchical;
    ``shared_memory``: every rank on this host over the shared-memory transport)."""
    if shared_memory:
        return "shared_memory"
    if (len(hosts) > 1 and len({len(group) for group in hosts}) == 1 and len(hosts[0]) > 1
            and nbytes >= HIERARCHICAL_FROM_BYTES):
        return "hierarchical"
    link = link or shared_link()
    return min(ALGORITHMS, key=lambda algorithm: allreduce_time(algorithm, nbytes, n_ranks, link))
