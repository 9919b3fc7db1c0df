"""gradsync bench faults: kill a rank of a real `gradsync train` run with SIGKILL and check what is left;
with --preempt, send SIGTERM instead and measure what the preemption costs (preempt_run).

One trial:
    1. start `gradsync train --strategy S --workers W --timeout T` as a subprocess;
    2. wait until training has started (the first step line in metrics.jsonl), then a random
       0-1 s more, and SIGKILL one rank chosen at random (its RANK read from /proc/PID/environ);
    3. measure the time from the kill until the whole job has exited, and check:
       clean = the job exited non-zero, its error names the killed rank, every rank process is
       gone (no orphans), and neither the launcher's temporary directory (gradsync-spawn-<its
       pid>-*) nor a /dev/shm entry of the job is left behind (named after one of its processes,
       or the shared-memory segments' gradsync-<launcher pid>x...).
The job's error is the launcher's one-screen summary (launch.py).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gradsync.group.liveness import process_alive

STRATEGIES = ("ddp", "zero1", "ps-sync", "ps-async", "ssp")


def _children(pid: int) -> list[int]:
    try:
        return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def rank_pids(job_pid: int) -> dict[int, int]:
    """rank -> pid of the job's rank processes (the launcher names them gradsync-r{rank}; they are its
    children, or its forkserver's: launch.py)."""
    ranks = {}
    for pid in [grandchild for child in _children(job_pid) for grandchild in (child, *_children(child))]:
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("gradsync-r") and name[10:].isdigit():
            ranks[int(name[10:])] = pid
    return ranks


def leftovers(pids: list[int]) -> set[str]:
    """Temporary directories of the launcher ``pids[0]`` and /dev/shm entries naming any of ``pids``
    (other jobs on the machine may create their own meanwhile; only this job's count)."""
    tmp = {f"tmp:{p.name}" for p in Path(tempfile.gettempdir()).glob(f"gradsync-spawn-{pids[0]}-*")}
    shm = set()
    if Path("/dev/shm").is_dir():
        shm = {f"shm:{p.name}" for p in Path("/dev/shm").iterdir()
               if any(str(pid) in p.name.split("_") or p.name.endswith(f"-{pid}") for pid in pids)
               or p.name.startswith(f"gradsync-{pids[0]}x")}
    return tmp | shm


