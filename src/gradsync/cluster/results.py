"""A cluster job's per-rank results -> one row: step time, per-link bytes beside the formulas, the model.

Vocabulary
    M        model bytes (float32 gradients = parameters);  W workers;  S servers;  N ranks
    L        ranks per host;  H hosts;  host h holds ranks h*L .. h*L+L-1
    link     a host's veth to the switch; tx = what the host uploads, rx = what it downloads
    R        the link rate in bit/s; payload moves at G = R/8 * 1448/1514 bytes/s (a 1500-byte MTU
             frame, 1514 bytes to the shaper with its Ethernet header, carries 1448 bytes of TCP
             payload with timestamps), so beta = 1/G

Payload bytes per step crossing a host's link, each direction (the closed forms the meter and the
kernel counters are held against):
    ps-*, server host     sum over its servers of W*M/S      (every worker pushes and pulls M/S each)
    ps-*, worker host     M per worker on it                  (its pushes to, and pulls from, all S)
    ring, L = 1           2(N-1)/N*M                          (reduce-scatter + all-gather)
    powersgd, L = 1       2(N-1)/N*rho*M                      (rho: the share a compressed step sends)
    diloco, L = 1         2(N-1)/N*M/H                        (one ring all-reduce of M every H steps)
    hierarchical, H hosts 2(H-1)/H*M                          (each of L rails: 2(H-1)/H*M/L)
The meter column is the payload the host's ranks sent to ranks on other hosts (gs.traffic(),
per peer); the kernel columns add the TCP/IP headers, ACKs, the barriers and the PS headers.

Prediction (sim/cost.py, this link's beta, the alpha fitted by the job, the job's measured compute c:
forward + backward, and for ring and hierarchical the optimizer's update and the copy of the
gradients into DDP's buckets, which the one-host hierarchical row showed missing: the update 2-3 ms
of a 22 ms step, the copy of 16 MB 2-4 ms in one process):
    ps-sync              strategy "ps" with S servers, push-then-pull server (ps_server="serial")
    ps-async, ssp        strategy "ps-async" (no straggler: a bound of 2 never binds)
    ps-*                 with u, the busiest server's update seconds per step, measured in the job
                         (median over reps; sync: one optimizer step, async and ssp: W of them),
                         in series with the server's link (cost.py, "server update"); rows saved
                         before it was measured have none (u = 0)
    ps-async, ssp        with D, the first server's link both ways at once against one way, measured
                         in the job before the reps (worker.py: M bytes in from a worker and M out
                         to another through gloo, at once and alone, medians of 5; D = both /
                         max(in, out), within [1, 2]): the async server's wire time is W*M*beta*D.
                         Measured here: D = 1.00-1.02 at 1 Gbit/s, 1.33-1.75 at 10 Gbit/s, where the
                         CPU, not the shaper, sets the pace of a transfer (docs/studies/cluster-cost-model.md)
    ps-*                 with the fan, a server's link timed in the job (worker.py: every worker
                         sends a shard of M/S bytes to every server at once, p_in seconds per byte
                         of the W*M/S through a server's link; every server to every worker,
                         p_out; both at once, p_both): sync moves a server's W*M/S bytes in at
                         max(beta, p_in) and out at max(beta, p_out) per byte, async at
                         max(beta, p_both), in place of beta + the host term (and D). The fan
                         holds the link, the kernel and the shared cores as a step's transfers meet
                         them, not the server's own work per byte: at 10 Gbit/s it ran at the link's
                         rate (0.85-0.95 ns/B, one server) while sync steps took twice the fan's
                         time until the checksums were made cheap (docs/studies/cluster-cost-model.md). Rows
                         saved before the fan was measured keep the host term and D
    ps-async, ssp        with the pair, the duplex timing's both-at-once (worker.py: M bytes in from
                         one worker while M go out to another), p_pair = both / M seconds per byte:
                         the server moves its W*M/S bytes in and out at max(beta, p_pair) per byte,
                         in place of the fan's p_both. Why: an async server reads one push at a
                         time while it answers another worker (ps/server.py), one stream in and one
                         out, as the pair has it, never W at once as the fan; at 10 Gbit/s W streams
                         at once moved their bytes about 1.5x faster per byte than one pair on the
                         2 cores (fan both 72 ms for 4 x 16 MB each way, pair 27 ms for 16 MB); over
                         three sweeps 14 of 30 async and SSP rows came within 25% with the fan,
                         26 with the pair (docs/studies/cluster-cost-model.md). Rows saved without it keep the fan
    powersgd, diloco     cost.py's rows of those names (rho, H from the job), priced as the ring
    ring                 strategy "ring"; with x, one ring step's seconds per byte measured in the
                         job (worker.py: every rank at once sends a chunk of M/N bytes to its right
                         neighbour and receives one from its left, median of 9), a rank sends at
                         max(beta, x) per byte in place of max(beta, 2h * max(1, N/C)): x holds the
                         link, both directions' CPU at once and the shared cores, as the ring meets
                         them. Why: a ring all-reduce took 2(N-1) such steps and its sum, within
                         9% (2 to 6 hosts at 10 Gbit/s), while 2h from the PS rows priced the
                         ring 25-27% short at N = 2 and, with h fitted under load, 22-35% long at
                         N = 4-6 by the medians (docs/studies/cluster-cost-model.md). Rows saved before x was
                         measured keep 2h
    hierarchical         strategy "hierarchical", L ranks per host, the intra-host link Link(); the
                         model gives every rail its own link, here the L rails of a host share its
                         one link, so the inter-host beta is L*beta; with x, a rail step measured
                         in the job (worker.py: every rank at once sends a chunk of M/N bytes to the
                         rank L after it, the L rails of a host through its one link at once), a
                         rank sends at max(L*beta, x) per byte between hosts, in place of the host
                         term, as the ring does. Why: HOST_S_PER_BYTE, fitted under load, priced
                         the idle 2x2 and 3x2 rows 30% and 77% long (docs/studies/cluster-cost-model.md). Rows
                         saved before x was measured keep the host term
"wire only" leaves the host term, u, D, the fan, the pair and x out (host_s_per_byte = 0, the textbook model);
"predicted" adds them, the host term with HOST_S_PER_BYTE, fitted on this machine from the
10 Gbit/s sync-PS rows, where the links ran at about 1 Gbit/s:
h = (step - c - u - 2*W*M/S*beta) / (2*W*M/S), divided by the row's shared-cores factor below,
the median over the rows (fit_host_s_per_byte; the one-server rows alone fall from about 0.9 to
0.5 ns/B from W = 2 to 6 within one run, so their median depends on which W a run has; the
median over all of them, S = 1 and 2, gave 0.84-0.88 ns/B in the three latest idle 10 Gbit/s
runs, against 0.66-0.75 from their one-server rows). HOST_S_PER_BYTE was fitted under heavy load;
``gradsync cluster --fit-host JSON`` fits h from the sync-PS rows of another run and predicts
with it.
comm share = (step - c) / step, measured; the model is held to 25% where it is >= 1/2.

Shared cores (a property of the emulation, not of a cluster): every emulated host runs on the same
C cores of this machine (C recorded in the row). Host work that runs at once shares them:
    ring, hierarchical   every rank moves bytes while every other rank does too, so when the N ranks
                         outnumber the cores each gets C/N of one: its host term is h * max(1, N/C)
                         (a ring row with x measured has it in x, timed with every rank at once),
                         and so are the intra-host link's beta and gamma (its copies and sums run
                         on the same cores; Link()'s defaults were measured with a core per rank)
    ps-*                 the S servers together do 2*W*M*h of host work a step (W*M in, W*M out),
                         and the workers, the other end of every byte, as much again: 4*W*M*h on
                         C cores takes 4*W*M*h/C, against a server's own 2*W*M/S*h. So the host
                         term is h * max(1, 2S/C): one server on 2 cores keeps h, two servers
                         on 2 cores pay 2h, no less than one server's time
It matters only where the host term is not hidden by the link: at 10 Gbit/s, not at 1 Gbit/s for
the ring (2h * N/C = 5.6 ns/B < beta = 8.4 ns/B); for two servers at 1 Gbit/s it adds 2*W*M/S*h,
about 10% of such a step.
"""

from __future__ import annotations

import os
import statistics

from gradsync.cluster.jobs import Job
from gradsync.cluster.netns import parse_rate
from gradsync.sim import cost

TCP_GOODPUT = 1448 / 1514
HOST_S_PER_BYTE = 2.8e-9
"""The cost model's host term on this machine (module docstring; docs/benchmarks.md, "Emulated cluster")."""
PS_STRATEGIES = ("ps-sync", "ps-async", "ssp")
PAIR_PRICED = ("ps-async", "ssp")
"""Strategies whose servers' links the model prices by the measured pair (module docstring)."""
PREDICTED_AS = {"ps-sync": "ps", "ps-async": "ps-async", "ssp": "ps-async", "ring": "ring",
                "hierarchical": "hierarchical", "powersgd": "powersgd", "diloco": "diloco"}
RING_BASED = ("ring", "powersgd", "diloco")
"""Strategies whose bytes go round the ring all-reduce (priced by the measured ring step x)."""


def link_payload_formula(job: Job, host: int, model_bytes: int, powersgd_ratio: float = 1.0) -> float | None:
    """Payload bytes per step over ``host``'s link, each direction (module docstring); None if no
    closed form is given for this layout (ring with several ranks per host). ``powersgd_ratio``: rho,
    the share of the gradient a compressed PowerSGD step sends."""
    m, w, s, ranks = model_bytes, job.workers, job.servers, range(host * job.ranks_per_host,
                                                                 (host + 1) * job.ranks_per_host)
    if job.is_ps:
        return sum(w * m / s if r < s else m for r in ranks)
    share = {"ring": 1.0, "powersgd": powersgd_ratio, "diloco": 1 / job.sync_every}.get(job.strategy)
    if share is not None and job.ranks_per_host == 1:
        return 2 * (w - 1) / w * m * share
    if job.strategy == "hierarchical":
        return 2 * (job.hosts - 1) / job.hosts * m
    return None


