"""gradsync cluster on a small configuration: emulated hosts (network namespaces on a bridge, links
shaped to 100 Mbit/s each way), one torchrun per host. Bytes per link are held against the closed
forms, counted by the kernel's interface counters of each host's veth; timings belong to the
benchmark (docs/benchmarks.md), not here. Whatever the run made must be gone afterwards, also when
it is interrupted. Skips where network namespaces cannot be made (not root, no iproute2)."""

import os
import signal
import subprocess
import sys
import time

import pytest

from gradsync.cluster import netns
from gradsync.cluster.jobs import Job, run_job
from gradsync.cluster.results import summarize
from gradsync.group.liveness import process_alive
from gradsync.sim import cost
from gradsync.sim.rates import bits_per_second

RATE = "100mbit"
PARAMS = 250_000
D = 354                       # worker.build_model(250_000): two Linear(354, 354)
M = 2 * (D * D + D) * 4       # model bytes, float32


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def can_build():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    probe = f"gsc{os.getpid()}-probe"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        pytest.skip(f"cannot create a network namespace here ({made.stderr.strip()}); needs root or CAP_SYS_ADMIN")
    _ip("netns", "del", probe)


def _ours_in_root_namespace() -> list[str]:
    """Interfaces named like ours in the machine's own namespace (there must never be any)."""
    return [line for line in _ip("-o", "link", "show").stdout.splitlines() if "gsc-" in line]


def _per_step(rep_list, key):
    return sum(rep["link"][key] for rep in rep_list) / sum(rep["steps"] for rep in rep_list)


HEADER_SHARE = 66 / 1448
"""Ethernet + IP + TCP (with timestamps) header bytes per full segment's payload, on a 1500-byte MTU."""


def _check_link(measured: float, payload: float, what: str) -> None:
    """The kernel counts payload plus the headers of the segments that carry it, the ACKs for what
    the host receives, barriers and PS headers: never less than the payload, and at most a header
    per full segment sent (when segments are not merged into GSO packets) and an ACK per segment
    received (as a receiver that quick-acks does) more, + 20 kB per step. Every host here receives
    as much payload as it sends."""
    most = payload * (1 + 2 * HEADER_SHARE) + 20_000
    assert payload <= measured <= most, f"{what}: kernel {measured:,.0f} B/step, formula {payload:,.0f}"


@pytest.mark.slow   # a second trial: the ring's link bytes here, the PS's exact bytes in test_bench.py
@pytest.mark.timeout(240)
def test_sync_parameter_server_link_bytes_match_the_formula(can_build):
    """1 server + 2 workers on 3 hosts: the server's link carries W*M each way per step, a worker's M."""
    job = Job("ps-sync", workers=2, params=PARAMS, steps=2, reps=1)
    with netns.EmulatedCluster(job.hosts, RATE) as cluster:
        made = list(cluster.made)
        assert len(made) == 4 and all(name in netns.namespaces() for name in made)
        for namespace, dev in ((cluster.namespace(1), cluster.link_if(1)), (cluster.switch, cluster.port_if(1))):
            qdiscs = subprocess.run(["tc", "-n", namespace, "qdisc", "show", "dev", dev],
                                    capture_output=True, text=True, timeout=30).stdout
            assert "tbf" in qdiscs and "100Mbit" in qdiscs, f"{namespace} {dev}: {qdiscs}"   # upload, download
        result = run_job(cluster, job, timeout=180)
    assert not [n for n in made if n in netns.namespaces()], "namespaces left behind"
    assert not _ours_in_root_namespace()
    ranks = {r["rank"]: r for r in result["ranks"]}
    assert ranks[0]["params"] == 2 * (D * D + D) and ranks[0]["role"] == "server"
    w = job.workers
    for host, payload in ((0, w * M), (1, M), (2, M)):
        reps = ranks[host]["reps"]
        for key in ("tx_bytes", "rx_bytes"):
            _check_link(_per_step(reps, key), payload, f"host {host} {key}")
    # the meter counts exactly the payload: W pushes in and W pulls out of M each per step
    steps = job.steps * job.reps
    assert sum(rep["bytes_received"] for rep in ranks[0]["reps"]) == w * M * steps
    assert sum(rep["bytes_sent"] for rep in ranks[0]["reps"]) == w * M * steps
    row = summarize(result, RATE)   # the command's row: the server's link is the busiest
    assert row["busiest"]["host"] == 0 and row["busiest"]["meter_sent"] == w * M and row["step_s"] > 0
    # the duplex timing moved M each way over the shaped link, outside the counted reps: no faster
    # than its rate allows after the token bucket's burst (256 KiB at line rate); the server timed
    # its updates
    wire_s = (M - 256 * 1024) * 8 / bits_per_second(RATE)
    assert netns.BURST == "256kb"
    assert min(ranks[0]["duplex"].values()) >= wire_s and 1.0 <= row["duplex"] <= 2.0, ranks[0]["duplex"]
    assert row["update_s"] > 0
    # the fan timing moved W shards of M (one server) into the server's link at once, and out: no
    # faster than the rate allows after the burst; the row prices it per byte of W*M
    fan = ranks[0]["fan"]
    assert fan["shard_bytes"] == M and min(fan["in_s"], fan["out_s"], fan["both_s"]) >= (w * M - 256 * 1024) * 8 / \
        bits_per_second(RATE), fan
    assert row["fan_s_per_byte"] == {kind: fan[f"{kind}_s"] / (w * M) for kind in ("in", "out", "both")}
    assert row["pair_s_per_byte"] == ranks[0]["duplex"]["both_s"] / M   # one stream in, one out, M each


