"""The shared-memory transport: how it is chosen, what it refuses, and what it leaves behind."""

import os
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.comm.allreduce_ring import ring_chunks
import shm_fns
from world_pool import RankFailure


@pytest.mark.timeout(120)
def test_auto_uses_shared_memory_and_unlinks_every_name_once_connected(monkeypatch):
    monkeypatch.delenv("GRADSYNC_TRANSPORT", raising=False)
    results = gs.spawn(shm_fns.transport_and_names, nprocs=3)
    for kind, names, x in results:
        assert kind == "ShmTransport"
        assert names == [], f"segments still named in /dev/shm while the job runs: {names}"
        assert torch.equal(x, torch.arange(10.0) * 6)


@pytest.mark.timeout(120)
def test_tcp_override_and_bad_setting(monkeypatch):
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    assert [r[0] for r in gs.spawn(shm_fns.transport_and_names, nprocs=2)] == ["TorchTransport"] * 2
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "infiniband")
    with pytest.raises(gs.SpawnError, match="GRADSYNC_TRANSPORT='infiniband' is not a transport; choose one of "
                                             "auto, tcp, shm"):
        gs.spawn(shm_fns.transport_and_names, nprocs=2)
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "shm")
    monkeypatch.setenv("GRADSYNC_SHM_RING_MB", "-3")
    with pytest.raises(gs.SpawnError, match="GRADSYNC_SHM_RING_MB='-3': give the ring size in MiB"):
        gs.spawn(shm_fns.transport_and_names, nprocs=2)


@pytest.mark.timeout(120)
def test_size_mismatch_is_an_error_naming_both_ranks():
    message = gs.spawn(shm_fns.size_mismatch, nprocs=2)[1]
    assert "rank 1: test/mismatch: receive from rank 0 expected 16 bytes, rank 0 sent 8 bytes" in message


@pytest.mark.timeout(120)
def test_sigkill_mid_collective_names_the_rank_and_leaves_nothing_in_dev_shm():
    before = {p.name for p in Path("/dev/shm").glob("gradsync-*")}
    with pytest.raises(gs.SpawnError) as failure:
        gs.spawn(shm_fns.killed_mid_collective, nprocs=3, timeout=30.0)
    assert failure.value.rank == 1 and "SIGKILL" in str(failure.value)
    # nothing to clean up was left to the launcher either: names go once every rank has mapped them
    # (test above); this checks the whole path, launcher included
    after = {p.name for p in Path("/dev/shm").glob("gradsync-*")}
    assert after <= before, f"left in /dev/shm: {sorted(after - before)}"


@pytest.mark.timeout(120)
def test_shared_memory_all_reduce_over_several_pieces_is_exact_and_metered(monkeypatch):
    monkeypatch.setenv("GRADSYNC_SHM_STAGE_MB", str(4096 / (1 << 20)))  # 4 KiB halves
    n_ranks, numel = 3, 3 * 512 + 5
    region = 4096 // n_ranks // 64 * 64 // 8     # 168 float64 per rank's region: 504 per piece
    results = gs.spawn(shm_fns.shared_memory_pieces, nprocs=n_ranks, args=(512,))
    expected = torch.arange(numel, dtype=torch.float64) * (1 + 2 + 3) / 3
    for rank, calls in enumerate(results):
        for x, received, sent in calls:
            assert torch.equal(x, expected) and torch.equal(x, results[0][0][0])
            # each piece: slice r from the N-1 others, then every other owner's slice (allreduce_two_shot.py)
            pieces = [n_ranks * region] * 3 + [numel - 3 * n_ranks * region]
            sizes = [[len(range(c, p, n_ranks)) for c in range(n_ranks)] for p in pieces]  # ring_chunks sizes
            mine = sum((n_ranks - 1) * s[rank] + (p - s[rank]) for p, s in zip(pieces, sizes)) * 8
            assert received == mine and sent == mine


@pytest.mark.timeout(120)
def test_shared_memory_all_reduce_refuses_tcp(monkeypatch):
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    message = gs.spawn(shm_fns.shared_memory_refused, nprocs=2)[0]
    assert "needs every rank on this host and the shared-memory transport" in message


