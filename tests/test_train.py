"""gradsync train end to end: accuracy, exact resume, clear errors for bad input, the example script."""

import json
import os
from collections import Counter
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsync.cli import main
from gradsync.train.config import TrainConfig
from gradsync.train.launcher import run

ROOT = Path(__file__).resolve().parents[1]


def gradient_bytes(bytes_sent: float, steps: int, per_step: float) -> float:
    """What a rank sent beyond ``per_step`` bytes of gradients a step: the per-step 16-byte all-reduce
    that agrees on checkpoints and preemption, the evaluation's sums and the replica check (a few
    hundred bytes in all); asserted between 0 and 32 bytes a step + 1 KiB."""
    extra = bytes_sent - steps * per_step
    assert 0 <= extra <= 32 * steps + 1024, (bytes_sent, steps, per_step, extra)
    return extra


def samples_per_epoch(log_dir: Path) -> dict[int, Counter]:
    """epoch -> how many times each sample id was trained on, from every rank's GRADSYNC_SAMPLE_LOG
    file ("epoch id id ..." per step it trained)."""
    seen: dict[int, Counter] = {}
    for path in log_dir.glob("samples.*"):
        for line in path.read_text().splitlines():
            epoch, *ids = map(int, line.split())
            seen.setdefault(epoch, Counter()).update(ids)
    return seen


def assert_each_sample_once(counts: Counter, n: int, what: str) -> None:
    missing = [i for i in range(n) if counts[i] == 0]
    twice = sorted(i for i, c in counts.items() if c > 1)
    assert not missing and not twice and set(counts) == set(range(n)), \
        f"{what}: {len(missing)} ids never trained on (e.g. {missing[:5]}), {len(twice)} more than once " \
        f"(e.g. {twice[:5]})"


@pytest.mark.timeout(300)
def test_default_job_reaches_95_percent_on_digits(tmp_path):
    from gradsync.train.models import DigitsCNN

    results = run(TrainConfig(out=str(tmp_path), quiet=True))
    summary = results[0]["summary"]
    assert summary["accuracy"] >= 0.95
    assert results[0]["digest"] == results[1]["digest"], "replicas must end bit-identical"
    assert (tmp_path / "metrics.jsonl").exists() and (tmp_path / "checkpoint.pt").exists()
    # docs/train.md's bytes sent per rank: 2(N-1)/N x M per step for M bytes of gradients (N=2: M)
    m_bytes = sum(p.numel() for p in DigitsCNN().parameters()) * 4
    for sent in summary["bytes_sent_per_rank"]:
        gradient_bytes(sent, summary["steps"], m_bytes)


