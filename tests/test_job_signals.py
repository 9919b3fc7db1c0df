"""Signals to every process of a job at once: what `timeout`, Slurm's scancel and `kill -- -PGID` send
(SIGTERM) and what Ctrl-C in a terminal sends (SIGINT to the foreground process group).

Each job runs in a process group of its own (test_preempt._cli), and the signal goes to the group:
the launcher, the forkserver and every rank receive it together (ddp and ps-async: test_preempt.py). Oracles: an uninterrupted run of
the same job (final weights compared with torch.equal) and the checkpoint's step against the last
step rank 0 logged (test_preempt._preempt); a second Ctrl-C against the 3 s the checkpoint write
takes (tests/preempt_slow_write.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradsync import checkpoint
from test_preempt import EXIT_INTERRUPTED, JOB, _final, _preempt, _run_command

ROOT = Path(__file__).resolve().parents[1]


def _uninterrupted(args: list[str], out: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", *args, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return _final(out)[0]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("job, signum", [
    pytest.param(["--strategy", "zero1", "--workers", "2", "--steps", "40"], signal.SIGINT,
                 marks=pytest.mark.slow),   # a second trial: test_preempt.py's ps-async one is Ctrl-C to the group
    (["--fault-tolerance", "live", "--workers", "2", "--steps", "40"], signal.SIGTERM),
    pytest.param(["--fault-tolerance", "live", "--strategy", "ps-sync", "--workers", "3", "--steps", "40"],
                 signal.SIGINT, marks=pytest.mark.slow),   # a second trial: live mode's ddp one is in the default run
], ids=["zero1-ctrl-c", "live-sigterm", "live-ps-sync-ctrl-c"])
def test_a_signal_to_the_whole_job_checkpoints_and_resumes_bit_identically(tmp_path, job, signum):
    """Ctrl-C to a zero1 job and to a live-mode ps-sync job (exit 130), SIGTERM to a live-mode ddp job
    (exit 75), each to every process at once: one "preempted at step N" line, no traceback, the
    checkpoint at the last step trained; the printed command (live mode: in live mode again) ends
    with the uninterrupted run's weights."""
    args = [*job, *JOB]
    expected = _uninterrupted(args, tmp_path / "a")
    stop = _preempt(args, tmp_path / "b", steps_in=8, target="group", signum=signum)
    assert stop["step"] < 40 and stop["command"].endswith("--resume"), stop
    assert ("--fault-tolerance live" in stop["command"]) == ("live" in job)
    done = _run_command(stop["command"])
    assert done.returncode == 0, done.stderr[-3000:]
    weights, _ = _final(tmp_path / "b")
    for name, value in expected.items():
        assert torch.equal(value, weights[name]), name


@pytest.mark.timeout(30)
def test_one_ctrl_c_received_twice_counts_once_and_a_later_one_is_a_second(tmp_path):
    """In this process, as the launcher (launch._relaying) and as a one-process job (PreemptWatch with
    interrupt_twice_raises): two SIGINTs 10 ms apart are one Ctrl-C (timeout -s INT sends two); one
    0.3 s later is a second Ctrl-C, which raises KeyboardInterrupt (stop at once)."""
    from gradsync.group import launch
    from gradsync.train.preempt import PreemptWatch

    def ctrl_c(after: float) -> None:
        time.sleep(after)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)   # the handler runs

    def once_received_twice() -> None:
        try:
            ctrl_c(0.0)
            ctrl_c(0.0)
        except KeyboardInterrupt:
            pytest.fail("one Ctrl-C received twice was taken for a second one")

    with launch._relaying((signal.SIGINT,), [], tmp_path):
        once_received_twice()
        with pytest.raises(KeyboardInterrupt):
            ctrl_c(0.3)
    with PreemptWatch("SIGTERM", interrupt_twice_raises=True) as watch:
        once_received_twice()
        assert watch.interrupts == 1 and watch.stop_code == 2
        with pytest.raises(KeyboardInterrupt):
            ctrl_c(0.3)


@pytest.mark.timeout(120)
def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path):
    """Ctrl-C (SIGINT to the job's process group) while training, then again while the checkpoint that
    the first one asked for is being written (slowed to 3 s, tests/preempt_slow_write.py): the job
    ends within a second of the second Ctrl-C with exit 130 and one line, no traceback; the file on
    disk is still the previous, whole checkpoint, and no half-written file is left."""
    job = subprocess.Popen([sys.executable, str(ROOT / "tests" / "preempt_slow_write.py"), "train", "--strategy",
                            "local", "--workers", "1", "--batch-size", "8", "--epochs", "3", "--quiet",
                            "--out", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    written = tmp_path / "checkpoint.pt"
    deadline = time.monotonic() + 100
    while not written.exists():   # the end of epoch 0 (fast: the first write)
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    previous = checkpoint.load(written)["step"]
    os.killpg(job.pid, signal.SIGINT)
    first = time.monotonic()
    while not (tmp_path / "writing").exists():   # the first Ctrl-C's checkpoint is being written, slowly
        assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1][-3000:]
        time.sleep(0.005)
    # a person's second Ctrl-C: later than job_signals.REPEATED_SIGNAL_SECONDS, which is one Ctrl-C received twice
    time.sleep(max(0.0, first + 0.3 - time.monotonic()))
    os.killpg(job.pid, signal.SIGINT)
    second = time.monotonic()
    stdout, stderr = job.communicate(timeout=60)
    assert job.returncode == EXIT_INTERRUPTED, (job.returncode, stderr[-3000:])
    # the write takes 3 s more: ending sooner, with the previous checkpoint in place, is not waiting for it
    assert time.monotonic() - second < 2.5, "the second Ctrl-C waited for the checkpoint write"
    assert "Traceback" not in stderr and stderr.strip().count("\n") == 0, stderr[-3000:]
    assert "interrupted again: stopped at once" in stderr, stderr
    assert checkpoint.load(written)["step"] == previous
    assert not list(tmp_path.glob(".checkpoint.pt.tmp-*")), "a half-written checkpoint was left behind"
