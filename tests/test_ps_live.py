"""Live parameter server: a worker is SIGKILLed mid-run and the job goes on with W - 1; a server is
SIGKILLed and every survivor ends with an error naming it.

The oracle is a single process that trains the same model on the same epoch order with the step's
mean loss over the whole global batch (tests/test_live.py's): in sync mode the step in flight is
trained again by the survivors and the version closed with the mean of their W - 1 pushes, so the
workers must end within 1e-12 (relative, float64) of it, having trained every sample of each epoch
exactly once; a survivor whose push failed too. `gradsync train` killed and uninterrupted: the same
samples step by step, and models as close as float32 reassociation leaves them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradsync as gs
from tests import live_fns, ps_live_fns
from tests.test_live import _oracle

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

STEPS_PER_EPOCH = -(-live_fns.N_SAMPLES // live_fns.GLOBAL_BATCH)


def _samples_per_epoch(tmp_path: Path, victim: int, agreed_step: int, epochs: int) -> None:
    """Every sample of every epoch exactly once over the workers' committed steps: the last line of a
    step per member, and the victim's steps before the one the survivors trained again."""
    trained: dict[tuple[int, int], list[int]] = {}
    for log in tmp_path.glob("samples.*"):
        member = int(log.suffix[1:])
        for line in log.read_text().splitlines():
            step, *ids = map(int, line.split())
            if member != victim or step <= agreed_step:
                trained[member, step] = ids
    for epoch in range(epochs):
        seen = [i for (member, step), ids in trained.items()
                if epoch * STEPS_PER_EPOCH < step <= (epoch + 1) * STEPS_PER_EPOCH for i in ids]
        assert sorted(seen) == list(range(live_fns.N_SAMPLES)), f"epoch {epoch}: samples lost or repeated"


