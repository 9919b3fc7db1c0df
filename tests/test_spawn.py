"""gs.spawn: results in rank order, tensors intact, failures named, no orphans."""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.group.liveness import process_alive
import spawn_fns



@pytest.mark.timeout(30)
def test_process_alive_is_false_once_a_process_exits_its_zombie_included(tmp_path):
    # the oracle is the kernel's own word through waitid: WNOWAIT returns once the child has exited
    # and leaves it unreaped, a zombie that os.kill(pid, 0) would still call alive. The program is a
    # copy of sleep named so that /proc/PID/stat reads "PID (a) Z (b) S ...": a parser that splits at
    # the first ") " would read state Z for a sleeping process.
    program = tmp_path / "a) Z (b"
    shutil.copy(shutil.which("sleep"), program)
    child = subprocess.Popen([str(program), "30"])
    try:
        assert process_alive(os.getpid())
        assert process_alive(child.pid), "a sleeping process was called dead"
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)   # exited, not reaped: a zombie
        os.kill(child.pid, 0)   # the signal test still finds the zombie ...
        assert not process_alive(child.pid), "a zombie was called alive"   # ... the liveness helper does not
    finally:
        child.kill()
        child.wait(timeout=10)
    assert not process_alive(child.pid)   # reaped: no /proc entry at all

@pytest.mark.timeout(120)
def test_spawn_returns_values_in_rank_order_with_tensors_intact():
    results = gs.spawn(spawn_fns.identity_and_state, nprocs=3, args=(0.5,))
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["world_size"] == 3 for r in results)
    for rank, r in enumerate(results):
        assert torch.equal(r["state"]["weight"], torch.full((2, 3), rank * 0.5))
        assert not process_alive(r["pid"])


def test_a_ranks_cuda_tensors_come_back_on_the_cpu(tmp_path, monkeypatch):
    # a result saved on a rank's GPU loads onto the CPU: the launcher may have no such GPU (here: none
    # at all, where torch.load refuses a CUDA location unless told where to put it)
    from gradsync.group import launch

    with monkeypatch.context() as saving_from_a_gpu:   # torch.save tags each storage with its device
        saving_from_a_gpu.setattr(torch.serialization, "location_tag", lambda storage: "cuda:1")
        torch.save({"weight": torch.arange(6.0).view(2, 3), "step": 7}, tmp_path / "1.result")
    loaded = launch.load_result(tmp_path / "1.result")
    assert loaded["step"] == 7 and loaded["weight"].device.type == "cpu"
    assert torch.equal(loaded["weight"], torch.arange(6.0).view(2, 3))


@pytest.mark.timeout(120)
def test_spawn_names_the_rank_that_raised_with_its_traceback():
    started = time.monotonic()
    with pytest.raises(gs.SpawnError) as info:
        gs.spawn(spawn_fns.raise_on_rank, nprocs=3, args=(2,))
    assert info.value.rank == 2
    assert "planted failure on rank 2" in str(info.value)
    assert "Traceback" in str(info.value) and "raise_on_rank" in str(info.value)
    assert time.monotonic() - started < 25, "the sleeping ranks were not stopped"


@pytest.mark.timeout(120)
def test_spawn_names_a_rank_killed_by_a_signal():
    with pytest.raises(gs.SpawnError) as info:
        gs.spawn(spawn_fns.die_on_rank, nprocs=3, args=(1,), timeout=10)
    assert info.value.rank == 1
    assert "rank 1 was killed by signal SIGKILL" in str(info.value)


