"""gradsync under a real Slurm: slurmctld, two slurmd and munge started here (tests/slurm_cluster.py), jobs
submitted with sbatch, ranks started with srun.

Oracles: `scontrol show hostnames` for the rendezvous node, the host exchange for where each task runs,
closed forms for the all-reduce, `gradsync train` on this machine for the accuracy, an uninterrupted
run under srun for the bit-identical resume after a requeue, and Slurm's own accounts of how each job
ended (`sacct --completion`, `scontrol show job`)."""

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import slurm_cluster
from gradsync import checkpoint

pytestmark = pytest.mark.slurm

TESTS = Path(__file__).resolve().parent
PYTHON = sys.executable
JOB_ENV = "export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1\n"
TRAIN = ["--seed", "0", "--batch-size", "16", "--quiet", "--timeout", "30"]
"""The flags of every training run here: 4 ranks x 16 = a global batch of 64, 23 steps an epoch on digits."""
REFERENCE_STEPS = 120


@pytest.fixture(scope="module")
def cluster():
    reason = slurm_cluster.unavailable()
    if reason:
        pytest.skip(reason)
    started = slurm_cluster.SlurmCluster()
    try:
        yield started.start()
    finally:
        started.stop()


def _submit(cluster, tmp_path: Path, body: str, *options: str) -> int:
    script = "#!/bin/bash\n" + JOB_ENV + body + "\n"
    return cluster.sbatch(script, "--chdir", str(tmp_path), "--output", str(tmp_path / "slurm-%j.out"), *options)


def _output(tmp_path: Path, job: int) -> str:
    path = tmp_path / f"slurm-{job}.out"
    return path.read_text() if path.exists() else "(no output)"


def _finished(cluster, tmp_path: Path, job: int, timeout: float, state: str = "COMPLETED") -> dict:
    """Wait for ``job`` to end; it must end in ``state``; its `scontrol show job` fields."""
    fields = cluster.wait(job, timeout)
    assert fields["JobState"] == state, f"job {job}: {fields.get('JobState')} {fields.get('ExitCode')}\n" \
                                        f"{_output(tmp_path, job)[-6000:]}"
    return fields


def _results(text: str) -> list[dict]:
    return sorted((json.loads(line.split("RESULT ", 1)[1]) for line in text.splitlines() if "RESULT " in line),
                  key=lambda r: r["rank"])


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait_for_steps(cluster, tmp_path: Path, job: int, out: Path, steps: int, timeout: float = 90) -> int:
    """Wait until rank 0 has logged ``steps`` steps in ``out``; the last step logged."""
    deadline = time.monotonic() + timeout
    for polls in itertools.count():
        if time.monotonic() > deadline:
            break
        logged = [r["step"] for r in _records(out) if r["event"] == "step"]
        if len(logged) >= steps:
            return logged[-1]
        if polls % 20 == 0:   # scontrol once a second: it costs a process, the metrics file does not
            state = cluster.job(job).get("JobState")
            assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} is {state}:\n{_output(tmp_path, job)}"
        time.sleep(0.05)
    raise AssertionError(f"job {job} logged no {steps} steps in {timeout:.0f} s:\n{_output(tmp_path, job)}")


def _model(out: Path) -> dict:
    return checkpoint.load(out / "checkpoint.pt")["model"]


