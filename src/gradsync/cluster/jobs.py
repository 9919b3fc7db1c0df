"""Run one job on an emulated cluster: one torchrun per host, every rank's result file back.

    with EmulatedCluster(hosts=3, rate="200mbit") as cluster:
        ranks = run_job(cluster, Job("ps-sync", workers=2, params=1e6))

A Job says what to train and how many ranks; ``Job.hosts`` how many emulated hosts that takes. A
step-time job runs worker.py; with ``max_steps`` set, a time-to-loss job runs loss_worker.py (charlm):
    ps-sync, ps-async, ssp   S servers + W workers = S+W ranks   (ranks 0..S-1 serve)
    ring, hierarchical, powersgd, diloco   W ranks (every rank a worker)
    hosts = ranks / ranks_per_host (the ranks must fill the hosts exactly); rank r is on host
    r // ranks_per_host (torchrun's node ranks).

Each host runs
    ip netns exec <host> python -m torch.distributed.run --nnodes H --nproc-per-node L
        --node-rank i --master-addr <host 0> --master-port 29500 -m gradsync.cluster.worker ...
with GLOO_SOCKET_IFNAME set to the host's link, so every byte between hosts crosses the shaped links.
Every torchrun runs in a session of its own; when one fails or the time runs out, all of them are
killed (the cluster's teardown kills whatever is still inside its namespaces as well).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gradsync.cluster.netns import EmulatedCluster
from gradsync.cluster.loss_worker import STRATEGIES as TIME_TO_LOSS_STRATEGIES
from gradsync.cluster.worker import PS_MODES, STRATEGIES
from gradsync.train.config import TrainConfig

MASTER_PORT = 29500   # every cluster's namespaces are new: the port is free there


@dataclass(frozen=True)
class Job:
    strategy: str
    """One of worker.STRATEGIES."""
    workers: int
    """W: ranks that compute gradients."""
    params: float
    """Model parameters (about; worker.build_model rounds)."""
    servers: int = 1
    """S: parameter servers (PS strategies only)."""
    ranks_per_host: int = 1
    """L: ranks per emulated host."""
    steps: int = 4
    """Steps per timed rep."""
    reps: int = 3
    """Timed reps (median), after one warm-up rep."""
    staleness: int = 2
    """SSP bound."""
    sync_every: int = TrainConfig.sync_every
    """DiLoCo's H (diloco only)."""
    powersgd_rank: int = TrainConfig.powersgd_rank
    """PowerSGD's r (powersgd only)."""
    outer_lr: float = TrainConfig.outer_lr
    """DiLoCo's outer learning rate (time-to-loss jobs; diloco only)."""
    outer_momentum: float = TrainConfig.outer_momentum
    """DiLoCo's outer momentum, Nesterov when > 0, plain SGD at 0 (time-to-loss jobs; diloco only)."""
    inner_lr: float | None = None
    """DiLoCo's inner AdamW learning rate (time-to-loss jobs; None: the lr every strategy uses, 1e-3)."""
    max_steps: int | None = None
    """Set: a time-to-loss job (loss_worker.py, charlm) of at most this many steps; None: a step-time job."""
    target: float | None = None
    """Time-to-loss jobs: the test loss to stop at (None: run max_steps, the ring's reference run)."""

    def __post_init__(self) -> None:
        valid = TIME_TO_LOSS_STRATEGIES if self.max_steps is not None else STRATEGIES
        if self.strategy not in valid:
            raise ValueError(f"unknown strategy {self.strategy!r}{' for --time-to-loss' if self.max_steps else ''}; "
                             f"choose one of {', '.join(valid)}")
        if min(self.workers, self.servers, self.ranks_per_host, self.steps, self.reps, self.sync_every,
               self.powersgd_rank, self.max_steps or 1) < 1:
            raise ValueError(f"workers, servers, ranks_per_host, steps, reps, sync_every, powersgd_rank and "
                             f"max_steps must be >= 1: {self}")
        if not 0 <= self.outer_momentum < 1 or not (self.inner_lr is None or self.inner_lr > 0):
            raise ValueError(f"outer_momentum must be in [0, 1) and inner_lr > 0 (or None): got outer_momentum="
                             f"{self.outer_momentum!r}, inner_lr={self.inner_lr!r}")
        if self.ranks % self.ranks_per_host:
            raise ValueError(f"{self.strategy}: {self.ranks} ranks do not fill hosts of {self.ranks_per_host} "
                             f"(ranks % ranks_per_host = {self.ranks % self.ranks_per_host}); pick --ranks-per-host "
                             f"dividing {self.ranks}")
        if self.strategy == "hierarchical" and self.ranks_per_host < 2:
            raise ValueError("hierarchical all-reduce needs --ranks-per-host >= 2 (shared memory inside a host)")

    @property
    def is_ps(self) -> bool:
        return self.strategy in PS_MODES

    @property
    def ranks(self) -> int:
        return self.workers + (self.servers if self.is_ps else 0)

    @property
    def hosts(self) -> int:
        return self.ranks // self.ranks_per_host


