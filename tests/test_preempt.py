"""Preemption and resuming on another world size, end to end with real signals and real jobs.

Oracles: an uninterrupted run of the same job (final weights compared with torch.equal, accuracy),
and the sample ids every rank logs as it trains them (GRADSYNC_SAMPLE_LOG), counted per epoch
against range(n): each id exactly once however the epoch was cut and regrouped.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from gradsync import checkpoint
from gradsync.bench.faults import rank_pids
from gradsync.train.datasets import digits

ROOT = Path(__file__).resolve().parents[1]
JOB = ["--batch-size", "16", "--epochs", "3", "--seed", "0", "--timeout", "30", "--quiet"]  # 45 steps/epoch at N=2
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130
REPLAY_TOLERANCE = 1e-4
"""How far a leg's update may be from one process's replay of its steps (replay.py): float32 sums in
another order, 2e-7 to 6e-7 over the legs of about 11 steps here, 0 for the one-process leg."""


def _cli(args: list[str], out: Path, env: dict | None = None) -> subprocess.Popen:
    """`gradsync train` in a process group of its own (its pid is the group's id), as a shell job."""
    return subprocess.Popen([sys.executable, "-m", "gradsync.cli", "train", *args, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})}, start_new_session=True)


def _last_step(out: Path) -> int | None:
    """The newest step rank 0 logged since the job (re)started in ``out``."""
    step = None
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        record = json.loads(line)
        if record["event"] == "start":
            step = None
        elif record["event"] == "step":
            step = record["step"]
    return step


def _preempt(args: list[str], out: Path, steps_in: int, target: str = "launcher", signum=signal.SIGTERM,
             env: dict | None = None) -> dict:
    """Start a job, signal it once it has trained ``steps_in`` steps, and return how it ended.
    ``target``: "launcher", "rankN", or "group": every process of the job at once (`timeout`, Slurm,
    `kill -- -PGID`; with SIGINT what Ctrl-C in a terminal does), which must end as quietly."""
    job = _cli(args, out, env)
    deadline = time.monotonic() + 150
    first = None
    while True:
        step = _last_step(out)
        first = step if first is None else first
        if step is not None and step - first >= steps_in:
            break
        assert job.poll() is None, f"the job ended before it could be signalled: {job.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "the job trained too few steps in 150 s"
        time.sleep(0.005)
    if target == "group":
        os.killpg(job.pid, signum)
    else:
        os.kill(job.pid if target == "launcher" else rank_pids(job.pid)[int(target.removeprefix("rank"))], signum)
    stdout, stderr = job.communicate(timeout=120)
    expected = EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED
    assert job.returncode == expected, (job.returncode, stderr[-3000:])
    assert "Traceback" not in stderr and "gradsync: error" not in stderr, stderr[-3000:]
    line = [x for x in stdout.splitlines() if x.startswith("preempted at step ")]
    assert len(line) == 1, stdout
    stopped = int(line[0].split()[3].rstrip(";"))
    state = checkpoint.load(out / "checkpoint.pt")
    # nothing trained is lost: the checkpoint holds the last step any rank logged
    assert state["step"] == stopped == _last_step(out), (state["step"], stopped, _last_step(out))
    return {"step": stopped, "command": line[0].split("resume with: ", 1)[1], "stdout": stdout, "state": state}


