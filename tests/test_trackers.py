"""`gradsync train --log tensorboard,wandb,mlflow`: what each tracker holds, read back by the tracker's
own reader (TensorBoard's EventAccumulator, MLflow's MlflowClient on the file store, W&B's `wandb leet
inspect --json` over the offline run files), never by a parser of ours.

Oracles: the steps a run must have logged (every --log-every'th, once each, through a preemption and
its resume, or a live world that lost its reporting rank), and metrics.jsonl's records of the same
steps (the loss rank 0 trained with, each rank's timings, the summary's accuracy), which the trackers
must hold unchanged. The run key every tracker's run is named by is read from the checkpoint.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync import checkpoint

pytest.importorskip("tensorboard")
pytest.importorskip("mlflow")
pytest.importorskip("wandb")

JOB = ["--workers", "2", "--batch-size", "16", "--seed", "0", "--timeout", "30", "--quiet", "--log-every", "10"]
"""digits at 2 x 16: 45 steps an epoch."""
EXIT_PREEMPTED = 75


def _train(args: list[str], out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


def _records(out: Path, event: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


def tensorboard_scalars(out: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard shows for the run: {tag: [(step, value), ...]} in its reader's order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def mlflow_runs(out: Path) -> list[tuple[object, dict[str, list[tuple[int, float]]]]]:
    """Every MLflow run in the run's file store: (its Run, {metric: [(step, value), ...]})."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(out / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("gradsync")
    runs = client.search_runs([experiment.experiment_id])
    return [(run, {key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
                   for key in run.data.metrics}) for run in runs]


def wandb_runs(out: Path) -> list[tuple[str, list[dict]]]:
    """Each offline run directory's (run id, history records in order), as `wandb leet inspect --json` prints
    the run file W&B's service wrote."""
    found = []
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        shown = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr[-2000:]
        records = [json.loads(line) for line in shown.stdout.splitlines() if line.strip()]
        (run_id,) = {r["run"]["run_id"] for r in records if r["type"] == "run"}
        found.append((run_id, [r["history"]["item"] for r in records if r["type"] == "history"]))
    return found


def _steps_once(pairs: list[tuple[int, float]]) -> list[int]:
    steps = [step for step, _ in pairs]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return sorted(steps)


def _as_jsonl(out: Path) -> dict[str, dict[int, float]]:
    """metrics.jsonl's figures by the trackers' names: {name: {step: value}}."""
    figures: dict[str, dict[int, float]] = {}
    for record in _records(out, "step"):
        figures.setdefault("loss", {})[record["step"]] = record["loss"]
    for record in _records(out, "ranks"):
        for i, rank in enumerate(record["ranks"]):
            figures.setdefault(f"rank{rank}/step_s", {})[record["step"]] = record["step_s"][i]
            figures.setdefault(f"rank{rank}/wait_s", {})[record["step"]] = record["wait_s"][i]
    for record in _records(out, "epoch"):
        figures.setdefault("test/accuracy", {})[record["step"]] = record["accuracy"]
    return figures


def _holds_jsonl(name: str, pairs: list[tuple[int, float]], jsonl: dict, rel: float) -> None:
    for step, value in pairs:
        assert value == pytest.approx(jsonl[name][step], rel=rel), (name, step, value, jsonl[name][step])


@pytest.mark.slow   # the preempted run's resume below makes the same checks of a run that also stopped once
@pytest.mark.timeout(300)
def test_a_clean_run_is_read_back_by_each_trackers_own_reader(tmp_path):
    """30 steps of 2 workers, logged every 10 to all three trackers: each holds the loss at steps 10, 20, 30
    once, each rank's timings at the same steps and the final test accuracy, as metrics.jsonl has them
    (TensorBoard keeps float32: within 1e-6); the MLflow run and the W&B run are named by the checkpoint's
    run key, the MLflow run finished."""
    out = tmp_path / "run"
    job = _train([*JOB, "--steps", "30", "--log", "tensorboard,wandb,mlflow"], out)
    assert job.returncode == 0, job.stderr[-3000:]
    key = checkpoint.load(out / "checkpoint.pt")["tracking"]["run_key"]
    jsonl = _as_jsonl(out)
    summary = _records(out, "summary")[-1]
    assert jsonl["test/accuracy"] == {30: summary["accuracy"]}

    board = tensorboard_scalars(out)
    for name in ("loss", "rank0/step_s", "rank1/step_s", "rank0/wait_s", "rank1/wait_s"):
        assert _steps_once(board[name]) == [10, 20, 30], (name, board[name])
        _holds_jsonl(name, board[name], jsonl, rel=1e-6)
    assert _steps_once(board["test/accuracy"]) == [30]
    _holds_jsonl("test/accuracy", board["test/accuracy"], jsonl, rel=1e-6)
    assert {"lr", "samples_per_s", "rank0/compute_s", "rank1/comm_s", "rank1/bytes_sent"} <= set(board)

    (run, metrics), = mlflow_runs(out)
    assert run.data.tags["gradsync.run"] == key and run.info.status == "FINISHED"
    for name in ("loss", "rank0/step_s", "rank1/wait_s", "test/accuracy"):
        assert _steps_once(metrics[name]) == ([30] if name.startswith("test") else [10, 20, 30])
        _holds_jsonl(name, metrics[name], jsonl, rel=1e-12)

    (run_id, history), = wandb_runs(out)
    assert run_id == key
    assert [item["_step"] for item in history] == [10, 20, 30]
    for item in history:
        for name in ("loss", "rank0/step_s", "rank1/step_s"):
            assert item[name] == pytest.approx(jsonl[name][item["_step"]], rel=1e-12)
    assert history[-1]["test/accuracy"] == summary["accuracy"]


