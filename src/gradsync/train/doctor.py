"""gradsync doctor RUN_DIR: read a run's metrics.jsonl (and trace.json) and go through the checklist
practitioners use when data-parallel training underperforms.

    batch math     per-worker batch x workers x accumulation = global batch; the learning rate after
                   scaling; WARN when the run is in the batch-size trap, with what to change (the line
                   `gradsync train` printed before training: train/batch_math.py), or when a scaled lr
                   has no warm-up
    loss spike     after the warm-up, the training loss (mean of a few steps) climbed back more than
                   half-way from its lowest to the untrained model's: WARN, with the batch math's advice
    overlap        how much bucket all-reduce time runs while backward is still computing?
                   (trace.json: each bucket span's part before its step's "backward end", weighed
                   by time over every rank and step, as the summary's overlap share is; without a
                   trace, the summary's figure); under 10% is a WARN
    bucket sizes   too small: every bucket pays 2(N-1) message latencies (4+ buckets, median < 256 KiB);
                   too large: one bucket holding >= 90% of the gradients starts only with the last
                   gradient, so it overlaps backward's last moments at most
    unused params  the reducer raises on them unless find_unused_parameters is set (so a finished run
                   had none, or paid the extra used-count all-reduce)
    stragglers     ranks whose compute time is > 20% above the median (they make everyone wait)
    slowdown       a rank that became slow partway through: from some step on, in every record of each
                   rank's timings after it (metrics.jsonl's "ranks", every --log-every steps; two records
                   at least), its compute (step time - exposed wait) is > 20% and SLOWDOWN_FLOOR_S above
                   the other ranks' median and > 20% above its own before; named with that step
    placement      ranks per host (uneven hosts leave the ring's slowest link on the crowded host)
    precision      parameter dtype and what travels on the wire (--compress fp16/bf16 halves the
                   bytes but rounds each gradient to 2^-11 / 2^-8 relative)

Each check ends as OK, WARN or INFO with the numbers behind it.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from gradsync.train.batch_math import RunShape, advice, default_epochs, default_warmup, trap_findings

STRAGGLER_FACTOR = 1.2
SMALL_BUCKET_BYTES = 256 << 10
SLOWDOWN_FLOOR_S = 0.010
"""Seconds a step a rank's compute must exceed the others' by to count as slow in a record: on a busy
2-core machine two healthy digits ranks differ by up to a few milliseconds a step from window to window."""


@dataclass(frozen=True)
class Finding:
    check: str
    verdict: str   # OK | WARN | INFO
    detail: str


def _read_run(run_dir: Path) -> dict[str, list[dict]]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ValueError(f"{run_dir} has no metrics.jsonl: point gradsync doctor at a --out directory of gradsync train")
    events: dict[str, list[dict]] = {}
    for number, line in enumerate(metrics.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{metrics}:{number} is not JSON ({exc.msg})") from None
        events.setdefault(record.get("event", "?"), []).append(record)
    if "start" not in events:
        raise ValueError(f"{metrics} has no start record; was the run interrupted before its first step?")
    return events


def _overlap_from_trace(trace_path: Path) -> tuple[float, int] | None:
    """(share of every rank's bucket all-reduce time that ran before its step's backward ended, steps).

    The summary's overlap share, recomputed from the timeline: both weigh each bucket by its time
    and sum over every rank and step (train/report.py). A bucket launched by the very last gradient
    hook hides nothing even though it starts during backward."""
    try:
        events = json.loads(trace_path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    hidden = total = 0.0
    steps = None
    for pid in sorted({e.get("pid") for e in events if e.get("ph") in ("X", "i")}, key=str):
        mine = [e for e in events if e.get("pid") == pid and e.get("ph") in ("X", "i")]
        starts = sorted(e["ts"] for e in mine if e.get("name") == "backward start")
        ends = sorted(e["ts"] for e in mine if e.get("name") == "backward end")
        spans = [(e["ts"], e.get("dur", 0.0)) for e in mine if str(e.get("name", "")).startswith("all_reduce bucket")]
        if not starts or not ends or not spans:
            continue
        steps = len(ends) if steps is None else steps
        for start, duration in spans:
            # the step a bucket belongs to began at the last "backward start" before the bucket
            step_start = max((s for s in starts if s <= start), default=None)
            step_end = min((e for e in ends if step_start is not None and e >= step_start), default=start)
            hidden += max(0.0, min(start + duration, step_end) - start)
            total += duration
    if steps is None:
        return None
    return (hidden / total if total > 0 else 0.0), steps


def _shape(start: dict) -> RunShape | None:
    """The run's batch math from its start record (None: a run recorded before its length was). The
    recorded epochs and warm-up are the run's own; those equal to the defaults count as not given."""
    cfg = start["config"]
    if "steps_per_epoch" not in start or cfg["strategy"] == "diloco":
        return None
    rule, b, g = cfg["lr_scaling"], cfg["batch_size"], start["global_batch"]
    samples = start.get("train_samples") or g * start["steps_per_epoch"]
    epochs = None if cfg["epochs"] == default_epochs(rule, g, b) else cfg["epochs"]
    warmup = None if cfg["warmup_steps"] == default_warmup(start["total_steps"]) else cfg["warmup_steps"]
    return RunShape(rule, b, g, samples, epochs, cfg.get("steps"), warmup)