def _run_command(command: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a printed `gradsync train ...` command as printed (gradsync -> this interpreter's module)."""
    argv = shlex.split(command)
    assert argv[:2] == ["gradsync", "train"], argv
    return subprocess.run([sys.executable, "-m", "gradsync.cli", *argv[1:]], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def _ids_per_epoch(log_dir: Path) -> dict[int, Counter]:
    seen: dict[int, Counter] = {}
    for path in log_dir.glob("samples.*"):
        for line in path.read_text().splitlines():
            epoch, *ids = map(int, line.split())
            seen.setdefault(epoch, Counter()).update(ids)
    return seen


def _final(out: Path) -> tuple[dict, float]:
    """Final weights (from the last checkpoint) and accuracy (from the summary) of the job in ``out``."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return checkpoint.load(out / "checkpoint.pt")["model"], [r for r in records if r["event"] == "summary"][-1]["accuracy"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference: 2 ddp workers, 3 epochs of digits, sample ids logged."""
    out = tmp_path_factory.mktemp("straight")
    (out / "ids").mkdir()
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--workers", "2", *JOB, "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "GRADSYNC_SAMPLE_LOG": str(out / "ids")})
    assert done.returncode == 0, done.stderr[-3000:]
    weights, accuracy = _final(out)
    return {"weights": weights, "accuracy": accuracy, "ids": _ids_per_epoch(out / "ids")}


def _each_id_once_per_epoch(seen: dict[int, Counter], epochs: int) -> None:
    n = len(digits()[0])
    assert sorted(seen) == list(range(epochs)), sorted(seen)
    for epoch, counts in seen.items():
        missing = [i for i in range(n) if counts[i] == 0]
        twice = {i: c for i, c in counts.items() if c > 1}
        assert not missing and not twice and set(counts) == set(range(n)), \
            f"epoch {epoch}: {len(missing)} ids never seen (e.g. {missing[:5]}), {len(twice)} seen more than once"


@pytest.mark.timeout(400)
# with -m slow: test_your_model.py's command-line trial sends SIGTERM to the whole job and resumes bit-identically
@pytest.mark.parametrize("target", [pytest.param(t, marks=pytest.mark.slow) for t in ("group", "launcher")])
def test_sigterm_then_resume_is_bit_identical_ddp(straight, tmp_path, target):
    """SIGTERM mid-epoch to `gradsync train` (launcher) or to every process of the job at once (group:
    `timeout`, Slurm, `kill -- -PGID`; the forkserver, the ranks' parent, must survive it): exit 75
    with a checkpoint at the last trained step; the printed command resumes it to exactly the
    uninterrupted weights, every sample seen once per epoch."""
    _each_id_once_per_epoch(straight["ids"], 3)   # the uninterrupted run itself, with its shorter last step
    (tmp_path / "ids").mkdir()
    env = {"GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids")}
    stop = _preempt(["--workers", "2", *JOB], tmp_path, steps_in=8, target=target, env=env)
    # 45 steps per epoch: 44 of 32 samples and one of the last 29 (1437 in all)
    state = stop["state"]
    assert state["position"] == min(32 * (stop["step"] - 45 * state["epoch"]), 1437), (stop["step"], state["position"])
    assert stop["command"].endswith("--resume") and "--workers 2" in stop["command"]
    done = _run_command(stop["command"], env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {tmp_path / 'checkpoint.pt'} at step {stop['step']}" in done.stdout
    weights, _ = _final(tmp_path)
    for name, value in straight["weights"].items():
        assert torch.equal(value, weights[name]), name
    _each_id_once_per_epoch(_ids_per_epoch(tmp_path / "ids"), 3)


@pytest.mark.slow   # a second trial: the default regrouping test sends SIGUSR1 to one ddp rank
@pytest.mark.timeout(400)
def test_sigusr1_to_one_rank_then_resume_is_bit_identical_zero1(tmp_path):
    """--preempt-signal SIGUSR1 sent to rank 1 only: every rank stops after the same step (zero1's
    checkpoint gathers the sharded optimizer state); resuming equals an uninterrupted zero1 run."""
    job = ["--workers", "2", "--strategy", "zero1", "--steps", "70", "--preempt-signal", "SIGUSR1", *JOB]
    reference = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *job, "--out", str(tmp_path / "a")],
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    stop = _preempt(job, tmp_path / "b", steps_in=8, target="rank1", signum=signal.SIGUSR1)
    assert stop["step"] < 70 and "--preempt-signal SIGUSR1" in stop["command"]
    done = _run_command(stop["command"])
    assert done.returncode == 0, done.stderr[-3000:]
    expected, _ = _final(tmp_path / "a")
    weights, _ = _final(tmp_path / "b")
    for name, value in expected.items():
        assert torch.equal(value, weights[name]), name


