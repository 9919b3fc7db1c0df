"""Faults for real: a rank SIGKILLed in the middle of `gradsync train`, for every strategy; what the
launcher reports about the other ranks; a long soak of collectives without growth."""

import os
import re
import tempfile

import pytest

from gradsync.bench import faults
from gradsync.group.liveness import process_alive


# Which rank dies, per strategy. Under the parameter-server strategies rank 0 is the server and
# ranks 1 and 2 are workers, so over ps-sync, ps-async and ssp the server and both workers die;
# under ddp and zero1, rank 0 and a non-zero rank.
VICTIMS = {"ddp": 0, "zero1": 2, "ps-sync": 0, "ps-async": 1, "ssp": 2}
# kill_trial draws its victim from random.Random(seed) (bench/faults.py); a seed that draws each rank
# of three (the test checks the draw, so a change in how the trial draws fails here, loudly)
SEED_DRAWING = {0: 1, 1: 0, 2: 3}


# ps-async's and ssp's trials (a worker killed under the parameter server: test_ps.py's dead-worker
# test kills one in CI too, ps-sync's trial kills the server) and zero1's (the launcher ends it as it
# ends ddp's) run with -m slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.slow) if s in ("ps-async", "ssp", "zero1")
                                      else s
                                      for s in faults.STRATEGIES])
def test_sigkill_of_a_rank_ends_the_job_cleanly(strategy):
    victim = VICTIMS[strategy]
    before = _entries()
    result = faults.kill_trial(strategy, seed=SEED_DRAWING[victim], workers=3, timeout=10.0)
    assert result.get("victim") == victim, f"the trial killed rank {result.get('victim')}, not rank {victim}"
    assert result["clean"], f"{result.get('why')}\n{result.get('stderr')}"
    assert result["detection_s"] < 10.0, "every other rank must be gone within the configured timeout"
    assert result["exit_code"] != 0
    # "clean" checked here too, without the trial's own test (faults._leftovers): no process of the
    # job is alive, and nothing that appeared in /dev/shm or the temp directory during the trial
    # names one of the job's processes (the launcher's spawn directory, the segments named after it)
    launcher, *ranks = result["pids"]
    assert len(ranks) == 3 and not [pid for pid in [launcher, *ranks] if process_alive(pid)], result["pids"]
    appeared = _entries() - before
    ours = {name for name in appeared if set(map(int, re.findall(r"\d+", name))) & set(result["pids"])}
    assert not ours, f"left behind by the job: {sorted(ours)}"


def _entries() -> set[str]:
    """What /dev/shm and the temporary directory hold now."""
    return {f"{where}/{name}" for where in ("/dev/shm", tempfile.gettempdir()) for name in os.listdir(where)}


@pytest.mark.timeout(600)
def test_soak_2000_collectives_without_growth(world_of):
    import spawn_fns
    from gradsync.comm.collectives import ALGORITHMS

    results = world_of(4).run(spawn_fns.soak, 2000, 300, 11, case_timeout=500)
    for rank, (transport, marks, counts) in enumerate(results):
        assert transport == "ShmTransport", "the soak runs on the default one-host transport"
        (rss_warm, fds_warm), (rss_end, fds_end) = marks["after_warmup"], marks["end"]
        assert fds_end == fds_warm, f"rank {rank}: open file descriptors went from {fds_warm} to {fds_end}"
        assert rss_end - rss_warm < 16 << 20, f"rank {rank}: RSS grew by {(rss_end - rss_warm) >> 20} MiB"
    counts = results[0][2]
    assert all(counts.get(("all_reduce", a), 0) >= 50 for a in ALGORITHMS), counts
    assert counts[("broadcast", "")] >= 50 and counts[("reduce_scatter", "")] >= 50, counts


@pytest.mark.timeout(600)
def test_max_restarts_resumes_bit_identically_after_a_kill(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    import torch

    from gradsync import checkpoint
    from gradsync.train.config import TrainConfig
    from gradsync.train.launcher import run

    # 16 epochs of ~0.1 s: the kill must land while training is still going
    common = ["--workers", "2", "--epochs", "16", "--quiet", "--seed", "3"]
    run(TrainConfig(workers=2, epochs=16, quiet=True, seed=3, out=str(tmp_path / "straight")))
    out = tmp_path / "restarted"
    job = subprocess.Popen([sys.executable, "-m", "gradsync.cli", "train", *common, "--max-restarts", "1",
                            "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = time.monotonic()
    while not (out / "checkpoint.pt").exists():   # first checkpoint written (after epoch 0)
        assert job.poll() is None and time.monotonic() - started < 120, "the job never reached its first epoch"
        time.sleep(0.01)
    ranks = faults.rank_pids(job.pid)
    assert ranks, "no rank processes found"
    os.kill(ranks[1], signal.SIGKILL)
    _, err = job.communicate(timeout=300)
    assert job.returncode == 0, err[-3000:]
    assert "rank 1 was killed by signal SIGKILL" in err and "restart 1 of 1, from the last checkpoint" in err
    a = checkpoint.load(tmp_path / "straight" / "checkpoint.pt")
    b = checkpoint.load(out / "checkpoint.pt")
    assert a["step"] == b["step"]
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{name} differs after the restart"
