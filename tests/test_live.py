"""Live fault tolerance: a rank is SIGKILLed mid-run, the survivors train on without a restart, and a
replacement the launcher starts joins them at a step boundary.

The oracle is a single process that trains the same model on the same epoch order with the step's
mean loss over the whole global batch: with the keep-global policy, the world shrinking from 3 to 2
ranks and growing back to 3 changes only how the sum is associated, so every member must end within
1e-12 (relative, float64) of it, bitwise equal to each other (the replacement too: it received the
parameters, the momentum buffers and the sampler position from a live peer), having seen every
sample of the epoch exactly once. Two members dying in the same step, a break declared while every
member lives and a member stalled past the timeout each end in a generation of exactly the members
alive, agreed as soon as each is accounted for (membership.py's quorum), not when its timeout runs out.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.group.liveness import process_alive
from tests import live_fns

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _oracle(steps: int) -> list[torch.Tensor]:
    """One process, global batch G, epoch order randperm(n) seeded with seed + epoch (data.py's rule)."""
    x, y = live_fns.dataset()
    module = live_fns.model()
    optimizer = torch.optim.SGD(module.parameters(), lr=live_fns.LR, momentum=live_fns.MOMENTUM)
    n, g = live_fns.N_SAMPLES, live_fns.GLOBAL_BATCH
    done = 0
    for epoch in range(steps * g // n + 1):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(epoch)).tolist()
        for start in range(0, n, g):
            if done == steps:
                break
            batch = order[start:start + g]
            optimizer.zero_grad()
            (((module(x[batch]) - y[batch]) ** 2).sum() / len(batch)).backward()
            optimizer.step()
            done += 1
    return [p.detach().clone() for p in module.parameters()]


def _shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.timeout(120)
def test_rank_0_dies_the_survivors_train_on_and_a_replacement_joins_to_the_oracle(tmp_path):
    victim, kill_step, epochs = 0, 4, 2
    before = _shm_entries()
    results = gs.spawn(live_fns.train_with_a_kill, nprocs=3, args=(victim, kill_step, epochs, str(tmp_path), 2),
                       timeout=20, fault_tolerance="live", join_timeout=90, replacements=1)
    assert len(results) == 4 and results[victim] is None, "the killed rank returned a value"
    survivors = [r for r in results if r is not None]
    assert [r["member"] for r in survivors] == [1, 2, 3], "the replacement is member 3, its value appended"
    assert [r["rank"] for r in survivors] == [0, 1, 2] and all(r["world_size"] == 3 for r in survivors)
    for r in survivors[:2]:
        recovery, growth = r["recoveries"]
        assert recovery["lost"] == (victim,) and recovery["members"] == (1, 2), recovery
        assert recovery["step"] == kill_step, f"member {r['member']}: the survivors resumed from step {recovery['step']}"
        assert growth["joined"] == (3,) and growth["members"] == (1, 2, 3) and growth["lost"] == (), growth
        # the world went 3 -> 2 -> 3: two steps at least in the shrunk world (the members waited for the joiner)
        at_two = growth["step"] - kill_step
        assert at_two >= 2 and r["world_sizes"] == [3] * kill_step + [2] * at_two + [3] * (len(r["world_sizes"])
                                                                                           - kill_step - at_two)
    (joined,) = survivors[2]["recoveries"]
    assert joined["joined"] == (3,) and joined["step"] == survivors[0]["recoveries"][1]["step"], joined
    assert len(survivors[2]["world_sizes"]) == len(survivors[0]["world_sizes"]) - joined["step"]

    # the run's final parameters: the oracle's, and bitwise the same on both survivors
    steps_per_epoch = -(-live_fns.N_SAMPLES // live_fns.GLOBAL_BATCH)
    expected = _oracle(epochs * steps_per_epoch)
    for r in survivors:
        for got, want in zip(r["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for other in survivors[1:]:
        for a, b in zip(survivors[0]["params"], other["params"]):
            assert torch.equal(a, b), f"member {other['member']}'s replica differs from member 1's"

    # every sample of every epoch exactly once, over the ranks' committed steps (the victim's included)
    trained: dict[tuple[int, int], list[int]] = {}
    for log in tmp_path.glob("samples.*"):
        for line in log.read_text().splitlines():
            step, *ids = map(int, line.split())
            trained[int(log.suffix[1:]), step] = ids
    assert max(step for member, step in trained if member == victim) == kill_step
    for epoch in range(epochs):
        seen = [i for (member, step), ids in trained.items()
                if epoch * steps_per_epoch < step <= (epoch + 1) * steps_per_epoch for i in ids]
        assert sorted(seen) == list(range(live_fns.N_SAMPLES)), f"epoch {epoch}: samples lost or repeated"

    # nothing left behind: no descriptor of the old worlds (the world is as large as before the kill and the
    # log is closed: at least 1 fewer), no process, no /dev/shm entry
    for r in survivors[:2]:
        assert r["fds"]["after"] <= r["fds"]["before"] - 1, f"member {r['member']}: open descriptors {r['fds']}"
    pids = [int(p.read_text()) for p in tmp_path.glob("pid.*")]
    assert len(pids) == 4 and not [pid for pid in pids if process_alive(pid)], "a rank process outlived the job"
    leaked = sorted(_shm_entries() - before)
    assert not [e for e in leaked if e.startswith("gradsync-")], f"leaked /dev/shm entries {leaked}"


@pytest.mark.parametrize("strategy", ["zero1", "diloco"])
def test_live_mode_refuses_what_it_does_not_rebuild_and_says_why(strategy, tmp_path):
    from gradsync.train.config import TrainConfig

    with pytest.raises(RuntimeError, match=f"--fault-tolerance live is not supported with --strategy {strategy}: .*"
                                           f"use --strategy ddp"):
        TrainConfig(strategy=strategy, workers=3, fault_tolerance="live", out=str(tmp_path))
    assert TrainConfig(workers=3, fault_tolerance="live", max_restarts=2, out=str(tmp_path)).max_restarts == 2
    with pytest.raises(ValueError, match="--fault-tolerance 'sometimes' is not one of: restart, live"):
        TrainConfig(workers=3, fault_tolerance="sometimes", out=str(tmp_path))
    with pytest.raises(ValueError, match="fault_tolerance must be one of stop, live"):
        gs.spawn(live_fns.dataset, nprocs=1, fault_tolerance="restart")
    with pytest.raises(ValueError, match="replacements=1 needs fault_tolerance='live'"):
        gs.spawn(live_fns.dataset, nprocs=1, replacements=1)
    with pytest.raises(ValueError, match="replacements must be an integer >= 0, got -1"):
        gs.spawn(live_fns.dataset, nprocs=1, fault_tolerance="live", replacements=-1)


def test_batch_policies_in_closed_form():
    from gradsync.live import resized

    assert resized("keep-global", 96, 0.06, 3, 2) == (96, 0.06)
    assert resized("keep-per-rank", 12, 0.3, 3, 2) == (8, pytest.approx(0.2))   # lr x W'/W (linear scaling)
    assert resized("keep-per-rank", 8, 0.2, 2, 3) == (12, pytest.approx(0.3))   # a replacement joined: back up
    assert resized("keep-per-rank", 12, 0.3, 3, 2, scaling="sqrt") == (8, pytest.approx(0.3 * (2 / 3) ** 0.5))
    assert resized("keep-per-rank", 12, 0.3, 3, 2, scaling="none") == (8, 0.3)
    with pytest.raises(ValueError, match="choose one of keep-global, keep-per-rank"):
        resized("keep-nothing", 12, 0.3, 3, 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_train_cli_live_keep_per_rank_after_a_kill_past_the_all_reduce_and_a_replacement(tmp_path):
    """`gradsync train --fault-tolerance live --live-batch keep-per-rank --max-restarts 1`: member 1 dies in
    step 5 after the all-reduce, before its optimizer step, and a replacement (member 3) joins; the job
    exits 0, the global batch and learning rate follow b x W' and lr x sqrt(W'/W) (--lr-scaling sqrt, the
    default) down to 2 ranks and back up to 3, and every sample of the epoch is trained exactly once (the replacement's steps included)."""
    import json
    import subprocess
    import sys

    from gradsync.train.datasets import digits

    (tmp_path / "ids").mkdir()
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids"), "GRADSYNC_LIVE_KILL": "1:5:optimizer",
           "GRADSYNC_LIVE_AWAIT_JOINER": "1"}
    job = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--workers", "3", "--fault-tolerance", "live",
                          "--live-batch", "keep-per-rank", "--max-restarts", "1", "--epochs", "1", "--quiet",
                          "--timeout", "20",
                          "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=500)
    assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    live, grown = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [1] and live["world_size"] == 2
    assert live["global_batch"] == start["global_batch"] // 3 * 2
    assert live["peak_lr"] == pytest.approx(start["peak_lr"] * (2 / 3) ** 0.5)
    assert grown["joined"] == [3] and grown["members"] == [0, 2, 3] and grown["world_size"] == 3
    assert grown["global_batch"] == start["global_batch"] and grown["peak_lr"] == pytest.approx(start["peak_lr"])
    assert "3 of 4 members finished" in job.stderr and "1 replacement(s) joined" in job.stderr
    assert live_fns.trained_ids(tmp_path / "ids", live["lost"], live["step"]) == {0: list(range(len(digits(0)[0])))}, \
        "samples lost or repeated"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_replacement_that_dies_while_joining_is_recovered_from_and_the_next_one_joins(tmp_path):
    """Member 0 dies, member 3 (the first replacement) dies as the state transfer to it begins: the
    members recover from that death like any other (generation of members 1, 2), then member 4 joins;
    all end bitwise equal and equal to the oracle."""
    results = gs.spawn(live_fns.train_where_the_first_replacement_dies_joining, nprocs=3, args=(str(tmp_path),),
                       timeout=20, fault_tolerance="live", join_timeout=150, replacements=2)
    assert [r is None for r in results] == [True, False, False, True, False]
    survivors = [r for r in results if r is not None]
    for r in survivors[:2]:
        assert [(c["lost"], c["joined"], c["members"]) for c in r["recoveries"]] == [
            ((0,), (), (1, 2)), ((3,), (), (1, 2)), ((), (4,), (1, 2, 4))], r["recoveries"]
    steps_per_epoch = -(-live_fns.N_SAMPLES // live_fns.GLOBAL_BATCH)
    for r in survivors:
        for got, want, first in zip(r["params"], _oracle(2 * steps_per_epoch), survivors[0]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert torch.equal(got, first), f"member {r['member']}'s replica differs from member 1's"


def test_live_mode_under_torchrun_refuses_replacements(tmp_path, monkeypatch):
    """Under torchrun nothing starts a replacement rank: --max-restarts in live mode is refused before
    the world is joined, naming what to do."""
    from gradsync.train.config import TrainConfig
    from gradsync.train.launcher import run

    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")):
        monkeypatch.setenv(name, value)
    cfg = TrainConfig(fault_tolerance="live", max_restarts=1, preempt_signal="none", out=str(tmp_path))
    with pytest.raises(RuntimeError, match="under torchrun a lost node is not replaced"):
        run(cfg)


def test_heartbeat_a_stopped_member_goes_silent_a_beating_one_does_not(monkeypatch):
    """live/heartbeat.py on a store: a member whose heart beats is never silent; once it stops, it is
    silent after SILENT_SECONDS and not before; a member never heard is not silent."""
    import time

    import torch.distributed as dist

    from gradsync.live import heartbeat

    monkeypatch.setattr(heartbeat, "BEAT_SECONDS", 0.02)
    monkeypatch.setattr(heartbeat, "SILENT_SECONDS", 0.4)
    monkeypatch.setattr(heartbeat, "READ_SECONDS", 0.0)
    store = dist.HashStore()
    beating, stopping = heartbeat.Heart(store, "t", 1), heartbeat.Heart(store, "t", 2)
    listener = heartbeat.Listener(store, "t")
    try:
        time.sleep(0.1)
        started = time.monotonic()
        assert not listener.silent(1) and not listener.silent(2) and not listener.silent(3)
        stopping.stop()
        time.sleep(0.05)   # its last beat is written
        listener.silent(2)
        first_read = time.monotonic()
        while not listener.silent(2):
            assert time.monotonic() - first_read < 5, "a stopped heart never went silent"
            assert not listener.silent(1)
            time.sleep(0.01)
        # the listener last saw the counter move at `started` at the earliest (its beats between then and the
        # stop are read only at first_read, if the heart beat at all on a loaded machine): silent not before
        assert time.monotonic() - started >= 0.4
        assert not listener.silent(1) and not listener.silent(3)
    finally:
        beating.stop()
        stopping.stop()


@pytest.mark.timeout(300)
def test_train_cli_live_checkpoints_and_rank_0_dies_writing_one(tmp_path):
    """`gradsync train --fault-tolerance live --checkpoint-every 5`: member 0, rank 0, dies while writing
    step 10's checkpoint (the knob writes half of the temporary file checkpoint.save would write, then
    SIGKILLs itself: what a death inside save leaves; save's own atomicity is
    tests/test_data_checkpoint.py's). The survivors train on; the new rank 0 removes the half-written
    file and writes the later checkpoints; the last one is intact, at the final step, and records the
    batch as it stands (keep-global: the global batch of the 3 workers it started with); every sample
    of the epoch is trained exactly once."""
    import json
    import subprocess
    import sys

    from gradsync import checkpoint
    from gradsync.train.datasets import digits

    (tmp_path / "ids").mkdir()
    out = tmp_path / "run"
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids"), "GRADSYNC_LIVE_KILL": "0:10:checkpoint"}
    job = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--workers", "3", "--fault-tolerance", "live",
                          "--checkpoint-every", "5", "--epochs", "1", "--quiet", "--timeout", "20", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=250)
    assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    start, summary = (next(r for r in records if r["event"] == e) for e in ("start", "summary"))
    (live,) = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [0] and live["world_size"] == 2 and live["step"] >= 10, live
    assert not list(out.glob(".checkpoint.pt.tmp-*")), "a half-written checkpoint was left behind"
    state = checkpoint.load(out / "checkpoint.pt")
    assert state["step"] == summary["steps"] == 15 and state["epoch"] == 1 and state["position"] == 0
    assert state["batch"]["workers"] == 3 and state["batch"]["peak_lr"] == pytest.approx(start["peak_lr"])
    assert live_fns.trained_ids(tmp_path / "ids", live["lost"], live["step"]) == {0: list(range(len(digits(0)[0])))}, \
        "samples lost or repeated"


@pytest.mark.timeout(120)
def test_admit_joiners_false_saves_the_boundary_all_reduce():
    """LiveDDP(admit_joiners=False) sends, per step on 2 ranks, exactly the gradient all-reduce's
    2(N-1)/N x M = M bytes; with joiners admitted (the default) each step's boundary adds its
    one-element all-reduce."""
    params = sum(p.numel() for p in live_fns.model().parameters())
    without = gs.spawn(live_fns.bytes_of_steps, 2, args=(False,), timeout=30, fault_tolerance="live")
    with_boundary = gs.spawn(live_fns.bytes_of_steps, 2, args=(True,), timeout=30, fault_tolerance="live")
    assert without == [3 * params * 8] * 2
    assert all(w > 3 * params * 8 for w in with_boundary), with_boundary


@pytest.mark.timeout(300)
def test_train_cli_live_a_death_during_the_evaluation_is_recorded_and_the_batch_follows(tmp_path):
    """Member 1 dies as the evaluation after epoch 0 starts (outside any step: the others meet its death
    in the evaluation's collectives, LiveDDP.collective). The recovery is recorded like one inside a
    step, and with keep-per-rank the rest of the run steps with the new global batch: every step of
    epoch 1 trains 2/3 of the first epoch's global batch (the last step the rest), and every sample of
    both epochs exactly once."""
    import json
    import subprocess
    import sys

    from gradsync.train.datasets import digits

    (tmp_path / "ids").mkdir()
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids"), "GRADSYNC_LIVE_KILL": "1:15:evaluate"}
    job = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--workers", "3", "--fault-tolerance", "live",
                          "--live-batch", "keep-per-rank", "--epochs", "2", "--quiet", "--timeout", "20",
                          "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=250)
    assert job.returncode == 0, job.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    (live,) = [r for r in records if r["event"] == "live"]
    assert live["lost"] == [1] and live["step"] == 15 and live["world_size"] == 2, live
    n, smaller = len(digits(0)[0]), start["global_batch"] // 3 * 2
    assert start["global_batch"] == 96 and live["global_batch"] == smaller
    per_step: dict[int, int] = {}
    for path in (tmp_path / "ids").glob("live.*"):
        for line in path.read_text().splitlines():
            step, epoch, *ids = map(int, line.split())
            if epoch == 1:
                per_step[step] = per_step.get(step, 0) + len(ids)
    sizes = [per_step[s] for s in sorted(per_step)]
    assert sizes[:-1] == [smaller] * (len(sizes) - 1) and sizes[-1] == n - smaller * (len(sizes) - 1), sizes
    assert live_fns.trained_ids(tmp_path / "ids", live["lost"], live["step"]) == {0: list(range(n)), 1: list(range(n))}


QUORUM_TIMEOUT = 60.0
"""The quorum timeout of the break tests: a generation agreed in far less time was agreed by the quorum's
accounting (every member of the old one registered or known dead), not by the timeout running out."""


@pytest.mark.timeout(60)
def test_quorum_after_two_deaths_at_once_and_after_a_break_with_every_member_alive():
    """live/membership.py on a store, five members: 1 and 3 are processes that have exited (/proc says
    so), 0, 2 and 4 register as survivors at once: generation 1 is exactly 0, 2, 4, the same for each,
    agreed without waiting out the quorum timeout. Then a break with every member alive, member 4 a
    second late (a stall): generation 2 holds all three, member 4 included, agreed once it registered."""
    import subprocess
    import sys
    import threading
    import time

    import torch.distributed as dist

    from gradsync.group.world_info import host_id
    from gradsync.live.membership import PREFIX, Membership

    store = dist.HashStore()
    for member in (1, 3):   # exited processes: a pid /proc no longer lists
        gone = subprocess.Popen([sys.executable, "-c", ""])
        gone.wait(timeout=30)
        store.set(f"{PREFIX}/member/{member}", f"{host_id()}|{gone.pid}")
    survivors = {m: Membership(store, m, tuple(range(5)), QUORUM_TIMEOUT) for m in (0, 2, 4)}

    def quorum(late: dict[int, float]) -> dict[int, tuple]:
        """Every survivor declares the generation broken and agrees on the next one (member m after
        late[m] seconds); per member (its generation, the seconds from the first registration) or the error."""
        started = time.monotonic()
        outcome: dict[int, tuple] = {}

        def survive(member: int) -> None:
            time.sleep(late.get(member, 0.0))
            try:
                survivors[member].declare_broken("a test break")
                generation = survivors[member].next_generation()
                outcome[member] = (generation.index, generation.members, time.monotonic() - started)
            except Exception as exc:   # noqa: BLE001 - reported by the assertion below
                outcome[member] = (exc,)

        threads = [threading.Thread(target=survive, args=(m,), daemon=True) for m in survivors]
        for thread in threads:
            thread.start()
        for member, thread in zip(survivors, threads):
            thread.join(timeout=max(0.0, started + QUORUM_TIMEOUT / 4 - time.monotonic()))
            assert not thread.is_alive(), f"member {member}: no generation agreed within {QUORUM_TIMEOUT / 4:.0f} s " \
                                          f"(the quorum timeout is {QUORUM_TIMEOUT:.0f} s)"
        return outcome

    try:
        after_deaths = quorum({})
        assert {m: o[:2] for m, o in after_deaths.items()} == {m: (1, (0, 2, 4)) for m in (0, 2, 4)}, after_deaths
        after_break = quorum({4: 1.0})
        assert {m: o[:2] for m, o in after_break.items()} == {m: (2, (0, 2, 4)) for m in (0, 2, 4)}, after_break
        assert all(o[2] >= 1.0 for o in after_break.values()), f"agreed before member 4 registered: {after_break}"
    finally:
        for membership in survivors.values():
            membership.close()



@pytest.mark.timeout(60)
def test_the_first_proposal_stored_is_every_members_generation_and_one_left_out_is_evicted():
    """live/membership.py on a store, three members: member 0's growth proposes (0, 2, 1) for generation 1
    after a quorum stored (0, 2) first, so it gets (0, 2), as does member 2 registering as a survivor;
    member 1, alive but left out, is Evicted naming the members agreed and the break's reason. Ranks follow
    the stored order (member 2 is rank 1)."""
    import torch.distributed as dist

    from gradsync.live.membership import PREFIX, Evicted, Membership

    store = dist.HashStore()
    members = {m: Membership(store, m, (0, 1, 2), quorum_timeout=10.0) for m in (0, 1, 2)}
    try:
        members[2].declare_broken("a test break")
        members[0].declare_broken("a later reason, not kept")
        store.compare_set(f"{PREFIX}/0/next", "", "0,2")   # the quorum's proposal, stored first
        grown = members[0].propose((0, 2, 1))
        survived = members[2].next_generation()
        assert (grown.index, grown.members) == (survived.index, survived.members) == (1, (0, 2))
        assert grown.rank_of(2) == 1
        with pytest.raises(Evicted) as evicted:
            members[1].next_generation()
        assert "generation 1 was agreed without it (members [0, 2])" in str(evicted.value)
        assert "member 2: a test break" in str(evicted.value)
        assert evicted.value.agreed == (0, 2) and evicted.value.left.index == 0
        assert members[1].current.index == 0   # it did not enter the generation it is not in
    finally:
        for membership in members.values():
            membership.close()

def _check_breaks(results: list, expected: list[tuple[tuple[int, ...], tuple[int, ...], int]], epochs: int) -> None:
    """Every survivor recorded the recoveries ``expected`` ((lost, members, the step the survivors resumed
    from) each, in order), each agreed well inside QUORUM_TIMEOUT; each committed every step once (a step
    it rolled back twice) and ends with the oracle's parameters, bitwise equal to the others."""
    survivors = [r for r in results if r is not None]
    assert [r["member"] for r in survivors] == list(expected[-1][1]), "a survivor did not finish, or a victim did"
    assert [r["rank"] for r in survivors] == list(range(len(survivors))), "ranks are not the members renumbered"
    for r in survivors:
        got = [(c["lost"], c["members"], c["step"]) for c in r["recoveries"]]
        assert got == expected, f"member {r['member']}: generations {got}, expected {expected}"
        slow = [round(c["seconds"], 1) for c in r["recoveries"] if c["seconds"] >= QUORUM_TIMEOUT / 4]
        assert not slow, f"member {r['member']}: recoveries took {slow} s (the quorum timeout is {QUORUM_TIMEOUT} s)"
    steps_per_epoch = -(-live_fns.N_SAMPLES // live_fns.GLOBAL_BATCH)
    expected_params = _oracle(epochs * steps_per_epoch)
    for r in survivors:
        rolled_back = sum(c["rolled_back"] for c in r["recoveries"])
        assert len(r["world_sizes"]) == epochs * steps_per_epoch + rolled_back, \
            f"member {r['member']}: committed {len(r['world_sizes'])} steps, rolled back {rolled_back}"
        for got, want, first in zip(r["params"], expected_params, survivors[0]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert torch.equal(got, first), \
                f"member {r['member']}'s replica differs from member {survivors[0]['member']}'s"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_two_members_die_at_once_then_a_declared_break_then_a_stall(transport, monkeypatch):
    """LiveDDP, 5 members: 1 and 3 die in the same step (3): the next generation is exactly 0, 2, 4,
    agreed as soon as both deaths are seen, not after the quorum timeout. Member 2, alive, declares a
    break before step 6, and member 4 stalls in step 12 past the world's 5 s timeout (the others' waits
    time out while it lives): each time the next generation holds every member of the one before, each
    having joined it. The run ends at the oracle's parameters, bitwise equal on every survivor."""
    monkeypatch.setenv("GRADSYNC_TRANSPORT", transport)
    breaks = {3: ("die", (1, 3), 0.0), 6: ("declare", (2,), 0.0), 12: ("stall", (4,), 7.0)}
    results = gs.spawn(live_fns.train_through_breaks, nprocs=5, args=(breaks, 2, QUORUM_TIMEOUT), timeout=5,
                       fault_tolerance="live", join_timeout=150)
    assert [r is None for r in results] == [False, True, False, True, False], "the victims are members 1 and 3"
    _check_breaks(results, [((1, 3), (0, 2, 4), 3), ((), (0, 2, 4), 6), ((), (0, 2, 4), 12)], epochs=2)


@pytest.mark.timeout(120)
def test_a_member_silent_past_its_heartbeat_is_left_out_then_rejoins_to_the_oracle(tmp_path):
    """Member 2 of 3 is stopped (SIGSTOP) for 4 s at step 5 and continued: a member that goes silent while
    its process lives, as one cut off by the network does, and comes back. Its heartbeat stops with it, so
    members 0 and 1 leave it out within SILENT_SECONDS and a little (the world's timeout is 20 s: not its
    receive timing out), train on as 2, and once it is continued it finds itself left out, rejoins at a step
    boundary with their state, and the world is 3 again within seconds. Every member ends at the oracle's
    parameters, bitwise equal to each other, and every sample of every epoch was trained exactly once (the
    steps it began or committed alone before it was left out do not count)."""
    from gradsync.live.heartbeat import SILENT_SECONDS

    victim, pause_step, seconds, epochs = 2, 5, 4.0, 3
    results = gs.spawn(live_fns.train_with_a_pause, nprocs=3, args=(victim, pause_step, seconds, epochs, str(tmp_path)),
                       timeout=20, fault_tolerance="live", join_timeout=100)
    assert [r["member"] for r in results] == [0, 1, 2] and all(r["world_size"] == 3 for r in results), \
        [r and (r["member"], r["world_size"]) for r in results]
    for r in results[:2]:
        left, back = r["recoveries"]
        assert left["lost"] == (victim,) and left["members"] == (0, 1) and "went silent" in left["cause"], left
        assert back["joined"] == (victim,) and back["members"] == (0, 1, 2) and back["lost"] == (), back
        at_two = back["step"] - left["step"]
        assert at_two >= 2 and r["world_sizes"] == [3] * left["step"] + [2] * at_two + [3] * (
            len(r["world_sizes"]) - back["step"]), r["world_sizes"]
    (rejoined,) = results[victim]["recoveries"]
    assert rejoined["joined"] == (victim,) and rejoined["step"] == results[0]["recoveries"][1]["step"], rejoined
    assert "agreed without it" in rejoined["cause"] and "went silent" in rejoined["cause"], rejoined["cause"]

    # found by its heartbeat, not by a receive waiting out the 20 s timeout; back within seconds of its return
    times = dict(line.split() for line in (tmp_path / "sizes.0").read_text().splitlines())
    found = float(times["2"]) - float(times["stopped"])
    back = float(times["3"]) - float(times["continued"])
    assert SILENT_SECONDS <= found < SILENT_SECONDS + 4.0, f"left out {found:.1f} s after it went silent"
    assert back < 5.0, f"the world was whole again {back:.1f} s after the member came back"

    steps_per_epoch = -(-live_fns.N_SAMPLES // live_fns.GLOBAL_BATCH)
    expected = _oracle(epochs * steps_per_epoch)
    for r in results:
        for got, want, first in zip(r["params"], expected, results[0]["params"]):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert torch.equal(got, first), f"member {r['member']}'s replica differs from member 0's"
    void = live_fns.void_steps(results[0]["recoveries"])
    assert set(void) == {victim}
    trained: dict[tuple[int, int], list[int]] = {}
    for log in tmp_path.glob("samples.*"):
        member = int(log.suffix[1:])
        low, high = void.get(member, (0, -1))
        for line in log.read_text().splitlines():
            step, *ids = map(int, line.split())
            if not low < step <= high:
                trained[member, step] = ids
    for epoch in range(epochs):
        seen = [i for (member, step), ids in trained.items()
                if epoch * steps_per_epoch < step <= (epoch + 1) * steps_per_epoch for i in ids]
        assert sorted(seen) == list(range(live_fns.N_SAMPLES)), f"epoch {epoch}: samples lost or repeated"


@pytest.mark.timeout(300)
def test_train_cli_live_below_min_workers_checkpoints_the_agreed_step_and_exits_75(tmp_path):
    """`gradsync train --workers 3 --fault-tolerance live --min-workers 3`: member 1 dies in step 5 (after its
    forward, the others waiting for it in the all-reduce). The survivors rebuild their world and agree on
    the step they all hold (5), and, 2 members being fewer than the floor of 3, train no further: the job
    exits 75 (preempted) with a checkpoint of exactly that step, the line that says why, and the resume
    command; no step past 5 was trained by anyone."""
    import json
    import subprocess
    import sys

    from gradsync import checkpoint
    from gradsync.train.preempt import EXIT_PREEMPTED

    (tmp_path / "ids").mkdir()
    out = tmp_path / "run"
    env = {**os.environ, "GRADSYNC_SAMPLE_LOG": str(tmp_path / "ids"), "GRADSYNC_LIVE_KILL": "1:5:forward"}
    job = subprocess.run([sys.executable, "-m", "gradsync.cli", "train", "--workers", "3", "--fault-tolerance", "live",
                          "--min-workers", "3", "--epochs", "2", "--quiet", "--timeout", "20", "--out", str(out)],
                         env=env, capture_output=True, text=True, timeout=250)
    assert job.returncode == EXIT_PREEMPTED, f"exit {job.returncode}:\n{job.stdout[-2000:]}\n{job.stderr[-3000:]}"
    assert "fewer than the floor of 3 (min_workers)" in job.stdout and "preempted at step 5; resume with:" in \
        job.stdout and "--min-workers 3" in job.stdout, job.stdout[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stopped = next(r for r in records if r["event"] == "preempted")
    state = checkpoint.load(out / "checkpoint.pt")
    assert stopped["step"] == state["step"] == 5 and state["batch"]["workers"] == 3, (stopped, state["step"])
    logged = [int(line.split()[0]) for log in (tmp_path / "ids").glob("live.*") for line in log.read_text().splitlines()]
    assert max(logged) == 6, f"steps begun: up to {max(logged)} (step 6 was in flight when member 1 died)"


@pytest.mark.timeout(120)
def test_a_survivor_past_a_collective_is_met_in_the_next_step_not_in_that_collective():
    """A peer lost inside a collective outside a step (the boundary's verdict) can leave one survivor past it
    and another still in it (a ring all-reduce ends on a rank once it has its pieces). After the recovery the
    one still in it must not run it again, alone, against the other's next step (a collective mismatch that
    ends the job): it is sent back to training (StepUndone) and both train on to the end, replicas equal."""
    results = gs.spawn(live_fns.train_past_a_collective, nprocs=3, args=(6,), timeout=20, fault_tolerance="live")
    assert results[2] is None, "the killed member returned a value"
    first, second = results[0], results[1]
    assert first["calls"] == [3] and first["undone"], f"member 0 ran the collective in worlds {first['calls']}"
    for r in (first, second):
        (recovery,) = r["recoveries"]
        assert recovery["lost"] == (2,) and recovery["step"] == 2 and recovery["in_step"], recovery
        assert r["step"] == 6 and r["world_size"] == 2, r
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))


@pytest.mark.timeout(120)
def test_survivors_one_collective_apart_meet_in_the_first_one_again():
    """A peer lost in a collective outside a step can leave one survivor past it, in the next collective, and
    another still in it. After the recovery the one ahead runs the finished one again with the others (its
    result set aside) before its own, rather than meet the other's first collective with its second (the
    same shape here: they would mix, silently). Oracle: the closed-form sums of the two survivors' values."""
    results = gs.spawn(live_fns.train_two_collectives_apart, nprocs=3, args=(6,), timeout=20,
                       fault_tolerance="live")
    assert results[2] is None, "the killed member returned a value"
    first, second = results[0], results[1]
    assert first["seen"] == {"verdict": [(2, [1 + 2, 10 + 20])], "statistics": [(2, [100 + 200] * 2)]}, first["seen"]
    assert second["seen"] == {"verdict": [(3, None), (2, [1 + 2, 10 + 20])],
                              "statistics": [(2, [100 + 200] * 2)]}, second["seen"]
    for r, caught_up in ((first, False), (second, True)):
        (recovery,) = r["recoveries"]
        assert recovery["lost"] == (2,) and recovery["step"] == 2 and not recovery["in_step"], recovery
        assert recovery["caught_up"] == caught_up, recovery
        assert r["step"] == 6 and r["world_size"] == 2, r
    assert all(torch.equal(a, b) for a, b in zip(first["params"], second["params"]))