def _signal_after(args: list[str], out: Path, steps: int) -> subprocess.Popen:
    """Start a job and SIGTERM its launcher once rank 0 has logged ``steps`` steps; the job, ended."""
    job = subprocess.Popen([sys.executable, "-m", "gradsync.cli", "train", *args, "--out", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 150
    while not ((out / "metrics.jsonl").exists() and len(_records(out, "step")) >= steps):
        assert job.poll() is None, f"the job ended before it could be signalled: {job.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"the job logged fewer than {steps} steps in 150 s"
        time.sleep(0.01)
    os.kill(job.pid, signal.SIGTERM)
    job.communicate(timeout=120)
    return job


@pytest.mark.timeout(400)
def test_a_preempted_run_resumes_into_the_same_tracker_run(tmp_path):
    """SIGTERM to the launcher after 15 steps of a 60-step run (exit 75, a checkpoint at step S), then
    --resume: TensorBoard and MLflow hold the loss and each rank's timings at 10, 20, ..., 60 once each
    and the test accuracy at the epoch's end (45) and the run's (60), as metrics.jsonl has them
    (TensorBoard keeps float32: within 1e-6), in one MLflow run, finished; W&B holds two offline parts
    of one run id (the checkpoint's key), the first ending at or before S, the second starting after
    it, with the same figures."""
    out = tmp_path / "run"
    args = [*JOB, "--steps", "60", "--log", "tensorboard,wandb,mlflow"]
    first = _signal_after(args, out, steps=15)
    assert first.returncode == EXIT_PREEMPTED
    stopped = checkpoint.load(out / "checkpoint.pt")
    key, at = stopped["tracking"]["run_key"], stopped["step"]
    assert at < 60
    resumed = _train([*args, "--resume"], out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert checkpoint.load(out / "checkpoint.pt")["tracking"]["run_key"] == key
    every = list(range(10, 61, 10))
    jsonl = _as_jsonl(out)

    assert jsonl["test/accuracy"][60] == _records(out, "summary")[-1]["accuracy"]

    board = tensorboard_scalars(out)
    for name in ("loss", "rank0/step_s", "rank1/step_s", "rank0/wait_s", "rank1/wait_s"):
        assert _steps_once(board[name]) == every, (name, board[name])
        _holds_jsonl(name, board[name], jsonl, rel=1e-6)
    assert _steps_once(board["test/accuracy"]) == [45, 60]
    _holds_jsonl("test/accuracy", board["test/accuracy"], jsonl, rel=1e-6)
    assert {"lr", "samples_per_s", "rank0/compute_s", "rank1/comm_s", "rank1/bytes_sent"} <= set(board)

    (run, metrics), = mlflow_runs(out)
    assert run.data.tags["gradsync.run"] == key and run.info.status == "FINISHED"
    assert _steps_once(metrics["loss"]) == every and _steps_once(metrics["rank0/wait_s"]) == every
    assert _steps_once(metrics["test/accuracy"]) == [45, 60]
    for name in ("loss", "rank1/step_s", "rank0/wait_s", "test/accuracy"):
        _holds_jsonl(name, metrics[name], jsonl, rel=1e-12)

    parts = wandb_runs(out)
    assert [run_id for run_id, _ in parts] == [key, key], parts
    steps = [[item["_step"] for item in history] for _, history in parts]
    assert steps[0] and steps[1] and max(steps[0]) <= at < min(steps[1]), (steps, at)
    assert sorted(s for part in steps for s in part if s % 10 == 0) == every
    assert [s for part in steps for s in part] == sorted({s for part in steps for s in part}), steps
    for _, history in parts:
        for item in history:
            for name in ("loss", "rank0/step_s", "rank1/wait_s", "test/accuracy"):
                if name in item:
                    assert item[name] == pytest.approx(jsonl[name][item["_step"]], rel=1e-12), (name, item)


@pytest.mark.timeout(300)
def test_a_live_run_that_lost_its_reporting_rank_records_on_to_the_same_tracker_run(tmp_path):
    """--fault-tolerance live, 3 workers, member 0 (rank 0, the reporting rank) killed in its 15th step:
    the new rank 0 opens the same tracker run and records steps 20 and 30; TensorBoard and MLflow hold
    the loss at 10, 20, 30 once each, three ranks' timings at step 10 and the two survivors' after."""
    out = tmp_path / "run"
    job = _train([*JOB, "--workers", "3", "--fault-tolerance", "live", "--steps", "30", "--log", "tensorboard,mlflow"],
                 out, env={"GRADSYNC_LIVE_KILL": "0:14:forward"})
    assert job.returncode == 0, job.stderr[-3000:]
    (live,) = _records(out, "live")
    assert live["lost"] == [0] and live["world_size"] == 2, live
    key = checkpoint.load(out / "checkpoint.pt")["tracking"]["run_key"]
    jsonl = _as_jsonl(out)

    board = tensorboard_scalars(out)
    assert _steps_once(board["loss"]) == [10, 20, 30]
    _holds_jsonl("loss", board["loss"], jsonl, rel=1e-6)
    assert _steps_once(board["rank2/step_s"]) == [10] and _steps_once(board["rank1/step_s"]) == [10, 20, 30]

    (run, metrics), = mlflow_runs(out)
    assert run.data.tags["gradsync.run"] == key and run.info.status == "FINISHED"
    assert _steps_once(metrics["loss"]) == [10, 20, 30]
    assert _steps_once(metrics["rank2/wait_s"]) == [10] and _steps_once(metrics["rank0/wait_s"]) == [10, 20, 30]
    _holds_jsonl("loss", metrics["loss"], jsonl, rel=1e-12)
