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
"""The flags of every training run here: 16 samples per rank a step."""
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


RESULTS_TO = "ENV_WORLD_RESULTS=."
"""sbatch --export: env_world_script.py writes each rank's result in the job's directory."""


def _results(tmp_path: Path, launcher: str) -> list[dict]:
    """What env_world_script.py's ranks under ``launcher`` (task, torchrun) wrote, by rank."""
    return sorted((json.loads(p.read_text()) for p in tmp_path.glob(f"{launcher}.*.json")), key=lambda r: r["rank"])


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
def test_init_in_srun_tasks_on_two_nodes(cluster, tmp_path):
    """gs.init() in each of 4 srun tasks on 2 nodes: one world of 4, ranks as Slurm numbers its tasks, the
    rendezvous on the first node `scontrol show hostnames` names, local ranks as the host exchange finds them."""
    body = f"""head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
echo "HEAD $head"
srun {PYTHON} {TESTS / 'env_world_script.py'}"""
    job = _submit(cluster, tmp_path, body, "--nodes", "2", "--ntasks-per-node", "2", "--export", f"ALL,{RESULTS_TO}")
    _finished(cluster, tmp_path, job, 180)
    text = _output(tmp_path, job)
    head = next(line.split()[1] for line in text.splitlines() if line.startswith("HEAD "))
    tasks = _results(tmp_path, "task")
    assert [r["rank"] for r in tasks] == [0, 1, 2, 3], text
    for r in tasks:
        assert (r["world_size"], r["sum"], r["master_addr"]) == (4, 1 + 2 + 3 + 4, head), r
        assert r["rank"] == int(r["slurm_procid"]) and r["local_rank"] == int(r["slurm_localid"]), r
    # where each rank runs, as the host exchange found it, is what Slurm says (SLURMD_NODENAME)
    on_node = {}
    for r in tasks:
        on_node.setdefault(r["node"], []).append(r["rank"])
    assert sorted(on_node.values()) == tasks[0]["hosts"] == [[0, 1], [2, 3]], tasks
    for r in tasks:
        assert r["local_world_size"] == 2 and on_node[r["node"]].index(r["rank"]) == r["local_rank"], r


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    """`srun gradsync train` for REFERENCE_STEPS on 2 nodes x 1 task, never stopped: its directory."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    out = tmp_path / "run"
    gradsync = Path(PYTHON).with_name("gradsync")
    job = _submit(cluster, tmp_path, f"srun {gradsync} train {' '.join(TRAIN)} --steps {REFERENCE_STEPS} --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "1")
    _finished(cluster, tmp_path, job, 180)
    return out


@pytest.mark.timeout(300)
def test_srun_gradsync_train_matches_gradsync_train(uninterrupted, tmp_path):
    """2 srun tasks on 2 nodes train what `gradsync train --workers 2` trains on one machine, on the same
    flags: the same losses step by step, the same accuracy, the same parameters bit for bit (two ranks' sum
    is the same whichever way it travels: TCP between the nodes, shared memory on one machine)."""
    out = tmp_path / "local"
    local = subprocess.run([PYTHON, "-m", "gradsync.train", *TRAIN, "--workers", "2", "--steps", str(REFERENCE_STEPS),
                            "--out", str(out)], capture_output=True, text=True, timeout=240,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert local.returncode == 0, local.stdout[-3000:] + local.stderr[-3000:]
    summaries = [next(r for r in _records(run) if r["event"] == "summary") for run in (uninterrupted, out)]
    assert summaries[0]["steps"] == summaries[1]["steps"] == REFERENCE_STEPS
    assert summaries[0]["accuracy"] == summaries[1]["accuracy"], summaries
    starts = [next(r for r in _records(run) if r["event"] == "start") for run in (uninterrupted, out)]
    assert starts[0]["global_batch"] == starts[1]["global_batch"] == 32
    losses = [[r["loss"] for r in _records(run) if r["event"] == "step"] for run in (uninterrupted, out)]
    assert losses[0] == losses[1], "the two runs' losses part"
    mine, local = _model(uninterrupted), _model(out)
    assert all(torch.equal(mine[name], local[name]) for name in local), "the parameters differ"


@pytest.mark.timeout(240)
def test_scancel_signal_term_checkpoints_and_exits_75(cluster, tmp_path):
    """`scancel --signal=TERM` reaches every task (one on each node); they stop after the same step, rank 0
    writes the checkpoint, the job exits 75: FAILED 75:0 in sacct (and ExitCode=75:0 in scontrol show job)."""
    out = tmp_path / "run"
    job = _submit(cluster, tmp_path, f"srun {PYTHON} -m gradsync.train {' '.join(TRAIN)} --steps 100000 --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "1")
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        cluster.client("scancel", "--signal=TERM", str(job))
        fields = _finished(cluster, tmp_path, job, 120, state="FAILED")
    finally:
        cluster.client("scancel", str(job), check=False)
    assert fields["ExitCode"] == "75:0", fields
    assert [(row["JobID"], row["State"], row["ExitCode"]) for row in cluster.sacct(job)] == [
        (str(job), "FAILED", "75:0")]
    (preempted,) = [r for r in _records(out) if r["event"] == "preempted"]
    saved = checkpoint.load(out / "checkpoint.pt")
    assert saved["step"] == preempted["step"] >= 5 and saved["world_size"] == 2
    assert _output(tmp_path, job).count(f"preempted at step {preempted['step']}; resume with: srun ") == 1


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
    job = _submit(cluster, tmp_path, body, "--nodes", "2", "--ntasks-per-node", "1", "--requeue", "--open-mode=append")
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        cluster.client("scancel", "--signal=USR1", str(job))
        fields = _finished(cluster, tmp_path, job, 200)
    finally:
        cluster.client("scancel", str(job), check=False)
    text = _output(tmp_path, job)
    assert fields["Restarts"] == "1" and "RESTART 0" in text and "RESTART 1" in text, fields
    # the job completion log: the requeue (the job already pending again), then the requeued run's end
    assert [(row["State"], row["ExitCode"]) for row in cluster.sacct(job)] == [("PENDING", "0:0"), ("COMPLETED", "0:0")]
    assert f"requeueing Slurm job {job}" in text and "--resume auto: continuing the run" in text, text[-4000:]
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


@pytest.mark.slow   # a second trial: test_multihost.py's live torchrun node loss is in the default run
@pytest.mark.timeout(300)
def test_live_mode_a_nodes_tasks_killed_the_others_train_on(cluster, tmp_path):
    """`srun gradsync train --fault-tolerance live` on 2 nodes x 2 tasks: both tasks on the second node are
    SIGKILLed mid-training; the first node's two go on without a restart and finish the run."""
    out = tmp_path / "run"
    epochs = 2
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
    # srun reports the killed tasks, and the job's exit status is theirs: FAILED whatever the survivors did
    assert "tasks 2-3: Killed" in text, text[-3000:]
    assert fields["JobState"] == "FAILED" and [row["State"] for row in cluster.sacct(job)] == ["FAILED"], fields
    print("live mode under srun, a node's tasks killed: sacct", cluster.sacct(job))


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


