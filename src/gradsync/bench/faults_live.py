"""gradsync bench faults --live: SIGKILL ranks of `gradsync train --fault-tolerance live` and measure
how the survivors go on.

Scenarios (each trial: `gradsync train --fault-tolerance live --workers W --epochs E --seed 0`, digits):
    random      wait until the run has logged 1-7 more steps (random), SIGKILL a random rank from
                outside (at whatever point of the next step it is)
    forward     the victim (a random member, at a random step of the first epoch) kills itself after
                its forward: the others are waiting for its gradients in the all-reduce
                (GRADSYNC_LIVE_KILL, train/live_knobs.py)
    optimizer   the same after the all-reduce, just before the victim's optimizer step
    checkpoint  with --checkpoint-every 5: member 0, rank 0, dies halfway through writing the
                checkpoint of step 5 or 10 (train/live_knobs.py's knob); the trial also needs the last
                checkpoint intact at the final step and no temporary checkpoint file left
    two         W+1 ranks (4 by default), two random ranks killed in a row from outside: the second
                once the survivors of the first have stepped again (4 -> 3 -> 2)
    ps-forward  --strategy ps-sync with 1 server and W workers (W+1 ranks): a random worker kills itself
                after its forward at a random step of the first epoch (train/live_knobs.py)
    replace     as random, with --max-restarts 1: the launcher starts a replacement that joins the
                survivors (3 -> 2 -> 3); GRADSYNC_LIVE_AWAIT_JOINER=1 makes them wait for it after
                one step in the shrunk world, so that it joins before the short run ends

Measured per trial, from metrics.jsonl (polled every 5 ms), the sample logs and /proc:
    kill -> next step   from the (last) kill to the first step the new world committed
    steps lost          steps the run had logged before the recovery beyond the step the survivors
                        resumed from (the step in flight is redone, so usually 0)
    samples             every epoch's ids over the committed steps of all members (a dead member's up to
                        the step the survivors agreed on): missing and repeated counts
    accuracy            the final test accuracy minus an uninterrupted run's (same seed, same command)
    join                (replace) from the replacement process appearing in /proc to the first step the
                        grown world committed
    leaks               a rank process alive after the job, a /dev/shm entry or spawn directory of the
                        job left, or a survivor holding more open file descriptors after the recovery than
                        before the kill
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.bench.faults import leftovers, rank_pids
from gradsync.group.liveness import process_alive

SCENARIOS = ("random", "forward", "optimizer", "checkpoint", "two", "replace", "ps-forward")
KILLED_FROM_INSIDE = ("forward", "optimizer", "checkpoint", "ps-forward")
"""Scenarios whose victim kills itself at a planted point (GRADSYNC_LIVE_KILL)."""
CHECKPOINT_EVERY = 5


def _records(metrics: Path) -> list[dict]:
    try:
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    except (OSError, json.JSONDecodeError):   # a line being written
        return []


def _logged_step(metrics: Path) -> int:
    """The last step metrics.jsonl has logged (0: none yet)."""
    return max((r["step"] for r in _records(metrics) if r["event"] == "step"), default=0)


def _fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


EXTRA_RANK = ("two", "ps-forward")
"""Scenarios that start with one rank more than --workers (a second victim; the parameter server)."""


def _strategy(scenario: str) -> tuple[str, ...]:
    return ("--strategy", "ps-sync") if scenario.startswith("ps-") else ()


def _command(workers: int, epochs: int, timeout: float, out: Path, replacements: int = 0,
             extra: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "gradsync.cli", "train", "--fault-tolerance", "live", "--workers", str(workers),
            "--epochs", str(epochs), "--timeout", str(timeout), "--quiet", "--seed", "0", "--out", str(out),
            "--max-restarts", str(replacements), *extra]


def _checkpoint_problem(out: Path, steps: int | None) -> str:
    """What is wrong with the checkpoints a 'checkpoint' trial left in ``out`` ('' when nothing)."""
    from gradsync import checkpoint

    left = [p.name for p in checkpoint.temporaries(out / "checkpoint.pt")]
    if left:
        return f"temporary checkpoint files left: {left}"
    try:
        step = checkpoint.load(out / "checkpoint.pt")["step"]
    except checkpoint.CheckpointError as exc:
        return f"last checkpoint unreadable: {exc}"
    return "" if step == steps else f"last checkpoint at step {step}, the run ended at {steps}"


def baseline_accuracy(workers: int = 3, epochs: int = 2, timeout: float = 10.0, extra: tuple[str, ...] = ()) -> float:
    """The final test accuracy of the same command with no kill."""
    out = Path(tempfile.mkdtemp(prefix="gradsync-live-base-"))
    try:
        subprocess.run(_command(workers, epochs, timeout, out, extra=extra), check=True, capture_output=True,
                       timeout=900)
        return next(r for r in _records(out / "metrics.jsonl") if r["event"] == "summary")["accuracy"]
    finally:
        shutil.rmtree(out, ignore_errors=True)


def live_trial(scenario: str, seed: int, baseline: float, workers: int = 3, epochs: int = 2,
               timeout: float = 10.0) -> dict:
    """One trial (module docstring); returns what happened."""
    out = Path(tempfile.mkdtemp(prefix="gradsync-live-"))
    try:
        return _trial(scenario, seed, baseline, workers + (scenario in EXTRA_RANK), epochs, timeout, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _wait_until(condition, limit: float, poll: float = 0.005):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    return None


def _trial(scenario: str, seed: int, baseline: float, workers: int, epochs: int, timeout: float, out: Path) -> dict:
    rng = random.Random(seed)
    (out / "ids").mkdir()
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(out / "ids")}
    victims: list[int] = []
    if scenario in ("forward", "optimizer", "ps-forward"):
        victims = [rng.randrange(scenario == "ps-forward", workers)]   # not the parameter server, rank 0
        env["GRADSYNC_LIVE_KILL"] = f"{victims[0]}:{rng.randrange(1, 15)}:{scenario.removeprefix('ps-')}"
    if scenario == "checkpoint":
        victims = [0]
        env["GRADSYNC_LIVE_KILL"] = f"0:{rng.choice([CHECKPOINT_EVERY, 2 * CHECKPOINT_EVERY])}:checkpoint"
    if scenario == "replace":
        env["GRADSYNC_LIVE_AWAIT_JOINER"] = "1"
    row = {"scenario": scenario, "seed": seed, "workers": workers, "clean": False}
    metrics = out / "run" / "metrics.jsonl"
    extra = ("--checkpoint-every", str(CHECKPOINT_EVERY)) if scenario == "checkpoint" else _strategy(scenario)
    job = subprocess.Popen(_command(workers, epochs, timeout, out / "run", int(scenario == "replace"), extra),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        started = _wait_until(lambda: any(r["event"] == "step" for r in _records(metrics)) or job.poll() is not None,
                              300)
        ranks = rank_pids(job.pid)
        if not started or job.poll() is not None or len(ranks) != workers:
            return {**row, "why": "the job ended or stalled before its first step"}
        killed_at = None
        for kill in range(2 if scenario == "two" else 1):
            fds_before = {m: _fds(pid) for m, pid in ranks.items()}
            if scenario in KILLED_FROM_INSIDE:
                dead = _wait_until(lambda: not process_alive(ranks[victims[0]]), 300)
            else:
                # a random step ahead, so that the kill lands in training and not after the run's end
                target = _logged_step(metrics) + rng.randrange(1, 8)
                _wait_until(lambda: _logged_step(metrics) >= target or job.poll() is not None, 120)
                victim = rng.choice(sorted(m for m in ranks if m not in victims))
                try:
                    os.kill(ranks[victim], signal.SIGKILL)
                except ProcessLookupError:
                    job.kill()
                    stdout, stderr = job.communicate()
                    return {**row, "why": f"member {victim} had exited before kill {kill + 1} (the run over?)",
                            "victims": victims, "stderr": stderr[-3000:], "records": _records(metrics)[-5:]}
                victims.append(victim)
                dead = True
            killed_at = time.monotonic()
            if not dead:
                return {**row, "why": "the planted kill did not happen"}

            def first_new_step():
                records = _records(metrics)
                recoveries = [i for i, r in enumerate(records) if r["event"] == "live" and not r["joined"]]
                return len(recoveries) > kill and any(r["event"] == "step" for r in records[recoveries[kill]:])
            if not _wait_until(first_new_step, timeout + 60):
                job.kill()
                stdout, stderr = job.communicate()
                return {**row, "why": f"no step within {timeout + 60:.0f} s of kill {kill + 1}", "victims": victims,
                        "stderr": stderr[-3000:], "stdout": stdout[-2000:], "records": _records(metrics)[-5:]}
            row.setdefault("kill_to_next_step_s", []).append(time.monotonic() - killed_at)
            row.setdefault("fds", []).append({m: (fds_before[m], _fds(pid)) for m, pid in ranks.items()
                                              if m not in victims})
        if scenario == "replace":
            joined = _join_time(job.pid, workers, metrics, timeout + 60)
            if joined is None:
                job.kill()
                stdout, stderr = job.communicate()
                return {**row, "why": "no replacement joined", "victims": victims, "stderr": stderr[-3000:]}
            row["join_s"], ranks[workers] = joined
        _, err_text = job.communicate(timeout=600)
        if scenario == "checkpoint":
            summary = next((r for r in _records(metrics) if r["event"] == "summary"), {})
            row["checkpoint_problem"] = _checkpoint_problem(out / "run", summary.get("steps"))
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    return _judge(row, job.returncode, err_text, metrics, out / "ids", ranks, victims, baseline, job.pid, epochs)


def _join_time(launcher: int, workers: int, metrics: Path, limit: float) -> tuple[float, int] | None:
    """(seconds from the replacement (member ``workers``) appearing in /proc to the grown world's first
    committed step, its pid), or None if that does not happen within ``limit`` seconds."""
    pid = _wait_until(lambda: rank_pids(launcher).get(workers), limit)
    if pid is None:
        return None
    appeared = time.monotonic()

    def first_grown_step():
        records = _records(metrics)
        grown = [i for i, r in enumerate(records) if r["event"] == "live" and r["joined"]]
        return grown and any(r["event"] == "step" for r in records[grown[0]:])
    if not _wait_until(first_grown_step, limit):
        return None
    return time.monotonic() - appeared, pid


def _judge(row, exit_code, err_text, metrics, ids_dir, ranks, victims, baseline, launcher, epochs) -> dict:
    from gradsync.train.datasets import digits

    records = _records(metrics)
    recoveries = [r for r in records if r["event"] == "live" and not r["joined"]]
    joins = [r for r in records if r["event"] == "live" and r["joined"]]
    lost = 0
    for index, recovery in enumerate(recoveries):
        before = records[:records.index(recovery)]
        logged = max((r["step"] for r in before if r["event"] == "step"), default=0)
        lost = max(lost, logged - recovery["step"])
    cutoff = {m: rec["step"] for rec in recoveries for m in rec["lost"]}
    trained: dict[tuple[int, int], tuple[int, list[int]]] = {}
    for path in ids_dir.glob("live.*"):
        member = int(path.name.rsplit(".m", 1)[1])
        for line in path.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            if step <= cutoff.get(member, 1 << 60):
                trained[member, step] = (epoch, ids)   # a step trained again after a roll-back: the last one
    counts: dict[tuple[int, int], int] = {}
    for epoch, ids in trained.values():
        for i in ids:
            counts[epoch, i] = counts.get((epoch, i), 0) + 1
    n = len(digits(0)[0])
    expected = {(e, i) for e in range(epochs) for i in range(n)}
    summary = next((r for r in records if r["event"] == "summary"), {})
    fd_growth = [m for rows in row.get("fds", []) for m, (a, b) in rows.items() if a is not None and b is not None
                 and b > a]
    orphans = [pid for pid in ranks.values() if process_alive(pid)]
    leaked = sorted(leftovers([launcher, *ranks.values()]))
    row.update(exit_code=exit_code, victims=victims, recoveries=len(recoveries), steps_lost=lost,
               recovery_s=[r["seconds"] for r in recoveries],
               samples_missing=len(expected - set(counts)), samples_repeated=sum(c - 1 for c in counts.values() if c > 1),
               accuracy=summary.get("accuracy"),
               accuracy_delta_points=None if summary.get("accuracy") is None else 100 * (summary["accuracy"] - baseline),
               orphans=orphans, leaked=leaked, fd_growth=fd_growth)
    problems = [why for why, bad in (
        (f"exit code {exit_code}", exit_code != 0), (f"{len(recoveries)} recoveries for {len(victims)} kills",
                                                     len(recoveries) != len(victims)),
        (f"{len(joins)} joins", len(joins) != (row["scenario"] == "replace")),
        (f"{lost} steps lost", lost > 1), ("samples missing", row["samples_missing"]),
        ("samples repeated", row["samples_repeated"]),
        ("accuracy off by > 0.5 points", row["accuracy_delta_points"] is None or abs(row["accuracy_delta_points"]) > 0.5),
        (f"orphans {orphans}", orphans), (f"leaked {leaked}", leaked), (f"fds grew on members {fd_growth}", fd_growth),
        (row.get("checkpoint_problem", ""), row.get("checkpoint_problem")))
        if bad]
    row.update(clean=not problems, why="; ".join(problems), stderr=err_text[-2000:] if problems else "")
    return row


def run(scenarios: list[str], trials: int, workers: int = 3, epochs: int = 2, timeout: float = 10.0) -> list[dict]:
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown live scenarios {unknown}; choose from {', '.join(SCENARIOS)}")
    # the uninterrupted run of each world size and strategy the trials start with
    starts = {s: (workers + (s in EXTRA_RANK), _strategy(s)) for s in scenarios}
    baselines = {start: baseline_accuracy(start[0], epochs, timeout, start[1]) for start in set(starts.values())}
    rows = []
    for scenario in scenarios:
        baseline = baselines[starts[scenario]]
        rows += [{**live_trial(scenario, seed, baseline, workers, epochs, timeout), "baseline_accuracy": baseline}
                 for seed in range(trials)]
    return rows


def median_and_worst(values: list[float]) -> str:
    values = sorted(values)
    return f"{statistics.median(values):.2f}, {values[-1]:.2f}" if values else "-"