@pytest.mark.timeout(240)
def test_ring_link_bytes_match_the_formula(can_build):
    """Ring all-reduce DDP on 3 hosts: every link carries 2(N-1)/N*M each way per step."""
    job = Job("ring", workers=3, params=PARAMS, steps=2, reps=1)
    with netns.EmulatedCluster(job.hosts, RATE) as cluster:
        made = list(cluster.made)
        result = run_job(cluster, job, timeout=180)
    assert not [n for n in made if n in netns.namespaces()]
    n = job.workers
    assert M // 4 % n == 0, "one bucket whose elements split evenly into N chunks: the formula is exact"
    for rank in result["ranks"]:
        for key in ("tx_bytes", "rx_bytes"):
            _check_link(_per_step(rank["reps"], key), 2 * (n - 1) / n * M, f"rank {rank['rank']} {key}")
        assert sum(rep["bytes_sent"] for rep in rank["reps"]) == 2 * (n - 1) * M // n * job.steps * job.reps
    # the ring step's timing moved a chunk of M/N each way over the shaped links, outside the counted
    # reps: no faster than the rate allows after the token bucket's burst; the row prices it
    exchange = result["ranks"][0]["exchange"]
    assert exchange["chunk_bytes"] == M // n
    assert exchange["exchange_s"] >= (M // n - 256 * 1024) * 8 / bits_per_second(RATE), exchange
    row = summarize(result, RATE)
    assert row["exchange_s_per_byte"] == exchange["exchange_s"] / exchange["chunk_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["powersgd", "diloco"])
def test_powersgd_and_diloco_link_bytes_match_their_formulas(can_build, strategy):
    """The slow-link strategies on 3 hosts (a second trial of the ring's kind): PowerSGD r=2 sends,
    every compressed step, the factors of the two 354 x 354 matrices, (354 + 354) x 2 elements each,
    and the two biases whole, 3,540 elements through the ring's 2(N-1)/N; DiLoCo H=4 one all-reduce of
    M every 4 steps (a rep is H steps). The meter exactly (every all-reduce splits evenly into 3
    chunks), the kernel within the headers' share."""
    job = Job(strategy, workers=3, params=PARAMS, steps=2, reps=1, sync_every=4)
    with netns.EmulatedCluster(job.hosts, RATE) as cluster:
        made = list(cluster.made)
        result = run_job(cluster, job, timeout=240)
    assert not [n for n in made if n in netns.namespaces()]
    n = job.workers
    sent = 4 * (2 * (D + D) * 2 + 2 * D) if strategy == "powersgd" else M
    steps = job.steps if strategy == "powersgd" else job.sync_every
    per_step = 2 * (n - 1) * sent // n / (1 if strategy == "powersgd" else job.sync_every)
    for rank in result["ranks"]:
        assert sum(rep["steps"] for rep in rank["reps"]) == steps * job.reps
        assert sum(rep["bytes_sent"] for rep in rank["reps"]) == per_step * steps * job.reps, rank["rank"]
        for key in ("tx_bytes", "rx_bytes"):
            _check_link(_per_step(rank["reps"], key), per_step, f"{strategy} rank {rank['rank']} {key}")
    row = summarize(result, RATE)
    assert row["busiest"]["formula"] == pytest.approx(per_step)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_time_to_loss_sync_ps_follows_the_rings_curve(can_build, tmp_path):
    """`gradsync cluster --time-to-loss` with 2 workers: sync PS applies AdamW to the averaged
    gradient on its server, ring DDP on every rank, on the same samples: the same test loss at every
    evaluation (float32 sums in another order), so it reaches the ring's target at the ring's step.
    The busiest link's bytes per step: the server's, W x M of pushes in (its answers out are one pull
    more, the evaluation's); the ring's M each way at N=2."""
    import json

    from gradsync.cli import main
    from gradsync.train.models import CharLM

    out = tmp_path / "ttl.json"
    assert main(["cluster", "--time-to-loss", "--strategy", "ring,ps-sync", "--workers", "2", "--link", "1gbit",
                 "--loss-steps", "16", "--step-cap", "1", "--json", str(out)]) == 0
    ring, ps = json.loads(out.read_text())["rows"]
    assert (ring["strategy"], ps["strategy"]) == ("ring", "ps-sync")
    assert [p["step"] for p in ring["curve"]] == [p["step"] for p in ps["curve"]] == [8, 16]
    for mine, theirs in zip(ps["curve"], ring["curve"]):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4), (ps["curve"], ring["curve"])
    assert ps["target"] == ring["target"] == pytest.approx(ring["final_loss"] * 1.02)
    assert ps["reached_step"] == ring["reached_step"] is not None
    m = 4 * sum(p.numel() for p in CharLM().parameters())
    w = 2
    assert ps["busiest"]["host"] == 0, ps["busiest"]
    assert w * m <= ps["busiest"]["kernel_rx_per_step"] <= w * m * (1 + 2 * HEADER_SHARE) + 20_000, ps["busiest"]
    assert m <= ring["busiest"]["kernel_tx_per_step"] <= m * (1 + 2 * HEADER_SHARE) + 20_000, ring["busiest"]


@pytest.mark.timeout(60)
def test_a_failing_job_still_deletes_everything(can_build):
    with pytest.raises(ZeroDivisionError):
        with netns.EmulatedCluster(2, RATE) as cluster:
            made = list(cluster.made)
            1 / 0
    assert made and not [n for n in made if n in netns.namespaces()]
    assert not _ours_in_root_namespace()


@pytest.mark.timeout(60)
def test_leftovers_of_a_killed_run_are_swept(can_build):
    """A run killed with SIGKILL cannot clean up; the next cluster deletes namespaces whose pid is dead."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"gsc{dead.pid}-0-h0"
    assert _ip("netns", "add", stale).returncode == 0
    try:
        with netns.EmulatedCluster(1, RATE):
            assert stale not in netns.namespaces()
    finally:
        _ip("netns", "del", stale)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_command_deletes_its_namespaces_and_processes(can_build, signum):
    """Ctrl-C or SIGTERM while the hosts' torchruns start: the command exits and leaves nothing."""
    cmd = [sys.executable, "-m", "gradsync.cluster", "--strategy", "ring", "--workers", "2", "--link", RATE,
           "--params", "250K", "--steps", "5000"]   # minutes of work: the signal always comes first
    # as typed in a terminal: Ctrl-C acts even when this suite runs as a background job, which
    # starts with SIGINT ignored (and a child inherits that)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefix = f"gsc{proc.pid}-"
    started = time.monotonic()
    inside = []
    try:
        while not any(n.startswith(prefix) and "-h1" in n for n in netns.namespaces()):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() - started < 60, "the cluster was never built"
            time.sleep(0.05)
        time.sleep(2.0)   # torchrun and its workers are starting inside the hosts
        ours = [n for n in netns.namespaces() if n.startswith(prefix)]
        inside = [int(pid) for n in ours for pid in _ip("netns", "pids", n).stdout.split()]
        proc.send_signal(signum)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert inside, "nothing ran inside the hosts when the signal came"
    assert proc.returncode != 0, out
    assert not [n for n in netns.namespaces() if n.startswith(prefix)], out
    assert not _ours_in_root_namespace()
    assert not [pid for pid in inside if process_alive(pid)], f"processes {inside} outlived the command"


def test_needs_root_and_says_so(monkeypatch, capsys):
    from gradsync.cli import cluster

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    parser = __import__("argparse").ArgumentParser()
    cluster.add_arguments(parser)
    assert cluster.run(parser.parse_args([])) == 2
    assert "needs root" in capsys.readouterr().err


def test_cost_model_host_term_by_hand():
    """The host term (sim/cost.py): serial with the wire on the PS server, the slower of link and CPU
    for a ring rank. Numbers worked by hand: M = 16e6 B, W = 4, S = 1, c = 0.03 s, alpha = 1e-3 s,
    beta = 8e-9 s/B, h = 3e-9 s/B."""
    link = cost.Link(alpha=1e-3, beta=8e-9, gamma=0.0)
    ps = cost.strategy_cost("ps", 16e6, 4, link, 0.03, ps_server="serial", host_s_per_byte=3e-9)
    # c + 2*(W*alpha + W*M*beta) + 2*W*M*h = 0.03 + 2*(0.004 + 0.512) + 0.384
    assert ps.step_s == pytest.approx(0.03 + 1.032 + 0.384)
    assert cost.strategy_cost("ps", 16e6, 4, link, 0.03).step_s == pytest.approx(0.03 + 0.004 + 0.512)
    # ring, N=4: 2h = 6e-9 < beta: unchanged; 2h = 10e-9 > beta: every byte sent costs 10 ns
    plain = 0.03 + 6e-3 + 1.5 * 16e6 * 8e-9
    assert cost.strategy_cost("ring", 16e6, 4, link, 0.03, host_s_per_byte=3e-9).step_s == pytest.approx(plain)
    assert cost.strategy_cost("ring", 16e6, 4, link, 0.03, host_s_per_byte=5e-9).step_s == pytest.approx(
        0.03 + 6e-3 + 1.5 * 16e6 * 10e-9)
    # async: the server takes a push every s = M*(beta + 2h) = 0.224 s; each of the W workers is away
    # z = c + 2*(alpha + M*beta) = 0.288 s between its pushes: the closed loop of W = 4 (test_sim.py
    # holds closed_loop_step to its closed forms), above the server's bound of W*s = 0.896 s
    step = cost.strategy_cost("ps-async", 16e6, 4, link, 0.03, host_s_per_byte=3e-9).step_s
    assert step == pytest.approx(cost.closed_loop_step(4, 0.224, 0.288)) and 0.896 < step < 0.288 + 0.896


def test_host_term_fit_recovers_the_term_of_a_row_made_with_it():
    """fit_host_s_per_byte inverts the serial sync-PS step, step = c + 2*W*M/S*(beta + h*f) (alphas
    apart; f = max(1, 2S/C), the shared-cores factor), on rows made with known h, one server or
    two; other strategies are left out of the fit."""
    from gradsync.cluster.results import fit_host_s_per_byte, link_for

    def row(strategy, workers, servers, h):
        m, c, f = 16e6, 0.02, max(1, servers)   # 2 cores: f = S
        beta = link_for("1gbit", 1e-4).beta
        return {"strategy": strategy, "servers": servers, "workers": workers, "model_bytes": m, "link": "1gbit",
                "alpha_s": 1e-4, "compute_s": c, "step_s": c + 2 * workers * m / f * (beta + h * f), "cores": 2}

    rows = [row("ps-sync", 2, 1, 1.0e-9), row("ps-sync", 4, 2, 1.1e-9), row("ps-sync", 6, 1, 1.2e-9),
            row("ps-sync", 4, 2, 1.3e-9), row("ps-sync", 6, 2, 1.4e-9), row("ring", 4, 0, 9e-9), row("ring", 6, 0, 9e-9)]
    assert fit_host_s_per_byte(rows) == pytest.approx(1.2e-9)
    assert fit_host_s_per_byte([row("ps-sync", 2, 1, -1e-9)]) == 0.0   # faster than the wire: no host term
    with pytest.raises(ValueError, match="needs sync-PS rows"):
        fit_host_s_per_byte([row("ring", 4, 0, 1e-9)])


def test_ring_ranks_share_the_machines_cores_in_the_prediction():
    """cluster/results.py: N ring ranks on C shared cores pay h * N/C per byte, at least h. Worked by
    hand at 10 Gbit/s (beta = 1/(1.25e9 * 1448/1514) = 0.8364 ns/B), h = 1 ns/B, M = 16e6 B, N = 6,
    c = 0.02 s, alpha = 1e-4 s, gamma = 0: C = 2 -> 2h * 3 = 6 ns/B per byte sent; C = 8 -> 2h = 2 ns/B."""
    from gradsync.cluster.results import predict

    row = {"strategy": "ring", "link": "10gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 6, "servers": 0,
           "ranks_per_host": 1, "compute_s": 0.02}
    gamma_term = 5 / 6 * 16e6 * cost.Link().gamma
    for cores, per_byte in ((2, 6e-9), (8, 2e-9)):
        expected = 0.02 + 10 * 1e-4 + 2 * 5 / 6 * 16e6 * per_byte + gamma_term
        assert predict({**row, "cores": cores}, host_s_per_byte=1e-9).step_s == pytest.approx(expected)


@pytest.mark.timeout(60)
def test_a_ring_rows_measured_step_replaces_the_host_term_in_the_prediction():
    """cluster/results.py: with x, a ring step's measured seconds per byte, a ring rank sends at
    max(beta, x) per byte, whatever h and the cores; below the wire's beta the wire sets the pace;
    the wire-only prediction leaves x out. By hand at 10 Gbit/s (beta = 0.8364 ns/B), M = 16e6 B,
    N = 4, c = 0.02 s, alpha = 1e-4 s: 6 messages, 2*3/4*M = 24e6 B sent, 3/4*M = 12e6 B reduced."""
    from gradsync.cluster.results import link_for, predict, with_predictions

    row = {"strategy": "ring", "link": "10gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 4, "servers": 0,
           "ranks_per_host": 1, "compute_s": 0.02}
    beta, gamma_term = link_for("10gbit", 1e-4).beta, 12e6 * cost.Link().gamma
    for exchange, cores, h in ((3e-9, 2, 1e-9), (3e-9, 8, 5e-9), (0.5e-9, 2, 1e-9)):
        expected = 0.02 + 6 * 1e-4 + 24e6 * max(beta, exchange) + gamma_term
        got = predict({**row, "cores": cores, "exchange_s_per_byte": exchange}, host_s_per_byte=h).step_s
        assert got == pytest.approx(expected), (exchange, cores, h)
    measured = {**row, "cores": 2, "exchange_s_per_byte": 3e-9, "step_s": 0.2}
    assert with_predictions(measured, 1e-9)["wire_only_s"] == pytest.approx(0.02 + 6e-4 + 24e6 * beta + gamma_term)
    # a row saved before x was measured keeps the host term: 2h * N/C = 4 ns/B
    assert predict({**row, "cores": 2, "exchange_s_per_byte": None}, 1e-9).step_s == pytest.approx(
        0.02 + 6e-4 + 24e6 * 4e-9 + gamma_term)

    # Hierarchical, 2 hosts x 2 ranks: its rail step x replaces the host term between hosts, held to
    # the link the 2 rails share (2*beta = 1.67 ns/B): inter-host ring on M/2 (2 messages, M/2 sent,
    # M/4 reduced); the intra-host phases stay Link()'s, slowed by N/C = 2 on 2 cores
    intra = cost.Link()
    hier = {**row, "strategy": "hierarchical", "ranks_per_host": 2, "cores": 2}
    within = 2 * intra.alpha + 16e6 * intra.beta * 2
    for exchange, h in ((3e-9, 1e-9), (3e-9, 5e-9), (0.5e-9, 1e-9)):
        expected = 0.02 + 2e-4 + 8e6 * max(2 * beta, exchange) + 4e6 * intra.gamma + within
        got = predict({**hier, "exchange_s_per_byte": exchange}, host_s_per_byte=h).step_s
        assert got == pytest.approx(expected), (exchange, h)
    assert predict({**hier, "exchange_s_per_byte": None}, 5e-9).step_s == pytest.approx(   # 2h * N/C = 20 ns/B
        0.02 + 2e-4 + 8e6 * 20e-9 + 4e6 * intra.gamma + within)


@pytest.mark.timeout(60)
def test_servers_and_their_workers_share_the_machines_cores_in_the_prediction():
    """cluster/results.py: a PS row's host term is h * max(1, 2S/C) (the servers' 2*W*M*h and the
    workers' as much again on C cores); a hierarchical row's intra-host link slows by N/C with its
    host term. Worked by hand at 10 Gbit/s (beta = 0.8364 ns/B), h = 1 ns/B, M = 16e6 B, W = 4,
    c = 0.02 s, alpha = 1e-4 s. Serial sync PS: step = c + 2*(W*alpha + W*M/S*beta) + 2*W*M/S*h'."""
    from gradsync.cluster.results import predict

    beta = 1 / (1.25e9 * 1448 / 1514)
    ps = {"strategy": "ps-sync", "link": "10gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 4,
          "ranks_per_host": 1, "compute_s": 0.02}
    for servers, cores, h in ((1, 2, 1e-9), (2, 2, 2e-9), (2, 8, 1e-9), (1, 1, 2e-9)):
        expected = 0.02 + 2 * (4e-4 + 64e6 / servers * beta) + 2 * 64e6 / servers * h
        got = predict({**ps, "servers": servers, "cores": cores}, host_s_per_byte=1e-9).step_s
        assert got == pytest.approx(expected), (servers, cores)
    # Wire only (h = 0) is the textbook model: no sharing there either.
    assert predict({**ps, "servers": 2, "cores": 2}, 0.0).step_s == pytest.approx(0.02 + 2 * (4e-4 + 32e6 * beta))

    # Hierarchical, 2 hosts x 2 ranks: the 2 rails share a link (beta -> 2*beta = 1.67 ns/B), a rank
    # moves bytes at max(link beta, 2h') per byte; inter-host ring on M/2, intra-host on M (Link()).
    intra = cost.Link()
    hier = {**ps, "strategy": "hierarchical", "servers": 0, "ranks_per_host": 2}
    for cores, shared in ((2, 2.0), (4, 1.0)):
        per_byte = max(2 * beta, 2 * 1e-9 * shared)
        inter = 2 * 1e-4 + 2 * 1 / 2 * 8e6 * per_byte + 1 / 2 * 8e6 * intra.gamma
        within = 2 * intra.alpha + 2 * 1 / 2 * 16e6 * intra.beta * shared
        assert predict({**hier, "cores": cores}, 1e-9).step_s == pytest.approx(0.02 + inter + within), cores


def test_a_servers_update_is_in_series_with_its_link_in_the_prediction():
    """cluster/results.py and sim/cost.py: the servers' measured update seconds per step, u, add to
    a sync step (one update between the pushes and the answers) and to an async server's time per
    W pushes (W updates); the fit of h takes u out first; wire only leaves u out. Worked by hand at
    1 Gbit/s: M = 16e6 B, W = 4, S = 1, c = 0.02 s, alpha = 1e-4 s, h = 1 ns/B, u = 0.05 s."""
    from gradsync.cluster.results import fit_host_s_per_byte, link_for, predict, with_predictions

    beta = link_for("1gbit", 1e-4).beta
    row = {"link": "1gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 4, "servers": 1,
           "ranks_per_host": 1, "compute_s": 0.02, "cores": 2}
    sync = {**row, "strategy": "ps-sync"}
    without = 0.02 + 2 * (4e-4 + 64e6 * beta) + 2 * 64e6 * 1e-9
    assert predict(sync, 1e-9).step_s == pytest.approx(without)
    assert predict({**sync, "update_s": 0.05}, 1e-9).step_s == pytest.approx(without + 0.05)
    # async: the server takes W*M*(beta + 2h) + u = 64e6*(beta + 2e-9) + 0.05 per W pushes, a worker
    # is away c + 2*(alpha + M*beta) between its pushes: the closed loop of W = 4 (sim/cost.py)
    assert predict({**row, "strategy": "ps-async", "update_s": 0.05}, 1e-9).step_s == pytest.approx(
        cost.closed_loop_step(4, (64e6 * (beta + 2e-9) + 0.05) / 4, 0.02 + 2 * (1e-4 + 16e6 * beta)))
    measured = {**sync, "update_s": 0.05, "step_s": without + 0.05}
    assert fit_host_s_per_byte([measured]) == pytest.approx(1e-9, rel=0.01)   # the fit leaves the alphas in h
    assert with_predictions(measured, 1e-9)["wire_only_s"] == pytest.approx(0.02 + 2 * (4e-4 + 64e6 * beta))


def test_the_async_servers_wire_time_grows_with_its_measured_duplex_factor():
    """sim/cost.py via cluster/results.py: an async server's wire time per W pushes is W*M*beta*D
    (D = 1: full duplex, the model as it was; D = 2: the link's two directions take turns); sync
    rows already pay both directions in turn and do not change; wire only keeps D = 1. Worked by
    hand at 10 Gbit/s (beta = 0.8364 ns/B): M = 16e6 B, W = 4, c = 0.02 s, h = 1 ns/B, u = 0.02 s."""
    from gradsync.cluster.results import predict, with_predictions

    beta = 1 / (1.25e9 * 1448 / 1514)
    row = {"strategy": "ps-async", "link": "10gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 4,
           "servers": 1, "ranks_per_host": 1, "compute_s": 0.02, "cores": 2, "update_s": 0.02}
    away = 0.02 + 2 * (1e-4 + 16e6 * beta)   # a worker's part of the closed loop (sim/cost.py)
    for duplex in (1.0, 1.6, 2.0):
        expected = cost.closed_loop_step(4, (64e6 * (beta * duplex + 2e-9) + 0.02) / 4, away)
        assert predict({**row, "duplex": duplex}, 1e-9).step_s == pytest.approx(expected), duplex
    sync = {**row, "strategy": "ps-sync"}
    assert predict({**sync, "duplex": 2.0}, 1e-9).step_s == pytest.approx(predict(sync, 1e-9).step_s)
    assert with_predictions({**row, "duplex": 2.0, "step_s": 1.0}, 1e-9)["wire_only_s"] == pytest.approx(
        predict({**row, "update_s": 0.0}, 0.0).step_s)
    with pytest.raises(ValueError, match="duplex in"):
        cost.strategy_cost("ps-async", 16e6, 4, cost.Link(), 0.02, duplex=2.5)


def test_an_async_rows_measured_pair_replaces_its_fan_in_the_prediction():
    """cluster/results.py: an async or SSP row with its pair (M bytes in from one worker while M go out
    to another, p_pair seconds per byte) moves the server's W*M/S bytes at max(beta, p_pair) per
    byte in its part of the closed loop, whatever the fan or host term say; a sync row keeps its fan;
    wire only ignores both. Worked by hand at 10 Gbit/s (beta = 0.8364 ns/B): M = 16e6 B, W = 4,
    S = 1, c = 0.02 s, alpha = 1e-4 s, u = 0.01 s."""
    from gradsync.cluster.results import predict

    beta = 1 / (1.25e9 * 1448 / 1514)
    row = {"link": "10gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 4, "servers": 1,
           "ranks_per_host": 1, "compute_s": 0.02, "cores": 2, "update_s": 0.01, "duplex": 1.7,
           "fan_s_per_byte": {"in": 2.5e-9, "out": 3e-9, "both": 1.2e-9}, "pair_s_per_byte": 1.7e-9}
    away = 0.02 + 2 * (1e-4 + 16e6 * beta)   # a worker's part of the closed loop (sim/cost.py)
    for strategy in ("ps-async", "ssp"):
        for h in (0.0, 5e-9):
            assert predict({**row, "strategy": strategy}, h).step_s == pytest.approx(
                cost.closed_loop_step(4, (64e6 * 1.7e-9 + 0.01) / 4, away)), (strategy, h)
        slower_than_wire = {**row, "strategy": strategy, "pair_s_per_byte": 0.5e-9}   # the shaper's burst
        assert predict(slower_than_wire).step_s == pytest.approx(cost.closed_loop_step(4, (64e6 * beta + 0.01) / 4,
                                                                                       away))
        without = {**row, "strategy": strategy, "pair_s_per_byte": None}   # saved before the pair: the fan
        assert predict(without).step_s == pytest.approx(cost.closed_loop_step(4, (64e6 * 1.2e-9 + 0.01) / 4, away))
        assert predict({**row, "strategy": strategy}, wire_only=True).step_s == pytest.approx(
            cost.closed_loop_step(4, 64e6 * beta / 4, away))
    sync = {**row, "strategy": "ps-sync"}
    assert predict(sync).step_s == pytest.approx(0.02 + 8e-4 + 64e6 * (2.5e-9 + 3e-9) + 0.01)


def test_a_ps_rows_measured_fan_replaces_the_host_term_in_the_prediction():
    """cluster/results.py: a PS row with its servers' links timed in the job (every worker sending a
    shard to every server at once, and back; p_in, p_out, p_both seconds per byte through a server's
    link) moves W*M/S bytes each way at max(beta, p) in place of beta + host term: a sync step is
    c + 2*W*alpha + W*M/S*(max(beta, p_in) + max(beta, p_out)) + u (the serial server's two
    phases), an async server's W pushes take W*M/S*max(beta, p_both) + u (its part of the closed
    loop, sim/cost.py), and neither the host term
    given nor the duplex factor changes them; wire only ignores the fan. Worked by hand at 10 Gbit/s
    (beta = 0.8364 ns/B): M = 16e6 B, W = 4, S = 2, c = 0.02 s, alpha = 1e-4 s, u = 0.01 s."""
    from gradsync.cluster.results import predict

    beta = 1 / (1.25e9 * 1448 / 1514)
    row = {"link": "10gbit", "alpha_s": 1e-4, "model_bytes": 16e6, "workers": 4, "servers": 2,
           "ranks_per_host": 1, "compute_s": 0.02, "cores": 2, "update_s": 0.01, "duplex": 1.7,
           "fan_s_per_byte": {"in": 2.5e-9, "out": 3e-9, "both": 4e-9}}
    sync = {**row, "strategy": "ps-sync"}
    away = 0.02 + 2 * (1e-4 + 16e6 * beta)   # an async worker's part of the closed loop (sim/cost.py)
    for h in (0.0, 1e-9, 5e-9):
        assert predict(sync, h).step_s == pytest.approx(0.02 + 8e-4 + 32e6 * (2.5e-9 + 3e-9) + 0.01), h
        assert predict({**row, "strategy": "ps-async"}, h).step_s == pytest.approx(
            cost.closed_loop_step(4, (32e6 * 4e-9 + 0.01) / 4, away)), h
    # a fan faster than the wire (the shaper's burst) is held to the wire
    fast = {**sync, "fan_s_per_byte": {"in": 0.5e-9, "out": 3e-9, "both": 0.5e-9}}
    assert predict(fast).step_s == pytest.approx(0.02 + 8e-4 + 32e6 * (beta + 3e-9) + 0.01)
    assert predict({**fast, "strategy": "ssp"}).step_s == pytest.approx(cost.closed_loop_step(4, (32e6 * beta + 0.01) / 4,
                                                                                                 away))
    assert predict(sync, wire_only=True).step_s == pytest.approx(0.02 + 2 * (4e-4 + 32e6 * beta))


def test_diloco_settings_of_a_time_to_loss_job_reach_the_workers_optimizers(monkeypatch):
    """Job -> torchrun's argv -> loss_worker's flags -> the inner AdamW and gs.DiLoCo's arguments
    (gs.DiLoCo replaced by a recorder: no world needed), and the bad values refused."""
    from pathlib import Path

    from gradsync.cluster import jobs, loss_worker
    from gradsync.train.models import CharLM

    class NoNamespaces:
        def exec_prefix(self, host):
            return []

        def address(self, host):
            return "10.0.0.1"

    def built(job):
        argv = jobs._torchrun(NoNamespaces(), job, 0, Path("out"))
        args = loss_worker.parse_args(argv[argv.index("gradsync.cluster.loss_worker") + 1:])
        _, optimizer, recorded = loss_worker._build(args, CharLM())
        return optimizer.param_groups[0]["lr"], recorded

    monkeypatch.setattr(loss_worker.gs, "DiLoCo", lambda model, optimizer, **settings: settings)
    lr, settings = built(Job("diloco", 4, 0.0, max_steps=16, target=2.5, outer_lr=1.0, outer_momentum=0.0, inner_lr=2e-3))
    assert lr == 2e-3 and settings["outer_lr"] == 1.0
    assert settings["outer_momentum"] == 0.0 and settings["nesterov"] is False
    lr, settings = built(Job("diloco", 4, 0.0, max_steps=16))   # gradsync train's outer step, every strategy's lr
    assert lr == 1e-3 and (settings["outer_lr"], settings["outer_momentum"], settings["nesterov"]) == (0.4, 0.9, True)
    for bad in ({"outer_momentum": 1.0}, {"outer_momentum": -0.1}, {"inner_lr": 0.0}):
        with pytest.raises(ValueError, match=r"outer_momentum must be in \[0, 1\) and inner_lr > 0"):
            Job("diloco", 4, 0.0, max_steps=16, **bad)