@pytest.mark.timeout(240)
def test_init_in_srun_tasks_and_under_srun_torchrun_on_two_nodes(cluster, tmp_path):
    """One job on two nodes: step 0 runs gs.init() in each of 4 srun tasks; step 1 runs one torchrun per node
    (c10d rendezvous on the first node), 2 workers each. Both make one world of 4 over both nodes."""
    body = f"""
head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "HEAD $head"
date +"STEP0 %s.%N"
srun {PYTHON} {TESTS / 'env_world_script.py'}
date +"STEP1 %s.%N"
srun --ntasks=2 --ntasks-per-node=1 {PYTHON} -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
    --rdzv-endpoint "$head:29400" --rdzv-id "$SLURM_JOB_ID" {TESTS / 'env_world_script.py'}
date +"END %s.%N"
"""
    job = _submit(cluster, tmp_path, body, "--nodes", "2", "--ntasks-per-node", "2")
    _finished(cluster, tmp_path, job, 180)
    text = _output(tmp_path, job)
    head = next(line.split()[1] for line in text.splitlines() if line.startswith("HEAD "))
    results = _results(text)
    assert len(results) == 8, text
    srun_tasks = [r for r in results if not r["under_torchrun"]]
    torchrun_workers = [r for r in results if r["under_torchrun"]]
    for r in srun_tasks:
        assert (r["world_size"], r["sum"], r["master_addr"]) == (4, 1 + 2 + 3 + 4, head), r
        assert r["rank"] == int(r["slurm_procid"]) and r["local_rank"] == int(r["slurm_localid"]), r
    # where each rank runs, as the host exchange found it, is what Slurm says (SLURMD_NODENAME)
    on_node = {}
    for r in srun_tasks:
        on_node.setdefault(r["node"], []).append(r["rank"])
    assert sorted(on_node.values()) == srun_tasks[0]["hosts"] == [[0, 1], [2, 3]], srun_tasks
    for r in srun_tasks:
        assert r["local_world_size"] == 2 and on_node[r["node"]].index(r["rank"]) == r["local_rank"], r
    # under srun torchrun, torchrun's variables win: 4 ranks from 2 agents (Slurm's tasks 0 and 1)
    assert [(r["rank"], r["world_size"], r["sum"]) for r in torchrun_workers] == [(k, 4, 10.0) for k in range(4)]
    assert sorted(r["slurm_procid"] for r in torchrun_workers) == ["0", "0", "1", "1"]


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """`srun gradsync train` for REFERENCE_STEPS on 2 nodes x 2 tasks, never stopped: its directory."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    out = tmp_path / "run"
    gradsync = Path(PYTHON).with_name("gradsync")
    job = _submit(cluster, tmp_path, f"srun {gradsync} train {' '.join(TRAIN)} --steps {REFERENCE_STEPS} --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "2")
    _finished(cluster, tmp_path, job, 180)
    return out


@pytest.mark.timeout(300)
def test_srun_gradsync_train_matches_gradsync_train(uninterrupted, tmp_path):
    """The 4 srun tasks on 2 nodes train what `gradsync train --workers 4` trains on one machine: the same
    accuracy on the same flags. The losses agree step by step until the all-reduce's different summation
    order (shared memory and TCP across 2 hosts, shared memory on one) shows, after some 40 steps here."""
    out = tmp_path / "local"
    local = subprocess.run([PYTHON, "-m", "gradsync.train", *TRAIN, "--workers", "4", "--steps", str(REFERENCE_STEPS),
                            "--out", str(out)], capture_output=True, text=True, timeout=240,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    summaries = [next(r for r in _records(run) if r["event"] == "summary") for run in (uninterrupted, out)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == REFERENCE_STEPS
    assert summaries[0]["accuracy"] == summaries[1]["accuracy"], summaries
    starts = [next(r for r in _records(run) if r["event"] == "start") for run in (uninterrupted, out)]
    assert starts[0]["global_batch"] == starts[1]["global_batch"] == 64
    losses = [[r["loss"] for r in _records(run) if r["event"] == "step"] for run in (uninterrupted, out)]
    assert losses[0][:30] == pytest.approx(losses[1][:30], rel=1e-6), "the two runs' first losses part"


@pytest.mark.timeout(240)
def test_scancel_signal_term_checkpoints_and_exits_75(cluster, tmp_path):
    """`scancel --signal=TERM` reaches every task; they stop after the same step, rank 0 writes the
    checkpoint, the job exits 75: FAILED 75:0 in sacct (and ExitCode=75:0 in scontrol show job)."""
    out = tmp_path / "run"
    job = _submit(cluster, tmp_path, f"srun {PYTHON} -m gradsync.train {' '.join(TRAIN)} --steps 100000 --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "2")
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        cluster.client("scancel", "--signal=TERM", str(job))
        fields = _finished(cluster, tmp_path, job, 120, state="FAILED")
    finally:
        cluster.client("scancel", str(job), check=False)
    assert fields["ExitCode"] == "75:0", fields
    assert [(row["JobID"], row["State"], row["ExitCode"]) for row in cluster.sacct(job)] == [(str(job), "FAILED", "75:0")]
    (preempted,) = [r for r in _records(out) if r["event"] == "preempted"]
    saved = checkpoint.load(out / "checkpoint.pt")
    assert saved["step"] == preempted["step"] >= 5 and saved["world_size"] == 4
    assert _output(tmp_path, job).count(f"preempted at step {preempted['step']};") == 1


@pytest.mark.timeout(300)
def test_a_requeued_job_resumes_and_ends_bit_identical(cluster, uninterrupted, tmp_path):
    """sbatch --requeue, `srun gradsync train --requeue --resume auto --preempt-signal SIGUSR1`: SIGUSR1 (as
    --signal=USR1@90 sends it) stops the job with a checkpoint, rank 0 runs scontrol requeue, Slurm runs the
    same script again (SLURM_RESTART_COUNT=1), which continues from the checkpoint to the end: the final
    parameters equal the uninterrupted run's bit for bit."""
    out = tmp_path / "run"
    gradsync = Path(PYTHON).with_name("gradsync")
    body = (f"echo \"RESTART ${{SLURM_RESTART_COUNT:-0}}\"\n"
            f"srun {gradsync} train {' '.join(TRAIN)} --steps {REFERENCE_STEPS} --out {out} --resume auto --requeue "
            f"--preempt-signal SIGUSR1")
    job = _submit(cluster, tmp_path, body, "--nodes", "2", "--ntasks-per-node", "2", "--requeue", "--open-mode=append")
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        cluster.client("scancel", "--signal=USR1", str(job))
        fields = _finished(cluster, tmp_path, job, 200)
    finally:
        cluster.client("scancel", str(job), check=False)
    text = _output(tmp_path, job)
    assert fields["Restarts"] == "1" and "RESTART 0" in text and "RESTART 1" in text, fields
    assert f"requeued Slurm job {job}" in text and "--resume auto: continuing the run" in text, text[-4000:]
    records = _records(out)
    (preempted,) = [r for r in records if r["event"] == "preempted"]
    starts = [i for i, r in enumerate(records) if r["event"] == "start"]
    resumed = [r["step"] for r in records[starts[-1]:] if r["event"] == "step"]
    assert len(starts) == 2 and resumed == list(range(preempted["step"] + 1, REFERENCE_STEPS + 1)), resumed
    summary = next(r for r in records if r["event"] == "summary")
    assert summary["steps"] == REFERENCE_STEPS and summary["steps_trained"] == REFERENCE_STEPS - preempted["step"]
    mine, reference = _model(out), _model(uninterrupted)
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[name], reference[name]) for name in mine), "the resumed run's parameters differ"