@pytest.mark.timeout(300)
def test_grad_accum_and_bf16_compression_equal_one_process_with_the_global_batch(tmp_path, monkeypatch):
    """--grad-accum 2 --compress bf16 on 2 workers (16 x 2 x 2 = 64 a step): one all-reduce a step, of
    the gradients in bf16 (M/2 bytes: the accumulation's first micro-batch under no_sync), and the
    update of one process taking the same 64 samples a step (replay.py) up to bf16's rounding (0.18%
    of the update in one run; a gradient twice too large is 100%)."""
    import replay
    from gradsync.train.models import DigitsCNN

    (tmp_path / "ids").mkdir()
    monkeypatch.setenv("GRADSYNC_SAMPLE_LOG", str(tmp_path / "ids"))
    steps, lr = 6, 0.05
    results = run(TrainConfig(workers=2, steps=steps, batch_size=16, grad_accum=2, compress="bf16", lr=lr,
                              lr_scaling="none", warmup_steps=0, out=str(tmp_path), quiet=True))
    assert results[0]["digest"] == results[1]["digest"], "replicas must end bit-identical"
    m_bytes = sum(p.numel() for p in DigitsCNN().parameters()) * 4
    for sent in results[0]["summary"]["bytes_sent_per_rank"]:
        gradient_bytes(sent, steps, m_bytes // 2)
    logged = replay.steps_logged(tmp_path / "ids")
    assert [len(ids) for ids in logged] == [64] * steps
    initial, oracle = replay.replay([(ids, lr) for ids in logged])
    assert replay.update_error(results[0]["params"], initial, oracle) < 2e-2


@pytest.mark.slow   # another route: test_your_model.py trains ps-sync, ps-async and ssp through the main job by default
@pytest.mark.timeout(300)
def test_parameter_server_strategies_train_digits(tmp_path):
    """1 server + 2 workers; async and SSP see the same samples as sync and land within a few points."""
    accuracy = {}
    for strategy in ("ps-sync", "ps-async", "ssp"):
        results = run(TrainConfig(workers=3, strategy=strategy, out=str(tmp_path / strategy), quiet=True))
        summary = results[1]["summary"]            # the first worker reports
        accuracy[strategy] = summary["accuracy"]
        server = results[0]["ps"]
        assert server["role"] == "server" and server["pushes"] == 2 * summary["steps"]
        if strategy == "ps-sync":
            assert results[1]["digest"] == results[2]["digest"], "sync workers end on the same version"
            assert set(server["staleness_histogram"]) == {0}
        if strategy == "ssp":
            assert server["max_clock_gap"] <= 2
        assert summary["staleness"]["updates"] == server["pushes"]
    assert accuracy["ps-sync"] >= 0.95, accuracy
    assert abs(accuracy["ps-async"] - accuracy["ps-sync"]) <= 0.03, accuracy
    assert abs(accuracy["ssp"] - accuracy["ps-sync"]) <= 0.03, accuracy


@pytest.mark.slow   # also shown mid-epoch by test_preempt.py and test_checkpoint_every_n_steps_...
@pytest.mark.timeout(300)
def test_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    common = dict(workers=2, steps=30, batch_size=64, quiet=True, trace=False)
    for leg in ("a", "b"):
        (tmp_path / f"ids-{leg}").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADSYNC_SAMPLE_LOG", str(tmp_path / "ids-a"))
        straight = run(TrainConfig(out=str(tmp_path / "a"), **common))
        patch.setenv("GRADSYNC_SAMPLE_LOG", str(tmp_path / "ids-b"))
        run(TrainConfig(out=str(tmp_path / "b"), **{**common, "steps": 13}))  # stops mid-epoch
        resumed = run(TrainConfig(out=str(tmp_path / "b"), resume=True, **common))
    for name, value in straight[0]["params"].items():
        assert torch.equal(value, resumed[0]["params"][name]), name
    # across the stop the two legs trained on exactly the samples of the uninterrupted run, epoch by epoch
    assert samples_per_epoch(tmp_path / "ids-b") == samples_per_epoch(tmp_path / "ids-a")


@pytest.mark.timeout(300)
def test_charlm_loss_falls(tmp_path):
    results = run(TrainConfig(model="charlm", workers=2, steps=40, batch_size=16, out=str(tmp_path), quiet=True))
    import json
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    losses = [s["loss"] for s in steps if s["event"] == "step"]
    assert losses[-1] < 0.75 * losses[0], f"loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    assert results[0]["summary"]["test_loss"] < losses[0]


@pytest.mark.timeout(120)
def test_trace_file_is_written(tmp_path):
    run(TrainConfig(workers=2, steps=5, out=str(tmp_path), quiet=True, trace=True))
    import json
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e["name"].startswith("all_reduce bucket") for e in events)


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "must be >= 1"),
    (["--batch-size", "0"], "must be >= 1"),
    (["--model", "resnet"], "invalid choice: 'resnet'"),
    (["--dataset", "imagenet"], "invalid choice: 'imagenet'"),
    (["--strategy", "ps-sync", "--workers", "2", "--servers", "2"], "servers < workers"),
    (["--model", "charlm", "--dataset", "digits"], "cannot train on"),
    (["--strategy", "ps-async", "--workers", "3", "--checkpoint-every", "10"], "checkpoints on preemption and at its end"),
    (["--out", "/proc/forbidden/run"], "not a writable directory"),
    (["--clip-grad", "0"], "--clip-grad must be a finite number > 0"),
    (["--clip-grad", "-1"], "--clip-grad must be a finite number > 0"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number > 0"),
    (["--clip-grad", "big"], "invalid float value: 'big'"),
])
def test_bad_flags_give_clear_errors(argv, message, capsys):
    try:
        code = main(["train", *argv])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, position", [(12, 8), (10, 8)])
