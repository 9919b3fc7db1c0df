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


@pytest.mark.slow   # a second trial: torchrun across emulated hosts trains in the live node loss and partitions
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


@pytest.mark.slow   # a second trial: test_partition.py's host cut for good finds it and bounds both sides
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


ELASTIC_JOB = ["--batch-size", "16", "--epochs", "25", "--seed", "0", "--timeout", "20", "--quiet",
               "--checkpoint-every", "10"]   # 45 steps/epoch at a global batch of 32


def _starts(out) -> list[tuple[int, int, int]]:
    """(workers, first step logged, last step logged) per start of the job in ``out`` (rank 0's log)."""
    import json

    path, runs = out / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record["event"] == "start":
            config = record["config"]
            runs.append([record["global_batch"] // (config["batch_size"] * config["grad_accum"]), None, None])
        elif record["event"] == "step" and runs:
            runs[-1][1] = runs[-1][1] or record["step"]
            runs[-1][2] = record["step"]
    return [tuple(run) for run in runs]


@pytest.mark.slow   # another route to a node lost and taken back: test_partition.py's healed host rejoins
@pytest.mark.timeout(420)
def test_elastic_torchrun_goes_on_without_a_lost_node_and_admits_it_back(two_hosts, tmp_path):
    """torchrun --nnodes 1:2 on each host, c10d rendezvous on host 0, --out shared: every process of
    host 1 is SIGKILLed mid-training; host 0's agent restarts its worker alone, which continues on one
    worker from the last periodic checkpoint; host 1 starts again and is admitted at the next
    restart, for which the agent stops host 0's worker with SIGTERM (a preemption: it checkpoints
    the step it finished), and the job continues on two workers from that step. Exit 0 on both
    hosts and >= 95% on digits."""
    import json
    import signal
    import time

    def launch(node: int) -> subprocess.Popen:
        namespace, link = two_hosts[node]
        # torch 2.13's agents share the rendezvous store across rounds, and a node that joins after the
        # first round waits for a MASTER_ADDR that rank 0 published only in that first round: opt out
        env = {**os.environ, "GLOO_SOCKET_IFNAME": link, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO",
               "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"{HOST_ADDRESSES[0]}:29500", "--rdzv-id", "elastic",
               "--local-addr", HOST_ADDRESSES[node],   # else workers are sent to the machine's host name
               "--rdzv-conf", f"last_call_timeout=3,is_host={int(node == 0)}", "--monitor-interval", "0.5",
               "-m", "gradsync.train", *ELASTIC_JOB, "--out", str(tmp_path)]
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def wait_for(what: str, ready, procs, seconds: float = 150):
        deadline = time.monotonic() + seconds
        while not ready(_starts(tmp_path)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                outputs = [p.communicate(timeout=30)[0] for p in procs]
                raise AssertionError(f"{what}: starts {_starts(tmp_path)}\n" + "\n---\n".join(o[-12000:] for o in outputs))
            time.sleep(0.2)

    host0, host1 = launch(0), launch(1)
    procs = [host0, host1]
    try:
        wait_for("both hosts train", lambda s: s and s[-1][0] == 2 and (s[-1][2] or 0) >= 25, procs)
        killed_after = _starts(tmp_path)[-1][2]
        for pid in _ip("netns", "pids", two_hosts[1][0]).stdout.split():  # host 1 is gone, agent and worker
            os.kill(int(pid), signal.SIGKILL)
        host1.wait(timeout=30)
        wait_for("host 0 goes on alone", lambda s: s[-1][0] == 1 and s[-1][1] is not None, [host0])
        host1 = launch(1)
        procs = [host0, host1]
        wait_for("host 1 is admitted back", lambda s: len(s) >= 3 and s[-1][0] == 2 and s[-1][1] is not None, procs)
        outputs = [proc.communicate(timeout=240)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"host {node} failed:\n{out[-3000:]}"
    runs = _starts(tmp_path)
    assert [workers for workers, _, _ in runs] == [2, 1, 2], runs
    # host 1 killed: host 0 continues from the last periodic checkpoint, losing at most 10 steps
    resumed = runs[1][1] - 1
    assert resumed % 10 == 0 and killed_after - 10 < resumed <= runs[0][2], (runs, killed_after)
    # host 1 back: the agent stops host 0's worker with SIGTERM, a preemption, so it checkpoints the
    # step it finished and the two workers continue from there: nothing lost
    assert runs[2][1] - 1 == runs[1][2], runs
    summary = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
               if '"summary"' in x][-1]
    assert summary["steps"] == 25 * 45 and summary["accuracy"] >= 0.95, summary


@pytest.mark.slow   # another route: test_partition.py's host cut for good, the survivors train on under torchrun
@pytest.mark.timeout(300)
def test_live_torchrun_a_node_lost_the_other_trains_on(two_hosts, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 2 -m gradsync.train --fault-tolerance live`: every process of
    host 1 (agent and both workers) is SIGKILLed mid-training, a machine lost. Host 0's two workers go
    on without a restart: one recovery, members [2, 3] lost, a world of 2 ranks on one host (shared
    memory), found by the heartbeats (live/heartbeat.py) well inside the 30-s quorum timeout; host 0's
    workers succeed, and every sample of every epoch is trained exactly once over the committed steps.
    Host 0's agent then leaves torchrun's exit barrier at once, exit status 0: the live job's rank 0 checked
    in for the node that is gone (group/agent_barrier.py), which torchrun alone would have waited 300 s for."""
    import json
    import signal
    import time

    from gradsync.train.datasets import digits
    from tests import live_fns

    epochs, timeout = 8, 30
    (tmp_path / "ids").mkdir()
    procs = []
    for node, (namespace, link) in enumerate(two_hosts):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": link, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO",
               "GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids")}
        cmd = ["ip", "netns", "exec", namespace, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
               "--master-addr", HOST_ADDRESSES[0], "--master-port", "29500",
               "-m", "gradsync.train", "--fault-tolerance", "live", "--epochs", str(epochs), "--seed", "0",
               "--timeout", str(timeout), "--quiet", "--preempt-signal", "none", "--out", str(tmp_path / f"node{node}")]
        with open(tmp_path / f"host{node}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    metrics, log0 = tmp_path / "node0" / "metrics.jsonl", tmp_path / "host0.log"
    try:
        started = time.monotonic()
        while not (metrics.exists() and metrics.read_text().count('"event": "step"') >= 5):
            assert all(p.poll() is None for p in procs), "a node ended before host 1 was lost"
            assert time.monotonic() - started < 150, "training never started"
            time.sleep(0.05)
        for pid in _ip("netns", "pids", two_hosts[1][0]).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        killed = time.monotonic()
        while "Local worker group finished" not in log0.read_text() and procs[0].poll() is None:
            assert time.monotonic() - killed < 200, f"host 0 did not finish:\n{log0.read_text()[-4000:]}"
            time.sleep(0.1)
        finished = time.monotonic()
        procs[0].wait(timeout=60)
        left = time.monotonic() - finished
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
    host0 = log0.read_text()
    assert "Local worker group finished (WorkerState.SUCCEEDED)" in host0, f"host 0 failed:\n{host0[-4000:]}"
    assert procs[0].returncode == 0 and left < 30, f"host 0's agent left {left:.1f} s after its workers finished " \
                                                   f"(exit status {procs[0].returncode}):\n{host0[-2000:]}"
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    (live,) = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [2, 3] and live["members"] == [0, 1] and live["world_size"] == 2, live
    assert live["seconds"] < timeout / 3, f"the recovery took {live['seconds']:.1f} s: the quorum waited out its timeout"
    start, summary = (next(r for r in records if r["event"] == event) for event in ("start", "summary"))
    n = len(digits(0)[0])
    steps_per_epoch = -(-n // start["global_batch"])   # keep-global: the same global batch after the loss
    assert len(summary["bytes_sent_per_rank"]) == 2 and summary["steps"] == epochs * steps_per_epoch, summary
    assert live_fns.trained_ids(tmp_path / "ids", live["lost"], live["step"]) == {
        epoch: list(range(n)) for epoch in range(epochs)}, "samples lost or repeated"


@pytest.mark.timeout(180)
def test_pytorchjob_environment_one_process_per_pod(two_hosts):
    """Kubernetes' PyTorchJob: each pod (here a namespace) runs one process with MASTER_ADDR, MASTER_PORT,
    RANK and WORLD_SIZE set and no LOCAL_RANK. gs.init() reads them; each rank is local rank 0 of 1 (the
    host exchange finds it alone on its host), and the all-reduce spans both pods: 1 + 2."""
    import json

    script = os.path.join(os.path.dirname(__file__), "env_world_script.py")
    procs = []
    for rank, (namespace, link) in enumerate(two_hosts):
        env = {**{k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "LOCAL_WORLD_SIZE")},
               "GLOO_SOCKET_IFNAME": link, "MASTER_ADDR": HOST_ADDRESSES[0], "MASTER_PORT": "29500",
               "RANK": str(rank), "WORLD_SIZE": "2"}
        procs.append(subprocess.Popen(["ip", "netns", "exec", namespace, sys.executable, script], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    results = []
    for rank, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"pod {rank} failed:\n{out[-3000:]}"
        results += [json.loads(line.split("RESULT ", 1)[1]) for line in out.splitlines() if line.startswith("RESULT ")]
    assert sorted((r["rank"], r["world_size"], r["local_rank"], r["local_world_size"], r["sum"]) for r in results) == [
        (0, 2, 0, 1, 3.0), (1, 2, 0, 1, 3.0)]
    assert all(r["hosts"] == [[0], [1]] for r in results)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first", ["returner", "rank 0"])
def test_a_gone_node_is_checked_in_for_once_whoever_settles_it_first(monkeypatch, first):
    """torchrun's exit barrier with 4 nodes, nodes 2 and 3 gone from the live job's final world, node 2's
    worker back after the run's end (left out by a partition that healed late). Node 2 is checked in for
    exactly once: by its own agent when its worker settled its fate first (claim_own_check_in), by rank 0
    otherwise, and then the worker is told to exit non-zero. Oracle: torch's own agent check-in
    (store_util._barrier_nonblocking): the last key is set by the last of the agents that do check in, not
    before it, so the store's node does not leave early and close the store on the others."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.utils import store as store_util

    from gradsync.group import agent_barrier
    from gradsync.group.bounded_store import BoundedStore, Contact

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    raw = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10), wait_for_workers=False)
    store = BoundedStore(raw, Contact(f"127.0.0.1:{raw.port}", 10.0))
    prefix = f"job/{agent_barrier.TERMINAL_STATE}"   # the agents' store: the job's, under the run id
    try:
        def returner() -> bool:
            monkeypatch.setenv("GROUP_RANK", "2")
            return agent_barrier.claim_own_check_in(store)

        if first == "returner":
            assert returner() and agent_barrier.check_in_for_gone_nodes(store, {"0", "1"}) == 1
            agents = ["0", "1", "2"]
        else:
            assert agent_barrier.check_in_for_gone_nodes(store, {"0", "1"}) == 2 and not returner()
            agents = ["0", "1"]
        for i, _node in enumerate(agents):
            assert not raw.check([prefix + "/last_member"]), f"the barrier was complete before agent {i} checked in"
            store_util._barrier_nonblocking(raw, 4, prefix)
        assert raw.check([prefix + "/last_member"]) and raw.add(prefix + "/num_members", 0) == 4
    finally:
        store.close()
