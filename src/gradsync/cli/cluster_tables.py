"""What `gradsync cluster` prints: the step-time rows (cluster/sweep.py) and the time-to-loss rows
(cluster/time_to_loss.py), as rich tables on a terminal or, with --markdown, as the Markdown tables
docs/benchmarks.md holds; one table per link rate."""

from __future__ import annotations

from rich.table import Table

from gradsync.cluster.results import PAIR_PRICED


def achieved_gbit(row: dict) -> float:
    """What the busiest link carried while the job ran, in Gbit/s: max(tx, rx) bytes per step over
    the step time. Near the link rate: the network sets the pace; far below it: something else does."""
    b = row["busiest"]
    return max(b["kernel_tx"], b["kernel_rx"]) * 8 / row["step_s"] / 1e9


def _update_ms(row: dict) -> str:
    """The servers' update per step (results.py), "-" for ring rows and runs saved without it."""
    return f"{row['update_s'] * 1e3:.1f}" if row.get("update_s") else "-"


def _duplex(row: dict) -> str:
    """The server link's duplex factor (results.py), "-" where none was measured."""
    return f"{row['duplex']:.2f}" if "duplex" in row and row["servers"] else "-"


def _measured_ns_per_byte(row: dict) -> str:
    """What the row's prediction measured per byte, in ns (results.py): a ring step's x, a PS
    server's fan in/out (sync), or its pair (async, ssp; the fan's both at once in rows saved
    without the pair); "-" where none was measured."""
    if row.get("exchange_s_per_byte"):
        return f"{row['exchange_s_per_byte'] * 1e9:.2f}"
    if row.get("pair_s_per_byte") and row["strategy"] in PAIR_PRICED:
        return f"{row['pair_s_per_byte'] * 1e9:.2f}"
    fan = row.get("fan_s_per_byte")
    if not fan:
        return "-"
    kinds = ("in", "out") if row["strategy"] == "ps-sync" else ("both",)
    return "/".join(f"{fan[kind] * 1e9:.2f}" for kind in kinds)


STEP_COLUMNS = ("strategy", "S", "W", "hosts", "step ms", "reps ms", "wire only ms", "predicted ms", "error",
                "compute ms", "update ms", "duplex", "step ns/B", "comm share", "formula MB", "meter out/in",
                "kernel tx/rx", "link Gbit/s")
"""The step-time tables' columns (Markdown puts the reps beside the step, in one cell)."""


def _step_cells(r: dict) -> list[str]:
    """One step-time row's cells, in STEP_COLUMNS' order."""
    b = r["busiest"]
    return [r["strategy"], str(r["servers"] or "-"), str(r["workers"]), f"{r['hosts']}x{r['ranks_per_host']}",
            f"{r['step_s'] * 1e3:.0f}", "/".join(f"{t * 1e3:.0f}" for t in r["reps_step_s"]),
            f"{r['wire_only_s'] * 1e3:.0f}", f"{r['predicted_s'] * 1e3:.0f}", f"{r['error']:+.0%}",
            f"{r['compute_s'] * 1e3:.1f}", _update_ms(r), _duplex(r), _measured_ns_per_byte(r), f"{r['comm_share']:.0%}",
            "-" if b["formula"] is None else f"{b['formula'] / 1e6:.2f}",
            f"{b['meter_sent'] / 1e6:.2f}/{b['meter_received'] / 1e6:.2f}",
            f"{b['kernel_tx'] / 1e6:.2f}/{b['kernel_rx'] / 1e6:.2f}", f"{achieved_gbit(r):.2f}"]