@pytest.mark.timeout(300)
def test_live_mode_a_nodes_tasks_killed_the_others_train_on(cluster, tmp_path):
    """`srun gradsync train --fault-tolerance live` on 2 nodes x 2 tasks: both tasks on the second node are
    SIGKILLed mid-training; the first node's two go on without a restart and finish the run."""
    out = tmp_path / "run"
    epochs = 4
    job = _submit(cluster, tmp_path, f"srun {PYTHON} -m gradsync.train {' '.join(TRAIN)} --epochs {epochs} "
                                     f"--fault-tolerance live --preempt-signal none --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "2")
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        killed = _kill_training_tasks(cluster, node=1)
        assert len(killed) == 2, killed
        fields = cluster.wait(job, 180)
    finally:
        cluster.client("scancel", str(job), check=False)
    text = _output(tmp_path, job)
    records = _records(out)
    (live,) = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [2, 3] and live["members"] == [0, 1] and live["world_size"] == 2, live
    summary = next((r for r in records if r["event"] == "summary"), None)
    assert summary is not None, f"the survivors did not finish: {fields}\n{text[-6000:]}"
    start = next(r for r in records if r["event"] == "start")
    steps_per_epoch = -(-1437 // start["global_batch"])   # digits' 1,437 training images; keep-global batch
    assert len(summary["bytes_sent_per_rank"]) == 2 and summary["steps"] == epochs * steps_per_epoch, summary
    # the step's exit status is the killed tasks' (srun: the highest of its tasks), the survivors' lines are there
    assert "task 2: Killed" in text or "task 2-3: Killed" in text or fields["JobState"] == "FAILED", text[-3000:]


def _kill_training_tasks(cluster, node: int) -> list[int]:
    """SIGKILL the training processes (not slurmd, not slurmstepd) running on ``node``; their pids."""
    killed = []
    for pid in cluster.namespace_pids(node):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(part.endswith(b"gradsync.train") for part in argv):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed
