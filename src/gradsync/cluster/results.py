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

Prediction: sim/cost.py's row for the strategy at this link's beta, with the job's measured compute
c and fitted alpha; "wire only" is that textbook model, "predicted" adds what the emulation's shared
host costs, each term measured in the job where it could be: the host term h (HOST_S_PER_BYTE), the
PS servers' update u, the duplex factor D, the fan and the pair timings of a server's link, the ring
step x, and the shared-cores factor. comm share = (step - c) / step; the model is held to 25% where it
is >= 1/2. What each term is, how it is measured and the evidence for it: docs/studies/cluster-cost-
model.md, "What results.py prices, term by term".
"""

from __future__ import annotations

import os
import statistics

from gradsync.cluster.jobs import Job
from gradsync.sim import cost
from gradsync.sim.rates import bits_per_second

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
    return cost.Link(alpha=alpha_s, beta=1 / (bits_per_second(rate) / 8 * TCP_GOODPUT), gamma=cost.Link().gamma)


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
