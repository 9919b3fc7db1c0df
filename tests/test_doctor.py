"""gradsync doctor on real runs with a planted bad bucket size, and on a run with a planted straggler;
its loss-spike rule on run logs built here, record for record as `gradsync train` writes them."""

import json
import re

import pytest

from gradsync.cli import main
from gradsync.train.doctor import examine
from gradsync.train.config import TrainConfig
from gradsync.train.launcher import run


def verdicts(run_dir):
    return {f.check: f for f in examine(run_dir)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("doctor")
    common = dict(workers=2, steps=6, quiet=True, trace=True)
    run(TrainConfig(out=str(base / "tiny"), bucket_mb=0.001, compress="bf16", **common))
    run(TrainConfig(out=str(base / "giant"), **common))   # the digits CNN fits one 25 MiB bucket
    return base


def planted(run_dir, into, change=None, trace=None):
    """A copy of ``run_dir``'s metrics.jsonl in ``into`` with ``change(records)`` applied, and
    ``trace`` (a list of trace events) as its trace.json (none when None)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    records = change(records) if change else records
    (into / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    if trace is not None:
        (into / "trace.json").write_text(json.dumps({"traceEvents": trace}))
    return into


def test_placement_precision_and_unused_parameters_of_real_runs(runs):
    import socket

    tiny, giant = verdicts(runs / "tiny"), verdicts(runs / "giant")
    for found in (tiny, giant):   # both ranks of each run on this host; both runs finished
        assert (found["placement"].verdict, found["placement"].detail) == ("OK", f"{socket.gethostname()}: 2 rank(s)")
        assert found["unused parameters"].verdict == "OK" and found["unused parameters"].detail.startswith("none")
    assert tiny["precision"].detail == "parameters float32; gradients on the wire: bf16 (2^-8 relative rounding)"
    assert giant["precision"].detail == "parameters float32; gradients on the wire: the parameters' own dtype"


def test_uneven_hosts_and_an_unfinished_run_are_flagged(runs, tmp_path):
    def three_ranks_on_two_hosts_and_no_summary(records):
        for record in records:
            if record["event"] == "setup":
                record["hosts"] = ["a", "a", "b"]
        return [r for r in records if r["event"] != "summary"]

    found = verdicts(planted(runs / "giant", tmp_path, three_ranks_on_two_hosts_and_no_summary))
    assert (found["placement"].verdict, found["placement"].detail) == ("WARN", "a: 2 rank(s), b: 1 rank(s); uneven hosts")
    assert (found["unused parameters"].verdict, found["unused parameters"].detail) == (
        "INFO", "the run did not finish; look at its error")


@pytest.mark.parametrize("buckets, expected", [
    ([(50, 100), (90, 10)], ("OK", "55% of bucket all-reduce time ran before backward ended (all ranks, 1 steps, trace.json)")),
    ([(100, 40), (95, 60)], ("WARN", "5% of bucket all-reduce time ran before backward ended (all ranks, 1 steps, trace.json)")),
])
def test_overlap_is_the_share_of_bucket_time_before_backward_ended(runs, tmp_path, buckets, expected):
    """A planted timeline: backward from 0 to 100 us, buckets (start, duration): (50, 100) hides 50 of
    its 100, (90, 10) all 10: 60 / 110 = 55%; (100, 40) none, (95, 60) 5 of 60: 5 / 100 = 5%, under
    the 10% that is a WARN."""
    trace = [{"name": "backward start", "ph": "i", "pid": 0, "ts": 0}, {"name": "backward end", "ph": "i", "pid": 0, "ts": 100}]
    trace += [{"name": f"all_reduce bucket {k}", "ph": "X", "pid": 0, "ts": ts, "dur": dur} for k, (ts, dur) in enumerate(buckets)]
    found = verdicts(planted(runs / "giant", tmp_path, trace=trace))
    assert (found["overlap"].verdict, found["overlap"].detail) == expected


def test_the_overlap_of_every_rank_is_weighed_by_time(runs, tmp_path):
    """Two ranks' timelines: rank 0's bucket (50, 100) hides 50 us of 100 before its backward ends at
    100; rank 1's (0, 10) hides all 10 of 10. Weighed by time, (50 + 10) / 110 = 55%, where rank 0
    alone would say 50% and a mean of the ranks' shares 75%."""
    trace = [{"name": name, "ph": "i", "pid": pid, "ts": ts} for pid in (0, 1)
             for name, ts in (("backward start", 0), ("backward end", 100))]
    trace += [{"name": "all_reduce bucket 0", "ph": "X", "pid": 0, "ts": 50, "dur": 100},
              {"name": "all_reduce bucket 0", "ph": "X", "pid": 1, "ts": 0, "dur": 10}]
    found = verdicts(planted(runs / "giant", tmp_path, trace=trace))
    assert found["overlap"].detail.startswith("55% of bucket all-reduce time"), found["overlap"].detail


def test_the_summary_and_the_doctor_report_the_same_overlap(runs):
    """The summary's overlap share (from each rank's reducer: its buckets' spans against its own
    backward's end) and the doctor's (from the trace's events, every rank) are one quantity: on the
    real run with many buckets they agree to within rounding: both are of the same spans, from the hook's
    call to its Future's completion, against the same end of backward."""
    from gradsync.train.doctor import _overlap_from_trace

    records = [json.loads(line) for line in (runs / "tiny" / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["event"] == "summary")
    from_trace, steps = _overlap_from_trace(runs / "tiny" / "trace.json")
    assert steps == 6 and summary["overlap"] is not None
    assert abs(summary["overlap"] - from_trace) <= 1e-6, (summary["overlap"], from_trace)


@pytest.mark.timeout(300)
def test_tiny_buckets_are_flagged(runs):
    found = verdicts(runs / "tiny")
    assert found["bucket sizes"].verdict == "WARN" and "under 256 KiB" in found["bucket sizes"].detail
    assert found["batch math"].detail.startswith("32 per worker x 2 workers x 1 accumulation = 64 global")


@pytest.mark.timeout(300)
def test_one_giant_bucket_is_flagged_and_hides_nothing(runs):
    found = verdicts(runs / "giant")
    assert found["bucket sizes"].verdict == "WARN" and "one bucket holds 100%" in found["bucket sizes"].detail
    # the single bucket starts only as backward ends; how much of it still overlaps the engine's last
    # microseconds depends on scheduling, so only the report itself is checked here
    assert "of bucket all-reduce time ran before backward ended" in found["overlap"].detail


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compute_s, verdict, words", [
    ([1.0, 1.6], "WARN", "rank 1: 1.23x the median compute"),               # 1.6 / 1.3 > 1.2
    ([1.0, 1.4], "OK", "every rank within 20% of the median compute (1.20 s)"),  # 1.4 / 1.2 = 1.17
])
def test_planted_straggler_is_named(runs, tmp_path, compute_s, verdict, words):
    records = [json.loads(line) for line in (runs / "giant" / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r["event"] == "summary")
    # the real run's verdict follows from its measured compute times: WARN iff a rank is > 1.2x the median
    measured = summary["compute_s"]
    assert len(measured) == 2 and min(measured) > 0
    median = sum(measured) / 2
    expected = "WARN" if max(measured) > 1.2 * median else "OK"
    assert verdicts(runs / "giant")["stragglers"].verdict == expected, measured
    summary["compute_s"] = compute_s
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    found = verdicts(tmp_path)
    assert found["stragglers"].verdict == verdict and words in found["stragglers"].detail


def test_doctor_on_a_directory_without_a_run(tmp_path, capsys):
    assert main(["doctor", str(tmp_path)]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err


SPIKED = [2.3, 2.3, 2.3, 1.8, 1.2, 0.8, 0.5, 0.4, 0.3, 0.3, 0.3, 0.3, 2.0, 2.0, 2.0, 0.3, 0.3, 0.3]
"""Losses of 18 steps with a spike at steps 13-15. The means of 3 steps, by the step that ends each
window: 2.30 (3), 2.13, 1.77, 1.27, 0.83, 0.57, 0.40, 0.33, 0.30 (11, the lowest), 0.30, 0.87 (13),
1.43 (14), 2.00 (15), 1.43 (16), 0.87 (17), 0.30 (18). The doctor's rule: a window that starts after
the warm-up and climbs more than half-way back from the lowest so far (0.30) to the first (2.30),
above 1.30, and above 1.5 x the lowest."""


def _run_log(run_dir, losses: list[float], warmup_steps: int):
    """metrics.jsonl of a finished 2-worker run of ``losses`` (one step record each), with every
    record as `gradsync train` writes it (train/report.py: start, setup, step, epoch, summary), the
    config in its resolved form (epochs, lr and warm-up decided)."""
    cfg = TrainConfig(workers=2, epochs=1, lr=0.05, warmup_steps=warmup_steps, out=str(run_dir)).to_dict()
    steps = len(losses)
    records = [{"event": "start", "config": cfg, "global_batch": 64, "peak_lr": 0.05 * 2 ** 0.5, "base_lr": 0.05,
                "steps_per_epoch": steps, "total_steps": steps, "train_samples": 64 * steps},
               {"event": "setup", "params": 1000, "param_bytes": 4000, "param_dtypes": ["float32"],
                "bucket_bytes": [1 << 20, 1 << 20], "world_size": 2, "hosts": ["a", "a"], "device": "cpu"}]
    records += [{"event": "step", "step": i + 1, "epoch": 0, "loss": loss, "samples_per_s": 5000.0, "overlap": 0.5}
                for i, loss in enumerate(losses)]
    records += [{"event": "epoch", "epoch": 0, "step": steps, "test_loss": 0.3, "accuracy": 0.9, "wall_s": 2.0},
                {"event": "summary", "wall_s": 2.0, "steps": steps, "steps_trained": steps, "samples_per_s": 5000.0,
                 "accuracy": 0.9, "test_loss": 0.3, "bytes_sent_per_rank": [1e6, 1e6], "compute_s": [1.0, 1.0],
                 "comm_s": [0.2, 0.2], "wait_s": [0.1, 0.1], "overlap": 0.5, "stragglers": [], "staleness": None,
                 "checkpoints": None, "checkpoint_s": None, "checkpoint_write_s": None}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return run_dir


@pytest.mark.parametrize("warmup_steps, step, mean", [(10, 14, "1.43"), (11, 14, "1.43"), (12, 15, "2.00"),
                                                     (13, 16, "1.43")])
def test_a_loss_spike_after_the_warm_up_is_a_warning_naming_its_step(tmp_path, capsys, warmup_steps, step, mean):
    """SPIKED's first window above 1.30 that starts after the warm-up: with a warm-up of 10 or 11 steps
    the one ending at step 14 (steps 12-14), with 12 the one ending at 15, with 13 the one ending at 16.
    The doctor says WARN, from the lowest mean (step 11) to that window's, and `gradsync doctor` prints it."""
    found = verdicts(_run_log(tmp_path, SPIKED, warmup_steps))
    assert found["loss spike"].verdict == "WARN", found["loss spike"]
    assert found["loss spike"].detail.startswith(
        f"after the warm-up ({warmup_steps} steps) the loss (mean of 3 steps) climbed from 0.30 (step 11) to "
        f"{mean} (step {step})"), found["loss spike"].detail
    assert main(["doctor", str(tmp_path)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert re.search(r"loss spike\W+WARN\W", printed) and f"to {mean} (step {step})" in printed, printed


@pytest.mark.parametrize("losses, warmup_steps", [
    (SPIKED, 15),                                                            # the spike inside the warm-up
    ([2.3, 2.3, 2.3, 1.2, 0.6, 0.4] + [0.3, 0.5, 0.2, 0.4, 0.25, 0.45] * 3, 3),   # noisy, never half-way back
    ([2.3, 2.3, 2.3, 2.2, 2.3, 2.25, 2.3, 2.2], 0),                          # flat: nothing to climb back to
])
def test_a_run_without_a_spike_after_the_warm_up_is_ok(tmp_path, losses, warmup_steps):
    """With a warm-up of 15 steps SPIKED's one window after it (steps 16-18) is at its lowest; a noisy
    run whose worst window after the drop (0.42) stays far under half-way back (1.29); a run that never
    improved (1.5 x its lowest mean is never passed)."""
    found = verdicts(_run_log(tmp_path, losses, warmup_steps))
    assert (found["loss spike"].verdict, found["loss spike"].detail) == (
        "OK", f"none after the warm-up ({warmup_steps} steps)"), found["loss spike"]


def _train_cli(out, env=None):
    import os
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--workers", "2", "--batch-size", "16",
                           "--steps", "70", "--log-every", "10", "--quiet", "--timeout", "30", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, env={**os.environ, **(env or {})})


@pytest.mark.timeout(400)
def test_a_rank_slowed_from_step_30_is_named_with_that_step(tmp_path, capsys):
    """GRADSYNC_SLOW_RANK=1:30:80: rank 1 sleeps 80 ms at the start of every step after its 30th (train/
    slow_rank.py). metrics.jsonl's per-rank records show it as the knob makes it, whatever else the
    machine does: from the record of steps 31-40 on, rank 1's compute (step - exposed wait) holds the
    80 ms and rank 0 waits for it in the all-reduce; doctor names rank 1 and step 31. The same run
    without the knob: no slowdown."""
    slowed, plain = tmp_path / "slowed", tmp_path / "plain"
    for out, env in ((slowed, {"GRADSYNC_SLOW_RANK": "1:30:80"}), (plain, None)):
        job = _train_cli(out, env)
        assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (slowed / "metrics.jsonl").read_text().splitlines()]
    ranks = [r for r in records if r["event"] == "ranks"]
    assert [r["step"] for r in ranks] == list(range(10, 71, 10)) and all(r["ranks"] == [0, 1] for r in ranks)
    for record in ranks[3:]:   # steps 31-70: every step of rank 1 sleeps 80 ms before it computes
        assert record["step_s"][1] - record["wait_s"][1] >= 0.080, record
        assert record["wait_s"][0] >= 0.040, record   # rank 0 waits for rank 1's gradients
    found = verdicts(slowed)["slowdown"]
    assert found.verdict == "WARN" and found.detail.startswith("rank 1 became slow at step 31: compute "), found
    assert "(the records of steps 40-70)" in found.detail, found
    assert main(["doctor", str(slowed)]) == 0
    assert "rank 1 became slow at step 31" in capsys.readouterr().out
    quiet = verdicts(plain)["slowdown"]
    assert (quiet.verdict, quiet.detail) == (
        "OK", "no rank became slow partway through (7 records of each rank's timings, every 10 steps)"), quiet
