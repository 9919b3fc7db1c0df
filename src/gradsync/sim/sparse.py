"""Cost model of a sparse table's step: sparse parameter server vs dense ring all-reduce vs sparse all-gather.

Symbols (cost.py for alpha, beta)
    R     rows of the table;  D  elements per row;  e  bytes per element;  r = D*e bytes per row
    u     unique rows one worker's batch touches (and pulls) per step
    W     workers;  S  parameter servers;  c  compute seconds per step

Rows are striped over the servers (row r on server r mod S, ps/row_sharding.py), so each server gets
u/S of every worker's rows. Per step and per server link (ps/sparse_wire.py):
    in    W*u/S*(8 + r)    pushed ids and rows        + W*u/S*8   ids of the rows each worker pulls
    out   W*u/S*r          pulled rows
    sparse PS    T = (W*alpha + in*beta) + (W*alpha + out*beta)     (gradsync's server answers pulls after
                                                                     the update: the two phases in turn)
    dense ring   T = 2(W-1)*alpha + 2(W-1)/W*R*r*beta                (every row, every step)
    sparse all-gather (torch DDP, sparse gradients on gloo): every rank's rows reach every rank,
                 T = (W-1)*alpha + (W-1)*u*(8 + r)*beta;  busiest link (W-1)*u*(8 + r) received
Busiest link bytes: sparse PS in + out on a server; ring 2(W-1)/W*R*r sent (the same received).

Crossover: sparse PS and ring take equal time at
    u* = S * (2(W-1)/W*R*r*beta + (2(W-1) - 2W)*alpha) / (W*(16 + 2r)*beta)
touched rows per worker; below u* the sparse server wins. With R*r fixed, u* grows with S and R and
shrinks as W grows (each server link carries every worker's rows, ring's per-rank bytes do not grow).
Example: R = 50,000, D = 128, fp32 (r = 512 B), W = 4, S = 1, 10 Gbit/s, alpha = 5 us:
ring sends 2*3/4*25.6 MB = 38.4 MB per rank (30.7 ms); u* = (30.7 ms - 10 us) / (4*1040 B*0.8 ns) = 9,200
rows per worker, so a batch touching 1,000 rows is ~9x cheaper on the server.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync.sim.cost import Link


@dataclass(frozen=True)
class SparseCost:
    name: str
    busiest_link_bytes: float
    comm_s: float
    step_s: float


def sparse_costs(rows: int, dim: int, touched: float, workers: int, link: Link, compute_s: float, *,
                 servers: int = 1, element_size: int = 4) -> list[SparseCost]:
    """Sparse PS, dense ring and sparse all-gather for one step (formulas in the module docstring)."""
    if rows < 1 or dim < 1 or workers < 1 or servers < 1 or not 0 <= touched <= rows:
        raise ValueError(f"need rows >= 1, dim >= 1, workers >= 1, servers >= 1 and 0 <= touched rows <= rows; got "
                         f"rows={rows}, dim={dim}, touched={touched}, workers={workers}, servers={servers}")
    row_bytes = dim * element_size
    per_server = workers * touched / servers
    ps_in, ps_out = per_server * (8 + row_bytes) + per_server * 8, per_server * row_bytes
    ps_s = (workers * link.alpha + ps_in * link.beta) + (workers * link.alpha + ps_out * link.beta)
    table = rows * row_bytes
    ring_bytes = 2 * (workers - 1) / workers * table
    ring_s = 2 * (workers - 1) * link.alpha + ring_bytes * link.beta
    gather_bytes = (workers - 1) * touched * (8 + row_bytes)
    gather_s = (workers - 1) * link.alpha + gather_bytes * link.beta
    return [SparseCost(f"sparse PS (S={servers})", ps_in + ps_out, ps_s, compute_s + ps_s),
            SparseCost("dense ring all-reduce", ring_bytes, ring_s, compute_s + ring_s),
            SparseCost("sparse all-gather (torch DDP)", gather_bytes, gather_s, compute_s + gather_s)]


def crossover_rows(rows: int, dim: int, workers: int, link: Link, *, servers: int = 1, element_size: int = 4) -> float:
    """u*: touched rows per worker at which the sparse PS and dense ring take equal time (module docstring)."""
    row_bytes = dim * element_size
    ring_s = 2 * (workers - 1) * link.alpha + 2 * (workers - 1) / workers * rows * row_bytes * link.beta
    per_row_s = workers * (16 + 2 * row_bytes) * link.beta / servers
    return max(0.0, (ring_s - 2 * workers * link.alpha) / per_row_s) if per_row_s else float("inf")