@pytest.mark.timeout(400)
def test_sigterm_mid_round_then_resume_is_bit_identical_diloco(tmp_path):
    """--strategy diloco stopped between outer steps, when every worker's replica and inner optimizer
    differ: each rank's replica file and DiLoCo's outer state bring the resumed job to exactly the
    weights of an uninterrupted one."""
    job = ["--workers", "2", "--strategy", "diloco", "--sync-every", "10", "--steps", "40", *JOB]
    reference = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *job, "--out", str(tmp_path / "a")],
                               capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    stop = _preempt(job, tmp_path / "b", steps_in=12)
    assert stop["step"] < 40 and "--strategy diloco" in stop["command"] and "--sync-every 10" in stop["command"]
    replicas = [checkpoint.load(tmp_path / "b" / f"replica{rank}.pt") for rank in range(2)]
    assert [r["step"] for r in replicas] == [stop["step"]] * 2
    if stop["step"] % 10:   # stopped between outer steps (as a rule): the replicas really differ there
        assert not all(torch.equal(replicas[0]["model"][k], replicas[1]["model"][k]) for k in replicas[0]["model"])
    done = _run_command(stop["command"])
    assert done.returncode == 0, done.stderr[-3000:]
    expected, _ = _final(tmp_path / "a")
    weights, _ = _final(tmp_path / "b")
    for name, value in expected.items():
        assert torch.equal(value, weights[name]), name


@pytest.mark.slow   # a longer chain: test_train.py and test_batch_math.py resume 2 workers on 4 by default
@pytest.mark.timeout(500)
def test_preempted_on_2_3_2_then_1_worker_sees_every_sample_once(tmp_path):
    """One 2-epoch job cut three times and regrouped 2 -> 3 -> 2 -> 1 workers: each resume says what it changed
    in the batch, every epoch trains every sample id exactly once, and the weights at every cut and at
    the end are one process's replaying the logged steps at the printed learning rates (replay.py). The
    second cut is SIGUSR1 (--preempt-signal SIGUSR1) to rank 2 alone: the stop reaches ranks 0 and 1
    through the per-step all-reduce, and the printed command keeps the flag."""
    import replay

    # the last --epochs wins: the one-process leg trains about 26 steps, not 60; linear scaling, so that
    # the lr moves with each leg's global batch by a factor the test can state
    job = [*JOB, "--epochs", "2", "--lr-scaling", "linear", "--warmup-steps", "20"]
    logs = tmp_path / "ids"
    logs.mkdir()
    env = {"GRADSYNC_SAMPLE_LOG": str(logs)}
    legs, seen = [], set()

    def leg_logs() -> set[str]:   # the logs the leg just run wrote (each rank process its own)
        new = {path.name for path in logs.glob("samples.*")} - seen
        seen.update(new)
        return new

    first = _preempt(["--workers", "2", *job], tmp_path, steps_in=10, env=env)
    legs.append((leg_logs(), 0.04))
    # G=32 does not divide over 3: the per-worker batch stays, G=48, lr x 1.5
    second = _preempt(["--workers", "3", *job, "--preempt-signal", "SIGUSR1", "--resume"], tmp_path, steps_in=10,
                      target="rank2", signum=signal.SIGUSR1, env=env)
    assert "global batch 32 does not divide over 3 workers" in second["stdout"]
    assert "lr 0.04 -> 0.06 (linear scaling)" in second["stdout"], second["stdout"]
    assert "--preempt-signal SIGUSR1" in second["command"] and "--workers 3" in second["command"]
    legs.append((leg_logs(), 0.06))
    # G=48 over 2 workers: 24 each, lr kept
    third = _preempt(["--workers", "2", *job, "--resume"], tmp_path, steps_in=10, env=env)
    assert "global batch 48 kept: 24 per worker" in third["stdout"], third["stdout"]
    legs.append((leg_logs(), 0.06))
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--strategy", "local", "--workers", "1",
                           *job, "--resume", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "global batch 48 kept: 48 per worker" in done.stdout, done.stdout
    legs.append((leg_logs(), 0.06))
    n = len(digits()[0])
    assert any(0 < cut["state"]["position"] < n for cut in (first, second, third)), "no cut fell mid-epoch"
    _each_id_once_per_epoch(_ids_per_epoch(logs), 2)
    # the oracle: one process replays each leg's logged steps from the checkpoint the leg resumed from
    # (the first from the initial weights), at the printed peak lr with the 20-step warm-up, and must
    # end where the leg's own checkpoint is
    final = checkpoint.load(tmp_path / "checkpoint.pt")
    starts, ends, done = [None, first["state"], second["state"], third["state"]], [first["state"], second["state"],
                                                                                  third["state"], final], 0
    for (names, peak), start, end in zip(legs, starts, ends):
        logged = replay.steps_logged(logs, names)
        assert end["step"] == done + len(logged), (end["step"], done, len(logged))
        initial, oracle = replay.replay([(ids, replay.warmed_up(done + k, peak, 20)) for k, ids in enumerate(logged)],
                                        start=start)
        done += len(logged)
        assert replay.update_error(end["model"], initial, oracle) < REPLAY_TOLERANCE, f"the leg that ended at step {done}"