SPIKE_WINDOW = 3
"""Steps averaged before the loss is compared (one noisy batch is not a spike)."""


def loss_spike(steps: list[dict], warmup_steps: int) -> str | None:
    """A loss spike after the warm-up, in words; None when there is none. The loss averaged over
    SPIKE_WINDOW steps is a spike after the warm-up when it climbs back more than half-way from its
    lowest so far to the first window's (the untrained model's): the old W=8 digits run went 1.37 ->
    2.90 (its first window 2.31); a healthy run's worst late step lifts its window from 0.02 to 0.15."""
    losses = [(r["step"], r["loss"]) for r in steps if r.get("loss") is not None]
    if len(losses) < 2 * SPIKE_WINDOW:
        return None
    means = [(losses[i + SPIKE_WINDOW - 1][0], sum(x for _, x in losses[i:i + SPIKE_WINDOW]) / SPIKE_WINDOW)
             for i in range(len(losses) - SPIKE_WINDOW + 1)]
    first = means[0][1]
    lowest, lowest_at = first, means[0][0]
    for step, mean in means[1:]:
        if step - SPIKE_WINDOW + 1 > warmup_steps and mean > lowest + (first - lowest) / 2 and mean > 1.5 * lowest:
            return (f"after the warm-up ({warmup_steps} steps) the loss (mean of {SPIKE_WINDOW} steps) climbed from "
                    f"{lowest:.2f} (step {lowest_at}) to {mean:.2f} (step {step}), more than half-way back to the "
                    f"untrained model's {first:.2f}")
        if mean < lowest:
            lowest, lowest_at = mean, step
    return None


def _compute_of(record: dict) -> dict[int, float]:
    """rank -> its mean compute seconds a step (step time - exposed wait) in a "ranks" record."""
    return {rank: step - wait for rank, step, wait in zip(record["ranks"], record["step_s"], record["wait_s"])}


def slowdowns(records: list[dict]) -> list[str]:
    """The ranks that became slow partway through (module docstring), in words, from the "ranks" records in
    the order they were written. Records of another set of ranks (a live world that changed) start afresh."""
    found = []
    segments: list[list[dict]] = []
    for record in records:
        if len(record["ranks"]) < 2:
            continue
        if not segments or segments[-1][-1]["ranks"] != record["ranks"] or segments[-1][-1]["step"] >= record["step"]:
            segments.append([])
        segments[-1].append(record)
    for segment in segments:
        computes = [_compute_of(r) for r in segment]
        for rank in segment[0]["ranks"]:
            def others(c: dict) -> float:
                return statistics.median(t for r, t in c.items() if r != rank)

            slow = [c[rank] > STRAGGLER_FACTOR * others(c) and c[rank] - others(c) > SLOWDOWN_FLOOR_S
                    for c in computes]
            first = len(slow)
            while first > 0 and slow[first - 1]:
                first -= 1
            if first == 0 or len(slow) - first < 2:   # slow from the start (stragglers), or not for long enough
                continue
            before = statistics.mean(c[rank] for c in computes[:first])
            after = statistics.mean(c[rank] for c in computes[first:])
            if after <= STRAGGLER_FACTOR * before:
                continue
            ratio = statistics.mean(c[rank] / others(c) for c in computes[first:] if others(c) > 0)
            found.append(f"rank {rank} became slow at step {segment[first - 1]['step'] + 1}: compute "
                         f"{after * 1e3:.1f} ms a step from then on (the records of steps {segment[first]['step']}-"
                         f"{segment[-1]['step']}), {ratio:.1f}x the other ranks' median, {before * 1e3:.1f} ms before")
    return found