def _stopped_with_a_checkpoint(out: Path) -> dict:
    """The run in ``out`` stopped after some step, with the checkpoint of that step."""
    (preempted,) = [r for r in _records(out) if r["event"] == "preempted"]
    saved = checkpoint.load(out / "checkpoint.pt")
    assert saved["step"] == preempted["step"] >= 1, (saved["step"], preempted)
    return preempted


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_preempted_by_a_higher_priority_job(cluster, tmp_path):
    """Partition urgent outranks main (PreemptType=preempt/partition_prio, PreemptMode=CANCEL, GraceTime=30 on
    main): a job there that needs node09 whole preempts the training job on it. Slurm sends SIGTERM to its
    tasks as the grace time starts; they stop after the step in flight, checkpoint and exit 75 within it."""
    out = tmp_path / "run"
    job = _submit(cluster, tmp_path, f"srun {PYTHON} -m gradsync.train {' '.join(TRAIN)} --steps 100000 --out {out}",
                  "--nodes", "1", "--ntasks-per-node", "2", "--nodelist", slurm_cluster.NODE_NAMES[0])
    urgent = None
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        urgent = _submit(cluster, tmp_path, "true", "--partition", "urgent", "--exclusive",
                         "--nodelist", slurm_cluster.NODE_NAMES[0])
        fields = _finished(cluster, tmp_path, job, 120, state="FAILED")
        _finished(cluster, tmp_path, urgent, 120)
    finally:
        cluster.client("scancel", *[str(j) for j in (job, urgent) if j], check=False)
    assert fields["ExitCode"] == "75:0", fields
    assert [(row["State"], row["ExitCode"]) for row in cluster.sacct(job)] == [("FAILED", "75:0")]
    _stopped_with_a_checkpoint(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_signal_usr1_before_the_time_limit(cluster, tmp_path):
    """`sbatch --time=3 --signal=USR1@90`, `gradsync train --preempt-signal SIGUSR1`: Slurm sends SIGUSR1 to the
    tasks 90 s before the limit, or up to 60 s earlier (its timer's resolution): between 30 and 90 s after the
    start, once the ranks are up. They checkpoint and exit 75, before the limit: FAILED 75:0."""
    out = tmp_path / "run"
    job = _submit(cluster, tmp_path, f"srun {PYTHON} -m gradsync.train {' '.join(TRAIN)} --steps 1000000 "
                                     f"--preempt-signal SIGUSR1 --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "2", "--time", "3", "--signal", "USR1@90")
    try:
        fields = _finished(cluster, tmp_path, job, 200, state="FAILED")
    finally:
        cluster.client("scancel", str(job), check=False)
    assert fields["ExitCode"] == "75:0", fields
    assert [(row["State"], row["ExitCode"]) for row in cluster.sacct(job)] == [("FAILED", "75:0")]
    _stopped_with_a_checkpoint(out)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_time_limits_sigterm_checkpoints(cluster, tmp_path):
    """`sbatch --time=1`: at the limit Slurm sends SIGTERM to the job (and SIGKILL KillWait seconds later, 10
    here): the ranks stop after the step in flight with a checkpoint, in time. sacct says TIMEOUT: the batch
    script was signalled too, and a job that reached its limit is TIMEOUT whatever its tasks' exit status."""
    out = tmp_path / "run"
    job = _submit(cluster, tmp_path, f"srun {PYTHON} -m gradsync.train {' '.join(TRAIN)} --steps 1000000 --out {out}",
                  "--nodes", "2", "--ntasks-per-node", "2", "--time", "1")
    try:
        _finished(cluster, tmp_path, job, 200, state="TIMEOUT")
    finally:
        cluster.client("scancel", str(job), check=False)
    assert [(row["State"], row["ExitCode"]) for row in cluster.sacct(job)] == [("TIMEOUT", "0:0")]
    _stopped_with_a_checkpoint(out)
    assert "tasks 0-1: Exited with exit code 75" in _output(tmp_path, job) or \
        "task 0: Exited with exit code 75" in _output(tmp_path, job), _output(tmp_path, job)[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_srun_torchrun_one_agent_per_node(cluster, tmp_path):
    """One torchrun per node under srun, c10d rendezvous on the first node. Step 0: gs.init() in its 4 workers
    makes one world of 4 (torchrun's variables win over the agents' SLURM_PROCID 0 and 1). Step 1: gradsync
    train; `scancel --signal=TERM` reaches the agents and their workers: the workers checkpoint and exit 75,
    each agent exits 1 (torchrun's SignalException), so sacct says FAILED 1:0."""
    out = tmp_path / "run"
    torchrun = (f'srun {PYTHON} -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d '
                f'--rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID"')
    body = f"""head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
{torchrun} {TESTS / 'env_world_script.py'}
{torchrun} -m gradsync.train {' '.join(TRAIN)} --steps 100000 --out {out}"""
    job = _submit(cluster, tmp_path, body, "--nodes", "2", "--ntasks-per-node", "1", "--export", f"ALL,{RESULTS_TO}")
    try:
        _wait_for_steps(cluster, tmp_path, job, out, 5)
        cluster.client("scancel", "--signal=TERM", str(job))
        fields = _finished(cluster, tmp_path, job, 120, state="FAILED")
    finally:
        cluster.client("scancel", str(job), check=False)
    workers = _results(tmp_path, "torchrun")
    assert [(r["rank"], r["world_size"], r["sum"]) for r in workers] == [(k, 4, 10.0) for k in range(4)], workers
    assert sorted(r["slurm_procid"] for r in workers) == ["0", "0", "1", "1"]
    assert workers[0]["hosts"] == [[0, 1], [2, 3]]
    assert fields["ExitCode"] == "1:0" and [(r["State"], r["ExitCode"]) for r in cluster.sacct(job)] == [
        ("FAILED", "1:0")], fields
    preempted = _stopped_with_a_checkpoint(out)
    assert checkpoint.load(out / "checkpoint.pt")["world_size"] == 4
    assert "torch.distributed.run --nnodes 2" in preempted["command"], preempted
