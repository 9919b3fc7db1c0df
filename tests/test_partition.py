"""Network partitions in live fault tolerance, on emulated hosts.

Each host is a network namespace on one bridge (gradsync.cluster.netns.EmulatedCluster: 10.231.1.<i+1>,
links at 1 Gbit/s), and runs one `torchrun --nnodes N --nproc-per-node 1 -m gradsync.train
--fault-tolerance live`, the job's store in host 0's agent (torchrun's static rendezvous). A cut is the
host's switch port set down: its packets vanish and no reset arrives, as when a cable, a switch or a
whole machine goes. A heal sets it up again. A slow or lossy link goes through a delay line
(tests/delay_line.py: this kernel has no tc-netem). The namespaces, with whatever runs in them, are
deleted when a test ends, passed or failed.

The oracles are the run's own records read against what the test did and when: the survivors' live
events (metrics.jsonl: who was lost or joined, at which step, when), the agents' logs (each worker's
exit status, when the agent left its exit barrier), each worker's own stderr (torchrun --redirects),
the checkpoint, and the sample logs (GRADSYNC_SAMPLE_LOG: every sample of every epoch trained exactly
once over the steps the job committed, tests/live_fns.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import live_fns

ROOT = Path(__file__).resolve().parent.parent
STORE_PORT = 29500   # the namespaces are new: any port is free


def _cluster(hosts: int):
    from gradsync.cluster import netns

    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    return netns.EmulatedCluster(hosts, "1gbit")


class Job:
    """One torchrun per host of ``cluster`` training the digits CNN in live mode; logs under ``out``."""

    def __init__(self, cluster, out: Path, flags: list[str], env: dict[str, str] | None = None) -> None:
        self.cluster, self.out, self.env = cluster, out, env or {}
        (out / "ids").mkdir(parents=True)
        self.procs = [self._launch(host, flags) for host in range(cluster.hosts)]
        self.ended: dict[int, float] = {}

    def _launch(self, host: int, flags: list[str]) -> subprocess.Popen:
        c = self.cluster
        env = {**os.environ, "GLOO_SOCKET_IFNAME": c.link_if(host), "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO",
               "GRADSYNC_SAMPLE_LOG": str(self.out / "ids"), "PYTHONPATH": str(ROOT / "src"), **self.env}
        cmd = [*c.exec_prefix(host), sys.executable, "-m", "torch.distributed.run", "--nnodes", str(c.hosts),
               "--nproc-per-node", "1", "--node-rank", str(host), "--master-addr", str(c.address(0)),
               "--master-port", str(STORE_PORT), "--log-dir", str(self.out / f"logs{host}"), "--redirects", "3",
               "-m", "gradsync.train", "--fault-tolerance", "live", "--seed", "0", "--quiet",
               "--preempt-signal", "none", "--out", str(self.out / f"node{host}"), *flags]
        with open(self.out / f"agent{host}.log", "w") as log:
            return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def records(self, host: int = 0) -> list[dict]:
        path = self.out / f"node{host}" / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def wait_for_steps(self, steps: int, seconds: float = 180) -> None:
        started = time.monotonic()
        while sum(r["event"] == "step" for r in self.records()) < steps:
            assert all(p.poll() is None for p in self.procs), f"a host ended before the partition:\n{self.tails()}"
            assert time.monotonic() - started < seconds, f"training never started:\n{self.tails()}"
            time.sleep(0.05)

    def port(self, host: int, state: str) -> float:
        """Set ``host``'s switch port up or down; when (time.time())."""
        subprocess.run(["ip", "-n", self.cluster.switch, "link", "set", self.cluster.port_if(host), state],
                       check=True, timeout=30)
        return time.time()

    def wait_all(self, seconds: float) -> dict[int, float]:
        """Until every agent has exited (at most ``seconds``); when each did (time.time())."""
        deadline = time.monotonic() + seconds
        while len(self.ended) < len(self.procs) and time.monotonic() < deadline:
            for host, proc in enumerate(self.procs):
                if host not in self.ended and proc.poll() is not None:
                    self.ended[host] = time.time()
            time.sleep(0.05)
        running = [h for h in range(len(self.procs)) if h not in self.ended]
        assert not running, f"hosts {running} still running {seconds:.0f} s on:\n{self.tails()}"
        return self.ended

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)

    def agent_log(self, host: int) -> str:
        return (self.out / f"agent{host}.log").read_text(errors="replace")

    def worker_stderr(self, host: int, stream: str = "stderr") -> str:
        """What host's worker wrote to ``stream`` (torchrun --redirects: <log dir>/<run>/attempt_0/0/stderr.log)."""
        found = sorted((self.out / f"logs{host}").rglob(f"{stream}.log"))
        return found[0].read_text(errors="replace") if found else ""

    def exit_status(self, host: int) -> int:
        """The worker's exit status, as its agent reports it (0 when the agent says its group succeeded)."""
        log = self.agent_log(host)
        if "Local worker group finished (WorkerState.SUCCEEDED)" in log:
            return 0
        found = re.search(r"failed \(exitcode: (-?\d+)\)", log)
        assert found, f"host {host}'s agent says nothing of its worker's end:\n{log[-3000:]}"
        return int(found.group(1))

    def tails(self) -> str:
        return "\n".join(f"--- host {h} (agent) ---\n{self.agent_log(h)[-2500:]}\n--- host {h} (worker stderr) ---\n"
                         f"{self.worker_stderr(h)[-2500:]}" for h in range(len(self.procs)))


def _live_events(job: Job) -> list[dict]:
    return [r for r in job.records() if r["event"] == "live"]


def _one_lost_contact_line(job: Job, host: int, members: list[int]) -> None:
    """Host's worker said it lost contact in one line naming the store and the members it last saw, and
    nothing else of its own (no traceback; torch's startup warnings aside), and exited 69."""
    from gradsync.live.failures import EXIT_LOST_CONTACT

    err = job.worker_stderr(host)
    said = [line for line in err.splitlines() if "lost contact" in line]
    assert len(said) == 1, f"host {host}: {len(said)} lost-contact lines:\n{err[-3000:]}"
    line = said[0]
    assert f"{job.cluster.address(0)}:{STORE_PORT}" in line and "last saw" in line and str(members) in line, line
    assert "Traceback" not in err, f"host {host}'s worker printed a traceback:\n{err[-3000:]}"
    assert job.exit_status(host) == EXIT_LOST_CONTACT, f"host {host}:\n{job.agent_log(host)[-3000:]}"


@pytest.mark.timeout(60)
def test_a_store_call_against_a_silent_server_ends_by_its_deadline(tmp_path):
    """group/bounded_store.py against a store whose host is cut off (its switch port down: no reset). A raw
    TCPStore call would block for the kernel's TCP retries (about 15 minutes, whatever its own timeout);
    each bounded call that waits for an answer raises StoreUnreachable once the store has been silent for
    the timeout (3 s), the first after 3 s and every later one at once; set, which waits for no answer,
    returns. Once the link is back, the store answers again."""
    timeout = 3.0
    with _cluster(2) as cluster:
        script = str(ROOT / "tests" / "store_cut_script.py")
        env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}
        address = str(cluster.address(0))
        server = subprocess.Popen([*cluster.exec_prefix(0), sys.executable, script, "serve", address,
                                   str(STORE_PORT)], stdout=subprocess.PIPE, text=True, env=env)
        client = None
        try:
            assert server.stdout.readline().strip() == "ready"
            client = subprocess.Popen([*cluster.exec_prefix(1), sys.executable, script, "ask", address, str(STORE_PORT),
                                       str(timeout)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
            assert client.stdout.readline().strip() == "connected"
            subprocess.run(["ip", "-n", cluster.switch, "link", "set", cluster.port_if(0), "down"], check=True)
            client.stdin.write("cut\n")
            client.stdin.flush()
            calls = [json.loads(client.stdout.readline()) for _ in range(7)]
            subprocess.run(["ip", "-n", cluster.switch, "link", "set", cluster.port_if(0), "up"], check=True)
            client.stdin.write("healed\n")
            client.stdin.flush()
            after = json.loads(client.stdout.readline())
        finally:
            for proc in (server, client):
                if proc is not None and proc.poll() is None:
                    proc.kill()
    by_call = {c["call"]: c for c in calls}
    assert by_call["set"]["error"] is None and by_call["set"]["seconds"] < 1.0, by_call["set"]
    first = by_call["get"]
    assert first["error"] == "StoreUnreachable" and timeout <= first["seconds"] < timeout + 1.5, first
    for name in ("check", "add", "compare_set", "multi_get", "wait"):
        assert by_call[name]["error"] == "StoreUnreachable" and by_call[name]["seconds"] < 0.5, by_call[name]
    assert after["value"] == "value" and after["seconds"] < 10, after


@pytest.mark.timeout(300)
def test_a_host_cut_for_good_stops_and_a_host_cut_and_healed_rejoins(tmp_path):
    """Four hosts (default floor: 2), --timeout 12. Hosts 2 and 3 are cut at once; host 2 is healed 5 s
    later, host 3 never is.

    host 3       its worker stops within the timeout and a few seconds, with one line saying it lost
                 contact with the job (the store's address, the members it last saw) and exit status 69
    hosts 0, 1   find both silent by their heartbeats, well inside the timeout, and train on as 2
    host 2       rejoins at a step boundary once the link is back, with the state of a live peer: the
                 world is 3 again within seconds of the heal, without restarting anything
    the end      hosts 0-2 finish (exit 0); their agents leave torchrun's exit barrier at once instead of
                 waiting 300 s for host 3's; every sample of every epoch trained exactly once; and the
                 job planned for the 4 ranks torchrun gave it, not --workers' default of 2: the batch line,
                 the global batch 4 x 32, the learning rate scaled by sqrt(4), 12 steps an epoch
    Rank 0 takes 200 ms more a step from step 5 (train/slow_rank.py), so that the run outlasts the heal: at
    full speed two ranks can end it before host 2 is back."""
    timeout, cut_seconds, epochs = 12, 5.0, 6
    with _cluster(4) as cluster:
        job = Job(cluster, tmp_path, ["--timeout", str(timeout), "--epochs", str(epochs)],
                  env={"GRADSYNC_SLOW_RANK": "0:5:200"})
        try:
            job.wait_for_steps(5)
            cut = job.port(2, "down")
            job.port(3, "down")
            time.sleep(cut_seconds)
            healed = job.port(2, "up")
            ended = job.wait_all(240)
        finally:
            job.stop()
        assert [job.exit_status(h) for h in range(3)] == [0, 0, 0], job.tails()
        _one_lost_contact_line(job, 3, [0, 1, 2, 3])
        assert ended[3] - cut < timeout + 10, f"host 3 stopped {ended[3] - cut:.1f} s after the cut"
        for host in range(3):   # the agent of the store's node leaves as the barrier completes, and may close
            # the store on another still reading the answer (torchrun's own race, pytorch/pytorch#69520): that one
            # logs an error and exits 0 at once; what is tested is that none waits for the gone node
            waited = re.search(r"(?:Done waiting for other agents|Error waiting on exit barrier)\. Elapsed: ([0-9.]+) "
                               r"seconds", job.agent_log(host))
            assert waited and float(waited.group(1)) < 5.0, f"host {host}'s agent:\n{job.agent_log(host)[-2000:]}"

        events = _live_events(job)
        left = [e for e in events if e["lost"]]
        back = [e for e in events if e["joined"]]
        assert sorted(m for e in left for m in e["lost"]) == [2, 3], events
        assert left[-1]["at"] - cut < timeout - 4, f"found silent {left[-1]['at'] - cut:.1f} s after the cut"
        assert [e["joined"] for e in back] == [[2]] and back[0]["world_size"] == 3, events
        assert back[0]["at"] - healed < 10, f"host 2 was back {back[0]['at'] - healed:.1f} s after the heal"

        records = job.records()
        start = next(r for r in records if r["event"] == "start")
        summary = next(r for r in records if r["event"] == "summary")
        assert start["global_batch"] == 4 * 32 and start["peak_lr"] == pytest.approx(start["base_lr"] * 2), start
        printed = job.worker_stderr(0, "stdout")
        assert "4 worker(s)" in printed and "32 per worker x 4 workers" in printed, printed[:2000]
        from gradsync.train.datasets import digits

        n = len(digits(0)[0])
        assert start["steps_per_epoch"] == math.ceil(n / 128) and summary["steps"] == epochs * start["steps_per_epoch"]
        resumed = min(e["step"] for e in left)
        ids = live_fns.trained_ids(tmp_path / "ids", [3], resumed, live_fns.void_steps(events))
        assert ids == {epoch: list(range(n)) for epoch in range(epochs)}, "samples lost or repeated"


@pytest.mark.timeout(240)
def test_the_store_host_cut_every_side_stops_within_its_timeout(tmp_path):
    """Three hosts, --timeout 10, the default --workers (2): host 0, which holds the job's store, is cut.
    Hosts 1 and 2 cannot reach the store: each stops within the timeout and a few seconds with its one
    lost-contact line and exit status 69. Host 0 finds them silent and is left alone, fewer than the
    default floor (half of 3, rounded up: 2): it trains no further, checkpoints the step it holds and
    exits 75, saying why. Nothing hangs. Its batch was planned for the 3 ranks torchrun gave it (3 workers
    in the batch line, a global batch of 96, the learning rate scaled by sqrt(3)), and so was the
    checkpoint."""
    from gradsync import checkpoint
    from gradsync.train.preempt import EXIT_PREEMPTED

    timeout = 10
    with _cluster(3) as cluster:
        job = Job(cluster, tmp_path, ["--timeout", str(timeout), "--epochs", "20"])
        try:
            job.wait_for_steps(5)
            cut = job.port(0, "down")
            ended = job.wait_all(120)
        finally:
            job.stop()
        for host in (1, 2):
            _one_lost_contact_line(job, host, [0, 1, 2])
        assert max(ended.values()) - cut < timeout + 10, {h: round(t - cut, 1) for h, t in ended.items()}
        assert job.exit_status(0) == EXIT_PREEMPTED, job.tails()
        printed = job.worker_stderr(0, "stdout")
        assert "3 worker(s)" in printed and "32 per worker x 3 workers" in printed, printed[:2000]
        records = job.records()
        note = [r["text"] for r in records if r["event"] == "note"]
        assert any("fewer than the floor of 2" in text for text in note), note
        stopped = next(r for r in records if r["event"] == "preempted")
        start = next(r for r in records if r["event"] == "start")
        assert start["global_batch"] == 3 * 32 and start["peak_lr"] == pytest.approx(start["base_lr"] * 3 ** 0.5)
        state = checkpoint.load(tmp_path / "node0" / "checkpoint.pt")
        assert state["step"] == stopped["step"] and state["batch"]["workers"] == 3, (state["step"], state["batch"])


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_slow_link_and_a_lossy_link_evict_no_one(tmp_path):
    """Three hosts, the default timeout. Host 2's link goes through a delay line: 200 ms each way for 20 s,
    then 10% of its frames lost, each way, for 20 s, then a plain wire. Its heartbeats arrive late or are
    sent again, never 3 s apart: no one is evicted (no live event), every host finishes, and every sample
    of every epoch is trained exactly once."""
    from tests import delay_line

    with _cluster(3) as cluster:
        line = delay_line.start(cluster, 2)
        job = Job(cluster, tmp_path, ["--epochs", "10"])
        try:
            job.wait_for_steps(5)
            steps = {}
            for name, delay_ms, loss in (("slow", 200, 0.0), ("lossy", 0, 0.1)):
                before = sum(r["event"] == "step" for r in job.records())
                delay_line.set_line(line, delay_ms, loss)
                time.sleep(20)
                steps[name] = sum(r["event"] == "step" for r in job.records()) - before
            delay_line.set_line(line, 0, 0.0)
            job.wait_all(300)
        finally:
            job.stop()
            delay_line.stop(line)
        assert [job.exit_status(h) for h in range(3)] == [0, 0, 0], job.tails()
        assert not _live_events(job), _live_events(job)
        assert all(count >= 1 for count in steps.values()), f"steps trained on each link: {steps}"
        from gradsync.train.datasets import digits

        n = len(digits(0)[0])
        assert live_fns.trained_ids(tmp_path / "ids", [], 0) == {epoch: list(range(n)) for epoch in range(10)}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_the_default_timeout_a_host_cut_for_good_is_found_in_seconds(tmp_path):
    """Three hosts, the default --timeout (60 s): host 2 is cut for good. Hosts 0 and 1 find it silent by its
    heartbeat in at most 5 s (not after the 60 s a receive would wait) and finish; host 2 stops within the
    timeout and a few seconds, with its one line and exit status 69."""
    with _cluster(3) as cluster:
        job = Job(cluster, tmp_path, ["--epochs", "8"])
        try:
            job.wait_for_steps(5)
            cut = job.port(2, "down")
            ended = job.wait_all(150)
        finally:
            job.stop()
        assert [job.exit_status(h) for h in range(2)] == [0, 0], job.tails()
        _one_lost_contact_line(job, 2, [0, 1, 2])
        (event,) = _live_events(job)
        found = event["at"] - event["seconds"] - cut   # when the survivors caught it, before their recovery
        assert event["lost"] == [2] and found <= 5.0, f"found {found:.1f} s after the cut: {event}"
        assert ended[2] - cut < 60 + 10, f"host 2 stopped {ended[2] - cut:.1f} s after the cut"