@pytest.mark.timeout(120)
def test_sync_a_worker_dies_between_servers_and_the_survivors_train_on_to_the_oracle(tmp_path):
    """2 servers, 3 workers; member 3 pushes step 4 to both servers, then dies after its PULL reached
    server 0 only: server 0 closes version 5, server 1 cannot; server 0 rolls it back and the two
    survivors train step 4 again over all its samples."""
    servers, victim, kill_step, epochs = 2, 3, 4, 2
    results = gs.spawn(ps_live_fns.train_with_a_kill, nprocs=5,
                       args=(servers, "sync", victim, kill_step, "pull", epochs, str(tmp_path)),
                       timeout=20, fault_tolerance="live", join_timeout=60)
    assert results[victim] is None, "the killed rank returned a value"
    survivors = [r for r in results if r is not None]
    assert [r["member"] for r in survivors] == [0, 1, 2, 4] and all(r["world_size"] == 4 for r in survivors)
    died = float((tmp_path / "died").read_text())
    for r in survivors:
        assert len(r["recoveries"]) == 1, f"member {r['member']}: {r['recoveries']}"
        (recovery,) = r["recoveries"]
        assert recovery["lost"] == (victim,) and recovery["members"] == (0, 1, 2, 4), recovery
        assert recovery["version"] == kill_step, f"member {r['member']}: the survivors resumed from {recovery}"
        assert recovery["caught_at"] - died < 5.0 and recovery["seconds"] < 10.0, recovery   # not the 20 s timeout
        assert r["check"] == 4.0   # a collective of the new world after training
    detected = sorted(r["recoveries"][0]["caught_at"] - died for r in survivors)
    assert detected[len(detected) // 2] < 1.0, f"from the death to the survivors catching it: {detected} s"
    by_member = {r["member"]: r for r in survivors}
    assert by_member[0]["recoveries"][0]["rolled_back"], "server 0 had closed the version in flight"
    assert not by_member[1]["recoveries"][0]["rolled_back"], "server 1 could not close it"
    assert all(by_member[m]["recoveries"][0]["rolled_back"] for m in (2, 4)), "the survivors had pushed step 4"

    total = epochs * STEPS_PER_EPOCH
    expected = _oracle(total)
    for member in (2, 4):
        assert by_member[member]["step"] == total
        for got, want in zip(by_member[member]["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert by_member[0]["stats"]["version"] == by_member[1]["stats"]["version"] == total
    _samples_per_epoch(tmp_path, victim, kill_step, epochs)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sync_a_survivor_whose_push_failed_trains_the_step_again_from_no_gradient(tmp_path):
    """1 server, 3 workers; member 2 dies after its forward in step 4, and member 3 pushes its step 4
    only once the server has torn its world down: that push fails with member 3's gradient still on
    its parameters. The survivors train step 4 again, member 3 from no gradient (not its old share's
    added to its new one's): both end within 1e-12 of the oracle, every sample of each epoch once."""
    victim, kill_step, epochs = 2, 4, 2
    results = gs.spawn(ps_live_fns.train_with_a_kill, nprocs=4,
                       args=(1, "sync", victim, kill_step, "forward", epochs, str(tmp_path), 3),
                       timeout=20, fault_tolerance="live", join_timeout=60)
    assert results[victim] is None, "the killed rank returned a value"
    survivors = {r["member"]: r for r in results if r is not None}
    assert sorted(survivors) == [0, 1, 3]
    (late,) = survivors[3]["recoveries"]
    # the PUSH header is the first thing member 3 sends after its backward
    assert "ps/header: send to rank 0" in late["cause"], f"member 3's push did not fail: {late['cause']}"
    assert late["lost"] == (victim,) and late["step"] == kill_step and not late["rolled_back"], late
    expected = _oracle(epochs * STEPS_PER_EPOCH)
    for member in (1, 3):
        assert survivors[member]["step"] == epochs * STEPS_PER_EPOCH
        for got, want in zip(survivors[member]["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    _samples_per_epoch(tmp_path, victim, kill_step, epochs)


@pytest.mark.timeout(120)
def test_after_training_survivors_one_collective_apart_meet_in_the_first_one_again(tmp_path):
    """LivePS's collectives after training, as LiveDDP's outside a step (test_live.py's trial of it): a
    worker that had finished the collective the others are still in runs it again with them first, so the
    second is not met by the first (one shape: they would mix). Oracle: the survivors' closed-form sums."""
    results = gs.spawn(ps_live_fns.collectives_apart_after_training, nprocs=4, args=(3, str(tmp_path)),
                       timeout=20, fault_tolerance="live", join_timeout=60)
    assert results[3] is None, "the killed member returned a value"
    verdict, statistics = [1 + 2 + 3, 10 + 20 + 30], [100 + 200 + 300] * 2
    for r in results[:3]:
        (recovery,) = r["recoveries"]
        assert recovery["lost"] == (3,) and recovery["caught_up"] == (r["member"] == 2), recovery
        assert r["seen"] == {"verdict": [(4, None)] * (r["member"] == 2) + [(3, verdict)],
                             "statistics": [(3, statistics)]}, (r["member"], r["seen"])
    assert [r["step"] for r in results[1:3]] == [3, 3]


@pytest.mark.timeout(120)
def test_a_server_dies_and_every_survivor_ends_naming_it(tmp_path):
    """2 servers, 1 worker; server rank 1 dies after its 3rd version: each survivor raises
    ServerLostError naming rank 1 and what was lost, well within the 20 s timeout."""
    servers, victim = 2, 1
    results = gs.spawn(ps_live_fns.train_with_a_kill, nprocs=3,
                       args=(servers, "sync", victim, 3, "server", 1, str(tmp_path)),
                       timeout=20, fault_tolerance="live", join_timeout=60)
    assert results[victim] is None
    survivors = [r for r in results if r is not None]
    assert [r["member"] for r in survivors] == [0, 2]
    for r in survivors:
        assert r["servers_lost"] == (1,), r
        assert "parameter server rank 1 died" in r["error"] and "its shard of the parameters" in r["error"], r["error"]
        assert "optimizer state" in r["error"], r["error"]
        took = r["at"] - float((tmp_path / "died").read_text())
        assert took < 10.0, f"member {r['member']} ended {took:.1f} s after the server died (timeout 20 s)"


@pytest.mark.timeout(120)
def test_ssp_drops_a_dead_worker_and_its_clock_holds_no_one_back(tmp_path):
    """1 server, 3 workers, SSP with bound 1: member 2 dies in its step 3, after its forward. The two
    survivors train all their steps (a bound still counting the dead worker's clock, 3, would stop
    them at step 5), the server applied exactly the pushes the workers completed, and the open
    workers' clocks never drifted more than the bound apart."""
    victim, kill_step, epochs = 2, 3, 1
    results = gs.spawn(ps_live_fns.train_with_a_kill, nprocs=4,
                       args=(1, "ssp", victim, kill_step, "forward", epochs, str(tmp_path)),
                       timeout=20, fault_tolerance="live", join_timeout=60)
    assert results[victim] is None
    server, *workers = [r for r in results if r is not None]
    total = epochs * STEPS_PER_EPOCH
    assert [w["member"] for w in workers] == [1, 3] and all(w["step"] == total for w in workers)
    died = float((tmp_path / "died").read_text())
    for r in (server, *workers):
        assert len(r["recoveries"]) == 1, f"member {r['member']}: {r['recoveries']}"
        (recovery,) = r["recoveries"]
        assert recovery["lost"] == (victim,) and not recovery["rolled_back"], recovery
        assert recovery["caught_at"] - died < 5.0, recovery   # not the 20 s timeout
    detected = sorted(r["recoveries"][0]["caught_at"] - died for r in (server, *workers))
    assert detected[len(detected) // 2] < 1.0, f"from the death to the survivors catching it: {detected} s"
    stats = server["stats"]
    assert stats["pushes"] == kill_step + 2 * total, stats
    assert stats["workers"] == [1, 2] and stats["max_clock_gap"] <= 1, stats


def test_train_refuses_what_live_ps_does_not_rebuild_and_says_why(tmp_path):
    from gradsync.train.config import TrainConfig
    from gradsync.train.runs import check_task

    for strategy in ("ps-sync", "ps-async", "ssp"):
        assert TrainConfig(strategy=strategy, workers=4, fault_tolerance="live", out=str(tmp_path)).servers == 1
        with pytest.raises(RuntimeError, match="keeps the global batch \\(--live-batch keep-global\\)"):
            TrainConfig(strategy=strategy, workers=4, fault_tolerance="live", live_batch="keep-per-rank",
                        out=str(tmp_path))
        with pytest.raises(RuntimeError, match="does not support sparse tables \\(in_embed.weight, out_embed.weight "
                                               "of --model word2vec\\)"):
            check_task(TrainConfig(strategy=strategy, workers=4, fault_tolerance="live", dataset="stdlib-tokens",
                                   out=str(tmp_path)))


def test_async_tasks_of_a_lost_worker_are_dealt_to_the_open_survivors():
    """train/strategies/ps.py tasks_of in closed form: T=4, workers 1, 2, 3; member 2 lost at clock 1 with
    1 and 3 open, then member 3 lost at clock 4 with only 1 open (it takes (1,2)); with no open
    survivor the lost tasks go to no one."""
    from types import SimpleNamespace

    from gradsync.train.strategies.ps import tasks_of

    first = SimpleNamespace(lost_clocks={2: 1}, open_workers=(1, 3))
    assert tasks_of([1, 2, 3], 4, [first]) == {1: [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 3)],
                                               3: [(2, 0), (2, 1), (2, 2), (2, 3), (1, 2)]}
    second = SimpleNamespace(lost_clocks={3: 4}, open_workers=(1,))
    assert tasks_of([1, 2, 3], 4, [first, second])[1] == [(0, 0), (0, 1), (0, 2), (0, 3), (1, 1), (1, 3), (1, 2)]
    closed = SimpleNamespace(lost_clocks={2: 1}, open_workers=())
    assert tasks_of([1, 2, 3], 4, [closed]) == {1: [(0, s) for s in range(4)], 3: [(2, s) for s in range(4)]}


PS_LIVE_EPOCHS = 4
"""The CLI run's length: 4 epochs of 15 steps, 40 of them past the 20-step warm-up; the digits CNN then
reaches about 82% test accuracy (chance: 10%), so its model is one that learned."""
PS_LIVE_PARAMETERS_RTOL = 1e-2
"""How far the survivors' final float32 model may be from the uninterrupted run's, relative, over all
its parameters together. The two differ only in how each step's mean gradient is summed (3 pushes or
2 larger ones, in the order they arrive): float32 reassociation, which the training past its warm-up
amplifies. Measured against one uninterrupted run: 7 other uninterrupted runs at 7e-8; 17 killed runs
at 9e-8 (9) or 3.8e-3 (8: a 1-ulp difference in the first worker's loss at step 13 grows from step 24
on). Planted: a server that kept the survivors' pushes of the step in flight, added to their
retrained ones, put the model 2.5e-2 away (test loss 0.59 against 0.50)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_train_cli_ps_sync_live_after_a_worker_dies(tmp_path):
    """`gradsync train --strategy ps-sync --workers 4 --fault-tolerance live --epochs 4` (1 server, 3
    workers): member 2 dies after its forward in step 5 (0-based). The job exits 0; every step trains
    exactly the samples the same command without the kill trains in that step, every sample once an
    epoch (the sample logs); both runs learn, and the survivors' final model (the servers' checkpoint)
    is the uninterrupted run's within PS_LIVE_PARAMETERS_RTOL."""
    import json
    import os
    import subprocess
    import sys

    from gradsync import checkpoint
    from gradsync.train.datasets import digits

    def train(out: Path, **env) -> list[dict]:
        (out / "ids").mkdir(parents=True)
        command = [sys.executable, "-m", "gradsync.cli", "train", "--strategy", "ps-sync", "--workers", "4",
                   "--fault-tolerance", "live", "--epochs", str(PS_LIVE_EPOCHS), "--quiet", "--timeout", "20",
                   "--out", str(out / "run")]
        job = subprocess.run(command, env={**os.environ, "GRADSYNC_SAMPLE_LOG": str(out / "ids"), **env},
                             capture_output=True, text=True, timeout=400)
        assert job.returncode == 0, job.stderr[-3000:]
        return [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]

    killed, uninterrupted = train(tmp_path / "killed", GRADSYNC_LIVE_KILL="2:5:forward"), train(tmp_path / "base")
    (live,) = [r for r in killed if r["event"] == "live"]
    assert live["lost"] == [2] and live["world_size"] == 3 and live["version"] == 5, live
    assert not [r for r in uninterrupted if r["event"] == "live"]

    # the samples: step by step those of the run without the kill, each epoch every sample once
    steps = live_fns.samples_by_step(tmp_path / "killed" / "ids", live["lost"], live["step"])
    expected = live_fns.samples_by_step(tmp_path / "base" / "ids", [], 0)
    assert len(expected) == PS_LIVE_EPOCHS * 15
    for epoch in range(PS_LIVE_EPOCHS):
        trained = sorted(i for e, ids in expected.values() if e == epoch for i in ids)
        assert trained == list(range(len(digits(0)[0]))), f"the run without the kill, epoch {epoch}"
    differ = [step for step in expected if steps.get(step) != expected[step]]
    assert not differ and len(steps) == len(expected), \
        f"steps whose samples differ from the uninterrupted run's: {differ}"

    # the model: learned, and the uninterrupted run's up to float32 reassociation
    accuracies = [next(r for r in records if r["event"] == "summary")["accuracy"]
                  for records in (killed, uninterrupted)]
    assert min(accuracies) >= 0.7, f"accuracy {accuracies}: the runs did not learn"
    ours, theirs = (checkpoint.load(tmp_path / name / "run" / "checkpoint.pt") for name in ("killed", "base"))
    assert ours["step"] == theirs["step"] == PS_LIVE_EPOCHS * 15
    assert list(ours["model"]) == list(theirs["model"])
    assert all(t.dtype == torch.float32 for t in (*ours["model"].values(), *theirs["model"].values()))
    got, want = (torch.cat([t.reshape(-1) for t in state["model"].values()]) for state in (ours, theirs))
    distance = float((got - want).norm() / want.norm())
    assert distance <= PS_LIVE_PARAMETERS_RTOL, f"the survivors' model is {distance:.2e} from the uninterrupted run's"


def test_ps_sync_live_under_torchrun_is_refused(tmp_path, monkeypatch):
    """LivePS rebuilds its world through gradsync's own launcher: under torchrun the job is refused
    before the world is joined, naming what to run instead."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.launcher import run

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    cfg = TrainConfig(strategy="ps-sync", workers=2, fault_tolerance="live", preempt_signal="none", out=str(tmp_path))
    with pytest.raises(RuntimeError, match="runs under gradsync's own launcher \\(gradsync train --workers N\\)"):
        run(cfg)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_train_cli_ssp_live_deals_the_dead_workers_steps_to_the_survivors(tmp_path):
    """`gradsync train --strategy ssp --staleness 1 --workers 4 --fault-tolerance live`: member 2 dies
    after its forward in its step 5; the job exits 0, the servers applied all 3 x 15 pushes, and every
    training sample is trained exactly once (the dead worker's lines up to the clock the servers hold)."""
    import json
    import os
    import subprocess
    import sys

    from gradsync.train.datasets import digits

    (tmp_path / "ids").mkdir()
    command = [sys.executable, "-m", "gradsync.cli", "train", "--strategy", "ssp", "--staleness", "1", "--workers",
               "4", "--fault-tolerance", "live", "--epochs", "1", "--quiet", "--timeout", "20", "--out",
               str(tmp_path / "run")]
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids"), "GRADSYNC_LIVE_KILL": "2:5:forward"}
    job = subprocess.run(command, env=env, capture_output=True, text=True, timeout=280)
    assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (live,) = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [2] and live["lost_clocks"] == {"2": 5} and live["open_workers"] == [1, 3], live
    assert next(r for r in records if r["event"] == "summary")["staleness"]["updates"] == 3 * 15
    assert live_fns.trained_ids(tmp_path / "ids", [2], 5) == {0: list(range(len(digits(0)[0])))}, \
        "samples lost or repeated"


@pytest.mark.slow   # a second trial of the floor: test_live.py's DDP one is in the default run
@pytest.mark.timeout(300)
def test_train_cli_ps_live_below_min_workers_stops_as_a_preemption(tmp_path):
    """`gradsync train --strategy ps-sync --workers 4 --fault-tolerance live --min-workers 3` (1 server, 3
    workers): member 2 dies after its forward in step 3. The survivors recover (2 open workers), fewer than
    the floor of 3: the job stops at the next version every rank agrees on, as a preemption does, writes
    the servers' checkpoint at that version and exits 75; LivePS says why (below_floor)."""
    import json
    import os
    import subprocess
    import sys

    from gradsync import checkpoint
    from gradsync.train.preempt import EXIT_PREEMPTED

    out = tmp_path / "run"
    env = {**os.environ, "GRADSYNC_LIVE_KILL": "2:3:forward"}
    job = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--strategy", "ps-sync", "--workers", "4",
                          "--fault-tolerance", "live", "--min-workers", "3", "--epochs", "2", "--quiet", "--timeout",
                          "20", "--out", str(out)], env=env, capture_output=True, text=True, timeout=250)
    assert job.returncode == EXIT_PREEMPTED, f"exit {job.returncode}:\n{job.stdout[-2000:]}\n{job.stderr[-3000:]}"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (live,) = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [2] and live["open_workers"] == [1, 3], live
    stopped = next(r for r in records if r["event"] == "preempted")
    state = checkpoint.load(out / "checkpoint.pt")
    assert 3 <= stopped["step"] <= 5 and state["ps"]["clocks"] == [stopped["step"]] * 2, \
        (stopped, state["ps"]["clocks"])
