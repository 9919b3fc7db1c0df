"""Alpha-beta cost model of gradsync's collectives.

Symbols
    N      ranks;  p = 2^floor(log2 N);  L = ceil(log2 N)
    M      message size in bytes
    alpha  seconds of fixed cost per message (latency + software overhead)
    beta   seconds per byte on one link (1 / bandwidth)
    gamma  seconds per byte reduced (one add of an incoming byte into a local one)

Times (one all-reduce of M bytes; Thakur, Rabenseifner & Gropp, IJHPCA 2005; Patarasuk & Yuan,
JPDC 2009):
    ring              2(N-1)*alpha + 2(N-1)/N*M*beta + (N-1)/N*M*gamma
    halving_doubling  2*log2(p)*alpha + 2(p-1)/p*M*beta + (p-1)/p*M*gamma
                      + (N != p) * (2*alpha + 2*M*beta + M*gamma)       (fold / unfold)
    tree              2*L*(alpha + M*beta) + L*M*gamma
    naive             2(N-1)*(alpha + M*beta) + (N-1)*M*gamma             (rank 0's link serialises)
    hierarchical      G ranks per host, H = N/G hosts; intra-host link (alpha_i, beta_i):
                      2(G-1)*alpha_i + 2(G-1)/G*M*beta_i          (intra reduce-scatter + all-gather)
                      + 2(H-1)*alpha + 2(H-1)/H*(M/G)*beta        (inter-host ring on 1/G of M)
Per-rank bytes sent (the busiest rank):
    ring 2(N-1)/N*M;  halving_doubling 2(p-1)/p*M (+M when folded);  tree L*M;  naive (N-1)*M;
    hierarchical, over the inter-host link: 2(H-1)/H*M/G

Strategies (one training step; W workers, S servers, c seconds of compute per step, of which the
backward pass takes b = backward_share * c):
    ps (sync)     each server link carries W*M/S in (pushes) and W*M/S out (pulls). Full duplex,
                  with pulls of updated keys overlapping pushes of the next (a pipelined server):
                  T_comm = W*alpha + W*M/S*beta;   step = c + T_comm.
                  gradsync's server answers pulls only after the whole update (ps/server.py), so it
                  pays both phases in turn: ps_server="serial" gives step = c + 2*T_comm
                  (measured on emulated 1 Gbit/s links: docs/benchmarks.md, "Emulated cluster")
    ps-async      no step barrier: W workers go round a closed loop, their own part z = c +
                  2*(alpha + M*beta) (compute, push, pull), then the servers, which take
                  s = M/S*beta per push (a server link is full duplex); a push that finds others
                  at the servers waits for them. Mean value analysis of that loop (one queue,
                  W customers, think time z): Q_0 = 0;  for n = 1..W: R_n = s*(1 + Q_{n-1}),
                  X_n = n/(z + R_n), Q_n = X_n*R_n;  step = W/X_W = z + R_W (time per W pushes).
                  It lies between max(W*s, z + s) (the servers' throughput, or one worker's
                  round with no wait: the bound this model gave before) and z + W*s; one worker
                  pays z + s. How far the bound alone fell short on emulated links:
                  docs/studies/cluster-cost-model.md. A gradient is about W-1 versions stale on arrival
    server update u = server_update_s (default 0): seconds a server spends per step applying updates
                  (its optimizer, and the copy of the shard it answers with), between reading
                  pushes and answering pulls, so in series with its link: ps T_comm += u (one
                  update a step); ps-async's server takes W*M/S*beta + u per W pushes (W updates)
    duplex D      how long a server link takes to move M bytes each way at once, against M one way
                  (default 1: full duplex; 2: the directions take turns, as when the CPU, not the
                  wire, moves the bytes): ps-async's server wire time is W*M/S*beta*D
    ring, halving_doubling, tree, naive, hierarchical
                  step = c + T_allreduce(M)                  (no overlap with backward)
    powersgd      ddp/powersgd.py: each step, per bucket, two ring all-reduces one after another
                  (P with the uncompressed tensors, then Q), rho*M bytes in all (rho: the compressed
                  share of the gradient, ``powersgd_ratio``; sum over matrices of (n + m) r / (n m));
                  K = ceil(M / B) buckets of B = ``bucket_bytes`` (the wrapper's smaller first bucket
                  not counted): T_comm = 2K * 2(N-1)*alpha + 2(N-1)/N*rho*M*beta + (N-1)/N*rho*M*gamma;
                  step = c + T_comm (no overlap; the factorisation's own flops, 4 n m r a matrix,
                  are left out). Busiest link: 2(N-1)/N*rho*M
    diloco        diloco.py: one ring all-reduce of M every H steps (``sync_every``):
                  step = c + T_ring(M)/H; busiest link: 2(N-1)/(N H)*M a step
    ddp           ring all-reduce per bucket of B bytes, overlapped with backward. Bucket k of K
                  (reverse order) is ready when backward has produced its bytes:
                  ready_k = (c - b) + b * (k+1)*B/M;  start_k = max(ready_k, end_{k-1});
                  end_k = start_k + T_ring(B_k);  step = max(c, end_{K-1}).
                  Small B pays 2(N-1)*alpha per bucket K times; large B leaves the last reductions
                  exposed after backward ends.
Scaling efficiency = c / step (1.0: communication fully hidden or free).

Host term (host_s_per_byte = h, default 0: a NIC that moves bytes for free): seconds of CPU per
byte an endpoint sends or receives (gloo's copies, the kernel's TCP path, the server's checksums
and sums). gradsync's server thread does that work between reads, so for ps and ps-async it adds
to the wire: ps T_comm += 2*W*M/S*h (x1, the CPU is not doubled by the serial server);
ps-async's server absorbs pushes at S/(M*(beta + 2h)); with u and D its W pushes take
W*M/S*(beta*D + 2h) + u, which is W*s in the loop above. Ring-family and
hierarchical transfers and reductions are pipelined, so a rank moves bytes at the slower of its
link and its CPU: beta -> max(beta, 2h) per byte sent (each byte sent is matched by one
received; an emulated cluster's ring job measures its step instead and passes max(beta, x) as the
link's beta with h = 0: cluster/results.py). h fitted on emulated links, and where a link hides it:
docs/studies/cluster-cost-model.md.

Textbook check (a 7B model, bf16 gradients: M = 14 GB; W = 64; 200 Gbit/s = 25 GB/s): one server
receives W*M = 896 GB and sends 896 GB per step, 35.8 s each way against 250 ms of compute
(~140:1); ring sends 2*63/64*14 GB = 27.6 GB per rank, 1.10 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALGORITHMS = ("ring", "halving_doubling", "tree", "naive")
STRATEGIES = ("ps", "ps-async", "ring", "halving_doubling", "tree", "naive", "hierarchical", "ddp", "powersgd",
              "diloco")


@dataclass(frozen=True)
class Link:
    """Cost of one link. Defaults: measured on the 2-core CI machine, gloo over loopback (docs/benchmarks.md)."""

    alpha: float = 60e-6
    """Seconds per message (latency plus per-message software cost)."""
    beta: float = 1 / 2.5e9
    """Seconds per byte (1 / bandwidth)."""
    gamma: float = 1 / 4e9
    """Seconds per byte of reduction (an add over the incoming bytes)."""

    def __post_init__(self) -> None:
        if min(self.alpha, self.beta, self.gamma) < 0:
            raise ValueError(f"link costs must be >= 0, got alpha={self.alpha}, beta={self.beta}, gamma={self.gamma}")


def allreduce_time(algorithm: str, nbytes: float, n_ranks: int, link: Link) -> float:
    """Predicted seconds for one all-reduce of ``nbytes`` over ``n_ranks`` (formulas above)."""
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    if n_ranks == 1:
        return 0.0
    a, b, g, n, m = link.alpha, link.beta, link.gamma, n_ranks, nbytes
    if algorithm == "ring":
        return 2 * (n - 1) * a + 2 * (n - 1) / n * m * b + (n - 1) / n * m * g
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        t = 2 * math.log2(p) * a + 2 * (p - 1) / p * m * b + (p - 1) / p * m * g
        return t + (2 * a + 2 * m * b + m * g if n != p else 0.0)
    if algorithm == "tree":
        levels = math.ceil(math.log2(n))
        return 2 * levels * (a + m * b) + levels * m * g
    if algorithm == "naive":
        return 2 * (n - 1) * (a + m * b) + (n - 1) * m * g
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def allreduce_bytes_per_rank(algorithm: str, nbytes: float, n_ranks: int) -> float:
    """Bytes sent by the busiest rank in one all-reduce (see module docstring)."""
    n, m = n_ranks, nbytes
    if n == 1:
        return 0.0
    if algorithm == "ring":
        return 2 * (n - 1) / n * m
    if algorithm == "halving_doubling":
        p = 1 << (n.bit_length() - 1)
        return 2 * (p - 1) / p * m + (m if n != p else 0.0)
    if algorithm == "tree":
        return math.ceil(math.log2(n)) * m
    if algorithm == "naive":
        return (n - 1) * m
    raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def hierarchical_time(nbytes: float, n_ranks: int, ranks_per_host: int, inter: Link, intra: Link) -> float:
    """Intra-host reduce-scatter, inter-host ring on 1/G of the data, intra-host all-gather."""
    g = min(ranks_per_host, n_ranks)
    if n_ranks % g:
        raise ValueError(f"ranks_per_host {g} must divide the number of ranks {n_ranks}")
    hosts = n_ranks // g
    intra_t = 2 * (g - 1) * intra.alpha + 2 * (g - 1) / g * nbytes * intra.beta if g > 1 else 0.0
    inter_t = (2 * (hosts - 1) * inter.alpha + 2 * (hosts - 1) / hosts * (nbytes / g) * inter.beta
               + (hosts - 1) / hosts * (nbytes / g) * inter.gamma) if hosts > 1 else 0.0
    return intra_t + inter_t


def ddp_step_time(nbytes: float, n_ranks: int, link: Link, compute_s: float, bucket_bytes: float,
                  backward_share: float = 2 / 3) -> tuple[float, float]:
    """(step seconds, exposed communication seconds) for ring all-reduce per bucket overlapped with backward."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    backward = backward_share * compute_s
    backward_start = compute_s - backward
    count = max(1, math.ceil(nbytes / bucket_bytes))
    end = 0.0
    for k in range(count):
        size = min(bucket_bytes, nbytes - k * bucket_bytes)
        ready = backward_start + backward * min(1.0, (k + 1) * bucket_bytes / nbytes)
        end = max(ready, end) + allreduce_time("ring", size, n_ranks, link)
    step = max(compute_s, end)
    return step, step - compute_s


