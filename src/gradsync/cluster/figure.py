"""Measured and predicted step time vs workers W on the emulated cluster, one panel per link rate.

Lines: sync and async PS with one server and ring DDP, measured (solid, markers; the bars span the reps'
per-step times) and predicted by the cost model (dashed, same colour; dotted: without the host
term and the server's update, the wire alone). The seed's claim: PS grows
about linearly with W (its server link carries 2*W*M per step), ring stays flat (2(N-1)/N*M per link).
The data behind it goes to a CSV beside the PNG.
"""

from __future__ import annotations

import csv
from pathlib import Path

SHOWN = (("ps-sync", 1, "C0", "sync PS, 1 server"), ("ps-async", 1, "C2", "async PS, 1 server"),
         ("ring", 0, "C3", "ring DDP"), ("powersgd", 0, "C4", "PowerSGD"), ("diloco", 0, "C5", "DiLoCo"))


def step_time_vs_workers(rows: list[dict], png: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png.parent.mkdir(parents=True, exist_ok=True)
    rates = list(dict.fromkeys(r["link"] for r in rows))
    fig, axes = plt.subplots(1, len(rates), figsize=(5.5 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for strategy, servers, colour, label in SHOWN:
            chosen = sorted((r for r in rows if r["link"] == rate and r["strategy"] == strategy
                             and r["servers"] == servers), key=lambda r: r["workers"])
            if not chosen:
                continue
            w = [r["workers"] for r in chosen]
            measured = [r["step_s"] for r in chosen]
            low = [m - min(r["reps_step_s"]) for m, r in zip(measured, chosen)]
            high = [max(r["reps_step_s"]) - m for m, r in zip(measured, chosen)]
            ax.errorbar(w, measured, yerr=[low, high], color=colour, marker="o", capsize=3, label=f"{label}, measured")
            ax.plot(w, [r["predicted_s"] for r in chosen], "--", color=colour, label=f"{label}, cost model")
            ax.plot(w, [r["wire_only_s"] for r in chosen], ":", color=colour, linewidth=1,
                    label=f"{label}, cost model, wire alone")
        first = next(r for r in rows if r["link"] == rate)
        ax.set(title=f"{rate} links, {first['params'] / 1e6:.1f}M params ({first['model_bytes'] / 1e6:.0f} MB)",
               xlabel="workers W", ylabel="seconds per step")
        ax.set_ylim(bottom=0)
        ax.set_xticks(sorted({r['workers'] for r in rows if r['link'] == rate}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Emulated cluster (gradsync cluster): step time vs workers", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    with open(png.with_suffix(".csv"), "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["link", "strategy", "servers", "workers", "step_s", "predicted_s", "compute_s", "comm_share",
                      "busiest_link_formula_bytes", "busiest_link_kernel_tx_bytes", "busiest_link_kernel_rx_bytes"])
        for r in rows:
            b = r["busiest"]
            out.writerow([r["link"], r["strategy"], r["servers"], r["workers"], f"{r['step_s']:.4f}",
                          f"{r['predicted_s']:.4f}", f"{r['compute_s']:.4f}", f"{r['comm_share']:.3f}",
                          "" if b["formula"] is None else f"{b['formula']:.0f}", f"{b['kernel_tx']:.0f}",
                          f"{b['kernel_rx']:.0f}"])
    return png