def _torchrun(cluster: EmulatedCluster, job: Job, host: int, out: Path) -> list[str]:
    launch = [*cluster.exec_prefix(host), sys.executable, "-m", "torch.distributed.run",
              "--nnodes", str(job.hosts), "--nproc-per-node", str(job.ranks_per_host), "--node-rank", str(host),
              "--master-addr", str(cluster.address(0)), "--master-port", str(MASTER_PORT)]
    common = ["--strategy", job.strategy, "--servers", str(job.servers), "--sync-every", str(job.sync_every),
              "--powersgd-rank", str(job.powersgd_rank), "--out", str(out)]
    if job.max_steps is not None:
        return [*launch, "-m", "gradsync.cluster.loss_worker", *common, "--max-steps", str(job.max_steps),
                "--outer-lr", f"{job.outer_lr:g}", "--outer-momentum", f"{job.outer_momentum:g}",
                *([] if job.inner_lr is None else ["--inner-lr", f"{job.inner_lr:g}"]),
                *([] if job.target is None else ["--target", repr(job.target)])]
    return [*launch, "-m", "gradsync.cluster.worker", *common, "--params", f"{job.params:g}",
            "--steps", str(job.steps), "--reps", str(job.reps), "--staleness", str(job.staleness)]


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run_job(cluster: EmulatedCluster, job: Job, timeout: float = 600.0) -> dict:
    """Run ``job`` on ``cluster`` (which must have job.hosts hosts); every rank's result and the
    hosts' kernel counters over the whole job. Raises RuntimeError, with the failing host's output,
    if any host fails or the job takes longer than ``timeout`` seconds."""
    if cluster.hosts != job.hosts:
        raise ValueError(f"{job.strategy} with {job.ranks} ranks, {job.ranks_per_host} per host needs "
                         f"{job.hosts} hosts; the cluster has {cluster.hosts}")
    with tempfile.TemporaryDirectory(prefix="gradsync-cluster-") as tmp:
        out = Path(tmp)
        before = [cluster.counters(h) for h in range(job.hosts)]
        procs, logs = [], []
        try:
            for host in range(job.hosts):
                log = open(out / f"host{host}.log", "w+")
                logs.append(log)
                env = {**os.environ, "GLOO_SOCKET_IFNAME": cluster.link_if(host), "PYTHONUNBUFFERED": "1",
                       "OMP_NUM_THREADS": "1"}
                procs.append(subprocess.Popen(_torchrun(cluster, job, host, out), env=env, stdout=log,
                                              stderr=subprocess.STDOUT, start_new_session=True))
            _wait_all(procs, logs, timeout)
        finally:
            _kill(procs)
            for log in logs:
                log.close()
        after = [cluster.counters(h) for h in range(job.hosts)]
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(job.ranks)]
    whole = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    return {"job": job, "ranks": ranks, "job_counters": whole}


def _wait_all(procs: list[subprocess.Popen], logs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [h for h, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            raise RuntimeError(f"host {failed[0]} failed (exit {codes[failed[0]]}):\n{_tail(logs[failed[0]])}")
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            waiting = [h for h, c in enumerate(codes) if c is None]
            raise RuntimeError(f"hosts {waiting} still running after {timeout:.0f} s:\n{_tail(logs[waiting[0]])}")
        time.sleep(0.1)


def _tail(log, chars: int = 3000) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:]