@pytest.mark.timeout(120)
def test_a_dead_peer_is_noticed_by_its_liveness_check_without_a_launcher(tmp_path):
    import json

    from gradsync.comm.transport.shm.waiting import LIVENESS_SLICE
    from world_pool import RankFailure, WorldPool

    pool = WorldPool(2, timeout=30.0)
    failure = None
    try:
        pool.run(shm_fns.detect_death, str(tmp_path), case_timeout=60)
    except RankFailure as exc:
        failure = exc
    finally:
        pool.close()
    report = json.loads((tmp_path / "report.json").read_text())
    assert f"rank 1 (pid {report['pid']}) exited" in report["error"], report["error"]
    assert failure is not None and failure.errors[1][0] == "died" and 0 not in failure.errors
    # every check before the death saw rank 1 alive; the first one after it saw it dead and raised
    results = [alive for _, alive in report["checks"]]
    assert results[-1] is False and all(results[:-1]) and len(results) >= 2, results
    assert all(started < report["observable"] for started, alive in report["checks"] if alive)
    # from the death being observable to the error: one liveness slice of sleep plus scheduling,
    # bounded loosely for a busy machine; the 30 s timeout is what would answer without the check
    # (the interval measured, about 0.2 s, is in docs/reliability.md)
    assert report["error_at"] - report["observable"] < 5.0 + LIVENESS_SLICE


@pytest.mark.timeout(120)
def test_waiting_on_tcp_keeps_shared_memory_sends_moving():
    total = gs.spawn(shm_fns.shm_send_while_waiting_on_tcp, nprocs=2, timeout=20.0)[0]
    assert total == float(sum(range(1 << 20)))


@pytest.mark.timeout(120)
def test_ranks_with_different_ring_sizes_are_refused():
    from world_pool import RankFailure, WorldPool

    pool = WorldPool(2, timeout=10.0, rank_env={1: {"GRADSYNC_SHM_RING_MB": "4"}})
    try:
        with pytest.raises(RankFailure) as failure:
            pool.run(shm_fns.transport_and_names)
    finally:
        pool.close()
    text = str(failure.value)
    assert "rank 1 has 4194304-byte rings" in text or "rank 0 has 2097152-byte rings" in text
    assert "set GRADSYNC_SHM_RING_MB and GRADSYNC_SHM_STAGE_MB alike on every rank" in text


@pytest.mark.timeout(120)
def test_shutdown_and_init_again_in_the_same_job():
    for rank_result in gs.spawn(shm_fns.reinit_three_times, nprocs=3):
        assert [(g, kind) for g, kind, _ in rank_result] == [(1, "ShmTransport"), (2, "ShmTransport"),
                                                             (3, "ShmTransport")]
        for _, _, x in rank_result:
            assert torch.equal(x, torch.full((5,), 6.0))


@pytest.mark.timeout(180)
def test_in_place_all_reduce_of_a_region_rewritten_at_once(world_of):
    # 1 MiB of float64 per rank: above IN_PLACE_FROM_BYTES, so the in-place all-reduce; 3 ranks on
    # 2 cores interleave unpredictably, which is what a missing barrier needs to show
    results = world_of(3).run(shm_fns.in_place_rewritten_at_once, 1 << 17, 60)
    assert results == [[], [], []]


@pytest.mark.timeout(180)
def test_in_place_reduce_scatter_of_a_region_rewritten_at_once(world_of):
    # as above for ShardedOptimizer's gradients: 1 MiB of float64 in a region, from IN_PLACE_FROM_BYTES
    # read where it lies (reduce_scatter_in_place.py), overwritten the moment each rank has its chunk
    results = world_of(3).run(shm_fns.reduce_scatter_region_rewritten_at_once, 1 << 17, 60)
    assert results == [[], [], []]


@pytest.mark.timeout(180)
def test_in_place_all_gather_of_a_region_rewritten_at_once(world_of):
    # ShardedOptimizer's parameters: each rank writes its chunk, the others copy it out of its region
    results = world_of(3).run(shm_fns.all_gather_region_rewritten_at_once, 1 << 17, 60)
    assert results == [[], [], []]
    messages = world_of(3).run(shm_fns.all_gather_in_place_of_a_plain_tensor)
    assert all(m and "needs a 1-D tensor in a shared region" in m and "use all_gather" in m for m in messages)