def test_the_epochs_shorter_last_step_averages_over_its_own_samples(world_of, n, position):
    """An epoch of n samples in steps of G = 8 ends with a shorter step of the n - 8 left: over 3 ranks
    they fall 2, 1, 1 (n=12) or 1, 1, 0 (n=10: rank 2 has none, its hooks still fire). With the loop's
    own weighting (train/step.py, weighed), DDP's averaged gradient must be one process's gradient
    of the mean loss over exactly those samples (torch autograd, float64, 1e-12)."""
    import train_fns

    results = world_of(3).run(train_fns.last_step_gradients, n, 8, position)
    ids = results[0][0]
    assert len(ids) == n - position and all(r[0] == ids for r in results)
    x, y = train_fns.last_step_data(n)
    torch.manual_seed(0)
    oracle = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)).double()
    torch.nn.functional.cross_entropy(oracle(x[ids]), y[ids]).backward()
    for rank, (_, grads) in enumerate(results):
        for grad, p in zip(grads, oracle.parameters()):
            assert torch.allclose(grad, p.grad, rtol=1e-12, atol=1e-15), (rank, (grad - p.grad).abs().max())


def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(tmp_path):
    from gradsync import checkpoint
    from gradsync.train import resume

    written = TrainConfig(out=str(tmp_path), model="cnn", seed=3)
    checkpoint.save(tmp_path / resume.CHECKPOINT_NAME, resume.run_record(written, resume.BatchPlan.fresh(written, 2)))
    resume.read(written)   # the same run reads it
    with pytest.raises(checkpoint.CheckpointError) as info:
        resume.read(TrainConfig(out=str(tmp_path), model="mlp", seed=4))
    assert "the checkpoint belongs to a different run: (checkpoint, now) = " in str(info.value)
    assert "'model': ('cnn', 'mlp')" in str(info.value) and "'seed': (3, 4)" in str(info.value), str(info.value)


@pytest.mark.timeout(120)
def test_a_rank_without_the_checkpoint_another_resumes_from_is_an_error_naming_it(world_of, tmp_path):
    """Rank 0 resumes and finds checkpoint.pt in its --out; rank 1's --out has none (not a shared
    directory): every rank raises, naming the resuming rank and the one without the file."""
    import train_fns
    from gradsync import checkpoint
    from gradsync.train import resume

    outs = [tmp_path / "r0", tmp_path / "r1"]
    for out in outs:
        out.mkdir()
    checkpoint.save(outs[0] / resume.CHECKPOINT_NAME, {"step": 1})
    for rank, (name, message) in enumerate(world_of(2).run(train_fns.resume_where_only_rank_0_has_the_checkpoint,
                                                            [str(out) for out in outs])):
        assert name == "CheckpointError", (rank, name, message)
        assert message.startswith(f"rank 0 resumes from {outs[rank] / resume.CHECKPOINT_NAME}, but rank(s) [1] have "
                                  "no such file: --out must be a directory every node shares"), (rank, message)


@pytest.mark.timeout(120)
def test_a_resume_where_no_rank_has_a_checkpoint_says_there_is_none(world_of, tmp_path):
    """--resume (under torchrun: decided by the ranks) where no rank's --out holds a checkpoint: every
    rank says there is none there, not that --out must be shared."""
    import train_fns

    outs = [tmp_path / "r0", tmp_path / "r1"]
    for out in outs:
        out.mkdir()
    for rank, (name, message) in enumerate(world_of(2).run(train_fns.resume_where_only_rank_0_has_the_checkpoint,
                                                            [str(out) for out in outs])):
        assert name == "CheckpointError", (rank, name, message)
        assert message.startswith(f"--resume: {outs[rank]} holds no checkpoint (checkpoint.pt) on any rank"), message


@pytest.mark.timeout(120)
def test_a_parameter_server_resume_on_another_number_of_workers_is_refused(world_of, tmp_path):
    """A ps-async checkpoint of 2 workers, resumed by 4 ranks with 1 server (3 workers): every rank
    refuses before it builds anything, naming both numbers (each worker's shard and clock are its own)."""
    import train_fns
    from gradsync import checkpoint
    from gradsync.train import resume

    written = TrainConfig(strategy="ps-async", workers=3, batch_size=16, out=str(tmp_path))
    checkpoint.save(tmp_path / resume.CHECKPOINT_NAME, {**resume.run_record(written, resume.BatchPlan.fresh(written, 2)),
                                                        "step": 5})
    for rank, (name, message) in enumerate(world_of(4).run(train_fns.ps_resume, str(tmp_path))):
        assert name == "CheckpointError", (rank, name, message)
        assert message.startswith("the checkpoint was written by 2 parameter-server workers, this job has 3 "
                                  "(--workers 4 - --servers 1)"), (rank, message)


@pytest.mark.timeout(120)
def test_dataset_smaller_than_a_step_is_refused(capsys, tmp_path):
    code = main(["train", "--workers", "2", "--batch-size", "1000", "--out", str(tmp_path), "--quiet"])
    assert code == 2 and "a step must fit in an epoch" in capsys.readouterr().err


@pytest.mark.slow   # test_preempt.py's 2 -> 3 -> 2 -> 1 checks the same messages
@pytest.mark.timeout(300)
def test_resume_with_a_different_world_size_says_what_changed(tmp_path, capfd, monkeypatch):
    """2 workers x 32 (global 64) resumed on 4: 16 per worker, global batch and lr kept, said before
    the first step; the epoch goes on from the checkpoint's position, every sample once."""
    from gradsync.train.datasets import digits

    monkeypatch.setenv("GRADSYNC_SAMPLE_LOG", str(tmp_path))
    assert main(["train", "--workers", "2", "--steps", "3", "--lr-scaling", "linear", "--out", str(tmp_path),
                 "--quiet"]) == 0   # linear: lr 0.04 at 64, the figure the message keeps
    assert main(["train", "--workers", "4", "--epochs", "1", "--out", str(tmp_path), "--resume", "--quiet"]) == 0
    out = capfd.readouterr().out
    assert "global batch 64 kept: 16 per worker per micro-batch x 1 accumulation x 4 workers; lr 0.04 kept" in out
    assert "resumed from" in out
    assert_each_sample_once(samples_per_epoch(tmp_path)[0], len(digits()[0]), "epoch 0, across the stop")


