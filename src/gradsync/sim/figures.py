"""gradsync figures: what the cost model (cost.py) says at cluster scale, as PNG figures plus the CSV behind each.

    traffic_vs_ranks.png     bytes per step through the parameter server's link (W*M in, W*M out)
                             against one ring rank (2(N-1)/N*M sent), a PowerSGD rank (1% of M)
                             and a DiLoCo rank (H = 8), N = 2 .. 1024, M = 14 GB (7B parameters,
                             bf16 gradients)
    step_time_vs_ranks.png   step time of sync PS, ring all-reduce, DDP (25 MiB buckets), PowerSGD
                             (1% of the gradient sent) and DiLoCo (H = 8) at 10, 100 and 400
                             Gbit/s, 250 ms of compute, N = 2 .. 1024
    bucket_size.png          DDP step time against bucket size: many tiny buckets pay 2(N-1)*alpha
                             each, one giant bucket cannot start before backward ends (100M fp32
                             parameters, N = 64, 100 Gbit/s, alpha 20 us)
    measured_vs_predicted.png  this machine: the calibrated model beside measurements, from the JSON
                             of ``gradsync simulate --calibrated --check 2,3,4 --json PATH``

Every figure has a title, axis units and a legend; its data is written beside it as CSV.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from gradsync.sim.cost import Link, strategy_cost

RANKS = [2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
GRADIENT_BYTES = 7e9 * 2
COMPUTE_S = 0.25


def _write_csv(path: Path, header: list[str], rows: list[list]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def traffic_vs_ranks(out: Path) -> Path:
    link = Link()
    rows = [[n, n * GRADIENT_BYTES, 2 * (n - 1) / n * GRADIENT_BYTES,
             strategy_cost("powersgd", GRADIENT_BYTES, n, link, COMPUTE_S).busiest_link_bytes,
             strategy_cost("diloco", GRADIENT_BYTES, n, link, COMPUTE_S).busiest_link_bytes] for n in RANKS]
    _write_csv(out / "traffic_vs_ranks.csv", ["ranks", "ps_server_link_bytes_each_way", "ring_rank_bytes_sent",
                                              "powersgd_rank_bytes_sent", "diloco_rank_bytes_sent_per_step"], rows)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog(RANKS, [r[1] / 1e9 for r in rows], "o-", label="parameter server link: W x M each way")
    ax.loglog(RANKS, [r[2] / 1e9 for r in rows], "s-", label="ring all-reduce, per rank: 2(N-1)/N x M")
    ax.loglog(RANKS, [r[3] / 1e9 for r in rows], "v-", label="PowerSGD (1% of M sent), per rank")
    ax.loglog(RANKS, [r[4] / 1e9 for r in rows], "D-", label="DiLoCo (H = 8), per rank and step")
    ax.set(title="Bytes per step, 7B model, bf16 gradients (M = 14 GB)", xlabel="workers N",
           ylabel="GB per step (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _save(fig, out / "traffic_vs_ranks.png")


def step_time_vs_ranks(out: Path) -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = []
    for gbit, style in ((10, ":"), (100, "--"), (400, "-")):
        link = Link(alpha=5e-6, beta=8 / (gbit * 1e9), gamma=0.0)
        for strategy, marker in (("ps", "o"), ("ring", "s"), ("ddp", "^"), ("powersgd", "v"), ("diloco", "D")):
            times = [strategy_cost(strategy, GRADIENT_BYTES, n, link, COMPUTE_S).step_s for n in RANKS]
            rows += [[gbit, strategy, n, t] for n, t in zip(RANKS, times)]
            ax.loglog(RANKS, times, style, marker=marker, markersize=3, label=f"{strategy}, {gbit} Gbit/s")
    ax.axhline(COMPUTE_S, color="grey", linewidth=0.8)
    ax.text(RANKS[0], COMPUTE_S * 1.1, "compute only (250 ms)", fontsize=8, color="grey")
    ax.set(title="Step time vs workers, 7B bf16, 250 ms compute (cost model)", xlabel="workers N",
           ylabel="seconds per step (log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    _write_csv(out / "step_time_vs_ranks.csv", ["gbit_per_s", "strategy", "ranks", "step_s"], rows)
    return _save(fig, out / "step_time_vs_ranks.png")


def bucket_size(out: Path) -> Path:
    nbytes, ranks = 100e6 * 4, 64
    link = Link(alpha=20e-6, beta=8 / 100e9, gamma=0.0)
    sizes = [2 ** k for k in range(16, 30)]   # 64 KiB .. 512 MiB
    rows = []
    for size in sizes:
        cost = strategy_cost("ddp", nbytes, ranks, link, COMPUTE_S, bucket_bytes=size)
        rows.append([size, cost.step_s, cost.comm_s])
    no_overlap = strategy_cost("ring", nbytes, ranks, link, COMPUTE_S).step_s
    _write_csv(out / "bucket_size.csv", ["bucket_bytes", "step_s", "exposed_comm_s"], rows)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.loglog([r[0] / 2**20 for r in rows], [r[1] * 1e3 for r in rows], "o-", label="DDP, ring per bucket")
    ax.axhline(no_overlap * 1e3, color="C3", linestyle="--", label="one all-reduce after backward (no overlap)")
    ax.axhline(COMPUTE_S * 1e3, color="grey", linewidth=0.8, label="compute only")
    best = min(rows, key=lambda r: r[1])
    ax.annotate(f"best: {best[0] / 2**20:g} MiB, {best[1] * 1e3:.0f} ms", (best[0] / 2**20, best[1] * 1e3),
                textcoords="offset points", xytext=(0, 25), ha="center", fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "black"})
    ax.set(title="Bucket size: 100M fp32 params, 64 ranks, 100 Gbit/s, alpha 20 us", xlabel="bucket size (MiB, log)",
           ylabel="step time (ms, log)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out / "bucket_size.png")


def measured_vs_predicted(out: Path, measured_json: Path) -> Path:
    rows = json.loads(measured_json.read_text())["rows"]
    _write_csv(out / "measured_vs_predicted.csv", ["what", "ranks", "bytes", "measured_s", "predicted_s", "error"],
               [[r["what"], r["workers"], r["size"], r["measured_s"], r["predicted_s"], r["error"]] for r in rows])
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 5))
    for what, marker in (("ring all-reduce", "o"), ("DDP step (mlp, 25 MiB)", "s")):
        chosen = [r for r in rows if r["what"] == what]
        ax.loglog([r["measured_s"] * 1e3 for r in chosen], [r["predicted_s"] * 1e3 for r in chosen], marker,
                  linestyle="none", label=what)
        for r in chosen:
            ax.annotate(f"N={r['workers']}", (r["measured_s"] * 1e3, r["predicted_s"] * 1e3), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    low = min(min(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 / 1.5
    high = max(max(r["measured_s"], r["predicted_s"]) for r in rows) * 1e3 * 1.5
    ax.plot([low, high], [low, high], color="grey", linewidth=0.8, label="prediction = measurement")
    ax.fill_between([low, high], [low * 0.75, high * 0.75], [low * 1.25, high * 1.25], color="grey", alpha=0.15,
                    label="within 25%")
    ax.set(title="This machine: calibrated model vs measured", xlabel="measured (ms, log)",
           ylabel="predicted (ms, log)")
    ax.legend(fontsize=8)
    return _save(fig, out / "measured_vs_predicted.png")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def write_all(out: Path, measured_json: Path | None = None) -> list[Path]:
    """Write every figure (measured_vs_predicted only with ``measured_json``) into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [traffic_vs_ranks(out), step_time_vs_ranks(out), bucket_size(out)]
    if measured_json is not None:
        paths.append(measured_vs_predicted(out, measured_json))
    return paths