@pytest.mark.timeout(200)
def test_a_second_sigterm_during_the_checkpoint_write_changes_nothing(tmp_path):
    """The preemption checkpoint's write is slowed (tests/preempt_slow_write.py); a second SIGTERM
    meanwhile is ignored: the file on disk stays the previous, whole checkpoint until the new one
    replaces it, the job still exits 75, and the new checkpoint is whole."""
    job = subprocess.Popen([sys.executable, str(ROOT / "tests" / "preempt_slow_write.py"), "train", "--strategy",
                            "local", "--workers", "1", "--batch-size", "8", "--epochs", "3", "--quiet",
                            "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    written = tmp_path / "checkpoint.pt"
    deadline = time.monotonic() + 150
    while not written.exists():   # the end of epoch 0 (fast: the first write)
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    previous = checkpoint.load(written)
    job.send_signal(signal.SIGTERM)
    while not (tmp_path / "writing").exists():   # the preemption checkpoint is being written, slowly
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    job.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert job.poll() is None, "a second SIGTERM must not end the job while it writes its checkpoint"
    during = checkpoint.load(written)
    assert during["step"] == previous["step"] and [p.name for p in tmp_path.glob(".checkpoint.pt.tmp-*")]
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == EXIT_PREEMPTED, stderr[-3000:]
    after = checkpoint.load(written)
    assert after["step"] > previous["step"] and f"preempted at step {after['step']};" in stdout
    assert not list(tmp_path.glob(".checkpoint.pt.tmp-*"))


@pytest.mark.timeout(200)
def test_a_sigterm_during_start_up_stops_after_the_first_step(tmp_path):
    """SIGTERM to the launcher as soon as its rank processes exist (still importing, not yet joined):
    the ranks hold it and the launcher delivers it once they can, so the job stops after step 1 with
    a checkpoint (exit 75) instead of losing its ranks to the signal during set-up."""
    job = _cli(["--workers", "2", *JOB], tmp_path)
    deadline = time.monotonic() + 60
    while not rank_pids(job.pid):
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.001)
    assert not (tmp_path / "metrics.jsonl").exists()   # no rank has started training yet
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == EXIT_PREEMPTED, (job.returncode, stderr[-3000:])
    assert "preempted at step 1;" in stdout, stdout
    assert checkpoint.load(tmp_path / "checkpoint.pt")["step"] == 1


@pytest.mark.slow   # a second trial: the elastic restart test ends the same way, after a restart
@pytest.mark.timeout(200)
def test_sigterm_to_the_torchrun_agent_checkpoints_and_prints_the_torchrun_command(tmp_path):
    """Under torchrun the agent relays SIGTERM to its workers: they stop after the same step with a
    checkpoint and print the agent's own command line with --resume."""
    from gradsync.group.runtime import free_port

    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                            str(free_port()), "-m", "gradsync.train", *JOB, "--out", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 150
    while (_last_step(tmp_path) or 0) < 3:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    line = [x for x in stdout.splitlines() if x.startswith("preempted at step ")]
    assert len(line) == 1, (stdout, stderr[-3000:])
    command = line[0].split("resume with: ", 1)[1]
    assert "-m torch.distributed.run --nproc-per-node 2" in command and command.endswith("-m gradsync.train "
                                                                                          + " ".join(JOB) + f" --out {tmp_path} --resume")
    state = checkpoint.load(tmp_path / "checkpoint.pt")
    assert state["step"] == int(line[0].split()[3].rstrip(";")) == _last_step(tmp_path)


def _worker_of_rank(agent_pid: int, rank: int) -> int:
    """The pid of the torchrun worker with RANK=rank among the agent's children."""
    children = Path(f"/proc/{agent_pid}/task/{agent_pid}/children").read_text().split()
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no worker with RANK={rank} among {children}")


@pytest.mark.slow   # a second trial: the default run's restart test, here to the end of 3 epochs
@pytest.mark.timeout(400)
def test_a_torchrun_restart_continues_from_the_last_checkpoint(tmp_path):
    """Elastic torchrun on one host (--nnodes 1:2, c10d rendezvous, --max-restarts 1), no --resume: a
    worker is SIGKILLed mid-training; the agent restarts both workers with the same command, and they
    continue from the job's last --checkpoint-every checkpoint (TORCHELASTIC_RESTART_COUNT) and finish."""
    job = _elastic_torchrun(tmp_path)
    killed_at, resumed_at = _kill_a_worker_and_wait_for_the_restart(job, tmp_path)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stderr[-3000:]
    summary = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"summary"' in x][-1]
    assert summary["steps"] == 135 and summary["accuracy"] >= 0.9, summary


@pytest.mark.timeout(300)
def test_a_torchrun_restart_continues_from_the_last_checkpoint_then_sigterm_to_the_agent_checkpoints(tmp_path):
    """The elastic torchrun job above, one worker SIGKILLed and both restarted from the last periodic
    checkpoint (not step 0); two steps later SIGTERM to the agent, which relays it: the workers stop
    after the same step with a checkpoint and print the agent's own command line with --resume."""
    job = _elastic_torchrun(tmp_path)
    killed_at, resumed_at = _kill_a_worker_and_wait_for_the_restart(job, tmp_path, then=2)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    line = [x for x in stdout.splitlines() if x.startswith("preempted at step ")]
    assert len(line) == 1, (stdout, stderr[-3000:])
    command = line[0].split("resume with: ", 1)[1]
    assert "-m torch.distributed.run --nnodes 1:2 --nproc-per-node 2 --max-restarts 1" in command, command
    assert command.endswith(f"-m gradsync.train {' '.join(JOB)} --checkpoint-every 5 --out {tmp_path} --resume"), command
    state = checkpoint.load(tmp_path / "checkpoint.pt")
    assert resumed_at + 2 <= state["step"] == int(line[0].split()[3].rstrip(";")) == _last_step(tmp_path)


def _elastic_torchrun(out: Path) -> subprocess.Popen:
    """2 digits workers under elastic torchrun on one host, a checkpoint every 5 steps, no --resume."""
    from gradsync.group.runtime import free_port

    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                             "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                             f"127.0.0.1:{free_port()}", "--rdzv-conf", "last_call_timeout=1", "-m", "gradsync.train",
                             *JOB, "--checkpoint-every", "5", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_a_worker_and_wait_for_the_restart(job: subprocess.Popen, out: Path, then: int = 0) -> tuple[int, int]:
    """SIGKILL worker RANK=1 after step 12; once the agent has restarted the workers and they have
    trained ``then`` steps, return (the last step before the kill, the step the restart resumed at),
    the latter a multiple of 5 of at least 10: the last periodic checkpoint, not step 0 (without the
    automatic resume the test fails with "(0, 13)")."""
    deadline = time.monotonic() + 200
    while (_last_step(out) or 0) < 12:
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    os.kill(_worker_of_rank(job.pid, 1), signal.SIGKILL)
    while True:
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        starts = [i for i, r in enumerate(records) if r["event"] == "start"]
        restarted = [r["step"] for r in records[starts[-1]:] if r["event"] == "step"] if len(starts) == 2 else []
        if len(restarted) > then:
            break
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    assert len(starts) == 2, "one start, one restart"
    killed_at = max(r["step"] for r in records[:starts[1]] if r["event"] == "step")
    resumed_at = restarted[0] - 1
    assert resumed_at % 5 == 0 and 10 <= resumed_at <= killed_at, (resumed_at, killed_at)
    return killed_at, resumed_at


def _ps_reference(args: list[str], out: Path) -> dict:
    """An uninterrupted parameter-server run: its final checkpoint and the sample ids its workers trained."""
    (out / "ids").mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *args, "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "GRADSYNC_SAMPLE_LOG": str(out / "ids")})
    assert done.returncode == 0, done.stderr[-3000:]
    return {"state": checkpoint.load(out / "checkpoint.pt"), "ids": _ids_per_epoch(out / "ids")}


@pytest.mark.timeout(300)
def test_ps_sync_preempted_at_a_worker_resumes_on_two_servers_bit_identical(tmp_path):
    """ps-sync, 1 server + 2 workers; SIGTERM to one worker only (its next push carries the stop flag,
    the server flags its answers, so both workers stop on the same version); resumed with 2 servers + 2 workers (the server state re-cut,
    momentum included): weights torch.equal to an uninterrupted run, and the workers trained exactly
    the reference's sample ids, each as often, across the interruption."""
    job = ["--strategy", "ps-sync", "--steps", "60", "--batch-size", "16", "--seed", "0", "--timeout", "30", "--quiet"]
    reference = _ps_reference([*job, "--workers", "3"], tmp_path / "a")
    (tmp_path / "ids").mkdir()
    env = {"GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids")}
    stop = _preempt([*job, "--workers", "3"], tmp_path / "b", steps_in=10, target="rank2", env=env)
    assert 10 <= stop["step"] < 60 and stop["state"]["ps"]["clocks"] == [stop["step"]] * 2, stop["state"]["ps"]["clocks"]
    assert stop["state"]["ps"]["version"] == stop["step"] and stop["command"].endswith("--workers 3 --out "
                                                                                      f"{tmp_path / 'b'} --resume")
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *job, "--workers", "4", "--servers", "2",
                           "--resume", "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {tmp_path / 'b' / 'checkpoint.pt'} at step {stop['step']}" in done.stdout
    final = checkpoint.load(tmp_path / "b" / "checkpoint.pt")
    assert final["ps"]["servers"] == 2 and final["step"] == 60
    for name, value in reference["state"]["model"].items():
        assert torch.equal(value, final["model"][name]), name
    assert _ids_per_epoch(tmp_path / "ids") == reference["ids"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy, target, signum", [("ps-async", "group", signal.SIGINT),   # Ctrl-C
                                                      pytest.param("ssp", "rank2", signal.SIGTERM,
                                                                   marks=pytest.mark.slow)])   # ssp: as async
