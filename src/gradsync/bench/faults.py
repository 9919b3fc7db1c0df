"""gradsync bench faults: kill a rank of a real `gradsync train` run with SIGKILL and check what is left.

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

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STRATEGIES = ("ddp", "zero1", "ps-sync", "ps-async", "ssp")


def _rank_pids(job_pid: int) -> dict[int, int]:
    """rank -> pid of the job's rank processes (the launcher names them gradsync-r{rank})."""
    try:
        children = Path(f"/proc/{job_pid}/task/{job_pid}/children").read_text().split()
    except OSError:
        return {}
    ranks = {}
    for pid in map(int, children):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("gradsync-r") and name[10:].isdigit():
            ranks[int(name[10:])] = pid
    return ranks


def _leftovers(pids: list[int]) -> set[str]:
    """Temporary directories of the launcher ``pids[0]`` and /dev/shm entries naming any of ``pids``
    (other jobs on the machine may create their own meanwhile; only this job's count)."""
    tmp = {f"tmp:{p.name}" for p in Path(tempfile.gettempdir()).glob(f"gradsync-spawn-{pids[0]}-*")}
    shm = set()
    if Path("/dev/shm").is_dir():
        shm = {f"shm:{p.name}" for p in Path("/dev/shm").iterdir()
               if any(str(pid) in p.name.split("_") or p.name.endswith(f"-{pid}") for pid in pids)
               or p.name.startswith(f"gradsync-{pids[0]}x")}
    return tmp | shm


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
    except OSError:
        return False
    return state != "Z"


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
    ranks = _rank_pids(job.pid)
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
    orphans = [pid for pid in ranks.values() if _alive(pid)]
    leaked = sorted(_leftovers([job.pid, *ranks.values()]))
    named = f"rank {victim} was killed by signal SIGKILL" in err_text
    clean = job.returncode != 0 and named and not orphans and not leaked
    why = [] if clean else [w for w, bad in (("exit code 0", job.returncode == 0), ("error does not name the rank", not named),
                                             (f"orphans {orphans}", bool(orphans)), (f"leaked {leaked}", bool(leaked))) if bad]
    return {"strategy": strategy, "seed": seed, "victim": victim, "ranks": len(ranks), "exit_code": job.returncode,
            "detection_s": detection_s, "clean": clean, "why": "; ".join(why), "stderr": err_text[-2000:]}


def run(strategies: list[str], trials: int, workers: int = 3, timeout: float = 10.0) -> list[dict]:
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    return [kill_trial(s, seed, workers, timeout) for s in strategies for seed in range(trials)]
