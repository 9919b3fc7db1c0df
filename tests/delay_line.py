"""A delay line on an emulated host's link: every Ethernet frame between the host and its switch held for a
set delay, and dropped with a set probability, in both directions (tc-netem's delay and loss, which this
kernel does not have: `tc qdisc add ... netem` answers "Specified qdisc kind is unknown").

How: the host's switch port is taken off the bridge, and a veth pair is put in its place: one end on the
bridge, the other beside the port; a process in the switch's namespace reads each frame off one of the
two interfaces with an AF_PACKET socket and writes it to the other once its delay is over (or drops it).
Frames leave in the order they came. Each is read and written with its virtio-net header
(PACKET_VNET_HDR), so the kernel completes on the way out what the sender left to the hardware: the
TCP and UDP checksums of a veth's frames, and the segmenting of a GSO frame longer than the MTU.

Run as a program (python -m tests.delay_line NAMESPACE PORT LINE), it forwards until its standard input
closes; each line read there, "DELAY_MS LOSS", sets both (0 0: a plain wire).
"""

from __future__ import annotations

import heapq
import os
import random
import select
import socket
import subprocess
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
"""linux/if_packet.h: frames read and written with a struct virtio_net_hdr in front (10 bytes)."""


def _ip(namespace: str, *args: str) -> None:
    subprocess.run(["ip", "-n", namespace, *args], check=True, capture_output=True, timeout=30)


def insert(cluster, host: int) -> tuple[str, str]:
    """Put a delay line's interfaces on ``host``'s link in ``cluster`` (netns.EmulatedCluster): the port off the
    bridge, a veth pair (dl0 on the bridge, dl1 beside the port); returns (port, dl1), the two ends the
    forwarder joins."""
    switch = cluster.switch
    port = cluster.port_if(host)
    _ip(switch, "link", "set", "dev", port, "nomaster")
    _ip(switch, "link", "add", "dl0", "type", "veth", "peer", "name", "dl1")
    _ip(switch, "link", "set", "dev", "dl0", "master", "gsc-br")
    for dev in ("dl0", "dl1"):
        _ip(switch, "link", "set", "dev", dev, "up")
    return port, "dl1"


def start(cluster, host: int) -> subprocess.Popen:
    """insert() and the forwarder, a plain wire until set(); stop it with stop()."""
    port, line = insert(cluster, host)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen(["ip", "netns", "exec", cluster.switch, sys.executable, "-m", "tests.delay_line",
                             port, line], stdin=subprocess.PIPE, text=True, cwd=here)


def set_line(forwarder: subprocess.Popen, delay_ms: float, loss: float) -> None:
    forwarder.stdin.write(f"{delay_ms} {loss}\n")
    forwarder.stdin.flush()


def stop(forwarder: subprocess.Popen) -> None:
    if forwarder.poll() is None:
        forwarder.stdin.close()
        try:
            forwarder.wait(timeout=10)
        except subprocess.TimeoutExpired:
            forwarder.kill()
            forwarder.wait()


def _open(interface: str) -> socket.socket:
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.bind((interface, ETH_P_ALL))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.setblocking(False)
    return sock


def forward(a: str, b: str) -> None:
    """Frames a <-> b, each held ``delay`` and dropped with probability ``loss`` (set from stdin)."""
    socks = {a: _open(a), b: _open(b)}
    other = {socks[a]: socks[b], socks[b]: socks[a]}
    delay, loss = 0.0, 0.0
    due: list[tuple[float, int, socket.socket, bytes]] = []
    serial = 0
    control = sys.stdin
    while True:
        wait = max(0.0, due[0][0] - time.monotonic()) if due else 1.0
        ready, _, _ = select.select([control, *other], [], [], wait)
        for source in ready:
            if source is control:
                line = control.readline()
                if not line:
                    return
                delay_ms, loss = (float(v) for v in line.split())
                delay = delay_ms / 1000.0
                continue
            while True:
                try:
                    frame, address = source.recvfrom(1 << 17)
                except BlockingIOError:
                    break
                except OSError:   # the link blinked (a setting changed, its peer went down): nothing to read
                    break
                if address[2] == socket.PACKET_OUTGOING:   # our own writes, seen on the way out
                    continue
                if loss and random.random() < loss:
                    continue
                serial += 1
                heapq.heappush(due, (time.monotonic() + delay, serial, other[source], frame))
        now = time.monotonic()
        while due and due[0][0] <= now:
            _, _, target, frame = heapq.heappop(due)
            try:
                target.send(frame)
            except OSError:   # a frame the interface refuses (or its queue is full): lost, as on a wire
                pass


if __name__ == "__main__":
    forward(sys.argv[1], sys.argv[2])
