"""TrafficMeter: every byte this rank sends or receives, per peer and per operation.

Two classes of traffic are kept apart:
    payload   tensor bytes an algorithm moves (what the formulas count: ring all-reduce sends
              2(N-1)/N*M payload bytes per rank);
    control   small fixed-layout headers (collective fingerprints, parameter-server message
              headers), counted separately so the payload counters stay exact.
Beside them, host staging's copies of CUDA tensors (device to host and back, comm/host_staging.py):
bytes that cross the PCIe bus for a collective, not the wire.

The meter is updated from the transport when a transfer completes, possibly from a background
communication thread, so every update takes a lock. A repeated small all-reduce takes none: it
adds one to its own call counter (``tally``), and the meter multiplies its calls by their bytes when
it is read or reset.
"""

from __future__ import annotations

import threading
from collections import defaultdict


MAX_TALLIES = 256
"""The most call counters (TrafficMeter.tally) one meter keeps."""


class TrafficMeter:
    """Counts bytes sent and received, per peer rank and per operation label."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tallies: dict[tuple, list] = {}   # tally()'s counters: key -> [counter, calls counted]
        self.reset()

    def reset(self) -> None:
        """Zero every counter."""
        with self._lock:
            self._sent = 0
            self._received = 0
            self._control_sent = 0
            self._control_received = 0
            self._device_to_host = 0
            self._host_to_device = 0
            self._per_peer: dict[int, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0})
            self._per_op: dict[str, dict[str, int]] = defaultdict(lambda: {"sent": 0, "received": 0})
            for entry in self._tallies.values():
                entry[1] = entry[0][0]

    def record_staging(self, *, device_to_host: int = 0, host_to_device: int = 0) -> None:
        """Count bytes copied between a device and host memory for a collective (host staging), beside
        the wire's: they cross the PCIe bus, not the network."""
        with self._lock:
            self._device_to_host += device_to_host
            self._host_to_device += host_to_device

    def record(self, *, peer: int, nbytes: int, op: str, sent: bool, control: bool = False) -> None:
        """Count one completed transfer of ``nbytes`` to (sent=True) or from ``peer``."""
        direction = "sent" if sent else "received"
        with self._lock:
            if control:
                if sent:
                    self._control_sent += nbytes
                else:
                    self._control_received += nbytes
                return
            if sent:
                self._sent += nbytes
            else:
                self._received += nbytes
            self._per_peer[peer][direction] += nbytes
            self._per_op[op][direction] += nbytes

    def record_exchange(self, *, peer: int, received: int, sent: int, op: str, control: bool = False) -> None:
        """Count both directions of one exchange with ``peer`` at once (one lock instead of two:
        the shared-memory collectives record every peer this way on every call)."""
        with self._lock:
            self._count_exchange(peer, received, sent, op, control)

    def record_exchanges(self, exchanges, *, op: str, control: bool = False) -> None:
        """Count several exchanges at once, each ``(peer, nbytes)`` received from and sent to ``peer``
        (one lock for all the peers of a small collective)."""
        with self._lock:
            for peer, nbytes in exchanges:
                self._count_exchange(peer, nbytes, nbytes, op, control)

    def tally(self, exchanges, *, op: str, control_each: int = 0,
              control_op: str | None = None) -> list[int] | None:
        """A call counter for a collective that repeats the same ``exchanges`` (as in
        record_exchanges) and ``control_each`` control bytes each way with each of those peers, for
        ``control_op``: its caller adds 1 to ``counter[0]`` after each call, and the meter counts
        the calls' bytes when it is read or reset, so the call itself takes no lock (a repeated
        small all-reduce: comm/allreduce_one_shot.py). Only the caller writes the counter; the meter
        keeps how many of its calls it has counted. One counter per distinct set of arguments, kept
        while the meter lives; None once MAX_TALLIES are kept (the caller records each call with
        record_exchanges instead), so a program of ever new shapes does not grow the meter."""
        key = (tuple(exchanges), op, control_each, control_op)
        with self._lock:
            entry = self._tallies.get(key)
            if entry is None:
                if len(self._tallies) >= MAX_TALLIES:
                    return None
                entry = self._tallies[key] = [[0], 0]
            return entry[0]

    def _count_tallies(self) -> None:
        """Count the calls of every tally() counter made since the last count (under the lock)."""
        for (exchanges, op, control_each, control_op), entry in self._tallies.items():
            calls = entry[0][0] - entry[1]
            if calls:
                entry[1] += calls
                for peer, nbytes in exchanges:
                    if nbytes:
                        self._count_exchange(peer, calls * nbytes, calls * nbytes, op, False)
                    if control_each:
                        self._count_exchange(peer, calls * control_each, calls * control_each, control_op, True)

    def _count_exchange(self, peer: int, received: int, sent: int, op: str, control: bool) -> None:
        if control:
            self._control_received += received
            self._control_sent += sent
            return
        self._received += received
        self._sent += sent
        for counts in (self._per_peer[peer], self._per_op[op]):
            counts["received"] += received
            counts["sent"] += sent

    def snapshot(self) -> dict:
        """A copy of the counters: bytes_sent, bytes_received, per_peer, per_op, control_bytes_*."""
        with self._lock:
            self._count_tallies()
            return {
                "bytes_sent": self._sent,
                "bytes_received": self._received,
                "per_peer": {peer: dict(c) for peer, c in sorted(self._per_peer.items())},
                "per_op": {op: dict(c) for op, c in sorted(self._per_op.items())},
                "control_bytes_sent": self._control_sent,
                "control_bytes_received": self._control_received,
                "device_to_host_bytes": self._device_to_host,
                "host_to_device_bytes": self._host_to_device,
            }


METER = TrafficMeter()
"""The process-wide meter every transport of this rank reports to."""


def traffic() -> dict:
    """This rank's traffic since the last traffic_reset(); see TrafficMeter.snapshot."""
    return METER.snapshot()


def traffic_reset() -> None:
    """Zero this rank's traffic counters."""
    METER.reset()