def machine_cores() -> int:
    """The cores every emulated host shares (those this process may run on)."""
    return len(os.sched_getaffinity(0))


def link_for(rate: str, alpha_s: float) -> cost.Link:
    """The emulated link as the cost model sees it (module docstring)."""
    return cost.Link(alpha=alpha_s, beta=1 / (parse_rate(rate) / 8 * TCP_GOODPUT), gamma=cost.Link().gamma)


def predict(row: dict, host_s_per_byte: float = HOST_S_PER_BYTE, wire_only: bool = False) -> cost.StrategyCost:
    """The cost model's step for a row of summarize() (its link, M, W, S, L, fitted alpha, compute,
    server update, measured fan, pair or ring step); ``wire_only``: the textbook model, none of the
    host term, server update, duplex factor, fan, pair or ring step."""
    if wire_only:
        host_s_per_byte = 0.0
    link = link_for(row["link"], row["alpha_s"])
    if row["strategy"] == "hierarchical":   # the host's L rails share its one link
        link = cost.Link(alpha=link.alpha, beta=link.beta * row["ranks_per_host"], gamma=link.gamma)
    extra = {"ps_server": "serial"} if row["strategy"] == "ps-sync" else {}
    shared = 1.0 if wire_only else shared_cores_factor(row)
    host_s_per_byte *= shared
    exchange = row.get("exchange_s_per_byte")
    if row["strategy"] in (*RING_BASED, "hierarchical") and exchange and not wire_only:   # measured: no host term
        link = cost.Link(alpha=link.alpha, beta=max(link.beta, exchange), gamma=link.gamma)
        host_s_per_byte = 0.0
    fan = row.get("fan_s_per_byte")
    duplex = 1.0 if wire_only else row.get("duplex", 1.0)
    pair = row.get("pair_s_per_byte") if row["strategy"] in PAIR_PRICED else None
    if pair and not wire_only:   # measured: the host term is what it adds to the wire
        host_s_per_byte, duplex = (max(link.beta, pair) - link.beta) / 2, 1.0
    elif row["strategy"] in PS_STRATEGIES and fan and not wire_only:
        host_s_per_byte, duplex = _fan_excess(fan, link.beta, row["strategy"]), 1.0
    intra = cost.Link()
    if row["strategy"] == "hierarchical":   # its intra-host copies share the cores too
        intra = cost.Link(alpha=intra.alpha, beta=intra.beta * shared, gamma=intra.gamma * shared)
    return cost.strategy_cost(PREDICTED_AS[row["strategy"]], row["model_bytes"], row["workers"], link,
                              row["compute_s"], servers=max(1, row["servers"]), ranks_per_host=row["ranks_per_host"],
                              intra=intra, host_s_per_byte=host_s_per_byte,
                              server_update_s=0.0 if wire_only else row.get("update_s", 0.0),
                              duplex=duplex, powersgd_ratio=row.get("powersgd_ratio", 1.0),
                              sync_every=row.get("sync_every", 8), **extra)