@dataclass(frozen=True)
class StrategyCost:
    strategy: str
    busiest_link_bytes: float
    """Bytes the busiest endpoint sends per step (a PS server: per direction; ring: per rank)."""
    comm_s: float
    """Communication seconds per step (for ddp: the part not hidden behind backward)."""
    step_s: float
    """Seconds per step (for ps-async: seconds per W pushes)."""
    efficiency: float
    """compute / step."""
    note: str = ""


def closed_loop_step(customers: int, service_s: float, think_s: float) -> float:
    """Seconds for ``customers`` visits to one first-come-first-served server that takes
    ``service_s`` a visit, each customer spending ``think_s`` away between its visits, in steady
    state: mean value analysis (module docstring, ps-async)."""
    queue, throughput = 0.0, 0.0
    for n in range(1, customers + 1):
        response = service_s * (1 + queue)
        throughput = n / (think_s + response)
        queue = throughput * response
    return customers / throughput


def strategy_cost(strategy: str, nbytes: float, workers: int, link: Link, compute_s: float, *, servers: int = 1,
                  ranks_per_host: int = 8, intra: Link | None = None, bucket_bytes: float = 25 * 2**20,
                  backward_share: float = 2 / 3, ps_server: str = "pipelined",
                  host_s_per_byte: float = 0.0, server_update_s: float = 0.0,
                  duplex: float = 1.0, powersgd_ratio: float = 0.01, sync_every: int = 8) -> StrategyCost:
    """One strategy's cost per training step (formulas in the module docstring). ``ps_server``
    (strategy "ps"): "pipelined" overlaps pulls with pushes, "serial" (gradsync's server) does not.
    ``host_s_per_byte``: the host term; ``server_update_s``: a PS server's update seconds per step;
    ``duplex``: the server link's duplex factor; ``powersgd_ratio``: the share of the gradient
    PowerSGD sends; ``sync_every``: DiLoCo's H (module docstring)."""
    if workers < 1 or servers < 1 or compute_s <= 0 or nbytes <= 0:
        raise ValueError(f"need workers >= 1, servers >= 1, compute > 0, bytes > 0; got workers={workers}, "
                         f"servers={servers}, compute={compute_s}, bytes={nbytes}")
    w, m, c = workers, nbytes, compute_s
    if host_s_per_byte < 0 or server_update_s < 0 or not 1 <= duplex <= 2:
        raise ValueError(f"need host_s_per_byte >= 0, server_update_s >= 0 and duplex in [1, 2]; got "
                         f"{host_s_per_byte}, {server_update_s} and {duplex}")
    if strategy != "ps" and strategy != "ps-async" and 2 * host_s_per_byte > link.beta:
        link = Link(alpha=link.alpha, beta=2 * host_s_per_byte, gamma=link.gamma)   # CPU-bound rank
    if strategy == "ps":
        if ps_server not in ("pipelined", "serial"):
            raise ValueError(f"ps_server must be 'pipelined' or 'serial', got {ps_server!r}")
        link_bytes = w * m / servers
        comm = (w * link.alpha + link_bytes * link.beta) * (2 if ps_server == "serial" else 1)
        comm += 2 * link_bytes * host_s_per_byte + server_update_s
        serial = f"push-then-pull server: {2 * comm:.3g} s" if ps_server == "pipelined" else "push-then-pull server"
        return StrategyCost(strategy, link_bytes, comm, c + comm, c / (c + comm),
                            f"{servers} server(s), each {link_bytes / 1e9:.3g} GB in and out; {serial}")
    if strategy == "ps-async":
        server_s = w * m / servers * (link.beta * duplex + 2 * host_s_per_byte) + server_update_s   # per W pushes
        worker_s = c + 2 * (link.alpha + m * link.beta)                                  # per push, each
        step = closed_loop_step(w, server_s / w, worker_s)
        return StrategyCost(strategy, w * m / servers, max(0.0, step - c), step, c / step,
                            f"~{w - 1} versions stale; {'server' if server_s > worker_s else 'worker'}-bound")
    if strategy in ALGORITHMS:
        comm = allreduce_time(strategy, m, w, link)
        return StrategyCost(strategy, allreduce_bytes_per_rank(strategy, m, w), comm, c + comm, c / (c + comm))
    if strategy == "hierarchical":
        g = min(ranks_per_host, w)
        hosts = w // g if w % g == 0 else None
        if hosts is None:
            raise ValueError(f"--ranks-per-host {g} must divide --workers {w}")
        comm = hierarchical_time(m, w, g, link, intra or link)
        inter_bytes = 2 * (hosts - 1) / hosts * m / g if hosts > 1 else 0.0
        return StrategyCost(strategy, inter_bytes, comm, c + comm, c / (c + comm),
                            f"{hosts} hosts x {g} ranks; bytes: inter-host link")
    if strategy == "ddp":
        step, exposed = ddp_step_time(m, w, link, c, bucket_bytes, backward_share)
        return StrategyCost(strategy, allreduce_bytes_per_rank("ring", m, w), exposed, step, c / step,
                            f"{math.ceil(nbytes / bucket_bytes)} buckets of {bucket_bytes / 2**20:g} MiB, overlapped "
                            f"with backward")
    if strategy == "powersgd":
        if not 0 < powersgd_ratio <= 1:
            raise ValueError(f"powersgd_ratio is the share of the gradient sent, in (0, 1]; got {powersgd_ratio}")
        sent = powersgd_ratio * m
        buckets = math.ceil(m / bucket_bytes)
        comm = allreduce_time("ring", sent, w, link) + (2 * buckets - 1) * 2 * (w - 1) * link.alpha   # every phase's messages
        return StrategyCost(strategy, allreduce_bytes_per_rank("ring", sent, w), comm, c + comm, c / (c + comm),
                            f"{powersgd_ratio:.3g} of the gradient, {2 * buckets} all-reduces a step")
    if strategy == "diloco":
        if not isinstance(sync_every, int) or sync_every < 1:
            raise ValueError(f"sync_every (DiLoCo's H) must be an integer >= 1, got {sync_every!r}")
        comm = allreduce_time("ring", m, w, link) / sync_every
        return StrategyCost(strategy, allreduce_bytes_per_rank("ring", m, w) / sync_every, comm, c + comm,
                            c / (c + comm), f"one all-reduce of M every {sync_every} steps")
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