def examine(run_dir: str | Path) -> list[Finding]:
    run_dir = Path(run_dir)
    events = _read_run(run_dir)
    start = events["start"][-1]
    cfg = start["config"]
    setup = events.get("setup", [{}])[-1]
    summary = events.get("summary", [None])[-1]
    findings = []

    workers = start["global_batch"] // (cfg["batch_size"] * cfg["grad_accum"])
    math = (f"{cfg['batch_size']} per worker x {workers} workers x {cfg['grad_accum']} accumulation = "
            f"{start['global_batch']} global; peak lr {start['peak_lr']:g} ({cfg['lr_scaling']} scaling, "
            f"warm-up {cfg['warmup_steps']} steps)")
    shape = _shape(start)
    trapped = trap_findings(shape) if shape is not None else []
    unwarmed = start["peak_lr"] > start.get("base_lr", start["peak_lr"]) and cfg["warmup_steps"] == 0
    if trapped:
        findings.append(Finding("batch math", "WARN", f"{math}: the batch-size trap: {'; '.join(trapped)}; "
                                                      f"{advice(shape)}"))
    elif unwarmed:
        findings.append(Finding("batch math", "WARN", f"{math}: a scaled lr wants a warm-up (Goyal et al. 2017)"))
    else:
        findings.append(Finding("batch math", "OK", math))
    spike = loss_spike(events.get("step", []), cfg["warmup_steps"] or 0)
    if spike is not None:
        findings.append(Finding("loss spike", "WARN", spike + (f"; {advice(shape)}" if shape is not None else "")))
    elif events.get("step"):
        findings.append(Finding("loss spike", "OK", f"none after the warm-up ({cfg['warmup_steps']} steps)"))

    trace_counts = _overlap_from_trace(run_dir / "trace.json")
    if cfg["strategy"] in ("ddp", "local"):
        if trace_counts is not None:
            share, steps = trace_counts
            findings.append(Finding("overlap", "OK" if share >= 0.1 else "WARN",
                                    f"{share:.0%} of bucket all-reduce time ran before backward ended "
                                    f"(all ranks, {steps} steps, trace.json)"))
        elif summary and summary.get("overlap") is not None:
            share = summary["overlap"]
            findings.append(Finding("overlap", "OK" if share >= 0.1 else "WARN",
                                    f"{share:.0%} of bucket all-reduce time ran before backward ended "
                                    f"(all ranks, the summary)"))
        else:
            findings.append(Finding("overlap", "INFO", "no trace.json and no overlap figure: rerun with --trace"))
    else:
        findings.append(Finding("overlap", "INFO", f"strategy {cfg['strategy']} reduces outside backward"))

    buckets = setup.get("bucket_bytes")
    if buckets:
        total = sum(buckets)
        small = [b for b in buckets if b < SMALL_BUCKET_BYTES]
        if len(buckets) >= 4 and statistics.median(buckets) < SMALL_BUCKET_BYTES:
            findings.append(Finding("bucket sizes", "WARN", f"{len(buckets)} buckets, {len(small)} under 256 KiB "
                                    f"(--bucket-mb {cfg['bucket_mb']:g}): each pays 2(N-1) message latencies; "
                                    f"try --bucket-mb {max(0.25, total / 4 / 2**20):.2g} (about 4 buckets)"))
        elif len(buckets) == 1 or max(buckets) >= 0.9 * total:
            findings.append(Finding("bucket sizes", "WARN" if workers > 1 else "INFO",
                                    f"one bucket holds {max(buckets) / total:.0%} of {total / 2**20:.1f} MiB of "
                                    f"gradients: it starts only when the last gradient is ready, so what overlaps "
                                    f"is backward's last moments, not its layers; lower --bucket-mb"))
        else:
            findings.append(Finding("bucket sizes", "OK", f"{len(buckets)} buckets, "
                                    f"{min(buckets) / 2**20:.2f}-{max(buckets) / 2**20:.2f} MiB, "
                                    f"{total / 2**20:.1f} MiB in all"))
    else:
        findings.append(Finding("bucket sizes", "INFO", f"no buckets recorded (strategy {cfg['strategy']})"))

    findings.append(Finding("unused parameters", "OK" if summary else "INFO",
                            "none: the reducer raises on a parameter without a gradient, and the run finished"
                            if summary else "the run did not finish; look at its error"))

    if summary:
        compute = [t for t in summary["compute_s"] if t > 0]
        median = statistics.median(compute) if compute else 0.0
        slow = [(r, t) for r, t in enumerate(summary["compute_s"]) if median > 0 and t > STRAGGLER_FACTOR * median]
        findings.append(Finding("stragglers", "WARN" if slow else "OK", ", ".join(
            f"rank {r}: {t / median:.2f}x the median compute ({t:.2f} s vs {median:.2f} s)" for r, t in slow)
            or f"every rank within 20% of the median compute ({median:.2f} s)"))
    else:
        findings.append(Finding("stragglers", "INFO", "no summary: the run did not finish"))
    ranks = events.get("ranks", [])
    if any(len(r["ranks"]) > 1 for r in ranks):
        slow = slowdowns(ranks)
        findings.append(Finding("slowdown", "WARN" if slow else "OK", "; ".join(slow) or (
            f"no rank became slow partway through ({len(ranks)} records of each rank's timings, every "
            f"{ranks[0]['steps']} steps)")))
    else:
        findings.append(Finding("slowdown", "INFO", "no records of each rank's timings (metrics.jsonl's \"ranks\", "
                                                    "every --log-every steps): a run of one rank, or an older run"))

    hosts = setup.get("hosts")
    if hosts:
        per_host = {h: hosts.count(h) for h in dict.fromkeys(hosts)}
        uneven = len(set(per_host.values())) > 1
        findings.append(Finding("placement", "WARN" if uneven else "OK", ", ".join(
            f"{h}: {n} rank(s)" for h, n in per_host.items()) + ("; uneven hosts" if uneven else "")))
    else:
        findings.append(Finding("placement", "INFO", "not recorded"))

    dtypes = ", ".join(setup.get("param_dtypes", ["?"]))
    wire = {"none": "the parameters' own dtype", "fp16": "fp16 (2^-11 relative rounding)",
            "bf16": "bf16 (2^-8 relative rounding)"}[cfg["compress"]]
    findings.append(Finding("precision", "INFO", f"parameters {dtypes}; gradients on the wire: {wire}"))
    return findings