@pytest.mark.timeout(120)
def test_a_reduce_scatter_of_a_region_against_a_plain_tensor_is_a_mismatch(world_of):
    # every rank's input must be at the same place of its region; a plain tensor on one rank is
    # named on every rank, before anything is read
    with pytest.raises(RankFailure) as info:
        world_of(3).run(shm_fns.reduce_scatter_region_against_plain, 100_000, case_timeout=30)
    assert set(info.value.errors) == {0, 1, 2}
    for name, message in info.value.errors.values():
        assert name == "CollectiveMismatchError" and "shared_memory_in_place" in message and "rank 1" in message


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 4])
def test_a_collective_holds_its_thread_on_the_ranks_own_core_and_gives_it_back(world_of, n):
    # local rank i runs each collective on core i mod C (on this 2-core machine: 2 ranks, a core
    # each; 4 ranks, two to a core), and the thread's affinity is as before afterwards. Held lazily
    # (hold.py): entered from the other core, it is on its own at the first barrier, and pinned once
    # it has slept (the late-peer case); with a core each, collectives of HOLD_BELOW_BYTES (4 MiB)
    # and more are not held
    # (the Python path's barriers, spied on; native_fns.affinity_while_in_the_core checks the core's hold)
    cores = sorted(os.sched_getaffinity(0))
    core_each = n <= len(cores)
    pool = world_of(n, GRADSYNC_NATIVE="0")
    for rank, (own_core, before, seen) in enumerate(pool.run(shm_fns.affinity_in_and_after_collectives)):
        assert before == cores
        assert own_core == cores[rank % len(cores)]
        for name, entries, on_cores, exits, after in seen:
            assert entries, f"{name} met no shared-memory barrier"
            assert after == cores, (rank, name, after)
            if core_each and name == "all_reduce 4 MiB":
                assert all(a == cores for a in entries + exits), (rank, name, entries, exits)
                continue
            assert on_cores[0] == own_core, (rank, name, on_cores)   # entered from another core: moved there
            assert all(a in (cores, [own_core]) for a in entries + exits), (rank, name, entries, exits)
            if name == "all_reduce, late peer" and rank != n - 1:
                assert exits[0] == [own_core], (rank, name, exits)


@pytest.mark.timeout(120)
def test_a_small_all_reduce_repeated_from_its_plan_equals_torch_distributed(world_of):
    # shapes from no element to 400 KB, four ops and four dtypes, five calls each: every call equal
    # to gloo's all-reduce of the same inputs, a plan kept for each shape, and tensors of the same
    # shapes that need grad or are strided (the general path) equal too
    for mismatches, plans in world_of(3).run(shm_fns.repeated_small_all_reduces, 5):
        assert mismatches == []
        assert {("avg", "torch.float64", 300), ("bor", "torch.int64", 5000), ("max", "torch.float32", 1000),
                ("sum", "torch.float32", 1), ("sum", "torch.float32", 1000), ("sum", "torch.int32", 0),
                ("sum", "torch.float32", 100_000)} <= set(plans)


@pytest.mark.timeout(120)
def test_a_kept_plan_is_not_used_for_a_tensor_that_lies_in_a_shared_region(world_of):
    # 400 KB float32, 3 ranks: plain tensors take the direct all-reduce and keep a plan (each rank
    # reads all of both others' copies, 2M), a tensor of the same shape in a shared region is
    # reduced in place (a slice from each other rank and the others' slices of the result, 2(N-1)/N M)
    numel, m = 100_000, 400_000
    for rank, (calls, kept) in enumerate(world_of(3).run(shm_fns.plan_then_region, numel)):
        assert kept, rank
        assert all(right for _, right in calls), (rank, calls)
        sizes = ring_chunks(numel, 3).sizes
        in_place = (2 * sizes[rank] + numel - sizes[rank]) * 4
        assert [received for received, _ in calls] == [2 * m, 2 * m, in_place, 2 * m], (rank, calls)


