"""Two hosts on one machine: two network namespaces joined by a veth pair (10.231.0.0/24), one
torchrun per namespace, gloo bound to the veth with GLOO_SOCKET_IFNAME. Traffic stays inside the
namespaces this test creates, and they are deleted afterwards."""

import os
import shutil
import subprocess
import sys

import pytest

HOST_ADDRESSES = ("10.231.0.1", "10.231.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def two_hosts():
    """(namespace, interface) for host 0 and host 1; skips where namespaces cannot be made."""
    if shutil.which("ip") is None:
        pytest.skip("the 'ip' command (iproute2) is not installed")
    tag = f"{os.getpid() % 100000}"
    names = [f"gs{tag}h0", f"gs{tag}h1"]
    links = [f"gsv{tag}a", f"gsv{tag}b"]
    made = _ip("netns", "add", names[0])
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here ({made.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    try:
        steps = [("netns", "add", names[1]),
                 ("link", "add", links[0], "type", "veth", "peer", "name", links[1]),
                 ("link", "set", links[0], "netns", names[0]), ("link", "set", links[1], "netns", names[1])]
        for host in (0, 1):
            steps += [("-n", names[host], "addr", "add", f"{HOST_ADDRESSES[host]}/24", "dev", links[host]),
                      ("-n", names[host], "link", "set", links[host], "up"),
                      ("-n", names[host], "link", "set", "lo", "up")]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(f"cannot build the veth pair: 'ip {' '.join(step)}' failed: {result.stderr.strip()}")
        yield list(zip(names, links))
    finally:
        for name in names:
            _ip("netns", "del", name)


def _tx_bytes(namespace: str, link: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", namespace, "cat", f"/sys/class/net/{link}/statistics/tx_bytes"],
                         capture_output=True, text=True, timeout=30)
    return int(out.stdout.strip())


def _torchrun_on_both(two_hosts, nproc: int, target: list[str], wait_s: float = 240) -> list[str]:
    """One `torchrun --nnodes 2` per namespace running ``target``; every node must exit 0; their outputs."""
    procs = []
    for node, (namespace, link) in enumerate(two_hosts):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": link, "PYTHONUNBUFFERED": "1"}
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc-per-node", str(nproc), "--node-rank", str(node),
               "--master-addr", HOST_ADDRESSES[0], "--master-port", "29500",   # the namespaces are new: any port is free
               *[arg.replace("{node}", str(node)) for arg in target]]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=wait_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} failed:\n{out[-3000:]}"
    return outputs


@pytest.mark.timeout(300)
def test_torchrun_two_nodes_over_a_veth_pair(two_hosts, tmp_path):
    outputs = _torchrun_on_both(two_hosts, 2, ["-m", "gradsync.train", "--steps", "5", "--quiet",
                                               "--out", str(tmp_path / "node{node}")])
    assert "4 worker(s)" in outputs[0] and "gradsync train: summary" in outputs[0]
    # each node's two ranks reach the other node's two ranks only through the veth pair
    for namespace, link in two_hosts:
        assert _tx_bytes(namespace, link) > 1_000_000


@pytest.mark.timeout(300)
def test_hierarchical_all_reduce_over_two_hosts_of_two_ranks(two_hosts):
    """Shared memory inside each namespace, TCP across the veth; exact sums; 1/L of the ring's bytes
    cross hosts."""
    import json

    outputs = _torchrun_on_both(two_hosts, 2, [os.path.join(os.path.dirname(__file__), "multihost_allreduce.py")])
    decoder = json.JSONDecoder()
    rows = [decoder.raw_decode(part)[0] for out in outputs for part in out.split("RESULT ")[1:]]
    assert sorted(row["rank"] for row in rows) == [0, 1, 2, 3]
    m = (1 << 20) * 8
    for row in rows:
        assert row["hosts"] == [[0, 1], [2, 3]] and row["transport"] == "ShmTransport"
        hier, auto, ring = row["results"]["hierarchical"], row["results"]["auto"], row["results"]["ring"]
        assert hier["exact"] and auto["exact"] and ring["exact"]
        # H=2 hosts, L=2 ranks each: 2(L-1)/L*M inside the host, 2(H-1)/H*M/L across
        assert hier["on_host_sent"] == m and hier["off_host_sent"] == m // 2
        assert auto == hier, "auto picks hierarchical for 8 MiB across hosts"
        # the flat ring (0-1-2-3) crosses hosts on two of its four links: ranks 1 and 3 send 2(N-1)/N*M over them
        assert ring["off_host_sent"] + ring["on_host_sent"] == 3 * m // 2


@pytest.mark.timeout(300)
def test_link_down_mid_training_is_detected_on_both_hosts(two_hosts, tmp_path):
    """Take the veth down while the two nodes train: both sides must fail, not hang."""
    import time

    timeout = 10
    procs = []
    for node, (namespace, link) in enumerate(two_hosts):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": link, "PYTHONUNBUFFERED": "1"}
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node),
               "--master-addr", HOST_ADDRESSES[0], "--master-port", "29500",
               "-m", "gradsync.train", "--steps", "100000", "--quiet", "--timeout", str(timeout),
               "--out", str(tmp_path / f"node{node}")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    metrics = tmp_path / "node0" / "metrics.jsonl"
    started = time.monotonic()
    while not (metrics.exists() and '"event": "step"' in metrics.read_text()):
        assert time.monotonic() - started < 120, "training never started"
        assert all(p.poll() is None for p in procs), "a node ended before the link went down"
        time.sleep(0.1)
    namespace, link = two_hosts[0]
    assert _ip("-n", namespace, "link", "set", "dev", link, "down").returncode == 0
    down_at = time.monotonic()
    outputs, ended = [], []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout + 90)[0])
            ended.append(time.monotonic() - down_at)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode != 0, f"node {node} ended cleanly although its peer vanished:\n{out[-2000:]}"
        assert "timed out" in out or "PeerError" in out or "Connection" in out, out[-2000:]
    # each worker gives up after its own timeout; torchrun's agent then needs a few seconds to stop
    assert max(ended) < timeout + 60, f"nodes ended {ended} s after the link went down"