def _fan_excess(fan: dict, beta: float, strategy: str) -> float:
    """The host term h that makes cost.py's PS formulas move a server's W*M/S bytes at the measured
    fan's pace (module docstring): sync pays max(beta, p_in) + max(beta, p_out) per byte = 2*beta +
    2h, async max(beta, p_both) = beta + 2h."""
    if strategy == "ps-sync":
        return (max(beta, fan["in"]) + max(beta, fan["out"])) / 2 - beta
    return (max(beta, fan["both"]) - beta) / 2


def shared_cores_factor(row: dict) -> float:
    """How much slower host work runs in ``row`` because its processes share C cores (module
    docstring, "Shared cores"): max(1, N/C) for ring and hierarchical, max(1, 2S/C) for PS."""
    cores = row.get("cores", machine_cores())
    if row["strategy"] in (*RING_BASED, "hierarchical"):
        return max(1.0, row["workers"] / cores)
    return max(1.0, 2 * max(1, row["servers"]) / cores)


def with_predictions(row: dict, host_s_per_byte: float = HOST_S_PER_BYTE) -> dict:
    """``row`` with predicted_s (host term), wire_only_s (none) and error = predicted / measured - 1."""
    predicted = predict(row, host_s_per_byte).step_s
    return {**row, "predicted_s": predicted, "wire_only_s": predict(row, wire_only=True).step_s,
            "host_s_per_byte": host_s_per_byte, "error": predicted / row["step_s"] - 1}


def fit_host_s_per_byte(rows: list[dict]) -> float:
    """h from sync-PS rows (module docstring): the median over them of (step - c - u - 2*W*M/S*beta)
    / (2*W*M/S) / f, f the row's shared-cores factor, at least 0. The host term moves with the
    machine's load (CPU per byte), so fit it from rows measured in the conditions it is to predict."""
    fits = []
    for row in rows:
        if row["strategy"] == "ps-sync":
            traffic = 2 * row["workers"] * row["model_bytes"] / max(1, row["servers"])
            beta = link_for(row["link"], row["alpha_s"]).beta
            fits.append((row["step_s"] - row["compute_s"] - row.get("update_s", 0.0) - traffic * beta)
                        / traffic / shared_cores_factor(row))
    if not fits:
        raise ValueError("fitting the host term needs sync-PS rows (gradsync cluster --strategy ps-sync ...); "
                         "none were given")
    return max(0.0, statistics.median(fits))