# A stop mid-epoch on 2 workers of 64 (global batch 128, 5 steps: position 640), resumed on 3, where
# 128 does not divide: 64 each, global batch 192, so the position is no whole number of the new
# global batches (640 = 3 x 192 + 64). The checkpoint holds the position, and the resumed epoch
# trains from exactly there: every sample of the epoch once across the stop (GRADSYNC_SAMPLE_LOG).
# The loop's own rank function runs in the test worlds (train_fns.py), which saves starting them.
@pytest.mark.timeout(300)
def test_a_resume_on_another_world_size_trains_every_sample_of_the_epoch_once(world_of, tmp_path):
    import train_fns
    from gradsync import checkpoint
    from gradsync.train.datasets import digits

    n = len(digits()[0])
    common = dict(epochs=1, batch_size=64, quiet=True, trace=False, out=str(tmp_path / "out"))
    world_of(2).run(train_fns.train_logging_samples, {**common, "steps": 5}, str(tmp_path), case_timeout=240)
    stopped = checkpoint.load(tmp_path / "out" / "checkpoint.pt")
    assert (stopped["step"], stopped["epoch"], stopped["position"]) == (5, 0, 5 * 128), \
        (stopped["step"], stopped["epoch"], stopped["position"])
    first_leg = samples_per_epoch(tmp_path)[0]
    assert sum(first_leg.values()) == 640 and max(first_leg.values()) == 1, "the first leg's 5 steps"
    world_of(3).run(train_fns.train_logging_samples, {**common, "resume": True}, str(tmp_path), case_timeout=240)
    done = checkpoint.load(tmp_path / "out" / "checkpoint.pt")
    assert (done["step"], done["epoch"], done["position"]) == (5 + -(-(n - 640) // 192), 1, 0), \
        (done["step"], done["epoch"], done["position"])
    assert_each_sample_once(samples_per_epoch(tmp_path)[0], n, "epoch 0, across the stop")


@pytest.mark.timeout(120)
def test_example_script_runs_under_gradsync():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ddp_digits.py"), "--workers", "2", "--epochs", "5"],
                         capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    accuracy = float(out.stdout.split("test accuracy ")[1].rstrip("%\n")) / 100
    assert accuracy > 0.9


@pytest.mark.timeout(120)
def test_runs_unchanged_under_torchrun(tmp_path):
    from gradsync.group.runtime import free_port
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(free_port()), "-m", "gradsync.train", "--steps", "5", "--quiet",
                          "--timeout", "30", "--out", str(tmp_path)], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "gradsync train: summary" in out.stdout
    assert (tmp_path / "checkpoint.pt").exists()


@pytest.mark.slow   # a mid-epoch --checkpoint-every checkpoint resumed bit-identically: also the snapshot test below
@pytest.mark.timeout(300)
def test_checkpoint_every_n_steps_resumes_mid_epoch_bit_identically(tmp_path):
    """A checkpoint taken by --checkpoint-every mid-epoch (copied while the job runs) resumes to the
    same parameters as an uninterrupted run; the summary counts the checkpoints and their time."""
    import shutil
    import time

    from gradsync import checkpoint

    common = dict(workers=2, epochs=2, batch_size=8, quiet=True, seed=4)  # ~89 steps per epoch
    straight = run(TrainConfig(out=str(tmp_path / "straight"), **common))
    job = subprocess.Popen([sys.executable, "-m", "gradsync.cli", "train", "--workers", "2", "--epochs", "2",
                            "--batch-size", "8", "--quiet", "--seed", "4", "--checkpoint-every", "4",
                            "--out", str(tmp_path / "periodic")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    written, copied = tmp_path / "periodic" / "checkpoint.pt", tmp_path / "copy"
    copied.mkdir()
    deadline = time.monotonic() + 120
    while not written.exists():  # saved atomically (rename), so whatever exists is whole
        assert job.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.002)
    shutil.copy(written, copied / "checkpoint.pt")
    out, err = job.communicate(timeout=200)
    assert job.returncode == 0, err[-3000:]
    assert "checkpoints" in out and "background" in out
    state = checkpoint.load(copied / "checkpoint.pt")
    assert state["step"] % 4 == 0 and state["batch_in_epoch"] != 0, (state["step"], state["batch_in_epoch"])
    resumed = run(TrainConfig(out=str(copied), resume=True, **common))
    for name, value in straight[0]["params"].items():
        assert torch.equal(value, resumed[0]["params"][name]), name
    summary = straight[0]["summary"]
    assert summary["checkpoints"] == 2  # one per epoch without --checkpoint-every


@pytest.mark.timeout(180)
def test_checkpoints_are_written_off_the_training_thread_from_a_snapshot(tmp_path):
    """Every checkpoint write takes 0.2 s longer (tests/checkpoint_slow_write.py sleeps before it
    serialises), less than the 60 steps between checkpoints take: training does not wait for them
    (the training thread's checkpoint time stays below half the writes'), and what is written is the
    state at the checkpoint's step (a copy taken mid-run resumes to an uninterrupted run's final
    parameters bit for bit, though training went on for 0.2 s before it was serialised). Every run
    is a process of its own, so nothing an earlier test left in this one changes its arithmetic."""
    import json
    import shutil
    import time

    from gradsync import checkpoint

    common = ["--strategy", "local", "--workers", "1", "--epochs", "1", "--batch-size", "8", "--quiet", "--seed", "4"]

    def train(*args: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    straight = train("-m", "gradsync.cli", "train", *common, "--out", str(tmp_path / "straight"))
    slow = train(os.path.join(os.path.dirname(__file__), "checkpoint_slow_write.py"), "0.2", "train", *common,
                 "--checkpoint-every", "60", "--out", str(tmp_path / "slow"))
    written, copied = tmp_path / "slow" / "checkpoint.pt", tmp_path / "copy"
    copied.mkdir()
    deadline = time.monotonic() + 120
    while not written.exists():
        assert slow.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.002)
    shutil.copy(written, copied / "checkpoint.pt")
    for job in (straight, slow):
        out, err = job.communicate(timeout=150)
        assert job.returncode == 0, err[-3000:]
    summary = [json.loads(x) for x in (tmp_path / "slow" / "metrics.jsonl").read_text().splitlines()
               if '"summary"' in x][-1]
    assert summary["checkpoints"] == 3 and summary["checkpoint_write_s"] >= 0.2 * 3, summary  # 60, 120, 180
    assert summary["checkpoint_s"] < 0.5 * summary["checkpoint_write_s"], summary
    assert checkpoint.load(copied / "checkpoint.pt")["step"] == 60
    resumed = train("-m", "gradsync.cli", "train", *common, "--resume", "--out", str(copied))
    out, err = resumed.communicate(timeout=150)
    assert resumed.returncode == 0, err[-3000:]
    final, again = (checkpoint.load(path / "checkpoint.pt") for path in (tmp_path / "straight", copied))
    assert final["step"] == again["step"] == 180
    for name, value in final["model"].items():
        assert torch.equal(value, again["model"][name]), name


@pytest.mark.timeout(120)
def test_checkpoint_every_by_time_and_bad_values(tmp_path):
    assert TrainConfig(out=str(tmp_path), checkpoint_every="5m").checkpoint_interval() == (None, 300.0)
    assert TrainConfig(out=str(tmp_path), checkpoint_every="200").checkpoint_interval() == (200, None)
    for bad in ("0", "5x", "-1m", "m"):
        with pytest.raises(ValueError, match="give a number of steps"):
            TrainConfig(out=str(tmp_path), checkpoint_every=bad)
    with pytest.raises(RuntimeError, match="not supported with --strategy ps-sync"):
        TrainConfig(out=str(tmp_path), workers=2, strategy="ps-sync", checkpoint_every="10")
    # 0s would be refused; a tiny interval checkpoints after (nearly) every step, agreed by broadcast
    summary = run(TrainConfig(out=str(tmp_path), workers=2, steps=6, quiet=True, checkpoint_every="0.000001s"))[0]["summary"]
    assert summary["checkpoints"] == 6  # after steps 1-5, and the last one at the end


def _step_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == "step"]


@pytest.mark.timeout(300)
def test_clip_grad_flag_equals_one_process_with_the_global_batch(world_of, tmp_path, capsys):
    """--clip-grad X under ddp, zero1 (2 workers x 16) and ps-sync (1 server, 2 workers x 16) against
    --strategy local with the global batch of 32, whose loop is torch.nn.utils.clip_grad_norm_ on one
    process. X is below every step's norm, so clipping bites at each step. The jobs run in the test
    session's worlds (train_rank is what each spawned rank runs)."""
    from gradsync.train.loop import train_rank
    from test_ps import relative_error

    common = dict(steps=4, lr=0.05, lr_scaling="none", warmup_steps=0, quiet=True, clip_grad=0.05)
    local = run(TrainConfig(workers=1, strategy="local", batch_size=32, out=str(tmp_path / "local"), **common))
    assert "clip grad 2-norm to 0.05 (torch's clip_grad_norm_)" in capsys.readouterr().out
    oracle, norms = local[0]["params"], [r["grad_norm"] for r in _step_records(tmp_path / "local")]
    # every step's gradient is scaled by less than 1/2: a run that did not clip would be far off
    assert len(norms) == 4 and min(norms) > 2 * common["clip_grad"], norms
    for strategy, world_size in (("ddp", 2), ("zero1", 2), ("ps-sync", 3)):
        out = tmp_path / strategy
        cfg = TrainConfig(workers=world_size, strategy=strategy, batch_size=16, out=str(out), **common)
        results = world_of(world_size).run(train_rank, cfg)
        # float32: the mean of two ranks' means is the global mean up to rounding, far below clipping's effect
        for rank, result in enumerate(results[1:] if strategy == "ps-sync" else results):
            assert relative_error(result["params"], oracle) <= 1e-5, f"{strategy} rank {rank}"
        if strategy != "ps-sync":   # the norm each step clipped by is the one process's
            assert [r["grad_norm"] for r in _step_records(out)] == pytest.approx(norms, rel=1e-5), strategy