def test_async_ps_preempted_resumes_every_worker_at_its_own_clock(tmp_path, strategy, target, signum):
    """1 server + 2 workers, Ctrl-C (SIGINT to every process: exit 130, no traceback) or SIGTERM to
    worker rank 2 alone: from then on every answer carries the stop
    flag and each worker stops at its own clock with its last push applied (the checkpoint's clocks
    are the steps each worker logged: nothing trained is lost). Resumed, each worker goes on at its
    own clock, and over both runs every worker trained exactly its own share of each global step, in
    order: of the epoch's permutation (torch.randperm seeded with seed + epoch), steps of G = 32 samples,
    the last of an epoch the 29 left, worker w taking every 2nd from the w-th, 60 steps each; which for
    the full steps is torch's own DistributedSampler's deal. (A resume on another number of workers:
    test_train.py.)"""
    job = ["--strategy", strategy, "--steps", "60", "--batch-size", "16", "--seed", "0", "--timeout", "30", "--quiet"]
    before, after = tmp_path / "ids-before", tmp_path / "ids-after"
    before.mkdir()
    after.mkdir()
    stop = _preempt([*job, "--workers", "3"], tmp_path, steps_in=8, target=target, signum=signum,
                    env={"GRADSYNC_SAMPLE_LOG": str(before)})
    clocks = stop["state"]["ps"]["clocks"]
    assert all(0 < clock < 60 for clock in clocks), clocks
    assert stop["command"].endswith(f"--workers 3 --out {tmp_path} --resume"), stop["command"]
    done = _run_command(stop["command"], {"GRADSYNC_SAMPLE_LOG": str(after)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint.load(tmp_path / "checkpoint.pt")["ps"]["clocks"] == [60, 60]
    train_set = digits()[0]
    for worker, clock in enumerate(clocks):
        runs = [[line.split() for line in path.read_text().splitlines()]
                for logs in (before, after) for path in logs.glob(f"samples.*.r{worker + 1}")]
        assert len(runs) == 2 and len(runs[0]) == clock, (worker, clock, [len(run) for run in runs])
        per_epoch = -(-len(train_set) // 32)
        expected = []
        for step in range(60):
            epoch, batch = divmod(step, per_epoch)
            order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(epoch)).tolist()
            expected.append([str(epoch), *map(str, order[batch * 32:(batch + 1) * 32][worker::2])])
        assert runs[0] + runs[1] == expected, f"worker {worker}: not its share of each step in order across the cut"
        sampler = torch.utils.data.DistributedSampler(train_set, num_replicas=2, rank=worker, shuffle=True, seed=0)
        assert [line[1:] for line in expected[:per_epoch - 1]] == \
            [list(map(str, list(sampler)[b * 16:(b + 1) * 16])) for b in range(per_epoch - 1)]