def _off_host_payload(rank: dict, job: Job) -> tuple[int, int]:
    """(sent, received) payload bytes of one rank's rep to ranks on other hosts."""
    here = rank["rank"] // job.ranks_per_host
    sent = received = 0
    for peer, counts in rank["per_peer"].items():
        if int(peer) // job.ranks_per_host != here:
            sent += counts["sent"]
            received += counts["received"]
    return sent, received


def summarize(result: dict, rate: str) -> dict:
    """One row from run_job's result (see module docstring)."""
    job: Job = result["job"]
    ranks = sorted(result["ranks"], key=lambda r: r["rank"])
    model_bytes = ranks[0]["model_bytes"]
    total_steps = sum(rep["steps"] for rep in ranks[0]["reps"])
    step_s = statistics.median(rep["wall_s"] / rep["steps"] for rep in ranks[0]["reps"])
    workers = [r for r in ranks if r["role"] != "server"]
    compute_s = statistics.median(r["compute_s"] for r in workers)
    servers = [r for r in ranks if r["role"] == "server"]
    update_s = max((statistics.median(rep["update_s"] / rep["steps"] for rep in r["reps"]) for r in servers),
                   default=0.0)
    timed = ranks[0].get("duplex") or {}
    duplex = min(2.0, max(1.0, timed["both_s"] / max(timed["in_s"], timed["out_s"]))) if timed else 1.0
    pair = timed["both_s"] / model_bytes if timed else None   # worker.py times M each way
    timed_fan = ranks[0].get("fan") or {}
    fan = {kind[:-2]: timed_fan[kind] / (job.workers * timed_fan["shard_bytes"])   # per byte through a
           for kind in ("in_s", "out_s", "both_s")} if timed_fan else None        # server's link
    alpha_s = ranks[0]["alpha_s"]
    step = ranks[0].get("exchange") or {}
    exchange = step["exchange_s"] / step["chunk_bytes"] if step else None
    links = []
    for host in range(job.hosts):
        on_host = [r for r in ranks if r["rank"] // job.ranks_per_host == host]
        sent = sum(_off_host_payload({**rep, "rank": r["rank"]}, job)[0] for r in on_host for rep in r["reps"])
        received = sum(_off_host_payload({**rep, "rank": r["rank"]}, job)[1] for r in on_host for rep in r["reps"])
        leader = next(r for r in on_host if r["local_rank"] == 0)
        tx = sum(rep["link"]["tx_bytes"] for rep in leader["reps"])
        rx = sum(rep["link"]["rx_bytes"] for rep in leader["reps"])
        links.append({"host": host, "formula": link_payload_formula(job, host, model_bytes,
                                                                  ranks[0].get("powersgd_ratio", 1.0)),
                      "meter_sent": sent / total_steps, "meter_received": received / total_steps,
                      "kernel_tx": tx / total_steps, "kernel_rx": rx / total_steps})
    busiest = max(links, key=lambda link: link["kernel_tx"] + link["kernel_rx"])
    return with_predictions({"link": rate, "strategy": job.strategy, "servers": job.servers if job.is_ps else 0,
            "workers": job.workers, "ranks_per_host": job.ranks_per_host, "hosts": job.hosts,
            "params": ranks[0]["params"], "model_bytes": model_bytes, "cores": machine_cores(),
            "steps": job.steps, "reps": job.reps,
            "step_s": step_s, "reps_step_s": [rep["wall_s"] / rep["steps"] for rep in ranks[0]["reps"]],
            "compute_s": compute_s, "update_s": update_s, "duplex": duplex,
            "fan_s_per_byte": fan, "pair_s_per_byte": pair, "exchange_s_per_byte": exchange,
            "comm_share": max(0.0, step_s - compute_s) / step_s, "alpha_s": alpha_s,
            "powersgd_ratio": ranks[0].get("powersgd_ratio", 1.0), "sync_every": job.sync_every,
            "links": links, "busiest": busiest, "job_counters": result["job_counters"]})