def kill_trial(strategy: str, seed: int, workers: int = 3, timeout: float = 10.0) -> dict:
    """One trial (see module docstring); returns what happened."""
    out = tempfile.mkdtemp(prefix="gradsync-fault-")
    try:
        return _trial(strategy, seed, workers, timeout, out)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _trial(strategy: str, seed: int, workers: int, timeout: float, out: str) -> dict:
    rng = random.Random(seed)
    cmd = [sys.executable, "-m", "gradsync.cli", "train", "--strategy", strategy, "--workers", str(workers),
           "--timeout", str(timeout), "--steps", "100000", "--quiet", "--out", out, "--seed", str(seed)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = Path(out) / "metrics.jsonl"
    started = time.monotonic()
    while time.monotonic() - started < 120:
        if metrics.exists() and '"event": "step"' in metrics.read_text():
            break
        if job.poll() is not None:
            break
        time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 1.0))
    ranks = rank_pids(job.pid)
    if job.poll() is not None or not ranks:
        job.kill()
        out_text, err_text = job.communicate()
        return {"strategy": strategy, "seed": seed, "clean": False, "why": "the job ended before a rank could be "
                "killed", "stderr": err_text[-2000:]}
    victim = rng.choice(sorted(ranks))
    os.kill(ranks[victim], signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        _, err_text = job.communicate(timeout=timeout + 30)
    except subprocess.TimeoutExpired:
        job.kill()
        _, err_text = job.communicate()
        return {"strategy": strategy, "seed": seed, "victim": victim, "clean": False,
                "why": f"the job was still running {timeout + 30:.0f} s after the kill", "stderr": err_text[-2000:]}
    detection_s = time.monotonic() - killed_at
    orphans = [pid for pid in ranks.values() if process_alive(pid)]
    leaked = sorted(leftovers([job.pid, *ranks.values()]))
    named = f"rank {victim} was killed by signal SIGKILL" in err_text
    clean = job.returncode != 0 and named and not orphans and not leaked
    why = [] if clean else [w for w, bad in (("exit code 0", job.returncode == 0), ("error does not name the rank", not named),
                                             (f"orphans {orphans}", bool(orphans)), (f"leaked {leaked}", bool(leaked))) if bad]
    return {"strategy": strategy, "seed": seed, "victim": victim, "ranks": len(ranks), "exit_code": job.returncode,
            "detection_s": detection_s, "clean": clean, "why": "; ".join(why), "stderr": err_text[-2000:],
            "pids": [job.pid, *ranks.values()]}


def run(strategies: list[str], trials: int, workers: int = 3, timeout: float = 10.0) -> list[dict]:
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    return [kill_trial(s, seed, workers, timeout) for s in strategies for seed in range(trials)]


# -- preemption trials -------------------------------------------------------------------------------
PREEMPT_STRATEGIES = ("ddp", "zero1", "local", "ps-sync", "ps-async", "ssp")
PS_STRATEGIES = ("ps-sync", "ps-async", "ssp")


def _steps_logged(metrics: Path, skip_lines: int = 0) -> list[dict]:
    """Rank 0's step records since the job last (re)started (ignoring the first ``skip_lines`` lines)."""
    records: list[dict] = []
    for line in metrics.read_text().splitlines()[skip_lines:] if metrics.exists() else []:
        record = json.loads(line)
        if record["event"] == "start":
            records = []
        elif record["event"] == "step":
            records.append(record)
    return records


def preempt_trial(strategy: str, seed: int, workers: int = 2, timeout: float = 10.0) -> dict:
    """One preemption trial (see preempt_run); returns what happened."""
    out = tempfile.mkdtemp(prefix="gradsync-preempt-")
    try:
        ranks = 1 if strategy == "local" else workers + 1 if strategy in PS_STRATEGIES else workers
        return _preempt_trial(strategy, seed, ranks, timeout, Path(out))
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _preempt_trial(strategy: str, seed: int, workers: int, timeout: float, out: Path) -> dict:
    from gradsync import checkpoint
    from gradsync.train.datasets import digits

    rng = random.Random(seed)
    (out / "ids").mkdir()
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(out / "ids")}
    ps = strategy in PS_STRATEGIES
    cmd = [sys.executable, "-m", "gradsync.cli", "train", "--strategy", strategy, "--workers", str(workers),
           "--timeout", str(timeout), "--epochs", "1", "--batch-size", "4", "--quiet", "--out", str(out / "run"),
           "--seed", str(seed)]
    row = {"strategy": strategy, "seed": seed, "clean": False}
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    metrics = out / "run" / "metrics.jsonl"
    started = time.monotonic()
    while not _steps_logged(metrics) and job.poll() is None and time.monotonic() - started < 120:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.5))
    targets = {"launcher": job.pid} if strategy == "local" else {"launcher": job.pid, **{
        f"rank {r}": pid for r, pid in rank_pids(job.pid).items()}}
    target = rng.choice(sorted(targets))
    if job.poll() is not None:
        return {**row, "why": "the job ended before the signal", "stderr": job.communicate()[1][-2000:]}
    os.kill(targets[target], signal.SIGTERM)
    signalled, signalled_wall = time.monotonic(), time.time()
    try:
        stdout, stderr = job.communicate(timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        job.kill()
        return {**row, "why": "still running 60 s after SIGTERM", "stderr": job.communicate()[1][-2000:]}
    row.update(target=target, exit_code=job.returncode, signal_to_exit_s=time.monotonic() - signalled)
    lines = [x for x in stdout.splitlines() if x.startswith("preempted at step ")]
    if job.returncode != 75 or not lines:
        return {**row, "why": f"exit code {job.returncode}, no 'preempted at step' line", "stderr": stderr[-2000:]}
    saved = checkpoint.load(out / "run" / "checkpoint.pt")
    logged = _steps_logged(metrics)
    preempted = [json.loads(x) for x in metrics.read_text().splitlines() if '"event": "preempted"' in x]
    if ps:   # each worker's steps trained (its sample-log lines) beyond its clock in the checkpoint
        trained = {int(path.name.rsplit(".r", 1)[1]): len(path.read_text().splitlines())
                   for path in (out / "ids").glob("samples.*")}
        lost = max((trained.get(rank, 0) - clock for rank, clock in enumerate(saved["ps"]["clocks"], start=1)),
                   default=0)
        step_s = sorted(4 * (workers - 1) / r["samples_per_s"] for r in logged)
        row.update(step=saved["step"], steps_lost=lost, seconds_lost=lost * (step_s[len(step_s) // 2] if step_s else 0.0),
                   clocks=saved["ps"]["clocks"])
    else:
        after = [r for r in logged if r["step"] > saved["step"]]
        row.update(step=saved["step"], steps_lost=len(after), seconds_lost=sum(4 * workers / r["samples_per_s"]
                                                                              for r in after))
    row.update(
               signal_to_checkpoint_s=preempted[-1]["checkpoint_at"] - signalled_wall if preempted else None)
    # restart: the printed command, timed to its first step
    resume = shlex.split(lines[0].split("resume with: ", 1)[1])
    before = len(metrics.read_text().splitlines())
    restarted = time.monotonic()
    job = subprocess.Popen([sys.executable, "-m", "gradsync.cli", *resume[1:]], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    while not _steps_logged(metrics, before) and job.poll() is None and time.monotonic() - restarted < 120:
        time.sleep(0.01)
    first_step_s = time.monotonic() - restarted if _steps_logged(metrics, before) else None
    _, stderr = job.communicate(timeout=300)
    row.update(restart_to_first_step_s=first_step_s, resume_exit_code=job.returncode)
    # the interrupted epoch: every sample id exactly once over both runs
    counts: dict[int, int] = {}
    for path in (out / "ids").glob("samples.*"):
        for line in path.read_text().splitlines():
            for sample in line.split()[1:]:
                counts[int(sample)] = counts.get(int(sample), 0) + 1
    expected = _expected_ids(seed, workers - 1) if ps else range(len(digits(seed)[0]))
    row["samples_missing"] = sum(1 for i in expected if i not in counts)
    row["samples_repeated"] = sum(1 for c in counts.values() if c > 1)
    problems = [w for w, bad in (("steps lost", row["steps_lost"] > 1), ("resume failed", job.returncode != 0),
                                 ("samples missing", row["samples_missing"] > 0),
                                 ("samples repeated", row["samples_repeated"] > 0)) if bad]
    row.update(clean=not problems, why="; ".join(problems), stderr=stderr[-2000:] if job.returncode else "")
    return row


def _expected_ids(seed: int, workers: int) -> list[int]:
    """The sample ids a parameter-server run of one epoch trains: each worker's shard of the epoch's
    order (data.DistributedSampler), in whole steps of 4 (the shard's tail that fills no step is skipped)."""
    from gradsync.data import DistributedSampler
    from gradsync.train.datasets import digits

    train_set, _ = digits(seed=seed)
    ids = []
    for worker in range(workers):
        sampler = DistributedSampler(train_set, num_replicas=workers, rank=worker, shuffle=True, seed=seed)
        sampler.set_epoch(0)
        ids += [int(i) for i in sampler.indices()[:len(sampler) // 4 * 4]]
    return ids


def preempt_run(strategies: list[str], trials: int, workers: int = 2, timeout: float = 10.0) -> list[dict]:
    """Per strategy, ``trials`` times: start `gradsync train --epochs 1 --batch-size 4` on digits
    (``workers`` ranks; local: one), wait for its first step plus a random 0-0.5 s, send SIGTERM to the
    launcher or to one rank (drawn at random), and measure: the time from the signal until the job
    has exited (with status 75), the steps and seconds trained after the checkpointed step (work a
    restart redoes), then run the printed resume command and measure the time from its start to
    its first step; at the end, count the sample ids both runs trained in the interrupted epoch."""
    unknown = [s for s in strategies if s not in PREEMPT_STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown} for preemption trials; choose from {', '.join(PREEMPT_STRATEGIES)}")
    return [preempt_trial(s, seed, workers, timeout) for s in strategies for seed in range(trials)]