@pytest.mark.timeout(120)
def test_spawn_leaves_no_orphans(tmp_path):
    with pytest.raises(gs.SpawnError):
        gs.spawn(spawn_fns.record_pid_then_hang, nprocs=3, args=(str(tmp_path / "pid"),))
    pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(3)]
    time.sleep(0.5)
    assert not any(process_alive(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path):
    """SIGKILL to the launcher (no chance to stop anyone): its ranks are gone within seconds."""
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import gradsync as gs, spawn_fns\n"
              "gs.spawn(spawn_fns.record_pid_and_wait, nprocs=2, args=(sys.argv[2],))\n")
    launcher = subprocess.Popen([sys.executable, "-c", script, str(Path(__file__).parent), str(tmp_path / "pid")])
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"pid.{r}").exists() for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
        pids = [int((tmp_path / f"pid.{r}").read_text()) for r in range(2)]
    finally:
        launcher.kill()
        launcher.wait(timeout=30)
    deadline = time.monotonic() + 5
    while any(process_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(process_alive(pid) for pid in pids), "ranks outlived their launcher"


@pytest.mark.timeout(120)
def test_ranks_take_the_launchers_environment_and_stdout_at_each_call(monkeypatch, capfd):
    """Ranks are forked from a process started at an earlier call: what they see must still be the
    launcher's environment and stdout at this call, and numpy's global stream must differ per rank."""
    with capfd.disabled():   # a forkserver started here has pytest's own stdout, not this test's capture
        gs.spawn(spawn_fns.what_the_launcher_gave, nprocs=2, args=("GRADSYNC_TEST_MARK",))
    monkeypatch.setenv("GRADSYNC_TEST_MARK", "set after the first call")
    results = gs.spawn(spawn_fns.what_the_launcher_gave, nprocs=2, args=("GRADSYNC_TEST_MARK",))
    assert [mark for mark, _ in results] == ["set after the first call"] * 2
    assert results[0][1] != results[1][1], "both ranks drew the same numbers from numpy's global stream"
    out = capfd.readouterr().out
    assert all(f"rank {r} writes to the launcher's stdout" in out for r in range(2)), out


@pytest.mark.timeout(120)
def test_ranks_load_the_public_names_and_connect_their_transport_at_init(monkeypatch):
    """Ranks init through runtime.init() (launch.py sits below the package and the communication
    layer): they still load the public names before the ranks meet, so they start their work
    together, and connect the transport there, because they take the launcher's init hooks."""
    monkeypatch.delenv("GRADSYNC_TRANSPORT", raising=False)
    from gradsync.comm.transport.shm import doorbell

    expected = "TorchTransport" if doorbell.supported() else "ShmTransport"
    assert gs.spawn(spawn_fns.what_init_did, nprocs=2) == [(True, expected)] * 2


@pytest.mark.timeout(120)
def test_a_script_that_spawns_at_its_top_level_is_told_to_add_the_main_guard(tmp_path):
    """A new user's first script: gs.spawn at module level, without `if __name__ == "__main__":`. Each rank
    imports the script to find fn and calls spawn again, and multiprocessing refuses before the rank runs
    anything of gradsync's: the launcher's error must say so (the guard to add, and the ranks' own last
    lines), as Python's multiprocessing does, not only that a rank exited with code 1."""
    script = tmp_path / "first.py"
    script.write_text("import gradsync as gs\n\ndef work():\n    return gs.world().rank\n\n"
                      "print(gs.spawn(work, nprocs=2))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()
    error = next(line for line in last if line.startswith("gradsync.group.spawn_report.SpawnError"))
    assert "before it ran fn" in error and 'if __name__ == "__main__":' in error, error
    assert any("bootstrapping phase" in line for line in last), done.stderr[-2000:]
    guarded = tmp_path / "guarded.py"
    guarded.write_text(script.read_text().replace("print(gs.spawn", 'if __name__ == "__main__":\n    print(gs.spawn'))
    done = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=100, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "[0, 1]", done.stderr[-2000:]


def test_spawn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="nprocs must be an integer >= 1"):
        gs.spawn(spawn_fns.identity_and_state, nprocs=0)
    with pytest.raises(ValueError, match="module-level function"):
        gs.spawn(lambda: None, nprocs=2)
    with pytest.raises(TypeError, match="args must be a tuple"):
        gs.spawn(spawn_fns.identity_and_state, nprocs=2, args=[1])


@pytest.mark.timeout(120)
def test_the_error_says_where_the_stopped_ranks_were():
    with pytest.raises(gs.SpawnError) as info:
        gs.spawn(spawn_fns.stall_fail_and_wait, nprocs=4, timeout=30)
    message = str(info.value)
    assert "rank 3 raised ValueError: bad batch on rank 3" in message
    where = message.split("when stopped, the other ranks were in:")[1].split("\n\n")[0]
    assert "rank 0: stall_fail_and_wait (spawn_fns.py" in where           # stalled in its own code
    # rank 1 waits inside a collective: on shared memory the agreement barrier waits for every rank,
    # so rank 1 often notices rank 3's exit itself (PeerError naming who has not arrived) before
    # the launcher stops it; either way its line names the collective
    before = message.split("\n\nrank 3 traceback")[0]
    rank1 = [line for line in before.splitlines() if line.strip().startswith("rank 1:")]
    assert len(rank1) == 1 and "all_reduce" in rank1[0], before
    assert "not arrived: rank 0" in rank1[0] or "collectives.py" in rank1[0], before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_live_rank_that_never_arrives_is_a_timeout_naming_it(monkeypatch, transport):
    """Rank 2 is alive but never calls the all-reduce: ranks 0 and 1 give up after the world's timeout
    (2 s), each with an error that says it timed out, after how long, and which rank it waited for
    (shared memory: the barrier's "not arrived"; TCP: the transfer from rank 2), instead of waiting
    for ever; a dead rank, by contrast, is noticed in a fraction of a second (test_shm.py)."""
    monkeypatch.setenv("GRADSYNC_TRANSPORT", transport)
    monkeypatch.setenv("GRADSYNC_STALL_SECONDS", "0")
    results = gs.spawn(spawn_fns.absent_rank, nprocs=3, args=(2,), timeout=2.0)
    assert results[2] is None
    for rank, (name, message, seconds) in enumerate(results[:2]):
        assert name == "PeerError" and f"rank {rank}: " in message and "timed out after" in message, (rank, message)
        assert "(timeout 2 s)" in message and "all_reduce" in message, (rank, message)
        assert ("not arrived: rank 2" if transport == "shm" else "from rank 2") in message, (rank, message)
        assert 2.0 <= seconds < 5.0, (rank, seconds)


@pytest.mark.timeout(120)
def test_debug_mode_compares_fingerprints_across_all_ranks_not_only_neighbours(monkeypatch):
    """GRADSYNC_DEBUG=1 over TCP (where, without it, ranks compare fingerprints with their ring
    neighbours only): rank 2 of 4 passes 13 elements where the others pass 12, and rank 0, which is
    not its neighbour, raises the mismatch naming rank 2 too, as every rank does."""
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    monkeypatch.setenv("GRADSYNC_DEBUG", "1")
    results = gs.spawn(spawn_fns.odd_rank_out, nprocs=4, args=(2,), timeout=10.0)
    for rank, (name, message) in enumerate(results):
        assert name == "CollectiveMismatchError" and "rank 2" in message and "13 float32" in message, (rank, message)


@pytest.mark.timeout(120)
def test_stall_inspector_names_the_rank_that_has_not_joined(capfd, monkeypatch):
    monkeypatch.setenv("GRADSYNC_STALL_SECONDS", "1.5")
    assert gs.spawn(spawn_fns.late_rank, nprocs=3, args=(2, 5.0), timeout=30) == [3.0, 3.0, 3.0]
    err = capfd.readouterr().err
    reports = [line for line in err.splitlines() if line.startswith("gradsync stall inspector (rank 0)")]
    assert reports, err[-3000:]
    assert "all_reduce (ring, 10 x float32)" in reports[0]
    assert "Also waiting in" in reports[0] and "ranks 1" in reports[0]
    assert "rank 2 (posted nothing" in reports[0]


@pytest.mark.timeout(120)
def test_a_send_to_a_peer_that_died_over_tcp_is_a_peer_error_naming_it(monkeypatch):
    """gloo refuses to post a send on a connection the dead peer closed, before any wait: that is
    a PeerError too (the live world's sign of a death, live/failures.py), naming both ranks, not
    gloo's bare "Connection closed by peer"."""
    monkeypatch.setenv("GRADSYNC_TRANSPORT", "tcp")
    failures = gs.spawn(spawn_fns.post_to_a_dead_peer, nprocs=2, timeout=10.0, fault_tolerance="live")[0]
    assert len(failures) == 2, failures
    for name, message, peer in failures:
        assert name == "PeerError" and peer == 1, (name, message)
        assert message.startswith("rank 0: probe: send to rank 1") and "rank 1 may have died" in message, message