@pytest.mark.timeout(120)
def test_small_all_reduces_of_nan_payloads_end_bit_identical_on_every_rank(world_of):
    # every rank folds in rank order, operand for operand, whether its own input comes from its
    # tensor (ranks 0 and 1) or from its staging half (rank 2); x86's add and multiply keep the NaN
    # payload of one operand by position, so a rank that swapped two operands would end with other bits
    sizes, ops = [1, 1000, 20000, 100000], ["sum", "product", "avg"]
    results = world_of(3).run(shm_fns.nan_payloads_all_reduced, sizes, ops)
    for key, bits in results[0].items():
        assert bits.numel() == key[1]
        for rank in (1, 2):
            assert torch.equal(results[rank][key], bits), (key, rank)
    sums = results[0][("sum", 1000, 1)]
    assert bool(torch.isnan(sums[0::3].view(torch.float32)).all())
    assert bool(torch.isnan(sums[1::3].view(torch.float32)).all())
    assert set((sums[0::3] & 7).tolist()) <= {1, 2} and set((sums[1::3] & 7).tolist()) <= {1, 3}   # a rank's payload
    assert bool(torch.isfinite(sums[2::3].view(torch.float32)).all())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,numel", [("dtype", 1000), ("op", 1000), ("op", 600_000)])
def test_a_call_that_differs_from_a_kept_plan_is_a_mismatch_on_every_rank(world_of, kind, numel):
    # ranks 0 and 2 run the kept plan of float32 sums (1,000: the direct all-reduce's; 600,000, 2.4 MB:
    # the split one's), rank 1 changes the dtype or the op: every rank raises, naming a rank that
    # differs, before anything is folded
    with pytest.raises(RankFailure) as info:
        world_of(3).run(shm_fns.plan_then_mismatch, kind, numel, case_timeout=30)
    assert set(info.value.errors) == {0, 1, 2}
    for rank, (name, message) in info.value.errors.items():
        assert name == "CollectiveMismatchError", message
        assert ("float64" if kind == "dtype" else "op=max") in message, message
        assert f"rank {0 if rank == 1 else 1}" in message, message


def test_a_wait_polls_long_only_on_the_main_thread_and_yields_where_ranks_outnumber_cores():
    # with a core per rank, the main thread polls SPIN_SECONDS (about a sleep and wake-up) before it
    # sleeps; a communication thread (DDP's reducer, the c10d backend's) shares its core with the
    # main thread's backward and polls only BACKGROUND_SPIN_SECONDS; where ranks outnumber the cores
    # every thread polls YIELD_SECONDS, yielding the core between polls
    import threading

    from gradsync.comm.transport.shm import waiting as shm

    assert shm.BACKGROUND_SPIN_SECONDS < shm.SPIN_SECONDS
    assert shm.poll_seconds(True) == shm.SPIN_SECONDS
    assert shm.poll_seconds(False) == shm.YIELD_SECONDS
    seen = []
    thread = threading.Thread(target=lambda: seen.extend([shm.poll_seconds(True), shm.poll_seconds(False)]))
    thread.start()
    thread.join(timeout=10)
    assert seen == [shm.BACKGROUND_SPIN_SECONDS, shm.YIELD_SECONDS]


@pytest.mark.timeout(120)
def test_a_tensor_adopted_as_a_region_is_read_where_it_lies_and_forgotten_once_freed(world_of):
    # 1 MiB of float64 per rank. Every rank offers: each reads every rank's values in its copy, the
    # tensor has moved into shared memory, the all-reduce sums it; once freed, a new mapping at its
    # old address is not taken for it, and a region allocated where another freed one lay is found.
    # One rank declines: no rank adopts, and the sums are the same.
    numel, n = 1 << 17, 3
    results = world_of(n).run(shm_fns.adopted_region, numel, None)
    for rank, (adopted, seen, moved, right, reused, readopted, _) in enumerate(results):
        assert (adopted, seen, moved, right, readopted) == (True, [1.0, 2.0, 3.0], True, True, True), rank
        assert reused is not True, rank
    assert any(reused is not None for _, _, _, _, reused, _, _ in results), "nothing mapped at a freed address"
    assert any(same_address for *_, same_address in results), "no region lay where a freed tensor had been"
    for rank, (adopted, seen, _, right, _, found, _) in enumerate(world_of(n).run(shm_fns.adopted_region, numel, 1)):
        assert (adopted, seen, right, found) == (False, None, True, True), rank


