"""Emulated hosts on one machine: network namespaces on a bridge, every host's link shaped to a rate.

Vocabulary
    host      a network namespace holding one end of a veth pair, ``link_if`` (10.231.1.<i+1>/24)
    switch    a namespace of its own holding a bridge; the other end of every host's veth pair (its
              "port") is enslaved to it. Nothing is created in the machine's own namespace: the
              veth pairs are made inside the namespaces, so deleting the namespaces deletes them all
    link      host <-> switch. Both ends are shaped with a token bucket (tc-tbf), so upload (host
              side egress) and download (port egress) are each limited to ``rate``, as on a
              full-duplex NIC:
                  tc qdisc add dev IF root tbf rate R burst 256kb latency 50ms
              (netem does not work on this kernel.) A link of R bit/s moves R/8 bytes/s each way.
    prefix    gsc<pid>-<n>: every name this process makes starts with it, so leftovers of a run
              killed with SIGKILL are recognised (their pid is dead) and swept by the next run or by
              ``gradsync cluster --clean``.

Addresses are only ever inside 10.231.0.0/16 and only inside the namespaces made here.
Counters: ``counters(host)`` reads the kernel's interface statistics of the host's end (the same
numbers as /sys/class/net/IF/statistics/{tx,rx}_bytes inside the namespace): tx = upload, rx =
download, including Ethernet/IP/TCP headers and ACKs.

Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and iproute2 (`ip`, `tc`); ``unavailable()`` says why not.
"""

from __future__ import annotations

import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field

from gradsync.group.liveness import process_alive
from gradsync.sim.rates import bits_per_second

SUBNET = ipaddress.ip_network("10.231.1.0/24")
"""The hosts' addresses: host i is .(i+1). Must stay inside ALLOWED."""
ALLOWED = ipaddress.ip_network("10.231.0.0/16")
MAX_HOSTS = 64
BURST = "256kb"
QUEUE_LATENCY = "50ms"
NAME_PATTERN = re.compile(r"^gsc(\d+)-\d+-")
_SERIAL = itertools.count()


def unavailable() -> str | None:
    """Why emulated hosts cannot be built here (None when they can)."""
    if os.geteuid() != 0:
        return (f"gradsync cluster needs root to create network namespaces and shape links (running as uid "
                f"{os.geteuid()}); run it with sudo or as root")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"gradsync cluster needs iproute2 ({' and '.join(missing)} not found on PATH)"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"'{' '.join(args)}' failed: {result.stderr.strip() or result.stdout.strip()}")
    return result


def namespaces() -> list[str]:
    """Names of every network namespace on this machine."""
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def delete_namespace(name: str) -> None:
    """Kill whatever still runs inside ``name`` (only our own jobs run there), then delete it."""
    pids = _run("ip", "netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    _run("ip", "netns", "del", name, check=False)


def sweep_stale(everything: bool = False) -> list[str]:
    """Delete namespaces left by cluster runs whose process is gone (``everything``: also live ones)."""
    swept = []
    for name in namespaces():
        match = NAME_PATTERN.match(name)
        if match and (everything or not process_alive(int(match.group(1)))):
            delete_namespace(name)
            swept.append(name)
    return swept


@dataclass
class EmulatedCluster:
    """``hosts`` namespaces on one bridge, every link shaped to ``rate`` (see module docstring).

    Use as a context manager: the namespaces exist inside the ``with`` block and are deleted on the
    way out, whatever the way out (an exception, KeyboardInterrupt, a signal turned into one).
    """

    hosts: int
    rate: str
    """Rate of every link in each direction as sim/rates.py reads it, e.g. "1gbit" or "25MB/s"
    (tc is given it in bits per second, so every spelling the command accepts shapes the link)."""
    prefix: str = field(default_factory=lambda: f"gsc{os.getpid()}-{next(_SERIAL)}")
    made: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in 1..{MAX_HOSTS}, got {self.hosts}")
        self.rate_bits = bits_per_second(self.rate)
        for host in range(self.hosts):
            assert self.address(host) in ALLOWED

    # -- names -------------------------------------------------------------------------------------
    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def link_if(self, host: int) -> str:
        """The host's end of its link (inside namespace(host)); GLOO_SOCKET_IFNAME for its ranks."""
        return f"gsc-h{host}"

    def port_if(self, host: int) -> str:
        """The switch's end of the host's link (inside the switch namespace)."""
        return f"gsc-p{host}"

    def address(self, host: int) -> ipaddress.IPv4Address:
        return SUBNET.network_address + host + 1

    # -- building ----------------------------------------------------------------------------------
    def __enter__(self) -> "EmulatedCluster":
        try:
            self.build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def build(self) -> None:
        """switch namespace + bridge; per host: namespace, veth pair, address, both ends shaped."""
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        sweep_stale()
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "gsc-br", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "gsc-br", "up")
        for host in range(self.hosts):
            ns, link, port = self.namespace(host), self.link_if(host), self.port_if(host)
            self._add_namespace(ns)
            _run("ip", "-n", ns, "link", "add", link, "type", "veth", "peer", "name", port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "gsc-br")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(host)}/{SUBNET.prefixlen}", "dev", link)
            _run("ip", "-n", ns, "link", "set", link, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            for where, dev in ((ns, link), (self.switch, port)):   # upload, download
                _run("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf",
                     "rate", f"{self.rate_bits:.0f}bit", "burst", BURST, "latency", QUEUE_LATENCY)

    def _add_namespace(self, name: str) -> None:
        self.made.append(name)   # before it exists: an interrupted `ip netns add` is still cleaned up
        _run("ip", "netns", "add", name)

    def destroy(self) -> None:
        """Delete every namespace made here (and with them the veths, the bridge and the qdiscs).
        Ctrl-C is held back while this runs so that a second one cannot interrupt the cleanup."""
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if _main_thread() else None
        try:
            for name in reversed(self.made):
                delete_namespace(name)
            self.made.clear()
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)

    def leftovers(self) -> list[str]:
        """Namespaces of this cluster that still exist (empty after destroy())."""
        return [n for n in namespaces() if n.startswith(self.prefix + "-")]

    # -- using -------------------------------------------------------------------------------------
    def exec_prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program inside host ``host``."""
        return ["ip", "netns", "exec", self.namespace(host)]

    def counters(self, host: int) -> dict[str, int]:
        """Kernel counters of the host's link end: tx_bytes (upload), rx_bytes (download), packets."""
        out = _run("ip", "netns", "exec", self.namespace(host), "cat",
                   *[f"/sys/class/net/{self.link_if(host)}/statistics/{c}"
                     for c in ("tx_bytes", "rx_bytes", "tx_packets", "rx_packets")]).stdout.split()
        return dict(zip(("tx_bytes", "rx_bytes", "tx_packets", "rx_packets"), map(int, out)))


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()

