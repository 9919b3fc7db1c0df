"""A preempted Slurm job continues as itself: --requeue queues it again, --resume auto picks the run up.

Vocabulary
    requeue      `scontrol requeue JOBID`: Slurm ends the job's steps, puts the job back in the queue with
                 the same id and batch script, and counts SLURM_RESTART_COUNT up by one. Slurm allows it for
                 jobs submitted with `sbatch --requeue` (or where the cluster's JobRequeue=1); the job is
                 eligible again once its credentials expire (AuthInfo cred_expire, 120 s by default).
    --requeue    after a preemption's checkpoint is on disk, rank 0 requeues the job (after_checkpoint):
                 the last thing the run does, because Slurm stops every task of the job at once.
    --resume auto  resume when --out holds a checkpoint (of this run: resume.IDENTITY, else the same
                 error as --resume), start a new run when it holds none; the batch script is the same for
                 the first run and every requeue (settle_resume).

Sequence (one task per rank under srun): the preemption signal reaches the ranks (`--signal=USR1@90`
with --preempt-signal SIGUSR1, `scancel --signal=TERM`, a time limit's SIGTERM); every rank stops after the
same step; rank 0 writes the checkpoint, logs the preemption, then requeues; the job exits 75 or is ended
by the requeue; the requeued job runs the same script, whose --resume auto finds the checkpoint and
continues: the same parameters, bit for bit, as a run never stopped.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from gradsync import checkpoint
from gradsync.group import slurm
from gradsync.train.config import TrainConfig
from gradsync.train.resume import CHECKPOINT_NAME

SCONTROL_TIMEOUT = 30.0
"""Seconds `scontrol requeue` may take (it asks slurmctld, MessageTimeout 10 s by default)."""


def check(cfg: TrainConfig) -> None:
    """--requeue needs a Slurm job to requeue: a clear error before any rank starts."""
    if cfg.requeue and slurm.job_id() is None:
        raise ValueError("--requeue asks Slurm to requeue this job after a preemption, but this is not a Slurm job "
                         "(SLURM_JOB_ID is not set): run it under sbatch, or drop --requeue")


def settle_resume(cfg: TrainConfig, say=print) -> TrainConfig:
    """``cfg`` with --resume auto decided: True where --out holds a checkpoint, else False (a new run).
    --resume and no --resume pass through."""
    if cfg.resume != "auto":
        return cfg
    path = Path(cfg.out) / CHECKPOINT_NAME
    found = path.exists()
    if found:
        try:
            step = checkpoint.load(path).get("step")
        except checkpoint.CheckpointError as exc:
            raise ValueError(f"--resume auto: {path} cannot be read ({exc}); move it away to start a new run") from None
        restart = os.environ.get("SLURM_RESTART_COUNT")
        say(f"gradsync train: --resume auto: continuing the run in {cfg.out} from step {step}"
            + (f" (Slurm restart {restart})" if restart else ""), flush=True)
    else:
        say(f"gradsync train: --resume auto: {cfg.out} holds no checkpoint; starting a new run", flush=True)
    return dataclasses.replace(cfg, resume=found)


def after_checkpoint(cfg: TrainConfig, rank: int, reason: str | None) -> bool:
    """With --requeue, on rank 0, once the preemption's checkpoint is on disk: `scontrol requeue` this job.
    ``reason`` is why the job stopped (preempt.STOP_REASONS): Ctrl-C ("interrupted") is a person's, never
    requeued. Returns whether Slurm accepted; a refusal is one line on stderr (the run still exits 75, its
    checkpoint written, for a person or a script to resubmit)."""
    if not cfg.requeue or rank != 0 or reason != "preempted":
        return False
    job = slurm.job_id()
    command = ["scontrol", "requeue", str(job)]
    # Said before asking: once slurmctld accepts, it ends every task of the job at once, and a line written
    # after that may never reach the job's output (srun is stopped with its tasks).
    print(f"gradsync train: requeueing Slurm job {job} ({' '.join(command)}): it runs again and continues from "
          f"this checkpoint with --resume auto", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=SCONTROL_TIMEOUT)
        refusal = None if done.returncode == 0 else (done.stderr.strip() or done.stdout.strip()
                                                     or f"exit status {done.returncode}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        refusal = str(exc)
    if refusal is None:
        return True
    print(f"gradsync train: --requeue: '{' '.join(command)}' failed: {refusal.splitlines()[0]} (submit with "
          f"sbatch --requeue); the checkpoint is written: resubmit the job to continue", file=sys.stderr, flush=True)
    return False