def test_a_peer_that_did_its_part_and_exited_while_this_rank_slept_is_not_blamed(monkeypatch):
    """comm/transport/shm/waiting.py: a rank sleeping in a wait (a barrier) whose peer arrives and exits before
    the rank's liveness look must return, not raise "exited"; a peer dead before doing its part is
    still blamed. A stand-in for the transport: its doorbell's sleep is where the peer acts."""
    import threading
    import time
    from types import SimpleNamespace

    from gradsync.comm.transport.shm import waiting
    from gradsync.comm.transport import PeerError

    class Bell:
        def __init__(self, peer_arrives: bool) -> None:
            self.peer_arrives, self.arrived = peer_arrives, False

        def sleep(self, seen, seconds) -> None:
            time.sleep(waiting.LIVENESS_SLICE)   # a whole slice: the liveness look follows
            self.arrived = self.peer_arrives

    class Progress:   # nothing to move: the peer acts in the doorbell's sleep
        def __init__(self) -> None:
            self.lock, self.sleepers, self.broken = threading.Lock(), 0, None

        def advance(self) -> int:
            return 0

        def break_with(self, error):
            self.broken = error
            return error

    def stand(peer_arrives: bool) -> waiting.Waits:
        segments = SimpleNamespace(bell=Bell(peer_arrives), pids={1: 424242})
        return waiting.Waits(0, 10.0, segments, Progress(), None, None, spin_allowed=True)

    def stuck(waited, limit, what):
        return PeerError(f"barrier {what}", rank=0, peer=1, op="barrier")

    monkeypatch.setattr(waiting, "process_alive", lambda pid: False)   # rank 1 has exited by the time anyone looks
    arrived = stand(peer_arrives=True)
    arrived.wait_until(lambda: arrived.segments.bell.arrived, None, [1], stuck)
    never = stand(peer_arrives=False)
    with pytest.raises(PeerError, match=r"barrier failed: rank 1 \(pid 424242\) exited"):
        never.wait_until(lambda: never.segments.bell.arrived, None, [1], stuck)


def test_dead_peers_are_the_local_peers_gone_from_proc():
    """Waits.dead_peers (Transport.dead_peers on shared memory), which the parameter server asks
    when gloo's receive from any worker timed out: the peers whose process has exited."""
    import subprocess
    import sys

    from types import SimpleNamespace

    from gradsync.comm.transport.shm import waiting

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    segments = SimpleNamespace(pids={1: os.getpid(), 2: int(gone.stdout), 3: os.getppid()})
    stand = waiting.Waits(0, 10.0, segments, None, None, None, spin_allowed=True)
    assert stand.dead_peers() == [2]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind,native", [("receive", "1"), ("barrier", "1"), ("barrier", "0")])
def test_a_wait_nobody_answers_times_out_naming_the_rank_and_the_operation(kind, native):
    # the shared-memory waits' timeout (waiting.py; the barrier's through the native core's slices
    # when it runs, or the Python path's): within the group's timeout, naming this rank, the
    # operation, the peer and the limit
    from world_pool import WorldPool

    pool = WorldPool(2, timeout=2.0, env={"GRADSYNC_NATIVE": native})
    try:
        (message, waited), _ = pool.run(shm_fns.wait_that_times_out, kind, 2.0, case_timeout=30)
    finally:
        pool.close()
    if kind == "receive":
        assert message.startswith("rank 0: test/receive: receive from rank 1 (64 bytes, shared memory) timed out "
                                  "after 2.0 s (timeout 2 s); rank 1 may have died or stalled"), message
    else:
        assert message.startswith("rank 0: test/barrier: barrier ") and \
            "on shared memory timed out after 2." in message and message.endswith("not arrived: rank 1"), message
    assert 2.0 <= waited < 3.0, waited