def print_step_times(rows: list[dict], markdown: bool = False) -> None:
    """The step-time rows, one table per link rate."""
    from gradsync.observe import display

    step = STEP_COLUMNS.index("step ms")
    for rate in dict.fromkeys(r["link"] for r in rows):
        chosen = [r for r in rows if r["link"] == rate]
        first = chosen[0]
        if markdown:
            header = [*STEP_COLUMNS[:step], "step ms (reps)", *STEP_COLUMNS[step + 2:]]
            print(f"\n{rate} links, {first['params'] / 1e6:.2f}M params ({first['model_bytes'] / 1e6:.1f} MB); "
                  f"bytes per step on the busiest link, MB\n")
            print("| " + " | ".join(header) + " |")
            print("|" + "---|" * len(header))
            for r in chosen:
                cells = _step_cells(r)
                cells[step:step + 2] = [f"{cells[step]} ({cells[step + 1]})"]
                print("| " + " | ".join(cells) + " |")
            continue
        table = Table(title=f"emulated cluster, {rate} links: {first['params'] / 1e6:.2f}M params "
                            f"({first['model_bytes'] / 1e6:.1f} MB), median of {first['reps']} reps x "
                            f"{first['steps']} steps; bytes per step on the busiest link (MB)")
        for column in STEP_COLUMNS:
            table.add_column(column, justify="right")
        for r in chosen:
            table.add_row(*_step_cells(r))
        display.console(170).print(table)


LOSS_COLUMNS = ("strategy", "W", "target loss", "last loss", "s to target", "step", "vs ring", "ms/step",
                "busiest link MB/step (tx)", "bytes vs ring")
"""The time-to-loss tables' columns."""


def _share(ratio: float) -> str:
    """1/6.5 below 1, 2.10x above."""
    return f"1/{1 / ratio:.1f}" if ratio < 1 else f"{ratio:.2f}x"


def _loss_cells(r: dict, ring: dict | None) -> list[str]:
    """One time-to-loss row's cells, in LOSS_COLUMNS' order, beside the ring row of its link and W."""
    reached = r["time_to_loss_s"] is not None
    vs = (f"{r['time_to_loss_s'] / ring['time_to_loss_s']:.2f}" if reached and ring and ring["time_to_loss_s"]
          else "-")
    ring_bytes = ring["busiest"]["kernel_tx_per_step"] if ring else None
    return [r["strategy"], str(r["workers"]), f"{r['target']:.4f}", f"{r['final_loss']:.4f}",
            f"{r['time_to_loss_s']:.1f}" if reached else f"not within {r['max_steps']} steps",
            str(r["reached_step"]) if reached else "-", vs, f"{r['step_s'] * 1e3:.0f}",
            f"{r['busiest']['kernel_tx_per_step'] / 1e6:.3f}",
            _share(r["busiest"]["kernel_tx_per_step"] / ring_bytes) if ring_bytes else "-"]


def _ring_of(rows: list[dict], r: dict) -> dict | None:
    return next((x for x in rows if x["strategy"] == "ring" and x["link"] == r["link"]
                 and x["workers"] == r["workers"]), None)


def print_times_to_loss(rows: list[dict], markdown: bool = False) -> None:
    """The time-to-loss rows, one table per link rate, the ring first at each W."""
    from gradsync.observe import display

    for rate in dict.fromkeys(r["link"] for r in rows):
        chosen = sorted((r for r in rows if r["link"] == rate), key=lambda r: (r["workers"], r["strategy"] != "ring"))
        title = (f"time to ring DDP's charlm loss (within 2%), {rate} links; training seconds (evaluations left "
                 f"out); bytes: the busiest host link's kernel counters")
        if markdown:
            print(f"\n{title}\n\n| " + " | ".join(LOSS_COLUMNS) + " |\n|" + "---|" * len(LOSS_COLUMNS))
            for r in chosen:
                print("| " + " | ".join(_loss_cells(r, _ring_of(rows, r))) + " |")
            continue
        table = Table(title=title)
        for column in LOSS_COLUMNS:
            table.add_column(column, justify="right")
        for r in chosen:
            table.add_row(*_loss_cells(r, _ring_of(rows, r)))
        display.console(150).print(table)
